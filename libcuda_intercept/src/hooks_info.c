/*
 * hooks_info.c — cuInit (fail closed, join the region) and the calls that
 * report memory: they show the container's slice, never the physical GPU.
 *
 * total = min(limit, physical)   (never a total above the hardware: HAMi-core#80-82)
 * free  = limit - usage, clamped to [0, total]; without oversubscription also
 *         at most the physical free memory.  These calls never fail because
 *         usage exceeds the limit (HAMi-core#200), and never underflow
 *         (HAMi#1181).
 */
#include <string.h>

#include "log.h"
#include "vgpu.h"

VGPU_EXPORT CUresult cuInit(unsigned flags)
{
    vgpu_resolve_cuda();
    int st = vgpu_status();
    if (st == VGPU_ST_FAILED)
        return vgpu_fail_closed("cuInit");
    if (st == VGPU_ST_ACTIVE && vgpu_ensure_joined() != 0)
        return vgpu_fail_closed("cuInit");
    if (!REAL(cuInit))
        return CUDA_ERROR_NOT_FOUND;
    return REAL(cuInit)(flags);
}

struct view {
    uint64_t total, free, used;
};

/* the container's view of limits index idx; device_only: NVML "used" is
 * device memory, so host-backed bytes are left out of it */
static void view_of(int idx, uint64_t phys_total, uint64_t phys_free, int device_only, struct view *v)
{
    const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
    struct vgpu_usage u;
    vgpu_rgn_usage((unsigned)idx, &u);
    uint64_t all = vgpu_sat_add(vgpu_sat_add(u.device, u.host), u.extra);
    uint64_t total = L->memory_limit < phys_total ? L->memory_limit : phys_total;
    uint64_t free = L->memory_limit > all ? L->memory_limit - all : 0;
    if (free > total)
        free = total;
    if (!L->oversubscribe && free > phys_free)
        free = phys_free;
    uint64_t used = device_only ? vgpu_sat_add(u.device, u.extra) : all;
    v->total = total;
    v->free = free;
    v->used = used > total ? total : used;
}

VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *freep, size_t *totalp)
{
    vgpu_resolve_cuda();
    if (!REAL(cuMemGetInfo_v2))
        return CUDA_ERROR_NOT_FOUND;
    int st = vgpu_status();
    if (LIKELY(st == VGPU_ST_INACTIVE))
        return REAL(cuMemGetInfo_v2)(freep, totalp);
    if (st == VGPU_ST_FAILED || vgpu_ensure_mapped() != 0)
        return vgpu_fail_closed("cuMemGetInfo");
    size_t pf = 0, pt = 0;
    CUresult rc = REAL(cuMemGetInfo_v2)(&pf, &pt);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUdevice d;
    rc = REAL(cuCtxGetDevice) ? REAL(cuCtxGetDevice)(&d) : CUDA_ERROR_NOT_INITIALIZED;
    if (rc != CUDA_SUCCESS)
        return rc;
    int idx = vgpu_dev_index(d);
    struct view v = {.total = pt, .free = 0};
    if (idx >= 0) {
        vgpu_rgn_reclaim(); /* a dead process's usage is not reported as used */
        view_of(idx, pt, pf, 0, &v);
    }
    if (freep)
        *freep = v.free;
    if (totalp)
        *totalp = v.total;
    return CUDA_SUCCESS;
}

VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    vgpu_resolve_cuda();
    if (!REAL(cuDeviceTotalMem_v2))
        return CUDA_ERROR_NOT_FOUND;
    int st = vgpu_status();
    if (LIKELY(st == VGPU_ST_INACTIVE))
        return REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (st == VGPU_ST_FAILED)
        return vgpu_fail_closed("cuDeviceTotalMem");
    size_t pt = 0;
    CUresult rc = REAL(cuDeviceTotalMem_v2)(&pt, dev);
    if (rc != CUDA_SUCCESS || !bytes)
        return rc;
    int idx = vgpu_dev_index(dev);
    uint64_t lim = idx >= 0 ? vgpu_limits()->dev[idx].memory_limit : pt;
    *bytes = lim < pt ? lim : pt;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------- NVML */

static int nvml_view(nvmlDevice_t h, unsigned long long total, unsigned long long freeb, struct view *v, int *rcp)
{
    int st = vgpu_status();
    if (LIKELY(st == VGPU_ST_INACTIVE))
        return 0;
    if (st == VGPU_ST_FAILED || vgpu_ensure_mapped() != 0) {
        vgpu_fail_closed("nvmlDeviceGetMemoryInfo");
        *rcp = NVML_ERROR_NO_PERMISSION;
        return -1;
    }
    int idx = vgpu_nvml_index(h);
    if (idx < 0)
        return 0; /* not this container's device (or unknown): pass through */
    vgpu_rgn_reclaim();
    view_of(idx, total, freeb, 1, v);
    return 1;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m)
{
    vgpu_resolve_nvml();
    if (!REAL(nvmlDeviceGetMemoryInfo))
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = REAL(nvmlDeviceGetMemoryInfo)(h, m);
    if (rc != NVML_SUCCESS || !m)
        return rc;
    struct view v;
    int err = 0, r = nvml_view(h, m->total, m->free, &v, &err);
    if (r < 0)
        return err;
    if (r > 0) {
        m->total = v.total;
        m->free = v.free;
        m->used = v.used;
    }
    return NVML_SUCCESS;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m)
{
    vgpu_resolve_nvml();
    if (!REAL(nvmlDeviceGetMemoryInfo_v2))
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = REAL(nvmlDeviceGetMemoryInfo_v2)(h, m);
    if (rc != NVML_SUCCESS || !m)
        return rc;
    struct view v;
    int err = 0, r = nvml_view(h, m->total, m->free, &v, &err);
    if (r < 0)
        return err;
    if (r > 0) {
        m->total = v.total;
        m->reserved = 0;
        m->free = v.free;
        m->used = v.used;
    }
    return NVML_SUCCESS;
}
