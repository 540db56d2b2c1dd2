/* fakegpu libcuda: stream-ordered allocation and memory pools.
 *
 * From the CUDA Driver API reference, "Stream Ordered Memory Allocator": a pool reserves device
 * memory (here in 2 MiB steps, charged to the process like any allocation) and hands out
 * allocations from it.  Freed bytes stay reserved until a synchronisation (stream, event,
 * context) when more than the release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, default 0)
 * is idle, or until cuMemPoolTrimTo; a pool destroyed while allocations are outstanding is
 * released once they are freed.  Pools at a host location (CU_MEM_LOCATION_TYPE_HOST /
 * HOST_NUMA / HOST_NUMA_CURRENT) hold host memory: never counted on a device.  Pools created
 * with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR can be exported (cuMemPoolExportToShareableHandle)
 * and imported by another process (cuMemPoolImportFromShareableHandle), which maps single
 * allocations of it (cuMemPoolExportPointer / cuMemPoolImportPointer): their bytes are shared
 * (cuda_ipc.c), their memory stays counted in the exporting process's pool, whose process must
 * outlive the imports ("the imported memory must be freed from all importing processes before
 * being freed in the exporting process").  Inside a stream capture, allocations and frees become
 * graph memory nodes (cuda_graph.c).  Allocation is immediate (not ordered after the stream's
 * kernels): a simplification that never makes memory available earlier than on a GPU.
 */
#include "fg_cuda.h"

#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

#define GRAN (2ULL << 20)
#define MAX_POOLS 64
#define LOC_DEVICE 1
#define LOC_HOST 2
#define LOC_HOST_NUMA 3
#define LOC_HOST_NUMA_CURRENT 4
#define HT_POSIX_FD 1

struct fg_pool {
    uint32_t magic;
    int dev;
    uint64_t reserved, used, reserved_high, used_high, threshold;
    int reuse[4];
    int host;        /* at a host location: nothing counted on the device */
    int handle_types;
    int destroyed;   /* released when its last allocation is freed */
    int imported;    /* from another process: only for cuMemPoolImportPointer */
    int shared, fd;  /* exported: entry index + 1 and the descriptor of its file (-1 none) */
    uint64_t shared_gen;
};

/* CUmemPoolPtrExportData: 64 opaque bytes */
struct ptr_export {
    uint64_t magic;
    int32_t idx, dev;
    uint64_t gen, size;
    char reserved[32];
};
_Static_assert(sizeof(struct ptr_export) == 64, "CUmemPoolPtrExportData size");
#define PTR_MAGIC 0x5254504c4f4f5046ULL

static struct fg_pool g_pools[MAX_POOLS];
static int g_default[FG_MAX_DEV]; /* index+1 of the default pool; 0 none */
static int g_current[FG_MAX_DEV]; /* index+1 of the device's current pool; 0: the default one */
static pthread_mutex_t g_pmu = PTHREAD_MUTEX_INITIALIZER;

static int pool_live(const struct fg_pool *p)
{
    return p && p >= &g_pools[0] && p < &g_pools[MAX_POOLS] && p->magic == FG_MAGIC_POOL;
}

static int pool_valid(const struct fg_pool *p)
{
    return pool_live(p) && !p->destroyed;
}

static void charge_back(struct fg_pool *p, uint64_t n)
{
    if (!p->host)
        fg_uncharge(p->dev, n, FG_KIND_DEVICE);
}

static struct fg_pool *pool_new(int dev)
{
    for (int i = 0; i < MAX_POOLS; i++)
        if (g_pools[i].magic == 0) {
            memset(&g_pools[i], 0, sizeof(g_pools[i]));
            g_pools[i].magic = FG_MAGIC_POOL;
            g_pools[i].dev = dev;
            g_pools[i].fd = -1;
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
        charge_back(p, p->reserved - target);
        p->reserved = target;
    }
}

