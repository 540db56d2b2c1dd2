/* common.h — driver-API test programs: one function table, filled in one of
 * the four ways a program can reach the driver (see load_api). */
#ifndef VGPU_TEST_COMMON_H
#define VGPU_TEST_COMMON_H

#include "cuda_abi.h"

typedef int CUmodule_dummy;
typedef struct CUmod_st *CUmodule;

#define API_FUNCS(X)                                                                                   \
    X(cuInit, "cuInit", 2000, 0, (unsigned))                                                           \
    X(cuDeviceGet, "cuDeviceGet", 2000, 0, (CUdevice *, int))                                          \
    X(cuDeviceGetCount, "cuDeviceGetCount", 2000, 0, (int *))                                          \
    X(cuDeviceGetUuid, "cuDeviceGetUuid", 9020, 0, (CUuuid *, CUdevice))                               \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, 0, (CUcontext *, CUdevice))          \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 4000, 0, (CUcontext))                                        \
    X(cuCtxGetDevice, "cuCtxGetDevice", 2000, 0, (CUdevice *))                                         \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, 0, (CUdeviceptr *, size_t))                                   \
    X(cuMemFree_v2, "cuMemFree", 3020, 0, (CUdeviceptr))                                               \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0, (size_t *, size_t *))                                  \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0, (size_t *, CUdevice))                          \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0, (CUdeviceptr *, size_t *, size_t, size_t, unsigned)) \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, 0, (CUdeviceptr *, size_t, unsigned))              \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 2, (CUdeviceptr *, size_t, CUstream))            \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 2, (CUdeviceptr, CUstream))                        \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 2,                               \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                                 \
    X(cuMemPoolCreate, "cuMemPoolCreate", 11020, 0, (CUmemoryPool *, const void *))                    \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, 0, (CUmemoryPool))                                  \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, 0, (CUmemoryPool, size_t))                            \
    X(cuStreamSynchronize, "cuStreamSynchronize", 2000, 0, (CUstream))                                 \
    X(cuMemCreate, "cuMemCreate", 10020, 0,                                                            \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))       \
    X(cuMemRelease, "cuMemRelease", 10020, 0, (CUmemGenericAllocationHandle))                          \
    X(cuMemAddressReserve, "cuMemAddressReserve", 10020, 0,                                            \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                                \
    X(cuMemAddressFree, "cuMemAddressFree", 10020, 0, (CUdeviceptr, size_t))                           \
    X(cuMemMap, "cuMemMap", 10020, 0, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long)) \
    X(cuMemUnmap, "cuMemUnmap", 10020, 0, (CUdeviceptr, size_t))                                       \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, 0, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *))          \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, 0, (CUarray))                                            \
    X(cuModuleLoadData, "cuModuleLoadData", 2000, 0, (CUmodule *, const void *))                       \
    X(cuModuleGetFunction, "cuModuleGetFunction", 2000, 0, (CUfunction *, CUmodule, const char *))     \
    X(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, 2,                                                  \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **)) \
    X(cuLaunchKernel, "cuLaunchKernel", 4000, 0,                                                       \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **)) \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, 0, (const CUlaunchConfig *, CUfunction, void **, void **)) \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 2, (CUgraphExec, CUstream))                          \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, 0,                                 \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **)) \
    X(cuMemSetAccess, "cuMemSetAccess", 10020, 0, (CUdeviceptr, size_t, const void *, size_t))         \
    X(cuEventCreate, "cuEventCreate", 2000, 0, (CUevent *, unsigned))                                  \
    X(cuEventRecord, "cuEventRecord", 2000, 0, (CUevent, CUstream))                                    \
    X(cuEventSynchronize, "cuEventSynchronize", 2000, 0, (CUevent))                                    \
    X(cuMemAdvise_v2, "cuMemAdvise", 12020, 0, (CUdeviceptr, size_t, int, CUmemLocation))              \
    X(cuMemPrefetchAsync_v2, "cuMemPrefetchAsync", 12020, 0, (CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream)) \
    API_FUNCS_PATHS(X)

