/* fakegpu libcuda: device memory (plain, pitch, managed, host), copies and sets.
 *
 * "Device" memory is backed by lazily-committed anonymous mappings (MAP_NORESERVE), so a device
 * pointer is a valid host address and copies move real bytes; only touched pages use RAM.  The
 * bytes are charged to the device in the shared state; physical exhaustion is
 * CUDA_ERROR_OUT_OF_MEMORY.  Copies are range-checked against the process's allocation table.
 */
#include "fg_cuda.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

FG_API CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream s); /* cuda_pool.c */

static pthread_mutex_t g_amu = PTHREAD_MUTEX_INITIALIZER;
static struct fg_alloc *g_tab; /* sorted by ptr */
static size_t g_n, g_cap;

void *fg_map_bytes(uint64_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void fg_unmap_bytes(uint64_t ptr, uint64_t size)
{
    munmap((void *)(uintptr_t)ptr, size);
}

static size_t lower_bound(uint64_t ptr)
{
    size_t lo = 0, hi = g_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g_tab[mid].ptr < ptr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int fg_alloc_insert(const struct fg_alloc *a)
{
    pthread_mutex_lock(&g_amu);
    if (g_n == g_cap) {
        size_t nc = g_cap ? g_cap * 2 : 64;
        struct fg_alloc *t = realloc(g_tab, nc * sizeof(*t));
        if (!t) {
            pthread_mutex_unlock(&g_amu);
            return -1;
        }
        g_tab = t;
        g_cap = nc;
    }
    size_t i = lower_bound(a->ptr);
    memmove(&g_tab[i + 1], &g_tab[i], (g_n - i) * sizeof(*g_tab));
    g_tab[i] = *a;
    g_n++;
    pthread_mutex_unlock(&g_amu);
    return 0;
}

int fg_alloc_remove(uint64_t ptr, struct fg_alloc *out)
{
    pthread_mutex_lock(&g_amu);
    size_t i = lower_bound(ptr);
    if (i >= g_n || g_tab[i].ptr != ptr) {
        pthread_mutex_unlock(&g_amu);
        return -1;
    }
    *out = g_tab[i];
    memmove(&g_tab[i], &g_tab[i + 1], (g_n - i - 1) * sizeof(*g_tab));
    g_n--;
    pthread_mutex_unlock(&g_amu);
    return 0;
}

int fg_alloc_update(const struct fg_alloc *a)
{
    pthread_mutex_lock(&g_amu);
    size_t i = lower_bound(a->ptr);
    int rc = -1;
    if (i < g_n && g_tab[i].ptr == a->ptr) {
        g_tab[i] = *a;
        rc = 0;
    }
    pthread_mutex_unlock(&g_amu);
    return rc;
}

int fg_alloc_find_shared(int kind, int shared, uint64_t gen, struct fg_alloc *out)
{
    int rc = -1;
    pthread_mutex_lock(&g_amu);
    for (size_t i = 0; i < g_n; i++)
        if (g_tab[i].kind == kind && g_tab[i].shared == shared && g_tab[i].shared_gen == gen) {
            *out = g_tab[i];
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&g_amu);
    return rc;
}

int fg_alloc_find(uint64_t p, uint64_t n, struct fg_alloc *out)
{
    int rc = -1;
    pthread_mutex_lock(&g_amu);
    size_t i = lower_bound(p + 1);
    if (i > 0) {
        const struct fg_alloc *a = &g_tab[i - 1];
        if (p >= a->ptr && n <= a->size && p - a->ptr <= a->size - n) {
            *out = *a;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&g_amu);
    return rc;
}

int fg_alloc_each(uint64_t p, uint64_t n, void (*fn)(struct fg_alloc *, void *), void *arg)
{
    int k = 0;
    uint64_t hi = p + n < p ? UINT64_MAX : p + n;
    pthread_mutex_lock(&g_amu);
    size_t i = lower_bound(p + 1);
    for (i = i ? i - 1 : 0; i < g_n && g_tab[i].ptr < hi; i++) {
        struct fg_alloc *a = &g_tab[i];
        if (a->ptr + a->size <= p)
            continue;
        fn(a, arg);
        k++;
    }
    pthread_mutex_unlock(&g_amu);
    return k;
}

static void release(const struct fg_alloc *a)
{
    if (fg_ipc_free(a))
        return; /* shared with other processes: counted until the last one lets go */
    if (a->kind == FG_ALLOC_GRAPH || a->kind == FG_ALLOC_HOSTREG)
        return; /* not this table's to free */
    if (a->kind == FG_ALLOC_MANAGED) {
        fg_uncharge(a->dev, a->charged, FG_KIND_MANAGED_DEV);
        fg_uncharge(a->dev, a->host, FG_KIND_MANAGED_HOST);
    } else if (a->kind != FG_ALLOC_HOST && a->kind != FG_ALLOC_ASYNC && a->kind != FG_ALLOC_VA) {
        fg_uncharge(a->dev, a->charged, FG_KIND_DEVICE);
    }
    if (a->kind != FG_ALLOC_VA)
        fg_unmap_bytes(a->ptr, a->size);
}

void fg_alloc_free_ctx(struct fg_ctx *c)
{
    for (;;) {
        struct fg_alloc a;
        int found = 0;
        pthread_mutex_lock(&g_amu);
        for (size_t i = 0; i < g_n; i++) {
            if (g_tab[i].ctx == c && g_tab[i].kind != FG_ALLOC_ASYNC && g_tab[i].kind != FG_ALLOC_GRAPH &&
                g_tab[i].kind != FG_ALLOC_HOSTREG) {
                a = g_tab[i];
                memmove(&g_tab[i], &g_tab[i + 1], (g_n - i - 1) * sizeof(*g_tab));
                g_n--;
                found = 1;
                break;
            }
        }
        pthread_mutex_unlock(&g_amu);
        if (!found)
            return;
        release(&a);
    }
}

static CUresult alloc_common(CUdeviceptr *dptr, uint64_t size, uint64_t charge, int kind)
{
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    rc = fg_charge(c->dev, charge, FG_KIND_DEVICE);
    if (rc)
        return rc;
    void *p = fg_map_bytes(size);
    struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)p, .size = size, .charged = charge, .dev = c->dev,
                         .kind = kind, .ctx = c};
    if (!p || fg_alloc_insert(&a) != 0) {
        if (p)
            fg_unmap_bytes(a.ptr, size);
        fg_uncharge(c->dev, charge, FG_KIND_DEVICE);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = a.ptr;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc_common(dptr, bytesize, bytesize, FG_ALLOC_DEVICE);
}

/* Pitch: rows padded to 512 bytes (CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT); the charge is
 * pitch * height, what the real driver reserves. */
FG_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    if (!pitch || (elem != 4 && elem != 8 && elem != 16) || width == 0 || height == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = ((uint64_t)width + 511) & ~511ULL;
    if (height > UINT64_MAX / p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = alloc_common(dptr, p * height, p * height, FG_ALLOC_PITCH);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

/* Managed memory: nothing is resident on the device until the device touches it (a kernel,
 * cuda_um.c) or it is prefetched there, as on a GPU with concurrent managed access ("pages are
 * populated on first touch"); until then it counts as host memory.  Never OOM for lack of device
 * memory. */
FG_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags)
{
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if (size == 0 || (flags != 1 && flags != 2)) /* CU_MEM_ATTACH_GLOBAL / HOST */
        return CUDA_ERROR_INVALID_VALUE;
    void *p = fg_map_bytes(size);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)p, .size = size, .charged = 0, .host = size,
                         .dev = c->dev, .kind = FG_ALLOC_MANAGED, .ctx = c};
    fg_charge(c->dev, a.host, FG_KIND_MANAGED_HOST);
    if (fg_alloc_insert(&a) != 0) {
        release(&a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = a.ptr;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemFree_v2(CUdeviceptr ptr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (ptr == 0)
        return CUDA_SUCCESS;
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr)
        return CUDA_ERROR_INVALID_VALUE;
    if (a.kind == FG_ALLOC_GRAPH) /* "immediately upon the freeing call to cudaFree()" */
        return fg_graph_free_ptr(ptr);
    if (a.kind == FG_ALLOC_ASYNC || a.kind == FG_ALLOC_POOLIMPORT) /* frees stream-ordered memory too */
        return cuMemFreeAsync(ptr, FG_STREAM_LEGACY);
    if (a.kind == FG_ALLOC_HOST || a.kind == FG_ALLOC_VA || a.kind == FG_ALLOC_HOSTREG || a.kind == FG_ALLOC_IMPORT ||
        a.kind == FG_ALLOC_MODULE)
        return CUDA_ERROR_INVALID_VALUE;
    if (fg_alloc_remove(ptr, &a) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    release(&a);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total)
{
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    if (!free_b || !total)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_reap();
    uint64_t used = fg_dev_used(st, c->dev) + st->cfg[c->dev].reserved;
    uint64_t mem = st->cfg[c->dev].memory;
    fg_unlock();
    *total = mem;
    *free_b = used < mem ? mem - used : 0;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 0, &a) != 0 || a.kind == FG_ALLOC_HOST || a.kind == FG_ALLOC_HOSTREG)
        return CUDA_ERROR_NOT_FOUND;
    if (base)
        *base = a.ptr;
    if (size)
        *size = a.size;
    return CUDA_SUCCESS;
}

/* --- host (pinned) memory: not device memory, never charged -------------------------------- */

static CUresult host_alloc(void **pp, size_t size)
{
    if (!pp || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    void *p = fg_map_bytes(size);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)p, .size = size, .dev = c->dev, .kind = FG_ALLOC_HOST,
                         .ctx = c};
    if (fg_alloc_insert(&a) != 0) {
        fg_unmap_bytes(a.ptr, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAllocHost_v2(void **pp, size_t size)
{
    return host_alloc(pp, size);
}

FG_API CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
    if (flags & ~0xfu)
        return CUDA_ERROR_INVALID_VALUE;
    return host_alloc(pp, size);
}

FG_API CUresult cuMemFreeHost(void *p)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    struct fg_alloc a;
    uint64_t ptr = (uint64_t)(uintptr_t)p;
    if (fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr || a.kind != FG_ALLOC_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    fg_alloc_remove(ptr, &a);
    release(&a);
    return CUDA_SUCCESS;
}

/* --- copies and sets ---------------------------------------------------------------------- */

CUresult fg_check_dev_range(CUdeviceptr p, size_t n)
{
    struct fg_alloc a;
    if (fg_alloc_find(p, n, &a) != 0 || a.kind == FG_ALLOC_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    if (a.kind == FG_ALLOC_VA)
        return fg_vmm_mapped(p, n) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (a.kind == FG_ALLOC_GRAPH) /* only between the allocating node and the free */
        return fg_graph_live(p, n) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (a.kind == FG_ALLOC_HOSTREG)
        return CUDA_SUCCESS;
    if (fg_dev_lost(a.dev))
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    return CUDA_SUCCESS;
}

static CUresult copy_prologue(void)
{
    CUresult rc;
    return fg_current(&rc) ? CUDA_SUCCESS : rc;
}

static CUresult htod(CUdeviceptr dst, const void *src, size_t n)
{
    CUresult rc = copy_prologue();
    if (rc)
        return rc;
    if (n == 0)
        return CUDA_SUCCESS;
    if (!src)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fg_check_dev_range(dst, n)))
        return rc;
    memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}

static CUresult dtoh(void *dst, CUdeviceptr src, size_t n)
{
    CUresult rc = copy_prologue();
    if (rc)
        return rc;
    if (n == 0)
        return CUDA_SUCCESS;
    if (!dst)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fg_check_dev_range(src, n)))
        return rc;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

static CUresult dtod(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CUresult rc = copy_prologue();
    if (rc)
        return rc;
    if (n == 0)
        return CUDA_SUCCESS;
    if ((rc = fg_check_dev_range(src, n)) || (rc = fg_check_dev_range(dst, n)))
        return rc;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

/* Synchronous copies wait for the stream's earlier work, as with the legacy default stream. */
CUresult fg_copy_sync(int per_thread)
{
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    return fg_wait_idle(c->dev, per_thread ? FG_SIDX_PTDS : -1);
}

FG_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    CUresult rc = fg_copy_sync(0);
    return rc ? rc : htod(dst, src, n);
}
FG_API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n)
{
    CUresult rc = fg_copy_sync(1);
    return rc ? rc : htod(dst, src, n);
}
FG_API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    CUresult rc = fg_copy_sync(0);
    return rc ? rc : dtoh(dst, src, n);
}
FG_API CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n)
{
    CUresult rc = fg_copy_sync(1);
    return rc ? rc : dtoh(dst, src, n);
}
FG_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CUresult rc = fg_copy_sync(0);
    return rc ? rc : dtod(dst, src, n);
}
FG_API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CUresult rc = fg_copy_sync(1);
    return rc ? rc : dtod(dst, src, n);
}

