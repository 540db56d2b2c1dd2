/*
 * hooks_mem.c — every device-memory allocation and free path.
 *
 * Pattern: decide whether to account (active process, listed device), check
 * and charge the region *before* calling the driver (so racing processes can
 * never overshoot together), call the driver outside any shared lock, undo
 * the charge if the driver fails, and remember the object -> charge mapping
 * so the matching free returns exactly what was charged.  Frees of objects we
 * never charged are always forwarded (HAMi-core#93).
 */
#include <string.h>

#include "log.h"
#include "oversub.h"
#include "vgpu.h"

#define KIND_RELEASED 0x100u /* t_vmm: handle released, waiting for its last unmap */

/* 1: account on limits index *idx (CUDA ordinal *ord); 0: pass through untracked; -1: return *rc */
int vgpu_begin_ord(int dev, int *idx, CUdevice *ord, CUresult *rc)
{
    if (vgpu_in_hook)
        return 0;
    int st = vgpu_status();
    if (LIKELY(st == VGPU_ST_INACTIVE))
        return 0;
    if (st == VGPU_ST_FAILED || vgpu_ensure_joined() != 0) {
        *rc = vgpu_fail_closed("allocation");
        return -1;
    }
    if (dev < 0) {
        CUdevice d;
        CUresult r = REAL(cuCtxGetDevice) ? REAL(cuCtxGetDevice)(&d) : CUDA_ERROR_NOT_INITIALIZED;
        if (r != CUDA_SUCCESS) {
            *rc = r; /* no current context: the driver would fail this allocation too */
            return -1;
        }
        dev = d;
    }
    int i = vgpu_dev_index(dev);
    if (i == -2) {
        *rc = CUDA_ERROR_INVALID_DEVICE;
        return -1;
    }
    if (i < 0) {
        *rc = CUDA_ERROR_OUT_OF_MEMORY; /* a device this container has no slice of */
        return -1;
    }
    *idx = i;
    *ord = dev;
    vgpu_os_reap(0); /* memory freed in stream order whose stream is done (oversub.c) */
    return 1;
}

int vgpu_begin(int dev, int *idx, CUresult *rc)
{
    CUdevice ord;
    return vgpu_begin_ord(dev, idx, &ord, rc);
}

int vgpu_charge(int idx, uint64_t n, int kind)
{
    const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
    int r = vgpu_rgn_charge((unsigned)idx, n, L->memory_limit, L->device_limit, vgpu_ctx_reserve(), kind);
    /* memory this process's pools or graph pool no longer hold may still be charged (they give
     * it back at synchronisations the hooks do not all see): bring those charges up to date
     * once before refusing */
    if (r != 0 && (vgpu_pools_refresh(idx) | vgpu_graph_refresh(idx)))
        r = vgpu_rgn_charge((unsigned)idx, n, L->memory_limit, L->device_limit, vgpu_ctx_reserve(), kind);
    if (r != 0)
        VLOG(VGPU_LOG_INFO, "refusing %llu bytes on %s: over the container's %s of %llu", (unsigned long long)n,
             L->uuid, r == VGPU_OVER_SHARE ? "physical share" : "limit",
             (unsigned long long)(r == VGPU_OVER_SHARE ? L->device_limit : L->memory_limit));
    return r;
}

#define charge vgpu_charge

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

int vgpu_remember(struct vgpu_track *t, uint64_t key, uint64_t size, int idx, unsigned kind, uint64_t aux)
{
    struct vgpu_rec r = {.key = key, .size = size, .aux = aux, .dev = (uint32_t)idx, .kind = kind};
    return vgpu_track_put(t, &r);
}
#define remember vgpu_remember

/* ------------------------------------------------------------ cuMemAlloc */

/* The device allocation failed for lack of physical memory (non-vGPU users,
 * contexts) although the container is inside its share: with oversubscription
 * the bytes can still live in host memory.  Moves the charge on success. */
static CUresult to_host_after_oom(CUresult rc, int idx, CUdevice ord, uint64_t n, int *kind,
                                  CUresult (*host)(void *), void *arg)
{
    if (rc != CUDA_ERROR_OUT_OF_MEMORY || *kind != VGPU_KIND_DEVICE || !vgpu_os_can_host(idx, ord))
        return rc;
    rc = host(arg);
    if (rc == CUDA_SUCCESS) {
        vgpu_rgn_to_host((unsigned)idx, n);
        *kind = VGPU_KIND_HOST;
        VLOG(VGPU_LOG_DEBUG, "device full: %llu bytes host-backed (managed)", (unsigned long long)n);
    }
    return rc;
}

