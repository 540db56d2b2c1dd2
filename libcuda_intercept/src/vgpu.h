/* vgpu.h — libvgpu.so internals shared by the hook files. */
#ifndef VGPU_INTERNAL_H
#define VGPU_INTERNAL_H

#include <stdint.h>

#include "cuda_abi.h"
#include "region.h"
#include "track.h"
#include "vlimits.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_TLS __thread __attribute__((tls_model("initial-exec")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- real driver entry points (resolved from dlopen("libcuda.so.1") / libnvidia-ml.so.1) */
#define VGPU_REAL_CUDA(X)                                                                                          \
    X(cuInit, (unsigned))                                                                                          \
    X(cuGetProcAddress, (const char *, void **, int, cuuint64_t))                                                 \
    X(cuGetProcAddress_v2, (const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))            \
    X(cuCtxGetDevice, (CUdevice *))                                                                                \
    X(cuDeviceGetUuid, (CUuuid *, CUdevice))                                                                       \
    X(cuDeviceGetUuid_v2, (CUuuid *, CUdevice))                                                                    \
    X(cuMemAlloc_v2, (CUdeviceptr *, size_t))                                                                      \
    X(cuMemAllocPitch_v2, (CUdeviceptr *, size_t *, size_t, size_t, unsigned))                                     \
    X(cuMemAllocManaged, (CUdeviceptr *, size_t, unsigned))                                                        \
    X(cuMemFree_v2, (CUdeviceptr))                                                                                 \
    X(cuMemAllocAsync, (CUdeviceptr *, size_t, CUstream))                                                          \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr *, size_t, CUstream))                                                     \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                    \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                               \
    X(cuMemFreeAsync, (CUdeviceptr, CUstream))                                                                     \
    X(cuMemFreeAsync_ptsz, (CUdeviceptr, CUstream))                                                                \
    X(cuMemPoolCreate, (CUmemoryPool *, const CUmemPoolProps *))                                                   \
    X(cuMemPoolDestroy, (CUmemoryPool))                                                                            \
    X(cuMemPoolTrimTo, (CUmemoryPool, size_t))                                                                     \
    X(cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))      \
    X(cuMemRelease, (CUmemGenericAllocationHandle))                                                                \
    X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))                   \
    X(cuMemUnmap, (CUdeviceptr, size_t))                                                                           \
    X(cuArrayCreate_v2, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *))                                                \
    X(cuArray3DCreate_v2, (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                                            \
    X(cuArrayDestroy, (CUarray))                                                                                   \
    X(cuMipmappedArrayCreate, (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned))                     \
    X(cuMipmappedArrayDestroy, (CUmipmappedArray))                                                                 \
    X(cuMemGetInfo_v2, (size_t *, size_t *))                                                                       \
    X(cuDeviceTotalMem_v2, (size_t *, CUdevice))                                                                   \
    X(cuLaunchKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, \
                       void **, void **))                                                                          \
    X(cuLaunchKernel_ptsz, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,      \
                            CUstream, void **, void **))                                                           \
    X(cuLaunchKernelEx, (const CUlaunchConfig *, CUfunction, void **, void **))                                    \
    X(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *, CUfunction, void **, void **))                               \
    X(cuLaunchCooperativeKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,          \
                                  unsigned, CUstream, void **))                                                    \
    X(cuLaunchCooperativeKernel_ptsz, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,     \
                                       unsigned, CUstream, void **))                                               \
    X(cuGraphLaunch, (CUgraphExec, CUstream))                                                                      \
    X(cuGraphLaunch_ptsz, (CUgraphExec, CUstream))                                                                 \
    X(cuGraphUpload, (CUgraphExec, CUstream))                                                                      \
    X(cuGraphUpload_ptsz, (CUgraphExec, CUstream))                                                                 \
    X(cuGraphInstantiate, (CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t))                                 \
    X(cuGraphInstantiate_v2, (CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t))                              \
    X(cuGraphInstantiateWithFlags, (CUgraphExec *, CUgraph, unsigned long long))                                   \
    X(cuGraphInstantiateWithParams, (CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *))                     \
    X(cuGraphInstantiateWithParams_ptsz, (CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *))                \
    X(cuGraphExecDestroy, (CUgraphExec))                                                                           \
    X(cuDeviceGraphMemTrim, (CUdevice))                                                                            \
    X(cuDeviceGetGraphMemAttribute, (CUdevice, int, void *))                                                       \
    X(cuGraphGetNodes, (CUgraph, CUgraphNode *, size_t *))                                                         \
    X(cuGraphNodeGetType, (CUgraphNode, int *))                                                                    \
    X(cuGraphMemAllocNodeGetParams, (CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *))                                   \
    X(cuGraphMemFreeNodeGetParams, (CUgraphNode, CUdeviceptr *))                                                   \
    X(cuStreamIsCapturing, (CUstream, int *))                                                                      \
    X(cuStreamIsCapturing_ptsz, (CUstream, int *))                                                                 \
    X(cuStreamSynchronize, (CUstream))                                                                             \
    X(cuStreamSynchronize_ptsz, (CUstream))                                                                        \
    X(cuCtxSynchronize, (void))                                                                                    \
    X(cuCtxSynchronize_v2, (CUcontext))                                                                            \
    X(cuEventSynchronize, (CUevent))                                                                               \
    X(cuMemPoolGetAttribute, (CUmemoryPool, int, void *))                                                          \
    X(cuDeviceGetDefaultMemPool, (CUmemoryPool *, CUdevice))                                                       \
    X(cuDeviceGetMemPool, (CUmemoryPool *, CUdevice))                                                              \
    X(cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr))                                                          \
    X(cuIpcOpenMemHandle, (CUdeviceptr *, CUipcMemHandle, unsigned))                                               \
    X(cuIpcOpenMemHandle_v2, (CUdeviceptr *, CUipcMemHandle, unsigned))                                            \
    X(cuIpcCloseMemHandle, (CUdeviceptr))                                                                          \
    X(cuMemExportToShareableHandle, (void *, CUmemGenericAllocationHandle, int, unsigned long long))               \
    X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle *, void *, int))                               \
    X(cuMemGetAllocationPropertiesFromHandle, (void *, CUmemGenericAllocationHandle))                              \
    X(cuMemGetAddressRange_v2, (CUdeviceptr *, size_t *, CUdeviceptr))                                            \
    X(cuDeviceGetAttribute, (int *, int, CUdevice))                                                                \
    X(cuEventCreate, (CUevent *, unsigned))                                                                        \
    X(cuEventRecord, (CUevent, CUstream))                                                                          \
    X(cuEventRecord_ptsz, (CUevent, CUstream))                                                                     \
    X(cuEventQuery, (CUevent))                                                                                     \
    X(cuEventDestroy_v2, (CUevent))                                                                                \
    X(cuMemAdvise, (CUdeviceptr, size_t, int, CUdevice))                                                           \
    X(cuMemAdvise_v2, (CUdeviceptr, size_t, int, CUmemLocation))                                                   \
    X(cuMemPrefetchAsync, (CUdeviceptr, size_t, CUdevice, CUstream))                                               \
    X(cuMemPrefetchAsync_ptsz, (CUdeviceptr, size_t, CUdevice, CUstream))                                          \
    X(cuMemPrefetchAsync_v2, (CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream))                             \
    X(cuMemPrefetchAsync_v2_ptsz, (CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream))                        \
    X(cuMemPrefetchBatchAsync, (CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,                \
                                unsigned long long, CUstream))                                                     \
    X(cuMemPrefetchBatchAsync_ptsz, (CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,           \
                                     unsigned long long, CUstream))                                                \
    X(cuMemDiscardAndPrefetchBatchAsync, (CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,      \
                                          unsigned long long, CUstream))                                           \
    X(cuMemDiscardAndPrefetchBatchAsync_ptsz, (CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t, \
                                               unsigned long long, CUstream))                                      \
    X(cuMemDiscardBatchAsync, (CUdeviceptr *, size_t *, size_t, unsigned long long, CUstream))                     \
    X(cuMemDiscardBatchAsync_ptsz, (CUdeviceptr *, size_t *, size_t, unsigned long long, CUstream))                \
    X(cuMemAlloc, (unsigned *, unsigned))                                                                          \
    X(cuMemAllocPitch, (unsigned *, unsigned *, unsigned, unsigned, unsigned))                                     \
    X(cuArrayCreate, (CUarray *, const void *))                                                                    \
    X(cuArray3DCreate, (CUarray *, const void *))

