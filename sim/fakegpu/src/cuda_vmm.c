/* fakegpu libcuda: virtual memory management (cuMemCreate/Map/...) and CUDA arrays.
 *
 * From the CUDA Driver API reference, "Virtual Memory Management".  cuMemCreate charges the
 * physical handle's size to the device named by prop->location.id (never the current context's
 * device, the lesson of HAMi-core #169/#187); at a host location (CU_MEM_LOCATION_TYPE_HOST,
 * HOST_NUMA with a NUMA node id, HOST_NUMA_CURRENT) it is host memory and counts nowhere on a
 * device (HAMi-core #187: llama.cpp).  Address ranges are PROT_NONE reservations; cuMemMap
 * makes a range accessible.  The handle's memory is uncharged when it is released and no
 * mapping uses it any more, as the real driver documents.  A handle created with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes keeps its bytes in a shared
 * file (cuda_ipc.c): cuMemExportToShareableHandle gives a descriptor of it, which another
 * process imports (cuMemImportFromShareableHandle) and maps: one allocation, counted once,
 * freed when every process released it (what NCCL >= 2.19 does between the ranks of a node).
 */
#include "fg_cuda.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define GRAN (2ULL << 20)
#define HANDLE_MAGIC 0x484d4d46u
#define MAX_MAPS 1024
#define LOC_DEVICE 1
#define LOC_HOST 2
#define LOC_HOST_NUMA 3
#define LOC_HOST_NUMA_CURRENT 4
#define HT_POSIX_FD 1

struct vmm_handle {
    uint32_t magic;
    int dev;
    uint64_t size;
    int refs; /* 1 for the handle + 1 per mapping */
    int loc_type, loc_id;
    int handle_types;
    int host;     /* host memory: not counted on the device */
    int fd;       /* the shared file (exportable or imported handles), -1 none */
    int shared;   /* entry index + 1 in the node's shared table, 0 none */
    uint64_t shared_gen;
};

struct mapping {
    uint64_t ptr, size;
    struct vmm_handle *h;
};

static pthread_mutex_t g_vmu = PTHREAD_MUTEX_INITIALIZER;
static struct mapping g_maps[MAX_MAPS];

/* CUmemAllocationProp: type @0, requestedHandleTypes @4, location {type @8, id @12}, ... */
struct fg_alloc_prop {
    int type;
    int handleTypes;
    int locType;
    int locId;
};

static void handle_put(struct vmm_handle *h)
{
    if (--h->refs == 0) {
        if (h->fd >= 0)
            close(h->fd);
        if (h->shared)
            fg_share_drop(h->shared - 1, h->shared_gen); /* the last holder frees the memory */
        else if (!h->host)
            fg_uncharge(h->dev, h->size, FG_KIND_DEVICE);
        h->magic = 0;
        free(h);
    }
}

