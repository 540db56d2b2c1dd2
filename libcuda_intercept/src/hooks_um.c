/*
 * hooks_um.c — the unified-memory hints that could pull host-backed memory
 * into VRAM: cuMemAdvise(_v2), cuMemPrefetchAsync(_ptsz, _v2, _v2_ptsz) and
 * the CUDA 13 batch prefetches.
 *
 * Memory this library placed in host memory (the container is over its
 * physical share, oversub.c) must stay there: a prefetch to a device, a
 * preferred location on a device (or none), or read-mostly duplication would
 * have the driver put it into VRAM other containers were promised.  Such a
 * request on a range that overlaps host-backed memory is answered
 * CUDA_SUCCESS without being made: prefetches and advice are hints (the CUDA
 * driver API documents them as performance hints, never as a condition of
 * correctness), so a program keeps working, only slower.  Everything else is
 * forwarded.  Security: the container is untrusted; this is what keeps it from
 * undoing the placement with the driver's own API.
 */
#include <string.h>

#include "log.h"
#include "oversub.h"
#include "vgpu.h"

static int guarded(void) { return !vgpu_in_hook && vgpu_status() == VGPU_ST_ACTIVE; }

/* 1 if this advice would let the driver move pages of [p, p+n) onto a device */
static int pulls_in(int advice, int to_device)
{
    switch (advice) {
    case CU_MEM_ADVISE_SET_READ_MOSTLY:          /* read-only copies on every accessing device */
    case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION: /* back to migrate-on-fault */
        return 1;
    case CU_MEM_ADVISE_SET_PREFERRED_LOCATION:
        return to_device;
    default: /* UNSET_READ_MOSTLY, SET/UNSET_ACCESSED_BY: mappings only */
        return 0;
    }
}

static int ignored(const char *what, CUdeviceptr p, size_t n)
{
    if (!vgpu_os_overlaps_host(p, n))
        return 0;
    VLOG(VGPU_LOG_INFO, "%s on host-backed memory (0x%llx, %zu bytes) ignored: it stays in host memory", what,
         (unsigned long long)p, n);
    return 1;
}

VGPU_EXPORT CUresult cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice dev)
{
    NEED(cuMemAdvise);
    if (guarded() && pulls_in(advice, dev >= 0) && ignored("cuMemAdvise", p, n))
        return CUDA_SUCCESS;
    return REAL(cuMemAdvise)(p, n, advice, dev);
}

VGPU_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, CUmemLocation loc)
{
    NEED(cuMemAdvise_v2);
    if (guarded() && pulls_in(advice, loc.type == CU_MEM_LOCATION_TYPE_DEVICE) && ignored("cuMemAdvise", p, n))
        return CUDA_SUCCESS;
    return REAL(cuMemAdvise_v2)(p, n, advice, loc);
}

VGPU_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dst, CUstream s)
{
    NEED(cuMemPrefetchAsync);
    if (guarded() && dst >= 0 && ignored("cuMemPrefetchAsync", p, n))
        return CUDA_SUCCESS;
    return REAL(cuMemPrefetchAsync)(p, n, dst, s);
}

VGPU_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice dst, CUstream s)
{
    NEED(cuMemPrefetchAsync_ptsz);
    if (guarded() && dst >= 0 && ignored("cuMemPrefetchAsync", p, n))
        return CUDA_SUCCESS;
    return REAL(cuMemPrefetchAsync_ptsz)(p, n, dst, s);
}

VGPU_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned flags, CUstream s)
{
    NEED(cuMemPrefetchAsync_v2);
    if (guarded() && loc.type == CU_MEM_LOCATION_TYPE_DEVICE && ignored("cuMemPrefetchAsync", p, n))
        return CUDA_SUCCESS;
    return REAL(cuMemPrefetchAsync_v2)(p, n, loc, flags, s);
}

VGPU_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned flags,
                                                CUstream s)
{
    NEED(cuMemPrefetchAsync_v2_ptsz);
    if (guarded() && loc.type == CU_MEM_LOCATION_TYPE_DEVICE && ignored("cuMemPrefetchAsync", p, n))
        return CUDA_SUCCESS;
    return REAL(cuMemPrefetchAsync_v2_ptsz)(p, n, loc, flags, s);
}

/* Batches: prefetchLocs[j] applies to the entries from prefetchLocIdxs[j] up to
 * the next index (cuMemPrefetchBatchAsync).  A batch touching host-backed
 * memory with a device target is replayed entry by entry, those entries left
 * out; the batch is only "as a whole in stream order" anyway. */