/* A destroyed pool goes when nothing of it is outstanding (lock held). */
static void pool_finish(struct fg_pool *p)
{
    if (!p->destroyed || p->used)
        return;
    trim(p, 0);
    if (p->fd >= 0)
        close(p->fd);
    if (p->shared)
        fg_share_drop(p->shared - 1, p->shared_gen);
    p->magic = 0;
}

CUresult fg_pools_sync(int dev)
{
    pthread_mutex_lock(&g_pmu);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pool_live(&g_pools[i]) && !g_pools[i].imported && g_pools[i].dev == dev)
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
    if (fg_capture_count) {
        /* in a capture: a memory allocation node of the device's graph pool */
        pthread_mutex_lock(&g_pmu);
        int gdev = p ? (pool_valid(p) ? p->dev : -1) : dev;
        pthread_mutex_unlock(&g_pmu);
        if (gdev >= 0 && fg_capture_alloc(s, per_thread, gdev, size, dptr, &rc))
            return rc;
    }
    pthread_mutex_lock(&g_pmu);
    if (!p)
        p = current_pool(dev);
    if (!pool_valid(p) || p->imported) {
        pthread_mutex_unlock(&g_pmu);
        return p ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t idle = p->reserved - p->used;
    if (idle < size) {
        uint64_t grow = (size - idle + GRAN - 1) / GRAN * GRAN;
        if (!p->host && (rc = fg_charge(p->dev, grow, FG_KIND_DEVICE))) {
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
    struct fg_alloc a = {.size = size, .charged = size, .dev = p->dev, .kind = FG_ALLOC_ASYNC, .pool = p};
    void *m = NULL;
    if (p->handle_types & HT_POSIX_FD) {
        /* an exportable pool's allocation: its bytes in a shared file (counted by the pool) */
        int sidx;
        uint64_t sgen;
        int fd = fg_share_new(FG_SHK_POOLPTR, p->dev, size, 0, &sidx, &sgen, &rc);
        if (fd >= 0) {
            m = fg_share_map(fd, size, 0);
            close(fd);
            if (m) {
                a.shared = sidx + 1;
                a.shared_gen = sgen;
            } else {
                fg_share_drop(sidx, sgen);
            }
        }
    } else {
        m = fg_map_bytes(size);
    }
    a.ptr = (uint64_t)(uintptr_t)m;
    if (!m || fg_alloc_insert(&a) != 0) {
        if (m && a.shared)
            fg_ipc_free(&a);
        else if (m)
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
    if (fg_capture_count && fg_capture_free(s, per_thread, ptr, &rc))
        return rc; /* a memory free node */
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr)
        return CUDA_ERROR_INVALID_VALUE;
    if (a.kind == FG_ALLOC_GRAPH)
        return fg_graph_free_ptr(ptr);
    if (a.kind != FG_ALLOC_ASYNC && a.kind != FG_ALLOC_POOLIMPORT)
        return CUDA_ERROR_INVALID_VALUE;
    if (fg_alloc_remove(ptr, &a) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!fg_ipc_free(&a))
        fg_unmap_bytes(a.ptr, a.size);
    if (a.kind == FG_ALLOC_POOLIMPORT)
        return CUDA_SUCCESS; /* counted in the exporting process's pool */
    pthread_mutex_lock(&g_pmu);
    if (pool_live(a.pool)) {
        a.pool->used -= a.size <= a.pool->used ? a.size : a.pool->used;
        pool_finish(a.pool);
    }
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
    if (!pp || !props || props->allocType != 1) /* CU_MEM_ALLOCATION_TYPE_PINNED */
        return CUDA_ERROR_INVALID_VALUE;
    if (props->handleTypes & ~HT_POSIX_FD) /* WIN32 handles, FABRIC: not on this node */
        return CUDA_ERROR_NOT_SUPPORTED;
    int dev = 0, host = 0;
    if (props->locType == LOC_DEVICE) {
        dev = fg_phys(props->locId);
        if (dev < 0)
            return CUDA_ERROR_INVALID_DEVICE;
    } else if (props->locType == LOC_HOST || props->locType == LOC_HOST_NUMA_CURRENT ||
               (props->locType == LOC_HOST_NUMA && props->locId >= 0)) {
        host = 1; /* host memory: the device's count is not touched */
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_pmu);
    struct fg_pool *p = pool_new(dev);
    if (p) {
        p->host = host;
        p->handle_types = props->handleTypes;
    }
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
    if (g_current[p->dev] == (int)(p - g_pools) + 1)
        g_current[p->dev] = 0;
    /* "the function will return immediately and the resources associated with the pool will be
     * released automatically once there are no more outstanding allocations" */
    p->destroyed = 1;
    if (p->imported)
        p->used = 0;
    pool_finish(p);
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

/* --- exporting pools and their allocations ----------------------------------------------- */

FG_API CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool p, int type, unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!out || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    if (!pool_valid(p) || p->imported || type != HT_POSIX_FD || !(p->handle_types & HT_POSIX_FD)) {
        pthread_mutex_unlock(&g_pmu);
        return CUDA_ERROR_INVALID_VALUE; /* the handle type must have been requested at creation */
    }
    if (!p->shared) {
        int idx;
        uint64_t gen;
        int fd = fg_share_new(FG_SHK_POOL, p->dev, 0, 0, &idx, &gen, &rc);
        if (fd < 0) {
            pthread_mutex_unlock(&g_pmu);
            return rc;
        }
        p->fd = fd;
        p->shared = idx + 1;
        p->shared_gen = gen;
    }
    int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
    pthread_mutex_unlock(&g_pmu);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)out = fd;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pp, void *handle, int type, unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pp || flags != 0 || type != HT_POSIX_FD)
        return CUDA_ERROR_INVALID_VALUE;
    int idx, dev;
    uint64_t gen, size;
    if (fg_share_import_fd((int)(intptr_t)handle, FG_SHK_POOL, &idx, &gen, &size, &dev) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    struct fg_pool *p = pool_new(dev);
    if (p) {
        p->imported = 1;
        p->shared = idx + 1;
        p->shared_gen = gen;
        p->handle_types = HT_POSIX_FD;
    }
    pthread_mutex_unlock(&g_pmu);
    if (!p) {
        fg_share_drop(idx, gen);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolExportPointer(struct ptr_export *out, CUdeviceptr ptr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    struct fg_alloc a;
    if (!out || fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr || a.kind != FG_ALLOC_ASYNC || !a.shared)
        return CUDA_ERROR_INVALID_VALUE; /* an allocation of an exportable pool */
    memset(out, 0, sizeof(*out));
    out->magic = PTR_MAGIC;
    out->idx = a.shared - 1;
    out->dev = a.dev;
    out->gen = a.shared_gen;
    out->size = a.size;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolImportPointer(CUdeviceptr *pp, CUmemoryPool p, struct ptr_export *data)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pp || !data || data->magic != PTR_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pmu);
    int ok = pool_valid(p) && p->imported;
    pthread_mutex_unlock(&g_pmu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t size = 0;
    int dev = 0;
    int fd = fg_share_open(data->idx, data->gen, FG_SHK_POOLPTR, &size, &dev, &rc);
    if (fd < 0)
        return rc == CUDA_ERROR_INVALID_HANDLE ? CUDA_ERROR_INVALID_VALUE : rc;
    void *m = fg_share_map(fd, size, 0);
    close(fd);
    struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)m, .size = size, .dev = dev, .kind = FG_ALLOC_POOLIMPORT,
                         .shared = data->idx + 1, .shared_gen = data->gen};
    if (!m || fg_alloc_insert(&a) != 0) {
        if (m)
            munmap(m, size);
        fg_share_drop(data->idx, data->gen);
        return m ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_MAP_FAILED;
    }
    *pp = a.ptr;
    return CUDA_SUCCESS;
}
