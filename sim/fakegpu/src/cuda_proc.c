/* fakegpu libcuda: cuGetProcAddress / cuGetProcAddress_v2 and the error strings.
 *
 * Lookup by base name + requested CUDA version + flags, as the real driver does (see
 * docs/developers/simulators.md and shared reference cuda-interception.md §1-2): the entry with the highest
 * version <= the requested one wins ("cuMemAlloc"@3020 is cuMemAlloc_v2, "cuCtxCreate"@11040 is
 * cuCtxCreate_v3); CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (2) selects the _ptsz/_ptds
 * variant where one exists (CUDA >= 7.0).  A known name whose versions are all newer than the
 * request is CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, an unknown one SYMBOL_NOT_FOUND; both
 * return CUDA_ERROR_NOT_FOUND with *pfn = NULL.  "cuGetProcAddress" returns this library's own
 * functions (v1 at 11030, v2 at 12000).  Built with -Bsymbolic, the addresses here are this
 * library's even when an interposer exports the same names.
 */
#include "fg_cuda.h"

#include <string.h>

typedef void (*fg_fn)(void);

#define FUNCS_COPY(X) X(cuMemcpy) X(cuMemcpy_ptds) X(cuMemcpyAsync) X(cuMemcpyAsync_ptsz) X(cuMemcpyDtoDAsync_v2) X(cuMemcpyDtoDAsync_v2_ptsz) X(cuMemcpyPeer) X(cuMemcpyPeer_ptds) X(cuMemcpyPeerAsync) X(cuMemcpyPeerAsync_ptsz) X(cuMemcpy2D_v2) X(cuMemcpy2D_v2_ptds) X(cuMemcpy2DUnaligned_v2) X(cuMemcpy2DUnaligned_v2_ptds) X(cuMemcpy2DAsync_v2) X(cuMemcpy2DAsync_v2_ptsz) X(cuMemcpy3D_v2) X(cuMemcpy3D_v2_ptds) X(cuMemcpy3DAsync_v2) X(cuMemcpy3DAsync_v2_ptsz) X(cuMemsetD16_v2) X(cuMemsetD16_v2_ptds) X(cuMemsetD8Async) X(cuMemsetD8Async_ptsz) X(cuMemsetD16Async) X(cuMemsetD16Async_ptsz) X(cuMemsetD32Async) X(cuMemsetD32Async_ptsz) X(cuMemsetD2D8_v2) X(cuMemsetD2D8_v2_ptds) X(cuMemsetD2D16_v2) X(cuMemsetD2D16_v2_ptds) X(cuMemsetD2D32_v2) X(cuMemsetD2D32_v2_ptds) X(cuMemsetD2D8Async) X(cuMemsetD2D8Async_ptsz) X(cuMemsetD2D16Async) X(cuMemsetD2D16Async_ptsz) X(cuMemsetD2D32Async) X(cuMemsetD2D32Async_ptsz) X(cuPointerGetAttribute) X(cuPointerGetAttributes) X(cuMemPrefetchAsync) X(cuMemPrefetchAsync_ptsz) X(cuMemPrefetchAsync_v2) X(cuMemPrefetchAsync_v2_ptsz) X(cuMemAdvise) X(cuMemAdvise_v2)
#define FUNCS_MISC(X) X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuStreamGetCaptureInfo) X(cuStreamGetCaptureInfo_ptsz) X(cuStreamGetCaptureInfo_v2) X(cuStreamGetCaptureInfo_v2_ptsz) X(cuStreamGetCaptureInfo_v3) X(cuStreamGetCaptureInfo_v3_ptsz) X(cuThreadExchangeStreamCaptureMode) X(cuCtxGetLimit) X(cuCtxSetLimit) X(cuCtxGetCacheConfig) X(cuCtxSetCacheConfig) X(cuCtxGetSharedMemConfig) X(cuCtxSetSharedMemConfig) X(cuDeviceCanAccessPeer) X(cuDeviceGetP2PAttribute) X(cuCtxEnablePeerAccess) X(cuCtxDisablePeerAccess) X(cuStreamGetPriority) X(cuStreamGetPriority_ptsz) X(cuStreamGetId) X(cuStreamGetId_ptsz) X(cuStreamGetCtx) X(cuStreamGetCtx_ptsz) X(cuStreamGetCtx_v2) X(cuStreamGetCtx_v2_ptsz) X(cuStreamGetDevice) X(cuLaunchHostFunc) X(cuLaunchHostFunc_ptsz) X(cuStreamAddCallback) X(cuStreamAddCallback_ptsz) X(cuEventRecordWithFlags) X(cuEventRecordWithFlags_ptsz) X(cuMemHostGetDevicePointer_v2) X(cuMemHostGetFlags) X(cuProfilerStart) X(cuProfilerStop)
#define FUNCS_FEATURES(X) X(cuMulticastCreate) X(cuMulticastAddDevice) X(cuMulticastBindMem) X(cuMulticastBindAddr) X(cuMulticastUnbind) X(cuMulticastGetGranularity) X(cuGreenCtxCreate) X(cuGreenCtxDestroy) X(cuCtxFromGreenCtx) X(cuGreenCtxStreamCreate) X(cuDeviceGetDevResource) X(cuDevSmResourceSplitByCount) X(cuDevResourceGenerateDesc) X(cuLogsRegisterCallback) X(cuLogsUnregisterCallback)
#define DECL(n) extern void n(void);
#define FUNCS(X)                                                                                                 \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) X(cuDeviceGetUuid)     \
    X(cuDeviceGetUuid_v2) X(cuDeviceTotalMem_v2) X(cuDeviceGetAttribute) X(cuDeviceGetPCIBusId)                  \
    X(cuDeviceGetByPCIBusId) X(cuDeviceComputeCapability) X(cuDevicePrimaryCtxRetain)                            \
    X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset)                      \
    X(cuDevicePrimaryCtxReset_v2) X(cuDevicePrimaryCtxGetState) X(cuDevicePrimaryCtxSetFlags_v2)                 \
    X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4) X(cuCtxDestroy_v2) X(cuCtxSetCurrent)                  \
    X(cuCtxGetCurrent) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxGetDevice_v2)       \
    X(cuCtxSynchronize) X(cuCtxSynchronize_v2) X(cuCtxGetApiVersion) X(cuCtxGetFlags)                            \
    X(cuCtxGetStreamPriorityRange) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemGetInfo_v2) X(cuMemAllocPitch_v2)     \
    X(cuMemAllocManaged) X(cuMemGetAddressRange_v2) X(cuMemAllocHost_v2) X(cuMemHostAlloc) X(cuMemFreeHost)      \
    X(cuMemcpyHtoD_v2) X(cuMemcpyHtoD_v2_ptds) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoH_v2_ptds) X(cuMemcpyDtoD_v2)     \
    X(cuMemcpyDtoD_v2_ptds) X(cuMemcpyHtoDAsync_v2) X(cuMemcpyHtoDAsync_v2_ptsz) X(cuMemcpyDtoHAsync_v2)         \
    X(cuMemcpyDtoHAsync_v2_ptsz) X(cuMemsetD8_v2) X(cuMemsetD8_v2_ptds) X(cuMemsetD32_v2)                        \
    X(cuMemsetD32_v2_ptds) X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamDestroy_v2)                 \
    X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuStreamQuery) X(cuStreamQuery_ptsz)                    \
    X(cuStreamGetFlags) X(cuStreamWaitEvent) X(cuStreamWaitEvent_ptsz) X(cuEventCreate) X(cuEventDestroy_v2)     \
    X(cuEventRecord) X(cuEventRecord_ptsz) X(cuEventQuery) X(cuEventSynchronize) X(cuEventElapsedTime)           \
    X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleUnload) X(cuModuleGetFunction)           \
    X(cuModuleGetLoadingMode) X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx)                       \
    X(cuLaunchKernelEx_ptsz) X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuFuncGetAttribute) \
    X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz)                          \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemPoolCreate) X(cuMemPoolDestroy)            \
    X(cuMemPoolTrimTo) X(cuMemPoolSetAttribute) X(cuMemPoolGetAttribute) X(cuDeviceGetDefaultMemPool)            \
    X(cuDeviceGetMemPool) X(cuDeviceSetMemPool) X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve)            \
    X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAllocationGranularity)             \
    X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuGetExportTable) X(cuModuleLoadFatBinary)       \
    X(cuModuleGetGlobal_v2) X(cuModuleGetFunctionCount) X(cuModuleEnumerateFunctions) X(cuLibraryLoadData)         \
    X(cuLibraryLoadFromFile) X(cuLibraryUnload) X(cuLibraryGetKernel) X(cuLibraryGetKernelCount)                  \
    X(cuLibraryEnumerateKernels) X(cuLibraryGetModule) X(cuLibraryGetGlobal) X(cuLibraryGetManaged)               \
    X(cuLibraryGetUnifiedFunction) X(cuKernelGetFunction) X(cuKernelGetName) X(cuKernelGetLibrary)                \
    X(cuKernelGetAttribute) X(cuKernelSetAttribute) X(cuKernelSetCacheConfig) X(cuFuncGetName) X(cuFuncGetModule)  \
    X(cuFuncIsLoaded) X(cuFuncLoad) X(cuFuncSetAttribute) X(cuFuncSetCacheConfig) X(cuFuncSetSharedMemConfig)     \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor) X(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)         \
    X(cuOccupancyMaxPotentialBlockSize) X(cuOccupancyMaxPotentialBlockSizeWithFlags)                               \
    X(cuOccupancyAvailableDynamicSMemPerBlock) X(cuCtxGetId) FUNCS_COPY(X) FUNCS_MISC(X) FUNCS_FEATURES(X) X(cuMemPoolSetAccess) X(cuMemPoolGetAccess) X(cuMemExportToShareableHandle)                      \
    X(cuMemImportFromShareableHandle) X(cuMemRetainAllocationHandle) X(cuMemGetAllocationPropertiesFromHandle)   \
    X(cuStreamWriteValue32) X(cuStreamWriteValue32_ptsz) X(cuStreamWriteValue64) X(cuStreamWriteValue64_ptsz) GRAPH_FUNCS(X) SHARE_FUNCS(X)