#define VGPU_REAL_NVML(X)                                                 \
    X(nvmlDeviceGetUUID, (nvmlDevice_t, char *, unsigned))                \
    X(nvmlDeviceGetMemoryInfo, (nvmlDevice_t, nvmlMemory_t *))            \
    X(nvmlDeviceGetMemoryInfo_v2, (nvmlDevice_t, nvmlMemory_v2_t *))

#define VGPU_DECL_CUDA(name, params) extern CUresult(*real_##name) params;
#define VGPU_DECL_NVML(name, params) extern nvmlReturn_t(*real_##name) params;
VGPU_REAL_CUDA(VGPU_DECL_CUDA)
VGPU_REAL_NVML(VGPU_DECL_NVML)

/* load the real pointer (relaxed atomic: plain load) */
#define REAL(name) __atomic_load_n(&real_##name, __ATOMIC_RELAXED)

/* resolve.c */
void vgpu_resolve_cuda(void); /* idempotent, re-entrancy safe, lock-free */
void vgpu_resolve_nvml(void);
int vgpu_cuda_resolved(void);

/* state.c: process state */
enum { VGPU_ST_INACTIVE = 1, VGPU_ST_ACTIVE = 2, VGPU_ST_FAILED = 3 };
extern int vgpu_status_cache;
int vgpu_status_slow(void);
static inline int vgpu_status(void)
{
    int s = __atomic_load_n(&vgpu_status_cache, __ATOMIC_ACQUIRE);
    return LIKELY(s) ? s : vgpu_status_slow();
}
const struct vgpu_limits *vgpu_limits(void);
uint64_t vgpu_ctx_reserve(void);
/* report the fail-closed reason once (error level); returns CUDA_ERROR_NOT_PERMITTED */
CUresult vgpu_fail_closed(const char *where);
/* map the region (for reading usage); 0 ok */
int vgpu_ensure_mapped(void);
/* map + own a slot; 0 ok */
int vgpu_ensure_joined(void);
/* CUDA ordinal -> limits index; -1 if the device has no limits line, -2 on driver error */
int vgpu_dev_index(CUdevice dev);
/* NVML handle -> limits index, -1 unlisted, -2 error */
int vgpu_nvml_index(nvmlDevice_t h);
void vgpu_format_uuid(const CUuuid *u, char out[VGPU_UUID_LEN]);

