/*
 * hooks_share.c — device memory shared between processes of the container: legacy IPC
 * (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle: torch.multiprocessing, vLLM)
 * and shareable handles (cuMemExportToShareableHandle / cuMemImportFromShareableHandle with
 * POSIX file descriptors: NCCL >= 2.19 between the ranks of a node).
 *
 * An exported allocation is one piece of device memory however many processes map it, and it
 * lives until the last of them lets go (CUDA Driver API, "Memory Management" cuIpcCloseMemHandle,
 * "Virtual Memory Management" cuMemRelease: "the memory ... is freed when all outstanding
 * mappings ... and handles are released").  It counts once, to the allocation: on export its
 * charge moves from the exporting process's slot to an entry of the region's shared ledger
 * (region.c), which the importers join; the entry is freed with its last holder, whichever
 * process that is (a dead one included).  An importer finds the entry by what it received: the
 * IPC handle's bytes (hashed), or — for a descriptor — the exporter's descriptor of the same
 * open file (kcmp(KCMP_FILE); the exporter keeps one for that until it lets go).  An import
 * that matches no entry (the exporter is outside this container, or kcmp is refused) is charged
 * to the importer as a new entry, over the limit refused: counted once more rather than never.
 * Pools exported with cuMemPoolExportToShareableHandle stay charged to their pool in the
 * exporting process (hooks_pool.c); imported pool pointers are not charged again.
 */
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "sysio.h"
#include "vgpu.h"

/* ---------------------------------------------------------- local holds */

static int hold_inc(struct vgpu_rec *r, void *arg, int *rm)
{
    (void)arg;
    (void)rm;
    r->aux++;
    return 0;
}

uint64_t vgpu_share_hold(uint64_t ref)
{
    if (vgpu_track_update(&vgpu_t_shr, ref, hold_inc, NULL) != 0) {
        struct vgpu_rec r = {.key = ref, .aux = 1};
        vgpu_track_put(&vgpu_t_shr, &r);
    }
    return ref;
}

static int hold_dec(struct vgpu_rec *r, void *arg, int *rm)
{
    (void)arg;
    if (r->aux)
        r->aux--;
    *rm = r->aux == 0;
    return *rm;
}

void vgpu_share_release(uint64_t ref)
{
    /* the process's last hold of the entry lets go of it (the last holder frees it) */
    if (vgpu_track_update(&vgpu_t_shr, ref, hold_dec, NULL) == 1)
        vgpu_rgn_share_drop(ref);
}

static uint64_t hash64(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h ? h : 1;
}

/* ----------------------------------------------------------- legacy IPC */

static int set_ext(struct vgpu_rec *r, void *arg, int *rm)
{
    (void)rm;
    r->ext = *(uint64_t *)arg;
    return 0;
}

/* exports of this process, one at a time: an object's charge moves into the ledger once */
static pthread_mutex_t g_share_mu = PTHREAD_MUTEX_INITIALIZER;

/* The charge of tracked object key (t: vgpu_t_ptr or vgpu_t_vmm) moves into the ledger; its
 * reference, or 0 (untracked, not device memory, the ledger full). */
static uint64_t share_object(struct vgpu_track *t, uint64_t key)
{
    struct vgpu_rec r;
    uint64_t ref = 0;
    pthread_mutex_lock(&g_share_mu);
    if (!vgpu_track_get(t, key, &r)) {
        ref = 0;
    } else if (r.ext) {
        ref = r.ext; /* exported before */
    } else if (t == &vgpu_t_ptr && r.kind != VGPU_KIND_DEVICE) {
        ref = 0; /* host-backed or a pool's: not cuMemAlloc memory */
    } else if ((r.kind & 0xffu) == VGPU_KIND_HOST) {
        ref = 0; /* a host-NUMA handle of the oversubscription fallback: host memory, it stays the
                  * exporter's (importers see a host location and do not count it) */
    } else if ((ref = vgpu_rgn_share(r.dev, r.size)) != 0) {
        if (vgpu_track_update(t, key, set_ext, &ref) == 0) {
            vgpu_share_hold(ref);
        } else { /* freed meanwhile (a race the program made): nothing is left to share */
            vgpu_rgn_share_drop(ref);
            ref = 0;
        }
    }
    pthread_mutex_unlock(&g_share_mu);
    return ref;
}

VGPU_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
    NEED(cuIpcGetMemHandle);
    CUresult rc = REAL(cuIpcGetMemHandle)(h, p);
    if (rc == CUDA_SUCCESS && h && vgpu_hook_active()) {
        uint64_t ref = share_object(&vgpu_t_ptr, p);
        if (ref)
            vgpu_rgn_share_add_key(ref, hash64(h, sizeof *h));
    }
    return rc;
}

static int open_inc(struct vgpu_rec *r, void *arg, int *rm)
{
    (void)arg;
    (void)rm;
    r->aux++;
    return 0;
}