/* cuda_graph.c */
#define GRAPH_FUNCS(X)                                                                                           \
    X(cuGraphCreate) X(cuGraphDestroy) X(cuGraphAddMemAllocNode) X(cuGraphAddMemFreeNode) X(cuGraphAddKernelNode) \
    X(cuGraphAddKernelNode_v2) X(cuGraphAddEmptyNode) X(cuGraphGetNodes) X(cuGraphNodeGetType)                    \
    X(cuGraphMemAllocNodeGetParams) X(cuGraphMemFreeNodeGetParams) X(cuGraphInstantiate) X(cuGraphInstantiate_v2) \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz)          \
    X(cuGraphExecDestroy) X(cuGraphUpload) X(cuGraphUpload_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz)           \
    X(cuDeviceGraphMemTrim) X(cuDeviceGetGraphMemAttribute) X(cuDeviceSetGraphMemAttribute)                       \
    X(cuStreamBeginCapture) X(cuStreamBeginCapture_v2) X(cuStreamBeginCapture_ptsz) X(cuStreamEndCapture)         \
    X(cuStreamEndCapture_ptsz) X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuStreamGetCaptureInfo)       \
    X(cuStreamGetCaptureInfo_ptsz) X(cuStreamGetCaptureInfo_v2) X(cuStreamGetCaptureInfo_v2_ptsz)                 \
    X(cuStreamGetCaptureInfo_v3) X(cuStreamGetCaptureInfo_v3_ptsz) X(cuThreadExchangeStreamCaptureMode)
