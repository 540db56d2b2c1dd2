/* fakegpu libcuda: stream-ordered allocation and memory pools.
 *
 * A pool reserves device memory in 2 MiB steps (charged to the process like any allocation) and
 * hands out allocations from it.  Freed bytes stay reserved until a synchronisation (stream,
 * context) when more than the release threshold (default 0) is idle, or until cuMemPoolTrimTo,
 * which is what the real driver documents.  Allocation is immediate (not ordered after the
 * stream's kernels): a simplification that never makes memory available earlier than on a GPU.
 */
#include "fg_cuda.h"

#include <string.h>

#define GRAN (2ULL << 20)
#define MAX_POOLS 64

struct fg_pool {
    uint32_t magic;
    int dev;
    uint64_t reserved, used, reserved_high, used_high, threshold;
    int reuse[4];
};

static struct fg_pool g_pools[MAX_POOLS];
static int g_default[FG_MAX_DEV]; /* index+1 of the default pool; 0 none */
static int g_current[FG_MAX_DEV]; /* index+1 of the device's current pool; 0: the default one */
static pthread_mutex_t g_pmu = PTHREAD_MUTEX_INITIALIZER;

static int pool_valid(const struct fg_pool *p)
{
    return p && p >= &g_pools[0] && p < &g_pools[MAX_POOLS] && p->magic == FG_MAGIC_POOL;
}

static struct fg_pool *pool_new(int dev)
{
    for (int i = 0; i < MAX_POOLS; i++)
        if (g_pools[i].magic == 0) {
            memset(&g_pools[i], 0, sizeof(g_pools[i]));
            g_pools[i].magic = FG_MAGIC_POOL;
            g_pools[i].dev = dev;
            return &g_pools[i];
        }
    return NULL;
}

static struct fg_pool *default_pool(int dev)
{
    if (!g_default[dev]) {
        struct fg_pool *p = pool_new(dev);
        if (!p)
            return NULL;
        g_default[dev] = (int)(p - g_pools) + 1;
    }
    return &g_pools[g_default[dev] - 1];
}

static struct fg_pool *current_pool(int dev)
{
    return g_current[dev] ? &g_pools[g_current[dev] - 1] : default_pool(dev);
}

/* Gives back reserved memory above max(used, keep). */
static void trim(struct fg_pool *p, uint64_t keep)
{
    uint64_t target = p->used > keep ? p->used : keep;
    if (target >= p->reserved)
        return; /* (also keeps a threshold of UINT64_MAX, "never release", from overflowing below) */
    target = (target + GRAN - 1) / GRAN * GRAN;
    if (p->reserved > target) {
        fg_uncharge(p->dev, p->reserved - target, FG_KIND_DEVICE);
        p->reserved = target;
    }
}

CUresult fg_pools_sync(int dev)
{
    pthread_mutex_lock(&g_pmu);
    for (int i = 0; i < MAX_POOLS; i++)
        if (g_pools[i].magic == FG_MAGIC_POOL && g_pools[i].dev == dev)
            trim(&g_pools[i], g_pools[i].threshold);
    pthread_mutex_unlock(&g_pmu);
    return CUDA_SUCCESS;
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, struct fg_pool *p, CUstream s, int per_thread)
{
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    pthread_mutex_lock(&g_pmu);
    if (!p)
        p = current_pool(dev);
    if (!pool_valid(p)) {
        pthread_mutex_unlock(&g_pmu);
        return p ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t idle = p->reserved - p->used;
    if (idle < size) {
        uint64_t grow = (size - idle + GRAN - 1) / GRAN * GRAN;
        rc = fg_charge(p->dev, grow, FG_KIND_DEVICE);
        if (rc) {
            pthread_mutex_unlock(&g_pmu);
            return rc;
        }
        p->reserved += grow;
    }
    p->used += size;
    if (p->reserved > p->reserved_high)
        p->reserved_high = p->reserved;
    if (p->used > p->used_high)
        p->used_high = p->used;
    void *m = fg_map_bytes(size);
    struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)m, .size = size, .charged = size, .dev = p->dev,
                         .kind = FG_ALLOC_ASYNC, .pool = p};
    if (!m || fg_alloc_insert(&a) != 0) {
        if (m)
            fg_unmap_bytes(a.ptr, size);
        p->used -= size;
        pthread_mutex_unlock(&g_pmu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&g_pmu);
    *dptr = a.ptr;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s)
{
    return pool_alloc(dptr, size, NULL, s, 0);
}
FG_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s)
{
    return pool_alloc(dptr, size, NULL, s, 1);
}
FG_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool p, CUstream s)
{
    return p ? pool_alloc(dptr, size, p, s, 0) : CUDA_ERROR_INVALID_VALUE;
}
FG_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool p, CUstream s)
{
    return p ? pool_alloc(dptr, size, p, s, 1) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult pool_free(CUdeviceptr ptr, CUstream s, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr || a.kind != FG_ALLOC_ASYNC)
        return CUDA_ERROR_INVALID_VALUE;
    fg_alloc_remove(ptr, &a);
    fg_unmap_bytes(a.ptr, a.size);
    pthread_mutex_lock(&g_pmu);
    if (pool_valid(a.pool))
        a.pool->used -= a.size <= a.pool->used ? a.size : a.pool->used;
    pthread_mutex_unlock(&g_pmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream s)
{
    return pool_free(ptr, s, 0);
}
FG_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr ptr, CUstream s)
{
    return pool_free(ptr, s, 1);
}