typedef CUresult (*batch_fn)(CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t, unsigned long long,
                             CUstream);

static const CUmemLocation *loc_of(size_t i, CUmemLocation *locs, size_t *idxs, size_t nlocs)
{
    const CUmemLocation *l = NULL;
    for (size_t j = 0; j < nlocs; j++)
        if (idxs[j] <= i)
            l = &locs[j];
    return l;
}

static CUresult batch(batch_fn real, int discard, int per_thread, CUdeviceptr *p, size_t *sz, size_t count,
                      CUmemLocation *locs, size_t *idxs, size_t nlocs, unsigned long long flags, CUstream s)
{
    if (!guarded() || !p || !sz || !locs || !idxs)
        return real(p, sz, count, locs, idxs, nlocs, flags, s);
    int conflict = 0;
    for (size_t i = 0; i < count && !conflict; i++) {
        const CUmemLocation *l = loc_of(i, locs, idxs, nlocs);
        conflict = l && l->type == CU_MEM_LOCATION_TYPE_DEVICE && vgpu_os_overlaps_host(p[i], sz[i]);
    }
    if (!conflict)
        return real(p, sz, count, locs, idxs, nlocs, flags, s);
    VLOG(VGPU_LOG_INFO, "batched prefetch of host-backed memory to a device: those entries ignored");
    CUresult (*pf)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream) =
        per_thread ? REAL(cuMemPrefetchAsync_v2_ptsz) : REAL(cuMemPrefetchAsync_v2);
    CUresult (*dis)(CUdeviceptr *, size_t *, size_t, unsigned long long, CUstream) =
        per_thread ? REAL(cuMemDiscardBatchAsync_ptsz) : REAL(cuMemDiscardBatchAsync);
    if (!pf || (discard && !dis))
        return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = discard ? dis(p, sz, count, flags, s) : CUDA_SUCCESS;
    for (size_t i = 0; i < count && rc == CUDA_SUCCESS; i++) {
        const CUmemLocation *l = loc_of(i, locs, idxs, nlocs);
        if (!l || (l->type == CU_MEM_LOCATION_TYPE_DEVICE && vgpu_os_overlaps_host(p[i], sz[i])))
            continue;
        rc = pf(p[i], sz[i], *l, 0, s);
    }
    return rc;
}

VGPU_EXPORT CUresult cuMemPrefetchBatchAsync(CUdeviceptr *p, size_t *sz, size_t count, CUmemLocation *locs,
                                             size_t *idxs, size_t nlocs, unsigned long long flags, CUstream s)
{
    NEED(cuMemPrefetchBatchAsync);
    return batch(REAL(cuMemPrefetchBatchAsync), 0, 0, p, sz, count, locs, idxs, nlocs, flags, s);
}

VGPU_EXPORT CUresult cuMemPrefetchBatchAsync_ptsz(CUdeviceptr *p, size_t *sz, size_t count, CUmemLocation *locs,
                                                  size_t *idxs, size_t nlocs, unsigned long long flags, CUstream s)
{
    NEED(cuMemPrefetchBatchAsync_ptsz);
    return batch(REAL(cuMemPrefetchBatchAsync_ptsz), 0, 1, p, sz, count, locs, idxs, nlocs, flags, s);
}

VGPU_EXPORT CUresult cuMemDiscardAndPrefetchBatchAsync(CUdeviceptr *p, size_t *sz, size_t count, CUmemLocation *locs,
                                                       size_t *idxs, size_t nlocs, unsigned long long flags,
                                                       CUstream s)
{
    NEED(cuMemDiscardAndPrefetchBatchAsync);
    return batch(REAL(cuMemDiscardAndPrefetchBatchAsync), 1, 0, p, sz, count, locs, idxs, nlocs, flags, s);
}

VGPU_EXPORT CUresult cuMemDiscardAndPrefetchBatchAsync_ptsz(CUdeviceptr *p, size_t *sz, size_t count,
                                                            CUmemLocation *locs, size_t *idxs, size_t nlocs,
                                                            unsigned long long flags, CUstream s)
{
    NEED(cuMemDiscardAndPrefetchBatchAsync_ptsz);
    return batch(REAL(cuMemDiscardAndPrefetchBatchAsync_ptsz), 1, 1, p, sz, count, locs, idxs, nlocs, flags, s);
}
