/*
 * oversub.c — virtual device memory: the physical share and the host fallback.
 *
 * A container's slice (memory_limit) may be larger than its physical share
 * (device_limit = slice / memory scaling).  Device-resident bytes are charged
 * against both; beyond the share a path that can hold its bytes in host memory
 * gets unified memory there instead:
 *
 *   cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)
 *   cuMemAdvise(SET_PREFERRED_LOCATION, host)   the driver maps the pages for
 *   cuMemAdvise(SET_ACCESSED_BY, the device)    the device instead of migrating
 *                                                them into VRAM on a fault
 *
 * (CUDA driver API, "Unified Addressing" / cuMemAdvise: "Setting the preferred
 * location does not cause data to migrate ... If the data is already in its
 * preferred location and the faulting processor can establish a mapping without
 * requiring the data to be migrated, then data migration will be avoided.")
 * Advice or prefetches that would pull such memory into VRAM are ignored by the
 * guard in hooks_um.c, so the container cannot undo the placement.
 *
 * Security: the limits (and so the share) come from the read-only limits file;
 * nothing here reads a value the container controls except its own region, which
 * can only make its own accounting wrong (region.c).
 */
#include <string.h>

#include "log.h"
#include "oversub.h"

#define MAX_ORD 256
/* CUDA ordinal -> concurrent managed access: 0 unknown, 1 no, 2 yes */
static int g_cma[MAX_ORD];
static int g_ndefer; /* pointers waiting in vgpu_t_defer */

/* paths whose refusal at the physical share was already logged at error level */
#define MAX_LOGGED 16
static const char *g_logged[MAX_LOGGED];
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;

static int first_refusal(const char *what)
{
    int first = 1;
    pthread_mutex_lock(&g_log_mu);
    for (int i = 0; i < MAX_LOGGED && first; i++) {
        if (g_logged[i] == what)
            first = 0;
        else if (!g_logged[i]) {
            g_logged[i] = what;
            break;
        }
    }
    pthread_mutex_unlock(&g_log_mu);
    return first;
}

static int attr(int which, CUdevice ord, int *out)
{
    vgpu_resolve_cuda();
    if (!REAL(cuDeviceGetAttribute))
        return -1;
    vgpu_in_hook++;
    CUresult rc = REAL(cuDeviceGetAttribute)(out, which, ord);
    vgpu_in_hook--;
    return rc == CUDA_SUCCESS ? 0 : -1;
}

/* Managed memory can live in host memory while the device uses it only where
 * the device has concurrent managed access (Linux, Pascal and later); without
 * it the driver keeps managed memory on the device. */
static int managed_ok(CUdevice ord)
{
    if (!REAL(cuMemAllocManaged) || (!REAL(cuMemAdvise_v2) && !REAL(cuMemAdvise)))
        return 0;
    int c = ord >= 0 && ord < MAX_ORD ? __atomic_load_n(&g_cma[ord], __ATOMIC_RELAXED) : 0;
    if (!c) {
        int v = 0;
        c = attr(CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, ord, &v) == 0 && v ? 2 : 1;
        if (ord >= 0 && ord < MAX_ORD)
            __atomic_store_n(&g_cma[ord], c, __ATOMIC_RELAXED);
    }
    return c == 2;
}

int vgpu_os_can_host(int idx, CUdevice ord) { return vgpu_limits()->dev[idx].oversubscribe && managed_ok(ord); }


/* one line for a refusal: at the physical share (error level the first time per path), or over
 * the slice (info) */
