/* fakegpu libcuda: the copies and sets the CUDA runtime uses beyond cuMemcpyHtoD/DtoH/DtoD
 * (cuda_mem.c): unified-address copies (cuMemcpy, cuMemcpyAsync, peer copies), 2D and 3D copies,
 * 16-bit and 2D sets, the asynchronous forms and pointer attributes (the managed-memory hints are in
 * cuda_um.c).
 *
 * Unified addressing, as the real driver documents it (cuda.h, "Unified Addressing"): a pointer is
 * device memory when it lies in one of the process's device allocations (checked against the
 * allocation table: CUDA_ERROR_INVALID_VALUE when a range runs past the end of one) and host
 * memory otherwise.  Every copy moves the bytes; an asynchronous copy first waits for the
 * stream's earlier kernels, so ordering within a stream holds (copies take no device time).
 * CUDA arrays have no backing store in the simulator: copies to and from them are
 * CUDA_ERROR_NOT_SUPPORTED (docs/developers/simulators.md, "What is simplified").
 */
#include "fg_cuda.h"

#include <string.h>

#define MT_HOST 1
#define MT_DEVICE 2
#define MT_ARRAY 3
#define MT_UNIFIED 4

/* A unified pointer range: device (checked) or host. */
static CUresult check_any(uint64_t p, size_t n)
{
    struct fg_alloc a;
    if (fg_alloc_find(p, 1, &a) != 0 || a.kind == FG_ALLOC_HOST)
        return CUDA_SUCCESS; /* host memory: the process's own */
    return fg_check_dev_range(p, n);
}

static CUresult unified_copy(uint64_t dst, uint64_t src, size_t n)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if (!dst || !src)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    if ((rc = check_any(src, n)) || (rc = check_any(dst, n)))
        return rc;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CUresult rc = fg_copy_sync(0);
    return rc ? rc : unified_copy(dst, src, n);
}
FG_API CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CUresult rc = fg_copy_sync(1);
    return rc ? rc : unified_copy(dst, src, n);
}
FG_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 0);
    return rc ? rc : unified_copy(dst, src, n);
}
FG_API CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 1);
    return rc ? rc : unified_copy(dst, src, n);
}

static CUresult dev_copy(uint64_t dst, uint64_t src, size_t n)
{
    if (n == 0)
        return CUDA_SUCCESS;
    CUresult rc;
    if ((rc = fg_check_dev_range(src, n)) || (rc = fg_check_dev_range(dst, n)))
        return rc;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 0);
    return rc ? rc : dev_copy(dst, src, n);
}
FG_API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    CUresult rc = fg_copy_async(s, 1);
    return rc ? rc : dev_copy(dst, src, n);
}

/* Peer copies: the contexts only name the devices; one address space holds all of them. */
static CUresult peer_check(CUcontext a, CUcontext b)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    return fg_ctx_valid(a) && fg_ctx_valid(b) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

FG_API CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n)
{
    CUresult rc = peer_check(dctx, sctx);
    if (!rc)
        rc = fg_copy_sync(0);
    return rc ? rc : dev_copy(dst, src, n);
}
FG_API CUresult cuMemcpyPeer_ptds(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n)
{
    CUresult rc = peer_check(dctx, sctx);
    if (!rc)
        rc = fg_copy_sync(1);
    return rc ? rc : dev_copy(dst, src, n);
}
FG_API CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n,
                                  CUstream s)
{
    CUresult rc = peer_check(dctx, sctx);
    if (!rc)
        rc = fg_copy_async(s, 0);
    return rc ? rc : dev_copy(dst, src, n);
}
FG_API CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n,
                                       CUstream s)
{
    CUresult rc = peer_check(dctx, sctx);
    if (!rc)
        rc = fg_copy_async(s, 1);
    return rc ? rc : dev_copy(dst, src, n);
}

/* --- 2D and 3D copies: CUDA_MEMCPY2D / CUDA_MEMCPY3D of cuda.h ------------------------------ */

typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} fg_memcpy2d;

typedef struct {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    void *reserved0;
    size_t srcPitch, srcHeight;
    size_t dstXInBytes, dstY, dstZ, dstLOD;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    void *reserved1;
    size_t dstPitch, dstHeight;
    size_t WidthInBytes, Height, Depth;
} fg_memcpy3d;

_Static_assert(sizeof(fg_memcpy2d) == 128, "CUDA_MEMCPY2D layout");
_Static_assert(sizeof(fg_memcpy3d) == 200, "CUDA_MEMCPY3D layout");

/* One side of a pitched copy: its base address and whether it must be device memory. */
static CUresult side(int type, const void *host, CUdeviceptr dev, const void *array, uint64_t *base, int *is_dev)
{
    switch (type) {
    case MT_HOST:
        *base = (uint64_t)(uintptr_t)host;
        *is_dev = 0;
        return host ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case MT_DEVICE:
        *base = dev;
        *is_dev = 1;
        return dev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case MT_UNIFIED:
        *base = dev;
        *is_dev = -1;
        return dev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case MT_ARRAY:
        (void)array;
        return CUDA_ERROR_NOT_SUPPORTED;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult check_side(uint64_t p, size_t n, int is_dev)
{
    if (is_dev > 0)
        return fg_check_dev_range(p, n);
    if (is_dev < 0)
        return check_any(p, n);
    return CUDA_SUCCESS;
}

/* Copies depth x height rows of width bytes. */
static CUresult pitched(uint64_t s, size_t spitch, size_t sheight, int sdev, uint64_t d, size_t dpitch,
                        size_t dheight, int ddev, size_t width, size_t height, size_t depth)
{
    if (width == 0 || height == 0 || depth == 0)
        return CUDA_SUCCESS;
    if ((height > 1 || depth > 1) && (spitch < width || dpitch < width))
        return CUDA_ERROR_INVALID_VALUE;
    if (depth > 1 && (sheight < height || dheight < height))
        return CUDA_ERROR_INVALID_VALUE;
    /* the whole extent of each side first: nothing is written when a range is bad */
    uint64_t slast = ((depth - 1) * sheight + (height - 1)) * spitch + width;
    uint64_t dlast = ((depth - 1) * dheight + (height - 1)) * dpitch + width;
    CUresult rc;
    if ((rc = check_side(s, slast, sdev)) || (rc = check_side(d, dlast, ddev)))
        return rc;
    for (size_t z = 0; z < depth; z++)
        for (size_t y = 0; y < height; y++)
            memmove((void *)(uintptr_t)(d + (z * dheight + y) * dpitch),
                    (const void *)(uintptr_t)(s + (z * sheight + y) * spitch), width);
    return CUDA_SUCCESS;
}

static CUresult copy2d(const fg_memcpy2d *c)
{
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t sb, db;
    int sd, dd;
    CUresult rc;
    if ((rc = side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcArray, &sb, &sd)) ||
        (rc = side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstArray, &db, &dd)))
        return rc;
    sb += c->srcY * c->srcPitch + c->srcXInBytes;
    db += c->dstY * c->dstPitch + c->dstXInBytes;
    return pitched(sb, c->srcPitch, c->Height, sd, db, c->dstPitch, c->Height, dd, c->WidthInBytes, c->Height, 1);
}

static CUresult copy3d(const fg_memcpy3d *c)
{
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t sb, db;
    int sd, dd;
    CUresult rc;
    if ((rc = side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcArray, &sb, &sd)) ||
        (rc = side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstArray, &db, &dd)))
        return rc;
    sb += (c->srcZ * c->srcHeight + c->srcY) * c->srcPitch + c->srcXInBytes;
    db += (c->dstZ * c->dstHeight + c->dstY) * c->dstPitch + c->dstXInBytes;
    return pitched(sb, c->srcPitch, c->srcHeight, sd, db, c->dstPitch, c->dstHeight, dd, c->WidthInBytes, c->Height,
                   c->Depth);
}

