/*
 * hooks_pool.c — stream-ordered allocation (cuMemAllocAsync, cuMemAllocFromPoolAsync,
 * cuMemFreeAsync) and memory pools.
 *
 * What a pool takes from the device is its reservation (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
 * not the sum of its live allocations: freed memory stays reserved until a synchronisation finds
 * more than the release threshold idle, or cuMemPoolTrimTo gives it back (CUDA Driver API,
 * "Stream Ordered Memory Allocator": CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cuMemPoolTrimTo,
 * cuMemPoolDestroy).  So a pool's charge is its reservation:
 *  - before an allocation of n bytes, the growth it can cause — n minus the idle reserved bytes,
 *    rounded up to 2 MiB — is charged (refused when over the limit), the driver is called, and
 *    the charge is settled on the reservation the driver reports afterwards (more than estimated
 *    and over the limit: the allocation is freed, the pool trimmed back, CUDA_ERROR_OUT_OF_MEMORY);
 *  - frees return nothing; what the pool gives back is returned when the hooks next see the
 *    reservation: after cuMemPoolTrimTo, after a stream/context/event synchronisation that
 *    follows a free, before the next allocation from the pool, and before any charge of this
 *    process is refused;
 *  - a destroyed pool's charge goes when its last allocation is freed ("released automatically
 *    once there are no more outstanding allocations").
 * Pools at a host location are host memory: untouched.  Allocations made while their stream is
 * capturing are graph allocations, charged when a graph launch maps them (hooks_graph.c).
 * An allocation the device cannot take (the container's physical share is reached, or the driver
 * has no memory) goes to host memory when the container oversubscribes (oversub.c): host-backed
 * managed memory, recorded as such, whose cuMemFreeAsync frees it in stream order.
 * Allocations of one pool are serialised in this process (the estimate needs the idle bytes to
 * stay idle until the driver call); nothing here is on the kernel-launch path.
 */
#include <pthread.h>
#include <string.h>

#include "log.h"
#include "oversub.h"
#include "vgpu.h"

#define GRAN (2ull << 20)
/* vgpu_t_pool kinds */
#define POOL_HOST 0x1u
#define POOL_DESTROYED 0x2u

/* One recursive lock for pools and the graph pool (hooks_graph.c): a refresh from inside a
 * charge made under it takes it again; one lock, so no order between two. */
pthread_mutex_t vgpu_cache_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
#define g_pool_mu vgpu_cache_mu
static int g_dirty; /* a pool allocation was freed since the last look at the reservations */

static int reserved_of(CUmemoryPool p, uint64_t *r)
{
    return REAL(cuMemPoolGetAttribute) && REAL(cuMemPoolGetAttribute)(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, r) ==
                                              CUDA_SUCCESS
               ? 0
               : -1;
}

/* bring r's charge to what the pool reserves now; 1 if charge was given back */
static int settle(struct vgpu_rec *r)
{
    uint64_t now;
    if ((r->kind & (POOL_HOST | POOL_DESTROYED)) || reserved_of((CUmemoryPool)(uintptr_t)r->key, &now) != 0)
        return 0;
    if (now < r->size) {
        vgpu_rgn_uncharge(r->dev, r->size - now, VGPU_KIND_DEVICE);
        r->size = now;
        return 1;
    }
    if (now > r->size) { /* grown where the hooks did not see it: counted, whatever the limit */
        vgpu_rgn_charge(r->dev, now - r->size, UINT64_MAX, UINT64_MAX, vgpu_ctx_reserve(), VGPU_KIND_DEVICE);
        r->size = now;
    }
    return 0;
}

struct refresh {
    int idx, released;
};

static void refresh_one(struct vgpu_rec *r, void *arg)
{
    struct refresh *f = arg;
    if (f->idx < 0 || (int)r->dev == f->idx)
        f->released |= settle(r);
}

int vgpu_pools_refresh(int idx)
{
    if (vgpu_track_count(&vgpu_t_pool) == 0)
        return 0;
    pthread_mutex_lock(&g_pool_mu);
    struct refresh f = {idx, 0};
    __atomic_store_n(&g_dirty, 0, __ATOMIC_RELAXED);
    vgpu_track_each(&vgpu_t_pool, refresh_one, &f);
    pthread_mutex_unlock(&g_pool_mu);
    return f.released;
}