struct managed_args {
    CUdeviceptr *p;
    size_t n;
    CUdevice ord;
};
static CUresult managed_host(void *a)
{
    struct managed_args *m = a;
    return vgpu_os_managed(m->p, m->n, CU_MEM_ATTACH_GLOBAL, m->ord);
}

/* Beyond the physical share, with oversubscription, host memory (oversub.c). */
VGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t n)
{
    NEED(cuMemAlloc_v2);
    CUresult rc = CUDA_SUCCESS;
    CUdevice ord;
    int idx, kind, b = vgpu_begin_ord(-1, &idx, &ord, &rc);
    if (b <= 0)
        return b < 0 ? rc : REAL(cuMemAlloc_v2)(dptr, n);
    if (vgpu_os_charge(idx, ord, n, 1, "cuMemAlloc_v2", &kind) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct managed_args ma = {dptr, n, ord};
    if (kind == VGPU_KIND_HOST) {
        rc = managed_host(&ma);
    } else {
        vgpu_in_hook++;
        rc = REAL(cuMemAlloc_v2)(dptr, n);
        vgpu_in_hook--;
        rc = to_host_after_oom(rc, idx, ord, n, &kind, managed_host, &ma);
    }
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, n, kind);
        return rc;
    }
    if (remember(&vgpu_t_ptr, *dptr, n, idx, (unsigned)kind, 0) != 0) {
        REAL(cuMemFree_v2)(*dptr);
        vgpu_rgn_uncharge((unsigned)idx, n, kind);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned elem)
{
    NEED(cuMemAllocPitch_v2);
    CUresult rc = CUDA_SUCCESS;
    CUdevice ord;
    int idx, kind, b = vgpu_begin_ord(-1, &idx, &ord, &rc);
    if (b <= 0)
        return b < 0 ? rc : REAL(cuMemAllocPitch_v2)(dptr, pitch, w, h, elem);
    /* pre-charge an estimate (rows padded to 512 bytes), settle on pitch*h */
    uint64_t est = mul_sat(w > UINT64_MAX - 511 ? UINT64_MAX : (w + 511) & ~(uint64_t)511, h), actual = 0;
    if (vgpu_os_charge(idx, ord, est, 1, "cuMemAllocPitch_v2", &kind) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (kind == VGPU_KIND_HOST) {
        rc = vgpu_os_pitch(dptr, pitch, w, h, elem, ord, &actual); /* a pitched layout over managed memory */
    } else {
        vgpu_in_hook++;
        rc = REAL(cuMemAllocPitch_v2)(dptr, pitch, w, h, elem);
        vgpu_in_hook--;
        if (rc == CUDA_SUCCESS) {
            actual = mul_sat(*pitch, h);
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY && vgpu_os_can_host(idx, ord)) {
            rc = vgpu_os_pitch(dptr, pitch, w, h, elem, ord, &actual);
            if (rc == CUDA_SUCCESS) {
                vgpu_rgn_to_host((unsigned)idx, est);
                kind = VGPU_KIND_HOST;
            }
        }
    }
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, est, kind);
        return rc;
    }
    if (actual > est) {
        if (charge(idx, actual - est, kind) != 0) {
            REAL(cuMemFree_v2)(*dptr);
            vgpu_rgn_uncharge((unsigned)idx, est, kind);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < est) {
        vgpu_rgn_uncharge((unsigned)idx, est - actual, kind);
    }
    if (remember(&vgpu_t_ptr, *dptr, actual, idx, (unsigned)kind, 0) != 0) {
        REAL(cuMemFree_v2)(*dptr);
        vgpu_rgn_uncharge((unsigned)idx, actual, kind);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

/* Managed memory is charged in full to the current device (it may migrate
 * there at any time) while the physical share has room; beyond it, it is
 * advised to stay in host memory and charged as host-resident. */
VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t n, unsigned flags)
{
    NEED(cuMemAllocManaged);
    CUresult rc = CUDA_SUCCESS;
    CUdevice ord;
    int idx, kind, b = vgpu_begin_ord(-1, &idx, &ord, &rc);
    if (b <= 0)
        return b < 0 ? rc : REAL(cuMemAllocManaged)(dptr, n, flags);
    if (vgpu_os_charge(idx, ord, n, 1, "cuMemAllocManaged", &kind) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (kind == VGPU_KIND_HOST) {
        rc = vgpu_os_managed(dptr, n, flags, ord);
    } else {
        vgpu_in_hook++;
        rc = REAL(cuMemAllocManaged)(dptr, n, flags);
        vgpu_in_hook--;
    }
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, n, kind);
        return rc;
    }
    if (remember(&vgpu_t_ptr, *dptr, n, idx, (unsigned)kind, 0) != 0) {
        REAL(cuMemFree_v2)(*dptr);
        vgpu_rgn_uncharge((unsigned)idx, n, kind);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

/* shared by cuMemFree_v2 and cuMemFreeAsync(_ptsz): forget first (so a
 * concurrent allocation that reuses the address cannot lose its record),
 * free, then return the charge; put the record back if the driver refuses.
 * A pool allocation returns nothing (its pool keeps the memory: hooks_pool.c);
 * one exported to other processes lets go of its ledger entry (hooks_share.c);
 * host-backed memory freed in stream order is freed once its stream is done
 * (oversub.c). */
CUresult vgpu_free_tracked(CUdeviceptr p, CUresult (*fn)(CUdeviceptr, CUstream), CUstream s, int sync)
{
    struct vgpu_rec r;
    int tracked = !vgpu_in_hook && vgpu_status() != VGPU_ST_INACTIVE && vgpu_track_take(&vgpu_t_ptr, p, &r);
    if (tracked && !sync && r.kind == VGPU_KIND_HOST && !r.ext) {
        CUresult rc = vgpu_os_free_async(&r, s, fn == REAL(cuMemFreeAsync_ptsz));
        if (rc != CUDA_SUCCESS)
            vgpu_track_put(&vgpu_t_ptr, &r);
        return rc;
    }
    CUresult rc = sync ? REAL(cuMemFree_v2)(p) : fn(p, s);
    if (!tracked) {
        /* maybe a graph allocation (not while capturing: that frees it in the graph) */
        if (rc == CUDA_SUCCESS && !vgpu_in_hook && vgpu_status() != VGPU_ST_INACTIVE && (sync || !vgpu_capturing(s, fn)))
            vgpu_graph_freed(p);
        return rc;
    }
    if (rc != CUDA_SUCCESS)
        vgpu_track_put(&vgpu_t_ptr, &r);
    else if (r.kind == VGPU_KIND_POOL)
        vgpu_pool_freed(r.aux);
    else if (r.ext)
        vgpu_share_release(r.ext);
    else
        vgpu_rgn_uncharge(r.dev, r.size, (int)r.kind);
    return rc;
}
#define free_tracked vgpu_free_tracked

VGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    NEED(cuMemFree_v2);
    return free_tracked(p, NULL, NULL, 1);
}

/* -------------------------------------------------------------------- VMM */

/* Physical memory from cuMemCreate is charged to prop->location.id (never
 * the current context: HAMi-core#169/#187) and returned when the handle is
 * released *and* its last mapping is gone, which is when the driver frees it. */
VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    NEED(cuMemCreate);
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL(cuMemCreate)(h, n, prop, flags); /* host memory is not charged */
    CUresult rc = CUDA_SUCCESS;
    CUdevice ord;
    int idx, kind, b = vgpu_begin_ord(prop->location.id, &idx, &ord, &rc);
    if (b <= 0)
        return b < 0 ? rc : REAL(cuMemCreate)(h, n, prop, flags);
    /* beyond the physical share: a host-NUMA allocation, where the driver has them */
    if (vgpu_os_charge(idx, ord, n, 1, "cuMemCreate", &kind) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (kind == VGPU_KIND_HOST) {
        rc = vgpu_os_create_host(h, n, prop, flags, ord);
        if (rc != CUDA_SUCCESS) {
            VLOG(VGPU_LOG_ERROR,
                 "cuMemCreate: refusing %zu bytes beyond the container's physical share: no host-NUMA allocation (%d)",
                 n, rc);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else {
        vgpu_in_hook++;
        rc = REAL(cuMemCreate)(h, n, prop, flags);
        vgpu_in_hook--;
    }
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, n, kind);
        return rc;
    }
    if (remember(&vgpu_t_vmm, *h, n, idx, (unsigned)kind, 0) != 0) {
        REAL(cuMemRelease)(*h);
        vgpu_rgn_uncharge((unsigned)idx, n, kind);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

struct vmm_op {
    int delta_maps; /* +1 map, -1 unmap, 0 release */
    uint64_t size, ref;
    uint32_t dev;
    int uncharge;
    int kind; /* VGPU_KIND_DEVICE, or HOST for a host-NUMA handle of the fallback */
};

static int vmm_apply(struct vgpu_rec *r, void *arg, int *remove)
{
    struct vmm_op *op = arg;
    if (op->delta_maps > 0)
        r->aux++;
    else if (op->delta_maps < 0 && r->aux > 0)
        r->aux--;
    else if (op->delta_maps == 0)
        r->kind |= KIND_RELEASED;
    if ((r->kind & KIND_RELEASED) && r->aux == 0) {
        *remove = 1;
        op->uncharge = 1;
        op->size = r->size;
        op->dev = r->dev;
        op->ref = r->ext;
        op->kind = (r->kind & ~(KIND_RELEASED | VGPU_KIND_MAPCHARGE)) == VGPU_KIND_HOST ? VGPU_KIND_HOST
                                                                                      : VGPU_KIND_DEVICE;
    }
    return 0;
}

/* The handle's memory is freed when it is released and unmapped: its charge goes back (to the
 * shared ledger if other processes may hold it too). */
static void vmm_change(uint64_t handle, int delta)
{
    struct vmm_op op = {.delta_maps = delta};
    if (vgpu_track_update(&vgpu_t_vmm, handle, vmm_apply, &op) != 0 || !op.uncharge)
        return;
    if (op.ref)
        vgpu_share_release(op.ref);
    else
        vgpu_rgn_uncharge(op.dev, op.size, op.kind);
}

VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    NEED(cuMemRelease);
    CUresult rc = REAL(cuMemRelease)(h);
    if (rc == CUDA_SUCCESS && vgpu_status() != VGPU_ST_INACTIVE)
        vmm_change(h, 0);
    return rc;
}

VGPU_EXPORT CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h,
                              unsigned long long flags)
{
    NEED(cuMemMap);
    struct vgpu_rec hr;
    int tracked = !vgpu_in_hook && vgpu_status() != VGPU_ST_INACTIVE && vgpu_track_get(&vgpu_t_vmm, h, &hr);
    /* an imported handle whose size was not known: each mapping of it is charged */
    uint64_t mcharge = tracked && (hr.kind & VGPU_KIND_MAPCHARGE) ? n : 0;
    if (mcharge && charge((int)hr.dev, mcharge, VGPU_KIND_DEVICE) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = REAL(cuMemMap)(p, n, off, h, flags);
    if (rc != CUDA_SUCCESS) {
        if (mcharge)
            vgpu_rgn_uncharge(hr.dev, mcharge, VGPU_KIND_DEVICE);
        return rc;
    }
    if (tracked) {
        remember(&vgpu_t_map, p, mcharge, (int)hr.dev, 0, h);
        vmm_change(h, +1);
    }
    return rc;
}

struct unmapped {
    uint64_t handles[64];
    int n, overflow;
};

static void collect_unmapped(const struct vgpu_rec *r, void *arg)
{
    struct unmapped *u = arg;
    if (u->n < 64) {
        u->handles[u->n++] = r->aux;
        if (r->size) /* a mapping charged on its own */
            vgpu_rgn_uncharge(r->dev, r->size, VGPU_KIND_DEVICE);
    } else {
        u->overflow = 1;
    }
}

VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t n)
{
    NEED(cuMemUnmap);
    CUresult rc = REAL(cuMemUnmap)(p, n);
    if (rc != CUDA_SUCCESS || vgpu_status() == VGPU_ST_INACTIVE || vgpu_track_count(&vgpu_t_map) == 0)
        return rc;
    uint64_t hi = p + n < p ? UINT64_MAX : p + n;
    for (;;) {
        struct unmapped u = {.n = 0};
        vgpu_track_take_range(&vgpu_t_map, p, hi, collect_unmapped, &u);
        for (int i = 0; i < u.n; i++)
            vmm_change(u.handles[i], -1);
        if (!u.overflow)
            break;
    }
    return rc;
}

/* ----------------------------------------------------------------- arrays */

/* The driver does not say how much an array takes before creating it; charge
 * elements x channels x element size (unknown formats: 16 bytes/element,
 * over- rather than under-counting). */
static uint64_t elem_bytes(int fmt)
{
    switch (fmt) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    case 0x03: case 0x0a: case 0x20: return 4;
    default: return 16;
    }
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, int fmt, unsigned ch)
{
    uint64_t n = mul_sat(w ? w : 1, h ? h : 1);
    n = mul_sat(n, d ? d : 1);
    n = mul_sat(n, ch ? ch : 1);
    return mul_sat(n, elem_bytes(fmt));
}