#define SYNC2(name, T, fn, pt)                                                                                       \
    FG_API CUresult name(const T *c)                                                                                 \
    {                                                                                                                \
        CUresult rc = fg_copy_sync(pt);                                                                              \
        return rc ? rc : fn(c);                                                                                      \
    }
#define ASYNC2(name, T, fn, pt)                                                                                      \
    FG_API CUresult name(const T *c, CUstream s)                                                                     \
    {                                                                                                                \
        CUresult rc = fg_copy_async(s, pt);                                                                          \
        return rc ? rc : fn(c);                                                                                      \
    }

SYNC2(cuMemcpy2D_v2, fg_memcpy2d, copy2d, 0)
SYNC2(cuMemcpy2D_v2_ptds, fg_memcpy2d, copy2d, 1)
SYNC2(cuMemcpy2DUnaligned_v2, fg_memcpy2d, copy2d, 0)
SYNC2(cuMemcpy2DUnaligned_v2_ptds, fg_memcpy2d, copy2d, 1)
ASYNC2(cuMemcpy2DAsync_v2, fg_memcpy2d, copy2d, 0)
ASYNC2(cuMemcpy2DAsync_v2_ptsz, fg_memcpy2d, copy2d, 1)
SYNC2(cuMemcpy3D_v2, fg_memcpy3d, copy3d, 0)
SYNC2(cuMemcpy3D_v2_ptds, fg_memcpy3d, copy3d, 1)
ASYNC2(cuMemcpy3DAsync_v2, fg_memcpy3d, copy3d, 0)
ASYNC2(cuMemcpy3DAsync_v2_ptsz, fg_memcpy3d, copy3d, 1)

/* --- sets ----------------------------------------------------------------------------------- */

static CUresult set2d(CUdeviceptr dst, size_t pitch, const void *val, size_t elem, size_t width, size_t height)
{
    if (width == 0 || height == 0)
        return CUDA_SUCCESS;
    if (dst % elem || (height > 1 && (pitch < width * elem || pitch % elem)))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_check_dev_range(dst, (height - 1) * pitch + width * elem);
    if (rc)
        return rc;
    for (size_t y = 0; y < height; y++) {
        unsigned char *row = (unsigned char *)(uintptr_t)(dst + y * pitch);
        if (elem == 1)
            memset(row, *(const unsigned char *)val, width);
        else
            for (size_t x = 0; x < width; x++)
                memcpy(row + x * elem, val, elem);
    }
    return CUDA_SUCCESS;
}

#define SET1(name, T, elem, pt)                                                                                      \
    FG_API CUresult name(CUdeviceptr dst, T v, size_t n)                                                             \
    {                                                                                                                \
        CUresult rc = fg_copy_sync(pt);                                                                              \
        return rc ? rc : set2d(dst, 0, &v, elem, n, 1);                                                              \
    }
#define SET1A(name, T, elem, pt)                                                                                     \
    FG_API CUresult name(CUdeviceptr dst, T v, size_t n, CUstream s)                                                 \
    {                                                                                                                \
        CUresult rc = fg_copy_async(s, pt);                                                                          \
        return rc ? rc : set2d(dst, 0, &v, elem, n, 1);                                                              \
    }
#define SET2(name, T, elem, pt)                                                                                      \
    FG_API CUresult name(CUdeviceptr dst, size_t pitch, T v, size_t w, size_t h)                                     \
    {                                                                                                                \
        CUresult rc = fg_copy_sync(pt);                                                                              \
        return rc ? rc : set2d(dst, pitch, &v, elem, w, h);                                                          \
    }