/* The record of pool p (made on first sight for a device pool of ordinal ord); 0 ok. */
static int pool_rec(CUmemoryPool p, int ord, struct vgpu_rec *r)
{
    if (vgpu_track_get(&vgpu_t_pool, (uint64_t)(uintptr_t)p, r))
        return 0;
    int idx = vgpu_dev_index(ord);
    if (idx < 0)
        return -1;
    struct vgpu_rec n = {.key = (uint64_t)(uintptr_t)p, .dev = (uint32_t)idx, .aux = (uint64_t)(unsigned)ord};
    if (vgpu_track_put(&vgpu_t_pool, &n) != 0)
        return -1;
    *r = n;
    return 0;
}

static void note_pool(CUmemoryPool p, int ord, unsigned kind)
{
    if (!p || !vgpu_hook_active())
        return;
    pthread_mutex_lock(&g_pool_mu);
    struct vgpu_rec r;
    if (!vgpu_track_get(&vgpu_t_pool, (uint64_t)(uintptr_t)p, &r)) {
        int idx = kind & POOL_HOST ? 0 : vgpu_dev_index(ord);
        if (idx >= 0) {
            r = (struct vgpu_rec){.key = (uint64_t)(uintptr_t)p, .dev = (uint32_t)idx, .aux = (uint64_t)(unsigned)ord,
                                  .kind = kind};
            vgpu_track_put(&vgpu_t_pool, &r);
        }
    }
    pthread_mutex_unlock(&g_pool_mu);
}