/* per-process trackers */
extern struct vgpu_track vgpu_t_ptr;   /* CUdeviceptr -> charge; ext = shared-ledger reference */
extern struct vgpu_track vgpu_t_vmm;   /* CUmemGenericAllocationHandle -> charge; aux = live mappings;
                                          ext = shared-ledger reference */
extern struct vgpu_track vgpu_t_map;   /* mapped VA -> (aux = handle) */
extern struct vgpu_track vgpu_t_arr;   /* CUarray / CUmipmappedArray -> charge */
extern struct vgpu_track vgpu_t_pool;  /* CUmemoryPool -> charged reservation (hooks_pool.c) */
extern struct vgpu_track vgpu_t_exec;  /* CUgraphExec (+device) -> graph memory footprint (hooks_graph.c) */
extern struct vgpu_track vgpu_t_ipc;   /* cuIpcOpenMemHandle pointer -> opens; ext = ledger reference */
extern struct vgpu_track vgpu_t_shr;   /* shared-ledger reference -> this process's holds (hooks_share.c) */
extern struct vgpu_track vgpu_t_defer; /* host-backed pointer freed in stream order -> charge; aux = CUevent (oversub.c) */

/* kinds of vgpu_t_ptr records beyond VGPU_KIND_DEVICE / HOST */
#define VGPU_KIND_POOL 2u /* a pool allocation: the pool's reservation is what is charged */
/* vgpu_t_vmm flag: an imported handle of unknown size, each of its mappings is charged */
#define VGPU_KIND_MAPCHARGE 0x200u