static void refused(int r, int idx, CUdevice ord, uint64_t n, int host_ok, const char *what)
{
    const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
    if (r == VGPU_OVER_SHARE) {
        const char *why = !host_ok                  ? "this kind of memory cannot live in host memory"
                          : !L->oversubscribe        ? "oversubscription is off"
                          : !managed_ok(ord)         ? "the device has no concurrent managed access"
                                                     : "the slice is full";
        int lvl = first_refusal(what) ? VGPU_LOG_ERROR : VGPU_LOG_INFO;
        VLOG(lvl, "%s: refusing %llu bytes on %s: device-resident memory would exceed the container's physical share "
                  "of %llu bytes (%s)",
             what, (unsigned long long)n, L->uuid, (unsigned long long)L->device_limit, why);
    } else {
        VLOG(VGPU_LOG_INFO, "%s: refusing %llu bytes on %s: over the container's slice of %llu bytes", what,
             (unsigned long long)n, L->uuid, (unsigned long long)L->memory_limit);
    }
}

static int charge_host(int idx, uint64_t n)
{
    const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
    return vgpu_rgn_charge((unsigned)idx, n, L->memory_limit, L->device_limit, vgpu_ctx_reserve(), VGPU_KIND_HOST);
}

int vgpu_os_charge(int idx, CUdevice ord, uint64_t n, int host_ok, const char *what, int *kind)
{
    const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
    int r = VGPU_OVER_SLICE;
    for (int pass = 0; pass < 2; pass++) {
        r = vgpu_charge(idx, n, VGPU_KIND_DEVICE); /* pool and graph caches refreshed before a "no" */
        if (r == 0) {
            *kind = VGPU_KIND_DEVICE;
            return 0;
        }
        if (r == VGPU_OVER_SHARE && host_ok && vgpu_os_can_host(idx, ord)) {
            r = charge_host(idx, n);
            if (r == 0) {
                *kind = VGPU_KIND_HOST;
                VLOG(VGPU_LOG_DEBUG, "%s: %llu bytes in host memory (over the physical share of %llu on %s)", what,
                     (unsigned long long)n, (unsigned long long)L->device_limit, L->uuid);
                return 0;
            }
        }
        /* memory freed in stream order may be waiting for its stream: settle those first */
        if (pass == 0 && vgpu_os_reap(1) > 0)
            continue;
        break;
    }
    refused(r, idx, ord, n, host_ok, what);
    return -1;
}