/* Async copies: the stream's queued kernels are waited for first (copies are not modelled as
 * device work), so ordering within the stream holds. */
CUresult fg_copy_async(CUstream s, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = copy_prologue();
    if (rc)
        return rc;
    rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    return rc ? rc : fg_wait_idle(dev, idx);
}

FG_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 0);
    return rc ? rc : htod(dst, src, n);
}
FG_API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 1);
    return rc ? rc : htod(dst, src, n);
}
FG_API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 0);
    return rc ? rc : dtoh(dst, src, n);
}
FG_API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 1);
    return rc ? rc : dtoh(dst, src, n);
}

static CUresult memset_n(CUdeviceptr dst, const void *val, size_t elem, size_t n, int per_thread)
{
    CUresult rc = fg_copy_sync(per_thread);
    if (rc)
        return rc;
    if (n == 0)
        return CUDA_SUCCESS;
    if (n > SIZE_MAX / elem || (dst % elem) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fg_check_dev_range(dst, n * elem)))
        return rc;
    unsigned char *p = (unsigned char *)(uintptr_t)dst;
    if (elem == 1) {
        memset(p, *(const unsigned char *)val, n);
    } else {
        for (size_t i = 0; i < n; i++)
            memcpy(p + i * elem, val, elem);
    }
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n)
{
    return memset_n(dst, &v, 1, n, 0);
}
FG_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char v, size_t n)
{
    return memset_n(dst, &v, 1, n, 1);
}
FG_API CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n)
{
    return memset_n(dst, &v, 4, n, 0);
}
FG_API CUresult cuMemsetD32_v2_ptds(CUdeviceptr dst, unsigned int v, size_t n)
{
    return memset_n(dst, &v, 4, n, 1);
}