FG_API CUresult cuMemGetAllocationGranularity(size_t *g, const struct fg_alloc_prop *prop, int option)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!g || !prop || (option != 0 && option != 1))
        return CUDA_ERROR_INVALID_VALUE;
    *g = GRAN;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const struct fg_alloc_prop *prop,
                            unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!handle || !prop || flags != 0 || size == 0 || size % GRAN != 0 || prop->type != 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->handleTypes & ~HT_POSIX_FD) /* WIN32 handles, FABRIC: not on this node */
        return CUDA_ERROR_NOT_SUPPORTED;
    int dev = 0, host = 0;
    if (prop->locType == LOC_DEVICE) {
        dev = fg_phys(prop->locId);
        if (dev < 0)
            return CUDA_ERROR_INVALID_DEVICE;
        if (fg_dev_lost(dev))
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
    } else if (prop->locType == LOC_HOST || prop->locType == LOC_HOST_NUMA_CURRENT ||
               (prop->locType == LOC_HOST_NUMA && prop->locId >= 0)) {
        host = 1; /* id is ignored (HOST, HOST_NUMA_CURRENT) or a host NUMA node */
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct vmm_handle *h = calloc(1, sizeof(*h));
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!host && (rc = fg_charge(dev, size, FG_KIND_DEVICE))) {
        free(h);
        return rc;
    }
    h->magic = HANDLE_MAGIC;
    h->dev = dev;
    h->size = size;
    h->refs = 1;
    h->loc_type = prop->locType;
    h->loc_id = prop->locId;
    h->handle_types = prop->handleTypes;
    h->host = host;
    h->fd = -1;
    if (prop->handleTypes & HT_POSIX_FD) {
        int idx;
        uint64_t gen;
        h->fd = fg_share_new(FG_SHK_VMM, dev, size, host ? 0 : size, &idx, &gen, &rc);
        if (h->fd < 0) {
            if (!host)
                fg_uncharge(dev, size, FG_KIND_DEVICE);
            free(h);
            return rc;
        }
        h->shared = idx + 1;
        h->shared_gen = gen;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

static struct vmm_handle *handle_of(CUmemGenericAllocationHandle x);

FG_API CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle x, int type,
                                             unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!out || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (type != HT_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_vmu);
    struct vmm_handle *h = handle_of(x);
    /* the type must have been requested at cuMemCreate */
    int fd = h && h->fd >= 0 && (h->handle_types & HT_POSIX_FD) ? fcntl(h->fd, F_DUPFD_CLOEXEC, 0) : -2;
    pthread_mutex_unlock(&g_vmu);
    if (fd == -2)
        return CUDA_ERROR_INVALID_VALUE;
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)out = fd;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle, int type)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (type != HT_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)os_handle, idx, dev;
    uint64_t gen, size;
    /* a descriptor of an allocation some process of the node still holds */
    if (fg_share_import_fd(fd, FG_SHK_VMM, &idx, &gen, &size, &dev) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct vmm_handle *h = calloc(1, sizeof(*h));
    int own = h ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    if (!h || own < 0) {
        free(h);
        fg_share_drop(idx, gen);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fg_state *st = fg_g.st;
    fg_lock();
    int host = st->shared[idx].bytes == 0;
    fg_unlock();
    h->magic = HANDLE_MAGIC;
    h->dev = dev;
    h->size = size;
    h->refs = 1;
    h->loc_type = host ? LOC_HOST : LOC_DEVICE;
    h->loc_id = host ? 0 : fg_ordinal_of(dev);
    h->handle_types = HT_POSIX_FD;
    h->host = host;
    h->fd = own;
    h->shared = idx + 1;
    h->shared_gen = gen;
    *out = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

static struct vmm_handle *handle_of(CUmemGenericAllocationHandle x)
{
    struct vmm_handle *h = (struct vmm_handle *)(uintptr_t)x;
    return (h && h->magic == HANDLE_MAGIC) ? h : NULL;
}

FG_API CUresult cuMemRelease(CUmemGenericAllocationHandle x)
{
    pthread_mutex_lock(&g_vmu);
    struct vmm_handle *h = handle_of(x);
    if (h)
        handle_put(h);
    pthread_mutex_unlock(&g_vmu);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!ptr || size == 0 || size % GRAN != 0 || flags != 0 || (align & (align - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    (void)addr; /* a hint */
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)p, .size = size, .dev = -1, .kind = FG_ALLOC_VA};
    if (fg_alloc_insert(&a) != 0) {
        munmap(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = a.ptr;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 0, &a) != 0 || a.ptr != ptr || a.size != size || a.kind != FG_ALLOC_VA)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmu);
    for (int i = 0; i < MAX_MAPS; i++)
        if (g_maps[i].h && g_maps[i].ptr >= ptr && g_maps[i].ptr < ptr + size) {
            pthread_mutex_unlock(&g_vmu);
            return CUDA_ERROR_INVALID_VALUE; /* still mapped */
        }
    pthread_mutex_unlock(&g_vmu);
    fg_alloc_remove(ptr, &a);
    munmap((void *)(uintptr_t)ptr, size);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle x,
                         unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    struct fg_alloc a;
    if (flags != 0 || size == 0 || size % GRAN || ptr % GRAN || fg_alloc_find(ptr, size, &a) != 0 ||
        a.kind != FG_ALLOC_VA)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmu);
    struct vmm_handle *h = handle_of(x);
    int slot = -1;
    rc = CUDA_SUCCESS;
    if (!h || offset > h->size || size > h->size - offset) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (int i = 0; i < MAX_MAPS; i++) {
            if (g_maps[i].h && ptr < g_maps[i].ptr + g_maps[i].size && g_maps[i].ptr < ptr + size) {
                rc = CUDA_ERROR_ALREADY_MAPPED;
                break;
            }
            if (!g_maps[i].h && slot < 0)
                slot = i;
        }
        if (rc == CUDA_SUCCESS && slot < 0)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) {
        int ok = h->fd >= 0 ? mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->fd,
                                   (off_t)offset) != MAP_FAILED
                            : mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0;
        if (!ok) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g_maps[slot] = (struct mapping){ptr, size, h};
            h->refs++;
        }
    }
    pthread_mutex_unlock(&g_vmu);
    return rc;
}

FG_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmu);
    for (int i = 0; i < MAX_MAPS; i++) {
        if (g_maps[i].h && g_maps[i].ptr == ptr && g_maps[i].size == size) {
            if (g_maps[i].h->fd >= 0) /* back to a bare reservation */
                mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                     -1, 0);
            madvise((void *)(uintptr_t)ptr, size, MADV_DONTNEED);
            mprotect((void *)(uintptr_t)ptr, size, PROT_NONE);
            handle_put(g_maps[i].h);
            g_maps[i].h = NULL;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_vmu);
    return rc;
}

/* 1 if [p, p+n) lies inside one mapping */
int fg_vmm_mapped(uint64_t p, uint64_t n)
{
    int ok = 0;
    pthread_mutex_lock(&g_vmu);
    for (int i = 0; i < MAX_MAPS && !ok; i++)
        if (g_maps[i].h && p >= g_maps[i].ptr && n <= g_maps[i].size && p - g_maps[i].ptr <= g_maps[i].size - n)
            ok = 1;
    pthread_mutex_unlock(&g_vmu);
    return ok;
}

/* 1 if p lies in a mapping of a host-located handle (the kernel "touch" reads it over the host
 * link: cuda_um.c) */