static int capturing(CUstream s, int per_thread)
{
    CUresult (*f)(CUstream, int *) = per_thread ? REAL(cuStreamIsCapturing_ptsz) : REAL(cuStreamIsCapturing);
    int st = CU_STREAM_CAPTURE_STATUS_NONE;
    return f && f(s, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int vgpu_capturing(CUstream s, CUresult (*free_fn)(CUdeviceptr, CUstream))
{
    return capturing(s, free_fn && free_fn == REAL(cuMemFreeAsync_ptsz));
}

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pool_alloc_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*free_fn)(CUdeviceptr, CUstream);

#define WHAT() (pfn ? "cuMemAllocFromPoolAsync" : "cuMemAllocAsync")

/* the pre-pool accounting: the allocation itself, when the pool cannot be asked */
static CUresult alloc_plain(alloc_fn fn, pool_alloc_fn pfn, CUdeviceptr *dptr, size_t n, CUmemoryPool pool, CUstream s,
                            int idx, CUdevice ord)
{
    int cr = vgpu_charge(idx, n, VGPU_KIND_DEVICE);
    if (cr != 0)
        return vgpu_os_async_host(cr, idx, ord, dptr, n, WHAT());
    vgpu_in_hook++;
    CUresult rc = pfn ? pfn(dptr, n, pool, s) : fn(dptr, n, s);
    vgpu_in_hook--;
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, n, VGPU_KIND_DEVICE);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? vgpu_os_async_host(0, idx, ord, dptr, n, WHAT()) : rc;
    }
    if (vgpu_remember(&vgpu_t_ptr, *dptr, n, idx, VGPU_KIND_DEVICE, 0) != 0) {
        REAL(cuMemFree_v2)(*dptr);
        vgpu_rgn_uncharge((unsigned)idx, n, VGPU_KIND_DEVICE);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

static CUresult alloc_async(alloc_fn fn, pool_alloc_fn pfn, free_fn ffn, CUdeviceptr *dptr, size_t n,
                            CUmemoryPool pool, CUstream s, int per_thread)
{
#define FORWARD() (pfn ? pfn(dptr, n, pool, s) : fn(dptr, n, s))
    if (!vgpu_hook_active() || capturing(s, per_thread))
        return FORWARD(); /* capturing: a graph allocation node, charged at launch */
    CUdevice ord = -1;
    if (REAL(cuCtxGetDevice) && REAL(cuCtxGetDevice)(&ord) != CUDA_SUCCESS)
        ord = -1;
    CUmemoryPool p = pool;
    if (!pfn && (ord < 0 || !REAL(cuDeviceGetMemPool) || REAL(cuDeviceGetMemPool)(&p, ord) != CUDA_SUCCESS))
        p = NULL;
    pthread_mutex_lock(&g_pool_mu);
    struct vgpu_rec r;
    int have = p && (vgpu_track_get(&vgpu_t_pool, (uint64_t)(uintptr_t)p, &r) || pool_rec(p, ord, &r) == 0);
    if (have && (r.kind & POOL_HOST)) {
        pthread_mutex_unlock(&g_pool_mu);
        return FORWARD(); /* host memory */
    }
    CUresult rc = CUDA_SUCCESS;
    CUdevice dord;
    int idx, b = vgpu_begin_ord(have ? (int)r.aux : -1, &idx, &dord, &rc);
    if (b <= 0) {
        pthread_mutex_unlock(&g_pool_mu);
        return b < 0 ? rc : FORWARD();
    }
    uint64_t r0 = 0, u0 = 0;
    if (!have || reserved_of(p, &r0) != 0 ||
        REAL(cuMemPoolGetAttribute)(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u0) != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_pool_mu);
        return alloc_plain(fn, pfn, dptr, n, pool, s, idx, dord);
    }
    settle(&r);
    vgpu_track_put(&vgpu_t_pool, &r);
    uint64_t idle = r0 > u0 ? r0 - u0 : 0;
    uint64_t need = n > idle ? (n - idle + GRAN - 1) / GRAN * GRAN : 0;
    int cr = need ? vgpu_charge(idx, need, VGPU_KIND_DEVICE) : 0;
    if (cr != 0) {
        pthread_mutex_unlock(&g_pool_mu);
        return vgpu_os_async_host(cr, idx, dord, dptr, n, WHAT()); /* beyond the physical share */
    }
    vgpu_track_get(&vgpu_t_pool, r.key, &r); /* a refresh inside vgpu_charge may have settled it */
    vgpu_in_hook++;
    rc = FORWARD();
    vgpu_in_hook--;
    uint64_t charged = r.size + need, r1;
    if (rc == CUDA_SUCCESS && reserved_of(p, &r1) == 0 && r1 > charged) {
        /* the driver reserved more than the estimate: counted if it fits, else undone */
        if (vgpu_charge(idx, r1 - charged, VGPU_KIND_DEVICE) == 0) {
            charged = r1;
        } else {
            vgpu_in_hook++;
            ffn(*dptr, s);
            if (REAL(cuMemPoolTrimTo))
                REAL(cuMemPoolTrimTo)(p, r0);
            vgpu_in_hook--;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    r.size = charged;
    settle(&r); /* down to what the pool holds (a failed call: back to where it was) */
    if (rc == CUDA_SUCCESS) {
        r.ext++;
        if (vgpu_remember(&vgpu_t_ptr, *dptr, n, idx, VGPU_KIND_POOL, r.key) != 0)
            VLOG(VGPU_LOG_WARN, "pool allocation tracking failed; its pool stays charged");
    }
    vgpu_track_put(&vgpu_t_pool, &r);
    pthread_mutex_unlock(&g_pool_mu);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        return vgpu_os_async_host(0, idx, dord, dptr, n, WHAT()); /* the device had no room */
    return rc;
#undef FORWARD
}

void vgpu_pool_freed(uint64_t pool)
{
    pthread_mutex_lock(&g_pool_mu);
    struct vgpu_rec r;
    if (vgpu_track_get(&vgpu_t_pool, pool, &r)) {
        if (r.ext)
            r.ext--;
        if ((r.kind & POOL_DESTROYED) && r.ext == 0) { /* the destroyed pool goes with its last allocation */
            vgpu_rgn_uncharge(r.dev, r.size, VGPU_KIND_DEVICE);
            vgpu_track_take(&vgpu_t_pool, pool, NULL);
        } else {
            vgpu_track_put(&vgpu_t_pool, &r);
        }
    }
    __atomic_store_n(&g_dirty, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_pool_mu);
}

VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t n, CUstream s)
{
    NEED(cuMemAllocAsync);
    return alloc_async(REAL(cuMemAllocAsync), NULL, REAL(cuMemFreeAsync), dptr, n, NULL, s, 0);
}

VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t n, CUstream s)
{
    NEED(cuMemAllocAsync_ptsz);
    return alloc_async(REAL(cuMemAllocAsync_ptsz), NULL, REAL(cuMemFreeAsync_ptsz), dptr, n, NULL, s, 1);
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t n, CUmemoryPool pool, CUstream s)
{
    NEED(cuMemAllocFromPoolAsync);
    return alloc_async(NULL, REAL(cuMemAllocFromPoolAsync), REAL(cuMemFreeAsync), dptr, n, pool, s, 0);
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t n, CUmemoryPool pool, CUstream s)
{
    NEED(cuMemAllocFromPoolAsync_ptsz);
    return alloc_async(NULL, REAL(cuMemAllocFromPoolAsync_ptsz), REAL(cuMemFreeAsync_ptsz), dptr, n, pool, s, 1);
}

VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    NEED(cuMemFreeAsync);
    return vgpu_free_tracked(p, REAL(cuMemFreeAsync), s, 0);
}

VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    NEED(cuMemFreeAsync_ptsz);
    return vgpu_free_tracked(p, REAL(cuMemFreeAsync_ptsz), s, 0);
}

VGPU_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    NEED(cuMemPoolCreate);
    CUresult rc = REAL(cuMemPoolCreate)(pool, props);
    if (rc == CUDA_SUCCESS && pool && props)
        note_pool(*pool, props->location.id, props->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? 0 : POOL_HOST);
    return rc;
}

VGPU_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    NEED(cuDeviceGetDefaultMemPool);
    CUresult rc = REAL(cuDeviceGetDefaultMemPool)(pool, dev);
    if (rc == CUDA_SUCCESS && pool)
        note_pool(*pool, dev, 0);
    return rc;
}

VGPU_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    NEED(cuDeviceGetMemPool);
    CUresult rc = REAL(cuDeviceGetMemPool)(pool, dev);
    if (rc == CUDA_SUCCESS && pool)
        note_pool(*pool, dev, 0);
    return rc;
}

VGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    NEED(cuMemPoolTrimTo);
    CUresult rc = REAL(cuMemPoolTrimTo)(pool, keep);
    if (rc == CUDA_SUCCESS && vgpu_hook_active()) {
        pthread_mutex_lock(&g_pool_mu);
        struct vgpu_rec r;
        if (vgpu_track_get(&vgpu_t_pool, (uint64_t)(uintptr_t)pool, &r)) {
            settle(&r);
            vgpu_track_put(&vgpu_t_pool, &r);
        }
        pthread_mutex_unlock(&g_pool_mu);
    }
    return rc;
}

VGPU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    NEED(cuMemPoolDestroy);
    CUresult rc = REAL(cuMemPoolDestroy)(pool);
    if (rc == CUDA_SUCCESS && vgpu_hook_active()) {
        pthread_mutex_lock(&g_pool_mu);
        struct vgpu_rec r;
        if (vgpu_track_get(&vgpu_t_pool, (uint64_t)(uintptr_t)pool, &r)) {
            if (r.ext == 0) {
                if (!(r.kind & POOL_HOST))
                    vgpu_rgn_uncharge(r.dev, r.size, VGPU_KIND_DEVICE);
                vgpu_track_take(&vgpu_t_pool, r.key, NULL);
            } else {
                r.kind |= POOL_DESTROYED; /* charged until its last allocation is freed */
                vgpu_track_put(&vgpu_t_pool, &r);
            }
        }
        pthread_mutex_unlock(&g_pool_mu);
    }
    return rc;
}

/* ------------------------------------------------- synchronisations */

/* After a free, a synchronisation is where pools give memory back: look at the reservations. */
static CUresult after_sync(CUresult rc)
{
    if (UNLIKELY(__atomic_load_n(&g_dirty, __ATOMIC_RELAXED)) && vgpu_hook_active())
        vgpu_pools_refresh(-1);
    if (vgpu_hook_active())
        vgpu_os_reap(0); /* host-backed memory freed in stream order, its stream now done */
    return rc;
}

VGPU_EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    NEED(cuStreamSynchronize);
    return after_sync(REAL(cuStreamSynchronize)(s));
}

VGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    NEED(cuStreamSynchronize_ptsz);
    return after_sync(REAL(cuStreamSynchronize_ptsz)(s));
}

VGPU_EXPORT CUresult cuCtxSynchronize(void)
{
    NEED(cuCtxSynchronize);
    return after_sync(REAL(cuCtxSynchronize)());
}

VGPU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext c)
{
    NEED(cuCtxSynchronize_v2);
    return after_sync(REAL(cuCtxSynchronize_v2)(c));
}

VGPU_EXPORT CUresult cuEventSynchronize(CUevent e)
{
    NEED(cuEventSynchronize);
    return after_sync(REAL(cuEventSynchronize)(e));
}

void vgpu_pool_atfork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
    vgpu_cache_mu = fresh;
    g_dirty = 0;
}
