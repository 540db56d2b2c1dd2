/* fakegpu libcuda: the context, stream, event and peer queries the CUDA runtime and the frameworks
 * make around their work (limits, cache configuration, stream properties, host callbacks, peer
 * access, host-pointer lookups), with the values and error codes cuda.h documents.
 */
#include "fg_cuda.h"

#include <string.h>

CUresult cuEventRecord(void *e, CUstream s);
CUresult cuEventRecord_ptsz(void *e, CUstream s);

/* --- context limits and configuration (CUlimit of cuda.h) ------------------------------------ */

#define NLIMITS 7
static size_t g_limits[NLIMITS] = {
    1024,      /* STACK_SIZE */
    1 << 20,   /* PRINTF_FIFO_SIZE */
    8 << 20,   /* MALLOC_HEAP_SIZE */
    2,         /* DEV_RUNTIME_SYNC_DEPTH */
    2048,      /* DEV_RUNTIME_PENDING_LAUNCH_COUNT */
    64,        /* MAX_L2_FETCH_GRANULARITY */
    0,         /* PERSISTING_L2_CACHE_SIZE */
};
static int g_cache_config, g_shmem_config;

#define CUDA_ERROR_UNSUPPORTED_LIMIT 215
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CUDA_ERROR_PEER_ACCESS_NOT_ENABLED 705

FG_API CUresult cuCtxGetLimit(size_t *v, int limit)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (limit < 0 || limit >= NLIMITS)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    *v = __atomic_load_n(&g_limits[limit], __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSetLimit(int limit, size_t v)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (limit < 0 || limit >= NLIMITS)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    if (limit == 5 && v != 0 && v != 32 && v != 64 && v != 128) /* a hint: rounded as documented */
        v = 64;
    __atomic_store_n(&g_limits[limit], v, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetCacheConfig(int *c)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    *c = g_cache_config;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSetCacheConfig(int c)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (c < 0 || c > 3) /* CU_FUNC_CACHE_PREFER_NONE .. PREFER_EQUAL */
        return CUDA_ERROR_INVALID_VALUE;
    g_cache_config = c;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetSharedMemConfig(int *c)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    *c = g_shmem_config;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSetSharedMemConfig(int c)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (c < 0 || c > 2)
        return CUDA_ERROR_INVALID_VALUE;
    g_shmem_config = c;
    return CUDA_SUCCESS;
}

/* --- peers: every pair of distinct simulated devices can reach each other --------------------- */

static unsigned g_peer_enabled[FG_MAX_DEV]; /* bit p set in [d]: context on d may access p */

FG_API CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer)
{
    CUresult rc;
    if ((rc = fg_check_dev(dev)) || (rc = fg_check_dev(peer)))
        return rc;
    if (!can)
        return CUDA_ERROR_INVALID_VALUE;
    *can = dev != peer;
    return CUDA_SUCCESS;
}

/* CUdevice_P2PAttribute: 1 PERFORMANCE_RANK, 2 ACCESS_SUPPORTED, 3 NATIVE_ATOMIC_SUPPORTED,
 * 4 CUDA_ARRAY_ACCESS_SUPPORTED (and its old alias) */
FG_API CUresult cuDeviceGetP2PAttribute(int *v, int attr, CUdevice src, CUdevice dst)
{
    CUresult rc;
    if ((rc = fg_check_dev(src)) || (rc = fg_check_dev(dst)))
        return rc;
    if (!v || attr < 1 || attr > 4)
        return CUDA_ERROR_INVALID_VALUE;
    if (src == dst)
        return CUDA_ERROR_INVALID_DEVICE;
    *v = attr == 1 ? 0 : 1;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags)
{
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if (flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (!fg_ctx_valid(peer))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (peer->dev == c->dev)
        return CUDA_ERROR_INVALID_DEVICE;
    unsigned bit = 1u << peer->dev;
    if (__atomic_fetch_or(&g_peer_enabled[c->dev], bit, __ATOMIC_RELAXED) & bit)
        return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxDisablePeerAccess(CUcontext peer)
{
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if (!fg_ctx_valid(peer))
        return CUDA_ERROR_INVALID_CONTEXT;
    unsigned bit = 1u << peer->dev;
    if (!(__atomic_fetch_and(&g_peer_enabled[c->dev], ~bit, __ATOMIC_RELAXED) & bit))
        return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    return CUDA_SUCCESS;
}

/* --- stream properties ------------------------------------------------------------------------ */

static int special(CUstream s)
{
    return s == NULL || s == FG_STREAM_LEGACY || s == FG_STREAM_PER_THREAD;
}

static CUresult stream_priority(CUstream s, int pt, int *p)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, pt, &dev, &idx);
    if (rc)
        return rc;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    *p = special(s) ? 0 : s->priority;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamGetPriority(CUstream s, int *p)
{
    return stream_priority(s, 0, p);
}
FG_API CUresult cuStreamGetPriority_ptsz(CUstream s, int *p)
{
    return stream_priority(s, 1, p);
}

static CUresult stream_id(CUstream s, int pt, unsigned long long *id)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, pt, &dev, &idx);
    if (rc)
        return rc;
    if (!id)
        return CUDA_ERROR_INVALID_VALUE;
    *id = special(s) ? (unsigned long long)idx + 1 : s->id;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamGetId(CUstream s, unsigned long long *id)
{
    return stream_id(s, 0, id);
}
FG_API CUresult cuStreamGetId_ptsz(CUstream s, unsigned long long *id)
{
    return stream_id(s, 1, id);
}