/* hooks_mem.c: shared by the hook files */
/* 1: account on limits index *idx; 0: pass through untracked; -1: return *rc */
int vgpu_begin(int dev, int *idx, CUresult *rc);
/* the same, with the CUDA ordinal it resolved (dev, or the current context's) */
int vgpu_begin_ord(int dev, int *idx, CUdevice *ord, CUresult *rc);
/* check-and-charge n bytes on limits index idx (refreshing cached pool memory once when it does
 * not fit): against the slice and, device bytes, the physical share; 0 ok, VGPU_OVER_SLICE or
 * VGPU_OVER_SHARE */
int vgpu_charge(int idx, uint64_t n, int kind);
int vgpu_remember(struct vgpu_track *t, uint64_t key, uint64_t size, int idx, unsigned kind, uint64_t aux);
/* cuMemFree_v2 / cuMemFreeAsync of a tracked pointer (sync: cuMemFree_v2, else fn(p, s)) */
CUresult vgpu_free_tracked(CUdeviceptr p, CUresult (*fn)(CUdeviceptr, CUstream), CUstream s, int sync);
void vgpu_hooks_atfork_child(void); /* hooks_pool.c, hooks_graph.c: process-local state */

/* hooks_pool.c / hooks_graph.c: bring the charges of memory the driver keeps cached (pool
 * reservations, the graph memory pool) of limits index idx down to what the driver holds now.
 * Returns 1 if anything was given back. */
int vgpu_pools_refresh(int idx);
int vgpu_graph_refresh(int idx);
/* a pool allocation was freed (hooks_mem.c's free path): the pool may release memory at the
 * next synchronisation */
void vgpu_pool_freed(uint64_t pool);
/* an untracked address was freed (cuMemFree, cuMemFreeAsync outside a capture): a graph
 * allocation is no longer live */
void vgpu_graph_freed(CUdeviceptr p);
/* 1 if stream s is being captured (free_fn: the _ptsz free asks about the per-thread stream) */
int vgpu_capturing(CUstream s, CUresult (*free_fn)(CUdeviceptr, CUstream));

/* hooks_share.c: a charge that belongs to the shared ledger is dropped there */
void vgpu_share_release(uint64_t ref);
uint64_t vgpu_share_hold(uint64_t ref); /* one more local hold of ref (already held by the slot) */

/* re-entrancy guard: a hook entered from inside another hook passes through */
extern VGPU_TLS int vgpu_in_hook;

/* In a hook: the real `fn`, resolved on first use, or CUDA_ERROR_NOT_FOUND from the hook. */
#define NEED(fn)                         \
    do {                                 \
        vgpu_resolve_cuda();             \
        if (UNLIKELY(!REAL(fn)))         \
            return CUDA_ERROR_NOT_FOUND; \
    } while (0)

/* A hook accounts: not entered from inside another hook, and the library not inactive. */
static inline int vgpu_hook_active(void) { return !vgpu_in_hook && vgpu_status() != VGPU_ST_INACTIVE; }

#endif