static CUresult ipc_open(CUresult (*fn)(CUdeviceptr *, CUipcMemHandle, unsigned), CUdeviceptr *pp, CUipcMemHandle h,
                         unsigned flags)
{
    CUresult rc = fn(pp, h, flags);
    if (rc != CUDA_SUCCESS || !pp || !vgpu_hook_active())
        return rc;
    /* opened before in this process: the driver hands out the same pointer, counted */
    if (vgpu_track_update(&vgpu_t_ipc, *pp, open_inc, NULL) == 0)
        return rc;
    uint64_t ref = vgpu_rgn_share_find_key(hash64(&h, sizeof h));
    int idx = -1;
    if (!ref) {
        /* exported by no process of this container: this process brings it in, counted */
        CUresult brc = CUDA_SUCCESS;
        CUdeviceptr base = 0;
        size_t size = 0;
        if (vgpu_begin(-1, &idx, &brc) <= 0 || !REAL(cuMemGetAddressRange_v2) ||
            REAL(cuMemGetAddressRange_v2)(&base, &size, *pp) != CUDA_SUCCESS)
            return rc; /* untracked */
        const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
        if (vgpu_rgn_share_charge((unsigned)idx, size, L->memory_limit, L->device_limit, &ref) != 0) {
            if (REAL(cuIpcCloseMemHandle))
                REAL(cuIpcCloseMemHandle)(*pp);
            VLOG(VGPU_LOG_INFO, "refusing an IPC import of %zu bytes on %s: over the container limit", size, L->uuid);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    vgpu_share_hold(ref);
    struct vgpu_rec r = {.key = *pp, .aux = 1, .ext = ref, .dev = idx < 0 ? 0 : (uint32_t)idx};
    if (vgpu_track_put(&vgpu_t_ipc, &r) != 0)
        VLOG(VGPU_LOG_WARN, "IPC tracking failed: the mapping stays counted");
    return rc;
}

VGPU_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pp, CUipcMemHandle h, unsigned flags)
{
    NEED(cuIpcOpenMemHandle);
    return ipc_open(REAL(cuIpcOpenMemHandle), pp, h, flags);
}

VGPU_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pp, CUipcMemHandle h, unsigned flags)
{
    NEED(cuIpcOpenMemHandle_v2);
    return ipc_open(REAL(cuIpcOpenMemHandle_v2), pp, h, flags);
}

static int open_dec(struct vgpu_rec *r, void *arg, int *rm)
{
    uint64_t *ref = arg;
    if (r->aux)
        r->aux--;
    *rm = r->aux == 0;
    *ref = r->ext;
    return *rm;
}

VGPU_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
    NEED(cuIpcCloseMemHandle);
    CUresult rc = REAL(cuIpcCloseMemHandle)(p);
    uint64_t ref = 0;
    if (rc == CUDA_SUCCESS && vgpu_hook_active() && vgpu_track_update(&vgpu_t_ipc, p, open_dec, &ref) == 1 && ref)
        vgpu_share_release(ref);
    return rc;
}

/* ---------------------------------------------------- shareable handles */

VGPU_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                                  unsigned long long flags)
{
    NEED(cuMemExportToShareableHandle);
    CUresult rc = REAL(cuMemExportToShareableHandle)(out, h, type, flags);
    if (rc != CUDA_SUCCESS || !out || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !vgpu_hook_active())
        return rc;
    uint64_t ref = share_object(&vgpu_t_vmm, h);
    if (!ref)
        return rc;
    /* kept (close-on-exec) so that importers can tell this file from others (kcmp); closed
     * when this process lets go of the allocation */
    int mine = fcntl(*(int *)out, F_DUPFD_CLOEXEC, 3);
    if (mine >= 0 && vgpu_rgn_share_add_fd(ref, mine) != 0)
        close(mine);
    return rc;
}

/* CUmemAllocationProp as the driver writes it (32 bytes with allocFlags) */
struct alloc_prop_full {
    CUmemAllocationProp p;
    unsigned char alloc_flags[8];
};

VGPU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type)
{
    NEED(cuMemImportFromShareableHandle);
    CUresult rc = REAL(cuMemImportFromShareableHandle)(h, os_handle, type);
    if (rc != CUDA_SUCCESS || !h || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !vgpu_hook_active())
        return rc;
    int fd = (int)(intptr_t)os_handle;
    struct alloc_prop_full prop;
    CUdevice ord = -1;
    if (REAL(cuMemGetAllocationPropertiesFromHandle) &&
        REAL(cuMemGetAllocationPropertiesFromHandle)(&prop, *h) == CUDA_SUCCESS) {
        if (prop.p.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return rc; /* host memory */
        ord = prop.p.location.id;
    }
    CUresult brc = CUDA_SUCCESS;
    int idx;
    if (vgpu_begin(ord, &idx, &brc) <= 0)
        return rc; /* not a device of this container: nothing of its slice */
    uint64_t ref = vgpu_rgn_share_find_fd(fd);
    struct vgpu_rec r = {.key = *h, .dev = (uint32_t)idx};
    if (!ref) {
        /* not exported by a process of this container that can be identified: counted here */
        struct stat sb;
        uint64_t size = vgpu_fstat(fd, &sb) == 0 && sb.st_size > 0 ? (uint64_t)sb.st_size : 0;
        const struct vgpu_limit *L = &vgpu_limits()->dev[idx];
        if (size && vgpu_rgn_share_charge((unsigned)idx, size, L->memory_limit, L->device_limit, &ref) != 0) {
            REAL(cuMemRelease)(*h);
            VLOG(VGPU_LOG_INFO, "refusing an import of %llu bytes on %s: over the container limit",
                 (unsigned long long)size, L->uuid);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (!size)
            r.kind = VGPU_KIND_MAPCHARGE; /* size unknown: each mapping is charged */
    }
    if (ref)
        r.ext = vgpu_share_hold(ref);
    if (vgpu_track_put(&vgpu_t_vmm, &r) != 0 && ref)
        VLOG(VGPU_LOG_WARN, "import tracking failed: it stays counted");
    return rc;
}

void vgpu_share_atfork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_share_mu = fresh;
}