/* the allocation paths of paths.c and matrix.c */
#define API_FUNCS_PATHS(X)                                                                             \
    X(cuStreamCreate, "cuStreamCreate", 2000, 0, (CUstream *, unsigned))                               \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 4000, 0, (CUstream))                                      \
    X(cuCtxSynchronize, "cuCtxSynchronize", 2000, 0, (void))                                           \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, 0, (CUdeviceptr *, size_t, CUstream))                 \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, 0, (CUdeviceptr, CUstream))                             \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0,                                    \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                                 \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 11020, 0, (CUmemoryPool, int, void *))           \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 11020, 0, (CUmemoryPool, int, void *))           \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 11020, 0, (CUmemoryPool *, CUdevice))    \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, 0, (CUstream, int))                      \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000, 0, (CUstream, CUgraph *))                       \
    X(cuStreamIsCapturing, "cuStreamIsCapturing", 10000, 0, (CUstream, int *))                         \
    X(cuGraphCreate, "cuGraphCreate", 10000, 0, (CUgraph *, unsigned))                                 \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 11040, 0,                                      \
      (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *))             \
    X(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode", 11040, 0,                                        \
      (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr))                              \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiate", 12000, 0, (CUgraphExec *, CUgraph, unsigned long long)) \
    X(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, 0,                          \
      (CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *))                                       \
    X(cuGraphLaunch, "cuGraphLaunch", 10000, 0, (CUgraphExec, CUstream))                               \
    X(cuGraphUpload, "cuGraphUpload", 11010, 0, (CUgraphExec, CUstream))                               \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 10000, 0, (CUgraphExec))                               \
    X(cuGraphDestroy, "cuGraphDestroy", 10000, 0, (CUgraph))                                           \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 11040, 0, (CUdevice))                              \
    X(cuDeviceGetGraphMemAttribute, "cuDeviceGetGraphMemAttribute", 11040, 0, (CUdevice, int, void *)) \
    X(cuDeviceSetGraphMemAttribute, "cuDeviceSetGraphMemAttribute", 11040, 0, (CUdevice, int, void *)) \
    X(cuIpcGetMemHandle, "cuIpcGetMemHandle", 4010, 0, (CUipcMemHandle *, CUdeviceptr))               \
    X(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000, 0, (CUdeviceptr *, CUipcMemHandle, unsigned)) \
    X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 4010, 0, (CUdeviceptr))                              \
    X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 10020, 0,                          \
      (void *, CUmemGenericAllocationHandle, int, unsigned long long))                                 \
    X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 10020, 0,                      \
      (CUmemGenericAllocationHandle *, void *, int))                                                   \
    X(cuMemPoolExportToShareableHandle, "cuMemPoolExportToShareableHandle", 11020, 0,                  \
      (void *, CUmemoryPool, int, unsigned long long))                                                 \
    X(cuMemPoolImportFromShareableHandle, "cuMemPoolImportFromShareableHandle", 11020, 0,              \
      (CUmemoryPool *, void *, int, unsigned long long))                                               \
    X(cuMemPoolExportPointer, "cuMemPoolExportPointer", 11020, 0, (void *, CUdeviceptr))               \
    X(cuMemPoolImportPointer, "cuMemPoolImportPointer", 11020, 0, (CUdeviceptr *, CUmemoryPool, void *)) \
    X(cuMemHostRegister_v2, "cuMemHostRegister", 6050, 0, (void *, size_t, unsigned))                  \
    X(cuMemHostUnregister, "cuMemHostUnregister", 4000, 0, (void *))                                   \
    X(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, 0, (CUdeviceptr, const void *, size_t))                  \
    X(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, 0, (void *, CUdeviceptr, size_t))

#define API_FIELD(name, base, ver, flags, params) CUresult(*name) params;
struct api {
    API_FUNCS(API_FIELD)
};

#define API_COUNT(name, base, ver, flags, params) +1
enum { API_N = 0 API_FUNCS(API_COUNT) };

struct api_meta {
    const char *name, *base;
    int ver, flags;
};
extern const struct api_meta api_meta[API_N];

extern struct api A;
extern const char *api_mode;
extern int gpa_self_hooked; /* gpa mode: did cuGetProcAddress@11030/12000 come back as libvgpu's? */

/* mode: "dlsym" (dlopen + dlsym), "gpa" (dlopen + dlsym(cuGetProcAddress_v2), cudart's pattern);
 * the linked program adds "link" and "gpa-linked" through link_hook. */
int load_api(const char *mode);
extern int (*link_hook)(const char *mode);
/* 1 if p lies in libvgpu*.so */
int in_libvgpu(const void *p);
void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* PTX of the kernel "touch(const u64 *p, u64 bytes)": every thread of a grid-stride loop reads
 * its 8-byte words of [p, p + bytes) once (a memory-bound kernel).  The simulator runs a kernel
 * of that name for what reading those bytes costs where they live (docs/developers/simulators.md). */
extern const char touch_ptx[];

#endif