static CUresult array_create(const char *what, uint64_t bytes, CUresult (*mk)(void *, const void *, unsigned),
                             void *out, const void *desc, unsigned levels, uint64_t (*key)(void *))
{
    CUresult rc = CUDA_SUCCESS;
    CUdevice ord;
    int idx, kind, b = vgpu_begin_ord(-1, &idx, &ord, &rc);
    if (b <= 0)
        return b < 0 ? rc : mk(out, desc, levels);
    /* arrays are the device's own layout: never in host memory, refused at the physical share */
    if (vgpu_os_charge(idx, ord, bytes, 0, what, &kind) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    vgpu_in_hook++;
    rc = mk(out, desc, levels);
    vgpu_in_hook--;
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, bytes, VGPU_KIND_DEVICE);
        return rc;
    }
    if (remember(&vgpu_t_arr, key(out), bytes, idx, VGPU_KIND_DEVICE, 0) != 0) {
        /* cannot remember it: keep the charge (conservative) rather than destroy */
        VLOG(VGPU_LOG_WARN, "array tracking failed; its charge stays until exit");
    }
    return CUDA_SUCCESS;
}

static CUresult mk_array(void *out, const void *desc, unsigned l)
{
    (void)l;
    return REAL(cuArrayCreate_v2)(out, desc);
}
static CUresult mk_array3d(void *out, const void *desc, unsigned l)
{
    (void)l;
    return REAL(cuArray3DCreate_v2)(out, desc);
}
static CUresult mk_mipmap(void *out, const void *desc, unsigned l) { return REAL(cuMipmappedArrayCreate)(out, desc, l); }
static uint64_t key_array(void *out) { return (uint64_t)(uintptr_t)*(CUarray *)out; }
static uint64_t key_mipmap(void *out) { return (uint64_t)(uintptr_t)*(CUmipmappedArray *)out; }

VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    NEED(cuArrayCreate_v2);
    if (!a || !d)
        return REAL(cuArrayCreate_v2)(a, d);
    return array_create("cuArrayCreate_v2", array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels), mk_array,
                        a, d, 0, key_array);
}

VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    NEED(cuArray3DCreate_v2);
    if (!a || !d)
        return REAL(cuArray3DCreate_v2)(a, d);
    return array_create("cuArray3DCreate_v2", array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                        mk_array3d, a, d, 0, key_array);
}

VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    NEED(cuMipmappedArrayCreate);
    if (!a || !d)
        return REAL(cuMipmappedArrayCreate)(a, d, levels);
    uint64_t total = 0, w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1) && l < 64; l++) {
        total = vgpu_sat_add(total, array_bytes(w, h, z, d->Format, d->NumChannels));
        w = w > 1 ? w / 2 : w;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    return array_create("cuMipmappedArrayCreate", total, mk_mipmap, a, d, levels, key_mipmap);
}

static CUresult destroy_tracked(uint64_t key, CUresult (*fn)(void *), void *obj)
{
    struct vgpu_rec r;
    int tracked = vgpu_status() != VGPU_ST_INACTIVE && vgpu_track_take(&vgpu_t_arr, key, &r);
    CUresult rc = fn(obj);
    if (!tracked)
        return rc;
    if (rc == CUDA_SUCCESS)
        vgpu_rgn_uncharge(r.dev, r.size, VGPU_KIND_DEVICE);
    else
        vgpu_track_put(&vgpu_t_arr, &r);
    return rc;
}