/* cuda_ipc.c, cuda_vmm.c, cuda_pool.c */
#define SHARE_FUNCS(X)                                                                                           \
    X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle)                    \
    X(cuMemHostRegister) X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuMemHostGetDevicePointer_v2)           \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuMemRetainAllocationHandle)              \
    X(cuMemGetAllocationPropertiesFromHandle) X(cuMemPoolExportToShareableHandle)                                 \
    X(cuMemPoolImportFromShareableHandle) X(cuMemPoolExportPointer) X(cuMemPoolImportPointer)

FUNCS(DECL)

/* --- error strings (texts of cuda.h) ------------------------------------------------------- */

static const struct {
    int code;
    const char *name, *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_ARRAY_IS_MAPPED, "CUDA_ERROR_ARRAY_IS_MAPPED", "array is mapped"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int find_error(CUresult e)
{
    for (size_t i = 0; i < sizeof(g_errors) / sizeof(g_errors[0]); i++)
        if (g_errors[i].code == e)
            return (int)i;
    return -1;
}

FG_API CUresult cuGetErrorString(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    int i = find_error(e);
    *s = i >= 0 ? g_errors[i].text : NULL;
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuGetErrorName(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    int i = find_error(e);
    *s = i >= 0 ? g_errors[i].name : NULL;
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}


FG_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);
FG_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status);