/* CUmemPoolProps: allocType @0, handleTypes @4, location {type @8, id @12}, ... */
struct fg_pool_props {
    int allocType;
    int handleTypes;
    int locType;
    int locId;
};

FG_API CUresult cuMemPoolCreate(CUmemoryPool *pp, const struct fg_pool_props *props)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pp || !props || props->allocType != 1 || props->locType != 1) /* PINNED, LOCATION_TYPE_DEVICE */
        return CUDA_ERROR_INVALID_VALUE;
    int dev = fg_phys(props->locId);
    if (dev < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_pmu);
    struct fg_pool *p = pool_new(dev);
    pthread_mutex_unlock(&g_pmu);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolDestroy(CUmemoryPool p)
{
    pthread_mutex_lock(&g_pmu);
    if (!pool_valid(p) || (g_default[p->dev] && p == &g_pools[g_default[p->dev] - 1])) {
        pthread_mutex_unlock(&g_pmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    p->used = 0; /* outstanding allocations stay mapped, their memory is no longer charged */
    trim(p, 0);
    if (g_current[p->dev] == (int)(p - g_pools) + 1)
        g_current[p->dev] = 0;
    p->magic = 0;
    pthread_mutex_unlock(&g_pmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t keep)
{
    pthread_mutex_lock(&g_pmu);
    if (!pool_valid(p)) {
        pthread_mutex_unlock(&g_pmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    trim(p, keep);
    pthread_mutex_unlock(&g_pmu);
    return CUDA_SUCCESS;
}

/* CUmemPool_attribute: 1-3 reuse flags (int), 4 RELEASE_THRESHOLD, 5 RESERVED_MEM_CURRENT,
 * 6 RESERVED_MEM_HIGH, 7 USED_MEM_CURRENT, 8 USED_MEM_HIGH (cuuint64_t) */
FG_API CUresult cuMemPoolSetAttribute(CUmemoryPool p, int attr, void *value)
{
    CUresult rc = CUDA_SUCCESS;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    if (!pool_valid(p))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (attr >= 1 && attr <= 3)
        p->reuse[attr] = *(int *)value;
    else if (attr == 4)
        p->threshold = *(uint64_t *)value;
    else if ((attr == 6 || attr == 8) && *(uint64_t *)value == 0)
        *(attr == 6 ? &p->reserved_high : &p->used_high) = attr == 6 ? p->reserved : p->used;
    else
        rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_pmu);
    return rc;
}

FG_API CUresult cuMemPoolGetAttribute(CUmemoryPool p, int attr, void *value)
{
    CUresult rc = CUDA_SUCCESS;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    if (!pool_valid(p))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (attr >= 1 && attr <= 3)
        *(int *)value = p->reuse[attr];
    else if (attr >= 4 && attr <= 8) {
        uint64_t v[] = {p->threshold, p->reserved, p->reserved_high, p->used, p->used_high};
        *(uint64_t *)value = v[attr - 4];
    } else
        rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_pmu);
    return rc;
}

FG_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pp, CUdevice d)
{
    CUresult rc = fg_check_dev(d);
    if (rc)
        return rc;
    if (!pp)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    struct fg_pool *p = default_pool(fg_phys(d));
    pthread_mutex_unlock(&g_pmu);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetMemPool(CUmemoryPool *pp, CUdevice d)
{
    CUresult rc = fg_check_dev(d);
    if (rc)
        return rc;
    if (!pp)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    struct fg_pool *p = current_pool(fg_phys(d));
    pthread_mutex_unlock(&g_pmu);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool p)
{
    CUresult rc = fg_check_dev(d);
    if (rc)
        return rc;
    pthread_mutex_lock(&g_pmu);
    if (!pool_valid(p) || p->dev != fg_phys(d))
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        g_current[p->dev] = (int)(p - g_pools) + 1;
    pthread_mutex_unlock(&g_pmu);
    return rc;
}

/* CUmemAccessDesc: location {type, id}, flags.  The pool's own device always has read-write access
 * (cuda.h: it cannot be changed); peers may be given PROT_NONE (0) or READWRITE (3). */
FG_API CUresult cuMemPoolSetAccess(CUmemoryPool p, const int *desc, size_t count)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    int ok = pool_valid(p), dev = ok ? p->dev : -1;
    pthread_mutex_unlock(&g_pmu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        int type = desc[3 * i], id = desc[3 * i + 1], flags = desc[3 * i + 2];
        if (type != 1 || fg_phys(id) < 0 || (flags != 0 && flags != 3) || (fg_phys(id) == dev && flags != 3))
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* (CUmemAccess_flags *, pool, CUmemLocation *) */
FG_API CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool p, const int *loc)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!flags || !loc || loc[0] != 1 || fg_phys(loc[1]) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    int ok = pool_valid(p), dev = ok ? p->dev : -1;
    pthread_mutex_unlock(&g_pmu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = fg_phys(loc[1]) == dev ? 3 : 0;
    return CUDA_SUCCESS;
}