static CUresult rm_array(void *a) { return REAL(cuArrayDestroy)((CUarray)a); }
static CUresult rm_mipmap(void *a) { return REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)a); }

VGPU_EXPORT CUresult cuArrayDestroy(CUarray a)
{
    NEED(cuArrayDestroy);
    return destroy_tracked((uint64_t)(uintptr_t)a, rm_array, a);
}

VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    NEED(cuMipmappedArrayDestroy);
    return destroy_tracked((uint64_t)(uintptr_t)a, rm_mipmap, a);
}

/* ------------------------------------------- legacy 32-bit entry points */

/* The pre-3.2 allocation entry points (32-bit device pointers) would bypass
 * accounting; inside a vGPU container they are refused. */
#define LEGACY(name, params, args)                                  \
    VGPU_EXPORT CUresult name params                                \
    {                                                               \
        vgpu_resolve_cuda();                                        \
        if (vgpu_status() != VGPU_ST_INACTIVE)                      \
            return CUDA_ERROR_NOT_SUPPORTED;                        \
        return REAL(name) ? REAL(name) args : CUDA_ERROR_NOT_FOUND; \
    }
LEGACY(cuMemAlloc, (unsigned *p, unsigned n), (p, n))
LEGACY(cuMemAllocPitch, (unsigned *p, unsigned *pitch, unsigned w, unsigned h, unsigned e), (p, pitch, w, h, e))
LEGACY(cuArrayCreate, (CUarray * a, const void *d), (a, d))
LEGACY(cuArray3DCreate, (CUarray * a, const void *d), (a, d))
