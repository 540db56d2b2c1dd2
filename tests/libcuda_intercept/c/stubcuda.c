/* stubcuda.c — link-time stand-in for libcuda.so.1 (never run: every
 * function aborts).  Lets link_* test programs be linked with -lcuda on a
 * machine without a driver; at run time the loader finds the real driver or
 * the simulator through LD_LIBRARY_PATH. */
#include <stdlib.h>

#define S(name) \
    __attribute__((visibility("default"))) int name(void) { abort(); }
S(cuInit) S(cuDeviceGet) S(cuDeviceGetCount) S(cuDeviceGetUuid) S(cuDevicePrimaryCtxRetain) S(cuCtxSetCurrent)
S(cuCtxGetDevice) S(cuMemAlloc_v2) S(cuMemFree_v2) S(cuMemGetInfo_v2) S(cuDeviceTotalMem_v2) S(cuMemAllocPitch_v2)
S(cuMemAllocManaged) S(cuMemAllocAsync_ptsz) S(cuMemFreeAsync_ptsz) S(cuMemAllocFromPoolAsync_ptsz)
S(cuMemPoolCreate) S(cuMemPoolDestroy) S(cuMemPoolTrimTo) S(cuStreamSynchronize) S(cuMemCreate) S(cuMemRelease)
S(cuMemAddressReserve) S(cuMemAddressFree) S(cuMemMap) S(cuMemUnmap) S(cuArrayCreate_v2) S(cuArrayDestroy)
S(cuModuleLoadData) S(cuModuleGetFunction) S(cuLaunchKernel_ptsz) S(cuLaunchKernel) S(cuLaunchKernelEx)
S(cuGraphLaunch_ptsz) S(cuLaunchCooperativeKernel) S(cuGetProcAddress_v2) S(cuGetProcAddress)
S(cuMemSetAccess) S(cuCtxSynchronize) S(cuEventCreate) S(cuEventRecord) S(cuEventSynchronize) S(cuMemAdvise_v2)
S(cuMemPrefetchAsync_v2)