int fg_vmm_host(uint64_t p)
{
    int host = 0;
    pthread_mutex_lock(&g_vmu);
    for (int i = 0; i < MAX_MAPS; i++)
        if (g_maps[i].h && p >= g_maps[i].ptr && p - g_maps[i].ptr < g_maps[i].size) {
            host = g_maps[i].h->host;
            break;
        }
    pthread_mutex_unlock(&g_vmu);
    return host;
}

/* CUmemAccessDesc: location {type, id}, flags (int) = 12 bytes */
FG_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const int *desc, size_t count)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[3 * i] != 1 || fg_phys(desc[3 * i + 1]) < 0 || desc[3 * i + 2] < 0 || desc[3 * i + 2] > 3)
            return CUDA_ERROR_INVALID_VALUE;
    uint64_t off = 0;
    while (off < size) { /* every granule of the range must be mapped */
        if (!fg_vmm_mapped(ptr + off, GRAN))
            return CUDA_ERROR_INVALID_VALUE;
        off += GRAN;
    }
    return CUDA_SUCCESS;
}

/* --- arrays ------------------------------------------------------------------------------- */

struct fg_array {
    uint32_t magic;
    int dev;
    uint64_t bytes;
};

static uint64_t format_bytes(int f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;             /* UNSIGNED_INT8, SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2;  /* (UN)SIGNED_INT16, HALF */
    case 0x03: case 0x0a: case 0x20: return 4;  /* (UN)SIGNED_INT32, FLOAT */
    default: return 0;
    }
}

static CUresult array_new(CUarray *pa, uint64_t w, uint64_t h, uint64_t d, int format, unsigned ch)
{
    CUresult rc;
    if (!pa)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    uint64_t eb = format_bytes(format);
    if (!eb || (ch != 1 && ch != 2 && ch != 4) || w == 0 || w > (1u << 17) || h > (1u << 16) || d > (1u << 14))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = w * (h ? h : 1) * (d ? d : 1) * eb * ch;
    struct fg_array *a = calloc(1, sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if ((rc = fg_charge(c->dev, bytes, FG_KIND_DEVICE))) {
        free(a);
        return rc;
    }
    a->magic = FG_MAGIC_ARRAY;
    a->dev = c->dev;
    a->bytes = bytes;
    *pa = a;
    return CUDA_SUCCESS;
}

/* CUDA_ARRAY_DESCRIPTOR: size_t Width, Height; CUarray_format Format; unsigned NumChannels */
struct fg_array_desc {
    size_t Width, Height;
    int Format;
    unsigned NumChannels;
};
/* CUDA_ARRAY3D_DESCRIPTOR: size_t Width, Height, Depth; Format; NumChannels; Flags */
struct fg_array3d_desc {
    size_t Width, Height, Depth;
    int Format;
    unsigned NumChannels;
    unsigned Flags;
};

FG_API CUresult cuArrayCreate_v2(CUarray *pa, const struct fg_array_desc *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_new(pa, d->Width, d->Height, 0, d->Format, d->NumChannels);
}

FG_API CUresult cuArray3DCreate_v2(CUarray *pa, const struct fg_array3d_desc *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_new(pa, d->Width, d->Height, d->Depth, d->Format, d->NumChannels);
}

FG_API CUresult cuArrayDestroy(CUarray a)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!a || a->magic != FG_MAGIC_ARRAY)
        return CUDA_ERROR_INVALID_HANDLE;
    fg_uncharge(a->dev, a->bytes, FG_KIND_DEVICE);
    a->magic = 0;
    free(a);
    return CUDA_SUCCESS;
}

/* --- handles seen from their mappings (PyTorch's expandable segments ask for these) --------- */

/* The handle mapped at ptr, with one more reference (released by cuMemRelease). */
FG_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *addr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = (uint64_t)(uintptr_t)addr;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmu);
    for (int i = 0; i < MAX_MAPS; i++)
        if (g_maps[i].h && p >= g_maps[i].ptr && p < g_maps[i].ptr + g_maps[i].size) {
            g_maps[i].h->refs++;
            *out = (CUmemGenericAllocationHandle)(uintptr_t)g_maps[i].h;
            rc = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&g_vmu);
    return rc;
}

/* CUmemAllocationProp (32 bytes): type PINNED, the handle types asked for, the location, the rest
 * zero */
FG_API CUresult cuMemGetAllocationPropertiesFromHandle(struct fg_alloc_prop *prop, CUmemGenericAllocationHandle x)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmu);
    struct vmm_handle *h = handle_of(x);
    struct fg_alloc_prop v = {0};
    if (h) {
        v.type = 1;
        v.handleTypes = h->handle_types;
        v.locType = h->loc_type;
        v.locId = h->loc_type == LOC_DEVICE ? fg_ordinal_of(h->dev) : h->loc_id;
    }
    pthread_mutex_unlock(&g_vmu);
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    memset(prop, 0, 32);
    prop->type = v.type;
    prop->handleTypes = v.handleTypes;
    prop->locType = v.locType;
    prop->locId = v.locId;
    return CUDA_SUCCESS;
}