#define SET2A(name, T, elem, pt)                                                                                     \
    FG_API CUresult name(CUdeviceptr dst, size_t pitch, T v, size_t w, size_t h, CUstream s)                         \
    {                                                                                                                \
        CUresult rc = fg_copy_async(s, pt);                                                                          \
        return rc ? rc : set2d(dst, pitch, &v, elem, w, h);                                                          \
    }

SET1(cuMemsetD16_v2, unsigned short, 2, 0)
SET1(cuMemsetD16_v2_ptds, unsigned short, 2, 1)
SET1A(cuMemsetD8Async, unsigned char, 1, 0)
SET1A(cuMemsetD8Async_ptsz, unsigned char, 1, 1)
SET1A(cuMemsetD16Async, unsigned short, 2, 0)
SET1A(cuMemsetD16Async_ptsz, unsigned short, 2, 1)
SET1A(cuMemsetD32Async, unsigned int, 4, 0)
SET1A(cuMemsetD32Async_ptsz, unsigned int, 4, 1)
SET2(cuMemsetD2D8_v2, unsigned char, 1, 0)
SET2(cuMemsetD2D8_v2_ptds, unsigned char, 1, 1)
SET2(cuMemsetD2D16_v2, unsigned short, 2, 0)
SET2(cuMemsetD2D16_v2_ptds, unsigned short, 2, 1)
SET2(cuMemsetD2D32_v2, unsigned int, 4, 0)
SET2(cuMemsetD2D32_v2_ptds, unsigned int, 4, 1)
SET2A(cuMemsetD2D8Async, unsigned char, 1, 0)
SET2A(cuMemsetD2D8Async_ptsz, unsigned char, 1, 1)
SET2A(cuMemsetD2D16Async, unsigned short, 2, 0)
SET2A(cuMemsetD2D16Async_ptsz, unsigned short, 2, 1)
SET2A(cuMemsetD2D32Async, unsigned int, 4, 0)
SET2A(cuMemsetD2D32Async_ptsz, unsigned int, 4, 1)

/* --- pointer attributes (CUpointer_attribute of cuda.h) ------------------------------------- */

enum {
    PA_CONTEXT = 1,
    PA_MEMORY_TYPE = 2,
    PA_DEVICE_POINTER = 3,
    PA_HOST_POINTER = 4,
    PA_SYNC_MEMOPS = 6,
    PA_BUFFER_ID = 7,
    PA_IS_MANAGED = 8,
    PA_DEVICE_ORDINAL = 9,
    PA_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
    PA_RANGE_START_ADDR = 11,
    PA_RANGE_SIZE = 12,
    PA_MAPPED = 13,
    PA_ALLOWED_HANDLE_TYPES = 14,
    PA_IS_GPU_DIRECT_RDMA_CAPABLE = 15,
    PA_ACCESS_FLAGS = 16,
    PA_MEMPOOL_HANDLE = 17,
    PA_MAPPING_SIZE = 18,
    PA_MAPPING_BASE_ADDR = 19,
    PA_MEMORY_BLOCK_ID = 20,
};