static CUresult stream_ctx(CUstream s, int pt, CUcontext *pc)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, pt, &dev, &idx);
    if (rc)
        return rc;
    if (!pc)
        return CUDA_ERROR_INVALID_VALUE;
    if (special(s)) {
        struct fg_ctx *c = fg_current(&rc);
        if (!c)
            return rc;
        *pc = c;
    } else {
        *pc = s->ctx;
    }
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamGetCtx(CUstream s, CUcontext *pc)
{
    return stream_ctx(s, 0, pc);
}
FG_API CUresult cuStreamGetCtx_ptsz(CUstream s, CUcontext *pc)
{
    return stream_ctx(s, 1, pc);
}

/* _v2 (12.5): (stream, CUcontext *, CUgreenCtx *): no green contexts here */
FG_API CUresult cuStreamGetCtx_v2(CUstream s, CUcontext *pc, void **green)
{
    if (green)
        *green = NULL;
    return stream_ctx(s, 0, pc);
}
FG_API CUresult cuStreamGetCtx_v2_ptsz(CUstream s, CUcontext *pc, void **green)
{
    if (green)
        *green = NULL;
    return stream_ctx(s, 1, pc);
}

FG_API CUresult cuStreamGetDevice(CUstream s, CUdevice *d)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, 0, &dev, &idx);
    if (rc)
        return rc;
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    *d = fg_ordinal_of(dev);
    return CUDA_SUCCESS;
}

/* --- host work in stream order: runs once the stream's earlier kernels completed -------------- */

static CUresult host_func(CUstream s, int pt, void (*fn)(void *), void *arg)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, pt, &dev, &idx);
    if (rc)
        return rc;
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fg_wait_idle(dev, idx)))
        return rc;
    fn(arg);
    return CUDA_SUCCESS;
}

FG_API CUresult cuLaunchHostFunc(CUstream s, void (*fn)(void *), void *arg)
{
    return host_func(s, 0, fn, arg);
}
FG_API CUresult cuLaunchHostFunc_ptsz(CUstream s, void (*fn)(void *), void *arg)
{
    return host_func(s, 1, fn, arg);
}

typedef void (*fg_stream_cb)(CUstream, CUresult, void *);

static CUresult add_callback(CUstream s, int pt, fg_stream_cb cb, void *arg, unsigned flags)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, pt, &dev, &idx);
    if (rc)
        return rc;
    if (!cb || flags)
        return CUDA_ERROR_INVALID_VALUE;
    rc = fg_wait_idle(dev, idx);
    cb(s, rc, arg);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamAddCallback(CUstream s, fg_stream_cb cb, void *arg, unsigned flags)
{
    return add_callback(s, 0, cb, arg, flags);
}
FG_API CUresult cuStreamAddCallback_ptsz(CUstream s, fg_stream_cb cb, void *arg, unsigned flags)
{
    return add_callback(s, 1, cb, arg, flags);
}

/* CU_EVENT_RECORD_DEFAULT 0, CU_EVENT_RECORD_EXTERNAL 1 (graphs only) */
FG_API CUresult cuEventRecordWithFlags(void *e, CUstream s, unsigned flags)
{
    if (flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    return cuEventRecord(e, s);
}
FG_API CUresult cuEventRecordWithFlags_ptsz(void *e, CUstream s, unsigned flags)
{
    if (flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    return cuEventRecord_ptsz(e, s);
}

/* --- host allocations seen from the device: one address space ---------------------------------- */

__attribute__((weak)) FG_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!d || flags)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_alloc a;
    if (fg_alloc_find((uint64_t)(uintptr_t)p, 1, &a) != 0 || a.kind != FG_ALLOC_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemHostGetFlags(unsigned *flags, void *p)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_alloc a;
    if (fg_alloc_find((uint64_t)(uintptr_t)p, 1, &a) != 0 || a.kind != FG_ALLOC_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    return CUDA_SUCCESS;
}

FG_API CUresult cuProfilerStart(void)
{
    CUresult rc;
    return fg_current(&rc) ? CUDA_SUCCESS : rc;
}

FG_API CUresult cuProfilerStop(void)
{
    CUresult rc;
    return fg_current(&rc) ? CUDA_SUCCESS : rc;
}

/* --- stream memory operations: a write once the stream's earlier work completed --------------- */

static CUresult write_value(CUstream s, int pt, CUdeviceptr addr, const void *v, size_t n, unsigned flags)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, pt, &dev, &idx);
    if (rc)
        return rc;
    if (flags > 1 || addr % n) /* CU_STREAM_WRITE_VALUE_DEFAULT / NO_MEMORY_BARRIER; aligned */
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fg_check_dev_range(addr, n)) || (rc = fg_wait_idle(dev, idx)))
        return rc;
    memcpy((void *)(uintptr_t)addr, v, n);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamWriteValue32(CUstream s, CUdeviceptr addr, unsigned v, unsigned flags)
{
    return write_value(s, 0, addr, &v, 4, flags);
}
FG_API CUresult cuStreamWriteValue32_ptsz(CUstream s, CUdeviceptr addr, unsigned v, unsigned flags)
{
    return write_value(s, 1, addr, &v, 4, flags);
}
FG_API CUresult cuStreamWriteValue64(CUstream s, CUdeviceptr addr, unsigned long long v, unsigned flags)
{
    return write_value(s, 0, addr, &v, 8, flags);
}
FG_API CUresult cuStreamWriteValue64_ptsz(CUstream s, CUdeviceptr addr, unsigned long long v, unsigned flags)
{
    return write_value(s, 1, addr, &v, 8, flags);
}