struct entry {
    const char *base;
    int version;   /* CUDA version that introduced this ABI of the name */
    fg_fn fn;      /* legacy default stream */
    fg_fn ptds;    /* per-thread default stream variant (introduced in CUDA 7.0), or NULL */
};

#define E(base, ver, fn) {base, ver, (fg_fn)fn, NULL},
#define P(base, ver, fn, pt) {base, ver, (fg_fn)fn, (fg_fn)pt},

/* Versions: cudaTypedefs.h's PFN_<name>_v<version> macros (CUDA 11.4+, e.g. PFN_cuCtxCreate_v11040,
 * __API_TYPEDEF_PTSZ(PFN_cuLaunchKernel, 4000, 7000)) and cudart's requests (reference §2);
 * cuCtxCreate_v4 (CUctxCreateParams) is CUDA 12.5, the _v2 forms of cuCtxGetDevice and
 * cuCtxSynchronize CUDA 13.0. */
static const struct entry g_table[] = {
    E("cuInit", 2000, cuInit)
    E("cuDriverGetVersion", 2020, cuDriverGetVersion)
    E("cuDeviceGet", 2000, cuDeviceGet)
    E("cuDeviceGetCount", 2000, cuDeviceGetCount)
    E("cuDeviceGetName", 2000, cuDeviceGetName)
    E("cuDeviceGetUuid", 9020, cuDeviceGetUuid)
    E("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2)
    E("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2)
    E("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute)
    E("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId)
    E("cuDeviceGetByPCIBusId", 4010, cuDeviceGetByPCIBusId)
    E("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability)
    E("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain)
    E("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease)
    E("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2)
    E("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset)
    E("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2)
    E("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState)
    E("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2)
    E("cuCtxCreate", 3020, cuCtxCreate_v2)
    E("cuCtxCreate", 11040, cuCtxCreate_v3)
    E("cuCtxCreate", 12050, cuCtxCreate_v4)
    E("cuCtxDestroy", 4000, cuCtxDestroy_v2)
    E("cuCtxSetCurrent", 4000, cuCtxSetCurrent)
    E("cuCtxGetCurrent", 4000, cuCtxGetCurrent)
    E("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2)
    E("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2)
    E("cuCtxGetDevice", 2000, cuCtxGetDevice)
    E("cuCtxGetDevice", 13000, cuCtxGetDevice_v2)
    E("cuCtxSynchronize", 2000, cuCtxSynchronize)
    E("cuCtxSynchronize", 13000, cuCtxSynchronize_v2)
    E("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion)
    E("cuCtxGetFlags", 7000, cuCtxGetFlags)
    E("cuCtxGetStreamPriorityRange", 5050, cuCtxGetStreamPriorityRange)
    E("cuMemAlloc", 3020, cuMemAlloc_v2)
    E("cuMemFree", 3020, cuMemFree_v2)
    E("cuMemGetInfo", 3020, cuMemGetInfo_v2)
    E("cuMemAllocPitch", 3020, cuMemAllocPitch_v2)
    E("cuMemAllocManaged", 6000, cuMemAllocManaged)
    E("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2)
    E("cuMemAllocHost", 3020, cuMemAllocHost_v2)
    E("cuMemHostAlloc", 2020, cuMemHostAlloc)
    E("cuMemFreeHost", 2000, cuMemFreeHost)
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds)
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds)
    P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds)
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz)
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz)
    P("cuMemsetD8", 3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds)
    P("cuMemsetD32", 3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds)
    E("cuStreamCreate", 2000, cuStreamCreate)
    E("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority)
    E("cuStreamDestroy", 4000, cuStreamDestroy_v2)
    P("cuStreamSynchronize", 2000, cuStreamSynchronize, cuStreamSynchronize_ptsz)
    P("cuStreamQuery", 2000, cuStreamQuery, cuStreamQuery_ptsz)
    E("cuStreamGetFlags", 5050, cuStreamGetFlags)
    P("cuStreamWaitEvent", 3020, cuStreamWaitEvent, cuStreamWaitEvent_ptsz)
    E("cuEventCreate", 2000, cuEventCreate)
    E("cuEventDestroy", 4000, cuEventDestroy_v2)
    P("cuEventRecord", 2000, cuEventRecord, cuEventRecord_ptsz)
    E("cuEventQuery", 2000, cuEventQuery)
    E("cuEventSynchronize", 2000, cuEventSynchronize)
    E("cuEventElapsedTime", 2000, cuEventElapsedTime)
    E("cuModuleLoad", 2000, cuModuleLoad)
    E("cuModuleLoadData", 2000, cuModuleLoadData)
    E("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx)
    E("cuModuleUnload", 2000, cuModuleUnload)
    E("cuModuleGetFunction", 2000, cuModuleGetFunction)
    E("cuModuleGetLoadingMode", 11070, cuModuleGetLoadingMode)
    P("cuLaunchKernel", 4000, cuLaunchKernel, cuLaunchKernel_ptsz)
    P("cuLaunchKernelEx", 11060, cuLaunchKernelEx, cuLaunchKernelEx_ptsz)
    P("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz)
    E("cuFuncGetAttribute", 2020, cuFuncGetAttribute)
    P("cuMemAllocAsync", 11020, cuMemAllocAsync, cuMemAllocAsync_ptsz)
    P("cuMemFreeAsync", 11020, cuMemFreeAsync, cuMemFreeAsync_ptsz)
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz)
    E("cuMemPoolCreate", 11020, cuMemPoolCreate)
    E("cuMemPoolDestroy", 11020, cuMemPoolDestroy)
    E("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo)
    E("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute)
    E("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute)
    E("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool)
    E("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool)
    E("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool)
    E("cuMemCreate", 10020, cuMemCreate)
    E("cuMemRelease", 10020, cuMemRelease)
    E("cuMemAddressReserve", 10020, cuMemAddressReserve)
    E("cuMemAddressFree", 10020, cuMemAddressFree)
    E("cuMemMap", 10020, cuMemMap)
    E("cuMemUnmap", 10020, cuMemUnmap)
    E("cuMemSetAccess", 10020, cuMemSetAccess)
    E("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity)
    E("cuArrayCreate", 3020, cuArrayCreate_v2)
    E("cuArray3DCreate", 3020, cuArray3DCreate_v2)
    E("cuArrayDestroy", 2000, cuArrayDestroy)
    E("cuGetExportTable", 3000, cuGetExportTable)
    E("cuModuleLoadFatBinary", 2000, cuModuleLoadFatBinary)
    E("cuModuleGetGlobal", 3020, cuModuleGetGlobal_v2)
    E("cuModuleGetFunctionCount", 12040, cuModuleGetFunctionCount)
    E("cuModuleEnumerateFunctions", 12040, cuModuleEnumerateFunctions)
    E("cuLibraryLoadData", 12000, cuLibraryLoadData)
    E("cuLibraryLoadFromFile", 12000, cuLibraryLoadFromFile)
    E("cuLibraryUnload", 12000, cuLibraryUnload)
    E("cuLibraryGetKernel", 12000, cuLibraryGetKernel)
    E("cuLibraryGetKernelCount", 12040, cuLibraryGetKernelCount)
    E("cuLibraryEnumerateKernels", 12040, cuLibraryEnumerateKernels)
    E("cuLibraryGetModule", 12000, cuLibraryGetModule)
    E("cuLibraryGetGlobal", 12000, cuLibraryGetGlobal)
    E("cuLibraryGetManaged", 12000, cuLibraryGetManaged)
    E("cuLibraryGetUnifiedFunction", 12000, cuLibraryGetUnifiedFunction)
    E("cuKernelGetFunction", 12000, cuKernelGetFunction)
    E("cuKernelGetName", 12030, cuKernelGetName)
    E("cuKernelGetLibrary", 12050, cuKernelGetLibrary)
    E("cuKernelGetAttribute", 12000, cuKernelGetAttribute)
    E("cuKernelSetAttribute", 12000, cuKernelSetAttribute)
    E("cuKernelSetCacheConfig", 12000, cuKernelSetCacheConfig)
    E("cuFuncGetName", 12030, cuFuncGetName)
    E("cuFuncGetModule", 11000, cuFuncGetModule)
    E("cuFuncIsLoaded", 12040, cuFuncIsLoaded)
    E("cuFuncLoad", 12040, cuFuncLoad)
    E("cuFuncSetAttribute", 9000, cuFuncSetAttribute)
    E("cuFuncSetCacheConfig", 3000, cuFuncSetCacheConfig)
    E("cuFuncSetSharedMemConfig", 4020, cuFuncSetSharedMemConfig)
    E("cuOccupancyMaxActiveBlocksPerMultiprocessor", 6050, cuOccupancyMaxActiveBlocksPerMultiprocessor)
    E("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", 7000,
      cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)
    E("cuOccupancyMaxPotentialBlockSize", 6050, cuOccupancyMaxPotentialBlockSize)
    E("cuOccupancyMaxPotentialBlockSizeWithFlags", 7000, cuOccupancyMaxPotentialBlockSizeWithFlags)
    E("cuOccupancyAvailableDynamicSMemPerBlock", 10020, cuOccupancyAvailableDynamicSMemPerBlock)
    E("cuCtxGetId", 12000, cuCtxGetId)
    E("cuMemPoolSetAccess", 11020, cuMemPoolSetAccess)
    E("cuMemPoolGetAccess", 11020, cuMemPoolGetAccess)
    E("cuMulticastCreate", 12010, cuMulticastCreate)
    E("cuMulticastAddDevice", 12010, cuMulticastAddDevice)
    E("cuMulticastBindMem", 12010, cuMulticastBindMem)
    E("cuMulticastBindAddr", 12010, cuMulticastBindAddr)
    E("cuMulticastUnbind", 12010, cuMulticastUnbind)
    E("cuMulticastGetGranularity", 12010, cuMulticastGetGranularity)
    E("cuGreenCtxCreate", 12040, cuGreenCtxCreate)
    E("cuGreenCtxDestroy", 12040, cuGreenCtxDestroy)
    E("cuCtxFromGreenCtx", 12040, cuCtxFromGreenCtx)
    E("cuGreenCtxStreamCreate", 12040, cuGreenCtxStreamCreate)
    E("cuDeviceGetDevResource", 12040, cuDeviceGetDevResource)
    E("cuDevSmResourceSplitByCount", 12040, cuDevSmResourceSplitByCount)
    E("cuDevResourceGenerateDesc", 12040, cuDevResourceGenerateDesc)
    E("cuLogsRegisterCallback", 12090, cuLogsRegisterCallback)
    E("cuLogsUnregisterCallback", 12090, cuLogsUnregisterCallback)
    E("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle)
    E("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle)
    E("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle)
    E("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle)
    P("cuStreamWriteValue32", 8000, cuStreamWriteValue32, cuStreamWriteValue32_ptsz)
    P("cuStreamWriteValue32", 11070, cuStreamWriteValue32, cuStreamWriteValue32_ptsz)
    P("cuStreamWriteValue64", 9000, cuStreamWriteValue64, cuStreamWriteValue64_ptsz)
    P("cuStreamWriteValue64", 11070, cuStreamWriteValue64, cuStreamWriteValue64_ptsz)
    /* graphs and stream capture (cuda_graph.c); cuGraphInstantiate is the WithFlags form from
     * CUDA 12.0 (cuda.h: #define cuGraphInstantiate cuGraphInstantiateWithFlags) */
    E("cuGraphCreate", 10000, cuGraphCreate)
    E("cuGraphDestroy", 10000, cuGraphDestroy)
    E("cuGraphAddMemAllocNode", 11040, cuGraphAddMemAllocNode)
    E("cuGraphAddMemFreeNode", 11040, cuGraphAddMemFreeNode)
    E("cuGraphAddKernelNode", 10000, cuGraphAddKernelNode)
    E("cuGraphAddKernelNode", 12000, cuGraphAddKernelNode_v2)
    E("cuGraphAddEmptyNode", 10000, cuGraphAddEmptyNode)
    E("cuGraphGetNodes", 10000, cuGraphGetNodes)
    E("cuGraphNodeGetType", 10000, cuGraphNodeGetType)
    E("cuGraphMemAllocNodeGetParams", 11040, cuGraphMemAllocNodeGetParams)
    E("cuGraphMemFreeNodeGetParams", 11040, cuGraphMemFreeNodeGetParams)
    E("cuGraphInstantiate", 10000, cuGraphInstantiate)
    E("cuGraphInstantiate", 11000, cuGraphInstantiate_v2)
    E("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags)
    E("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags)
    P("cuGraphInstantiateWithParams", 12000, cuGraphInstantiateWithParams, cuGraphInstantiateWithParams_ptsz)
    E("cuGraphExecDestroy", 10000, cuGraphExecDestroy)
    P("cuGraphUpload", 11010, cuGraphUpload, cuGraphUpload_ptsz)
    P("cuGraphLaunch", 10000, cuGraphLaunch, cuGraphLaunch_ptsz)
    E("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim)
    E("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute)
    E("cuDeviceSetGraphMemAttribute", 11040, cuDeviceSetGraphMemAttribute)
    E("cuStreamBeginCapture", 10000, cuStreamBeginCapture)
    P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2, cuStreamBeginCapture_ptsz)
    P("cuStreamEndCapture", 10000, cuStreamEndCapture, cuStreamEndCapture_ptsz)
    P("cuStreamIsCapturing", 10000, cuStreamIsCapturing, cuStreamIsCapturing_ptsz)
    P("cuStreamGetCaptureInfo", 10010, cuStreamGetCaptureInfo, cuStreamGetCaptureInfo_ptsz)
    P("cuStreamGetCaptureInfo", 11030, cuStreamGetCaptureInfo_v2, cuStreamGetCaptureInfo_v2_ptsz)
    P("cuStreamGetCaptureInfo", 12030, cuStreamGetCaptureInfo_v3, cuStreamGetCaptureInfo_v3_ptsz)
    E("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode)
    E("cuCtxGetLimit", 3010, cuCtxGetLimit)
    E("cuCtxSetLimit", 3010, cuCtxSetLimit)
    E("cuCtxGetCacheConfig", 3020, cuCtxGetCacheConfig)
    E("cuCtxSetCacheConfig", 3020, cuCtxSetCacheConfig)
    E("cuCtxGetSharedMemConfig", 4020, cuCtxGetSharedMemConfig)
    E("cuCtxSetSharedMemConfig", 4020, cuCtxSetSharedMemConfig)
    E("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer)
    E("cuDeviceGetP2PAttribute", 8000, cuDeviceGetP2PAttribute)
    E("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess)
    E("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess)
    P("cuStreamGetPriority", 5050, cuStreamGetPriority, cuStreamGetPriority_ptsz)
    P("cuStreamGetId", 12000, cuStreamGetId, cuStreamGetId_ptsz)
    P("cuStreamGetCtx", 9020, cuStreamGetCtx, cuStreamGetCtx_ptsz)
    P("cuStreamGetCtx", 12050, cuStreamGetCtx_v2, cuStreamGetCtx_v2_ptsz)
    E("cuStreamGetDevice", 12080, cuStreamGetDevice)
    P("cuLaunchHostFunc", 10000, cuLaunchHostFunc, cuLaunchHostFunc_ptsz)
    P("cuStreamAddCallback", 5000, cuStreamAddCallback, cuStreamAddCallback_ptsz)
    P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz)
    E("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2)
    E("cuMemHostGetFlags", 2030, cuMemHostGetFlags)
    E("cuProfilerStart", 4000, cuProfilerStart)
    E("cuProfilerStop", 4000, cuProfilerStop)
    P("cuMemcpy", 4000, cuMemcpy, cuMemcpy_ptds)
    P("cuMemcpyAsync", 4000, cuMemcpyAsync, cuMemcpyAsync_ptsz)
    P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz)
    P("cuMemcpyPeer", 4000, cuMemcpyPeer, cuMemcpyPeer_ptds)
    P("cuMemcpyPeerAsync", 4000, cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz)
    P("cuMemcpy2D", 3020, cuMemcpy2D_v2, cuMemcpy2D_v2_ptds)
    P("cuMemcpy2DUnaligned", 3020, cuMemcpy2DUnaligned_v2, cuMemcpy2DUnaligned_v2_ptds)
    P("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2, cuMemcpy2DAsync_v2_ptsz)
    P("cuMemcpy3D", 3020, cuMemcpy3D_v2, cuMemcpy3D_v2_ptds)
    P("cuMemcpy3DAsync", 3020, cuMemcpy3DAsync_v2, cuMemcpy3DAsync_v2_ptsz)
    P("cuMemsetD16", 3020, cuMemsetD16_v2, cuMemsetD16_v2_ptds)
    P("cuMemsetD8Async", 3020, cuMemsetD8Async, cuMemsetD8Async_ptsz)
    P("cuMemsetD16Async", 3020, cuMemsetD16Async, cuMemsetD16Async_ptsz)
    P("cuMemsetD32Async", 3020, cuMemsetD32Async, cuMemsetD32Async_ptsz)
    P("cuMemsetD2D8", 3020, cuMemsetD2D8_v2, cuMemsetD2D8_v2_ptds)
    P("cuMemsetD2D16", 3020, cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds)
    P("cuMemsetD2D32", 3020, cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds)
    P("cuMemsetD2D8Async", 3020, cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz)
    P("cuMemsetD2D16Async", 3020, cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz)
    P("cuMemsetD2D32Async", 3020, cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz)
    E("cuPointerGetAttribute", 4000, cuPointerGetAttribute)
    E("cuPointerGetAttributes", 7000, cuPointerGetAttributes)
    P("cuMemPrefetchAsync", 8000, cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz)
    P("cuMemPrefetchAsync", 12020, cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz)
    E("cuMemAdvise", 8000, cuMemAdvise)
    E("cuMemAdvise", 12020, cuMemAdvise_v2)
    /* sharing between processes, registered host memory (cuda_ipc.c, cuda_vmm.c, cuda_pool.c) */
    E("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle)
    E("cuIpcOpenMemHandle", 4010, cuIpcOpenMemHandle)
    E("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2)
    E("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle)
    E("cuMemHostRegister", 4000, cuMemHostRegister)
    E("cuMemHostRegister", 6050, cuMemHostRegister_v2)
    E("cuMemHostUnregister", 4000, cuMemHostUnregister)
    E("cuMemPoolExportToShareableHandle", 11020, cuMemPoolExportToShareableHandle)
    E("cuMemPoolImportFromShareableHandle", 11020, cuMemPoolImportFromShareableHandle)
    E("cuMemPoolExportPointer", 11020, cuMemPoolExportPointer)
    E("cuMemPoolImportPointer", 11020, cuMemPoolImportPointer)
    E("cuGetErrorString", 6000, cuGetErrorString)
    E("cuGetErrorName", 6000, cuGetErrorName)
    E("cuGetProcAddress", 11030, cuGetProcAddress)
    E("cuGetProcAddress", 12000, cuGetProcAddress_v2)
};

#define ST_SUCCESS 0
#define ST_NOT_FOUND 1
#define ST_VERSION 2

static CUresult lookup(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    int st = ST_NOT_FOUND;
    if (!symbol || !pfn || (flags & ~3ULL)) {
        if (status)
            *status = ST_NOT_FOUND;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pfn = NULL;
    const struct entry *best = NULL;
    for (size_t i = 0; i < sizeof(g_table) / sizeof(g_table[0]); i++) {
        const struct entry *e = &g_table[i];
        if (strcmp(e->base, symbol) != 0)
            continue;
        st = ST_VERSION;
        if (e->version <= version && (!best || e->version > best->version))
            best = e;
    }
    if (best) {
        int per_thread = (flags & 2) && best->ptds && version >= 7000;
        *pfn = (void *)(per_thread ? best->ptds : best->fn);
        st = ST_SUCCESS;
    }
    if (st != ST_SUCCESS)
        fg_trace("cuGetProcAddress %s@%d/%llu: %s", symbol, version, flags,
                 st == ST_VERSION ? "VERSION_NOT_SUFFICIENT" : "SYMBOL_NOT_FOUND");
    if (status)
        *status = st;
    return st == ST_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

FG_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags)
{
    return lookup(symbol, pfn, version, flags, NULL);
}

FG_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status)
{
    return lookup(symbol, pfn, version, flags, status);
}