/* Writes one attribute of allocation a (found) for ptr; returns an error for unknown ones. */
static CUresult pointer_attr(void *data, int attr, const struct fg_alloc *a, uint64_t ptr)
{
    int host = a->kind == FG_ALLOC_HOST;
    switch (attr) {
    case PA_CONTEXT: {
        CUcontext c = a->ctx;
        if (!c)
            fg_primary_ctx_handle(&c, fg_ordinal_of(a->dev));
        *(CUcontext *)data = c;
        return CUDA_SUCCESS;
    }
    case PA_MEMORY_TYPE:
        *(unsigned *)data = host ? MT_HOST : MT_DEVICE;
        return CUDA_SUCCESS;
    case PA_DEVICE_POINTER:
        *(CUdeviceptr *)data = ptr;
        return CUDA_SUCCESS;
    case PA_HOST_POINTER:
        if (!host && a->kind != FG_ALLOC_MANAGED)
            return CUDA_ERROR_INVALID_VALUE; /* device memory has no host address */
        *(void **)data = (void *)(uintptr_t)ptr;
        return CUDA_SUCCESS;
    case PA_SYNC_MEMOPS:
        *(int *)data = 0;
        return CUDA_SUCCESS;
    case PA_BUFFER_ID:
    case PA_MEMORY_BLOCK_ID:
        *(unsigned long long *)data = a->ptr;
        return CUDA_SUCCESS;
    case PA_IS_MANAGED:
        *(int *)data = a->kind == FG_ALLOC_MANAGED;
        return CUDA_SUCCESS;
    case PA_DEVICE_ORDINAL:
        *(int *)data = fg_ordinal_of(a->dev);
        return CUDA_SUCCESS;
    case PA_IS_LEGACY_CUDA_IPC_CAPABLE:
        *(int *)data = a->kind == FG_ALLOC_DEVICE || a->kind == FG_ALLOC_PITCH;
        return CUDA_SUCCESS;
    case PA_RANGE_START_ADDR:
    case PA_MAPPING_BASE_ADDR:
        *(void **)data = (void *)(uintptr_t)a->ptr;
        return CUDA_SUCCESS;
    case PA_RANGE_SIZE:
    case PA_MAPPING_SIZE:
        *(size_t *)data = a->size;
        return CUDA_SUCCESS;
    case PA_MAPPED:
        *(int *)data = a->kind != FG_ALLOC_VA || fg_vmm_mapped(ptr, 1);
        return CUDA_SUCCESS;
    case PA_ALLOWED_HANDLE_TYPES:
        *(unsigned long long *)data = 0;
        return CUDA_SUCCESS;
    case PA_IS_GPU_DIRECT_RDMA_CAPABLE:
        *(int *)data = 0;
        return CUDA_SUCCESS;
    case PA_ACCESS_FLAGS:
        *(int *)data = 3; /* CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE */
        return CUDA_SUCCESS;
    case PA_MEMPOOL_HANDLE:
        *(void **)data = a->pool;
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

FG_API CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_alloc a;
    if (fg_alloc_find(ptr, 1, &a) != 0 || a.kind == FG_ALLOC_MODULE)
        return CUDA_ERROR_INVALID_VALUE; /* not memory the driver knows */
    return pointer_attr(data, attr, &a, ptr);
}

/* Unlike cuPointerGetAttribute, an unknown pointer is no error: its attributes read as zero
 * (cuda.h, cuPointerGetAttributes). */
FG_API CUresult cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr ptr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!attrs || !data)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_alloc a;
    int known = fg_alloc_find(ptr, 1, &a) == 0 && a.kind != FG_ALLOC_MODULE;
    for (unsigned i = 0; i < n; i++) {
        if (!data[i])
            continue;
        if (known && pointer_attr(data[i], attrs[i], &a, ptr) == CUDA_SUCCESS)
            continue;
        switch (attrs[i]) {
        case PA_CONTEXT:
        case PA_HOST_POINTER:
        case PA_RANGE_START_ADDR:
        case PA_MAPPING_BASE_ADDR:
        case PA_MEMPOOL_HANDLE:
            *(void **)data[i] = NULL;
            break;
        case PA_DEVICE_POINTER:
        case PA_BUFFER_ID:
        case PA_MEMORY_BLOCK_ID:
        case PA_ALLOWED_HANDLE_TYPES:
            *(unsigned long long *)data[i] = 0;
            break;
        case PA_RANGE_SIZE:
        case PA_MAPPING_SIZE:
            *(size_t *)data[i] = 0;
            break;
        case PA_DEVICE_ORDINAL:
            *(int *)data[i] = -2; /* what the real driver answers for host memory */
            break;
        default:
            *(unsigned *)data[i] = 0;
        }
    }
    return CUDA_SUCCESS;
}

/* The managed-memory hints (cuMemAdvise, cuMemPrefetchAsync and their variants) decide where the
 * simulator keeps managed pages: cuda_um.c. */