CUresult vgpu_os_async_host(int why, int idx, CUdevice ord, CUdeviceptr *dptr, size_t n, const char *what)
{
    if (why == VGPU_OVER_SLICE || !vgpu_os_can_host(idx, ord)) {
        refused(why ? why : VGPU_OVER_SHARE, idx, ord, n, 1, what);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int r = charge_host(idx, n);
    if (r != 0 && vgpu_os_reap(1) > 0)
        r = charge_host(idx, n);
    if (r != 0) {
        refused(r, idx, ord, n, 1, what);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = vgpu_os_managed(dptr, n, CU_MEM_ATTACH_GLOBAL, ord);
    if (rc != CUDA_SUCCESS) {
        vgpu_rgn_uncharge((unsigned)idx, n, VGPU_KIND_HOST);
        return rc;
    }
    if (vgpu_remember(&vgpu_t_ptr, *dptr, n, idx, VGPU_KIND_HOST, 0) != 0) {
        vgpu_in_hook++;
        REAL(cuMemFree_v2)(*dptr);
        vgpu_in_hook--;
        vgpu_rgn_uncharge((unsigned)idx, n, VGPU_KIND_HOST);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    VLOG(VGPU_LOG_DEBUG, "%s: %llu bytes in host memory", what, (unsigned long long)n);
    return CUDA_SUCCESS;
}

static CUresult advise(CUdeviceptr p, size_t n, int advice, int loc_type, int id)
{
    if (REAL(cuMemAdvise_v2)) {
        CUmemLocation l = {.type = loc_type, .id = id};
        return REAL(cuMemAdvise_v2)(p, n, advice, l);
    }
    if (REAL(cuMemAdvise))
        return REAL(cuMemAdvise)(p, n, advice, loc_type == CU_MEM_LOCATION_TYPE_DEVICE ? id : CU_DEVICE_CPU);
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult vgpu_os_managed(CUdeviceptr *p, size_t n, unsigned flags, CUdevice ord)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    vgpu_in_hook++;
    CUresult rc = REAL(cuMemAllocManaged)(p, n, flags);
    if (rc == CUDA_SUCCESS) {
        CUresult a = advise(*p, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_MEM_LOCATION_TYPE_HOST, 0);
        if (a != CUDA_SUCCESS) {
            /* without the advice the driver may migrate it into VRAM others were promised */
            VLOG(VGPU_LOG_ERROR, "host fallback refused: cuMemAdvise(preferred location host) failed (%d)", a);
            REAL(cuMemFree_v2)(*p);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if ((a = advise(*p, n, CU_MEM_ADVISE_SET_ACCESSED_BY, CU_MEM_LOCATION_TYPE_DEVICE, ord)) !=
                   CUDA_SUCCESS) {
            /* only a performance hint: the device still reaches the pages, faulting on first touch */
            VLOG(VGPU_LOG_DEBUG, "cuMemAdvise(accessed by device %d) failed (%d)", ord, a);
        }
    }
    vgpu_in_hook--;
    return rc;
}

CUresult vgpu_os_pitch(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned elem, CUdevice ord,
                       uint64_t *bytes)
{
    /* the driver's own checks (cuMemAllocPitch: ElementSizeBytes 4, 8 or 16) */
    if (!p || !pitch || (elem != 4 && elem != 8 && elem != 16) || w == 0 || h == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t align = 512;
    int v = 0;
    if (attr(CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, ord, &v) == 0 && v > 0 && (uint64_t)v > align)
        align = (uint64_t)v;
    if (attr(CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, ord, &v) == 0 && v > 0 && (uint64_t)v > align)
        align = (uint64_t)v;
    if (align & (align - 1))
        return CUDA_ERROR_INVALID_VALUE;
    if (w > UINT64_MAX - (align - 1))
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t pt = ((uint64_t)w + align - 1) & ~(align - 1), total;
    if (__builtin_mul_overflow(pt, (uint64_t)h, &total) || total > SIZE_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = vgpu_os_managed(p, (size_t)total, CU_MEM_ATTACH_GLOBAL, ord);
    if (rc == CUDA_SUCCESS) {
        *pitch = (size_t)pt;
        *bytes = total;
    }
    return rc;
}

int vgpu_os_capturing(CUstream s, int per_thread)
{
    CUresult (*fn)(CUstream, int *) = per_thread ? REAL(cuStreamIsCapturing_ptsz) : REAL(cuStreamIsCapturing);
    if (!fn)
        return 0;
    int st = CU_STREAM_CAPTURE_STATUS_NONE;
    vgpu_in_hook++;
    CUresult rc = fn(s, &st);
    vgpu_in_hook--;
    return rc == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* free host-backed memory and return its charge; the driver's answer (an
 * unknown pointer, a double free by the program, counts as freed) */
static CUresult free_now(const struct vgpu_rec *r)
{
    vgpu_in_hook++;
    CUresult rc = REAL(cuMemFree_v2)(r->key);
    vgpu_in_hook--;
    if (rc == CUDA_ERROR_INVALID_VALUE)
        rc = CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS)
        vgpu_rgn_uncharge(r->dev, r->size, VGPU_KIND_HOST);
    return rc;
}

CUresult vgpu_os_free_async(const struct vgpu_rec *r, CUstream s, int per_thread)
{
    if (vgpu_os_capturing(s, per_thread)) {
        /* a free node in a graph cannot free memory that is not the graph's pool's */
        VLOG(VGPU_LOG_ERROR, "cuMemFreeAsync of host-backed memory during stream capture is not supported");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    CUresult (*rec)(CUevent, CUstream) = per_thread ? REAL(cuEventRecord_ptsz) : REAL(cuEventRecord);
    CUevent ev = NULL;
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    vgpu_in_hook++;
    if (REAL(cuEventCreate) && rec && REAL(cuEventQuery) && REAL(cuEventDestroy_v2) &&
        (rc = REAL(cuEventCreate)(&ev, CU_EVENT_DISABLE_TIMING)) == CUDA_SUCCESS) {
        rc = rec(ev, s);
        if (rc != CUDA_SUCCESS) {
            REAL(cuEventDestroy_v2)(ev);
            ev = NULL;
        }
    }
    if (!ev) {
        /* no event: wait for the stream instead (same order, blocking) */
        CUresult (*sync)(CUstream) = per_thread ? REAL(cuStreamSynchronize_ptsz) : REAL(cuStreamSynchronize);
        rc = sync ? sync(s) : rc;
        vgpu_in_hook--;
        return rc == CUDA_SUCCESS ? free_now(r) : rc;
    }
    vgpu_in_hook--;
    struct vgpu_rec d = *r;
    d.aux = (uint64_t)(uintptr_t)ev;
    if (vgpu_track_put(&vgpu_t_defer, &d) != 0) {
        /* cannot remember it: wait for the event here */
        vgpu_in_hook++;
        if (REAL(cuEventSynchronize))
            REAL(cuEventSynchronize)(ev);
        REAL(cuEventDestroy_v2)(ev);
        vgpu_in_hook--;
        return free_now(r);
    }
    __atomic_add_fetch(&g_ndefer, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

int vgpu_os_reap(int wait)
{
    if (LIKELY(__atomic_load_n(&g_ndefer, __ATOMIC_RELAXED) == 0))
        return 0;
    int freed = 0;
    struct vgpu_rec buf[64];
    size_t n = vgpu_track_snapshot(&vgpu_t_defer, buf, 64);
    for (size_t i = 0; i < n; i++) {
        CUevent ev = (CUevent)(uintptr_t)buf[i].aux;
        vgpu_in_hook++;
        CUresult rc = wait && REAL(cuEventSynchronize) ? REAL(cuEventSynchronize)(ev) : REAL(cuEventQuery)(ev);
        vgpu_in_hook--;
        if (rc == CUDA_ERROR_NOT_READY)
            continue;
        /* done (or the event is gone with its context: nothing will run on the memory) */
        struct vgpu_rec r;
        if (!vgpu_track_take(&vgpu_t_defer, buf[i].key, &r))
            continue; /* another thread reaped it */
        if (free_now(&r) != CUDA_SUCCESS) {
            /* e.g. no current context on this thread: a later reap frees it */
            vgpu_track_put(&vgpu_t_defer, &r);
            continue;
        }
        __atomic_sub_fetch(&g_ndefer, 1, __ATOMIC_RELAXED);
        vgpu_in_hook++;
        REAL(cuEventDestroy_v2)(ev);
        vgpu_in_hook--;
        freed++;
    }
    return freed;
}

CUresult vgpu_os_create_host(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                             unsigned long long flags, CUdevice ord)
{
    int sup = 0, numa = -1;
    if (attr(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, ord, &sup) != 0 || !sup)
        return CUDA_ERROR_NOT_SUPPORTED;
    /* "On systems where NUMA is not available, CUmemLocation::id must be set to 0" (cuMemCreate) */
    if (attr(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, ord, &numa) != 0 || numa < 0)
        numa = 0;
    CUmemAllocationProp p = *prop;
    p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    p.location.id = numa;
    p.allocFlags.compressionType = 0; /* host memory is never compressible */
    vgpu_in_hook++;
    CUresult rc = REAL(cuMemCreate)(h, n, &p, flags);
    vgpu_in_hook--;
    return rc;
}

int vgpu_os_overlaps_host(CUdeviceptr p, size_t n)
{
    uint64_t hi = p + n < p ? UINT64_MAX : p + (n ? n : 1);
    return vgpu_track_overlaps(&vgpu_t_ptr, p, hi, VGPU_KIND_HOST) ||
           vgpu_track_overlaps(&vgpu_t_defer, p, hi, VGPU_KIND_HOST);
}

void vgpu_os_atfork_child(void)
{
    g_ndefer = 0; /* the child's vgpu_t_defer was reset: the memory is the parent's */
    pthread_mutex_init(&g_log_mu, NULL);
}
