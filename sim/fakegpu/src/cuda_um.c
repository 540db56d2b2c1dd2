/* fakegpu libcuda: unified (managed) memory — where its pages live, the advice and prefetches
 * that move them — and what a kernel pays to read memory.
 *
 * The model, for a GPU with concurrent managed access on Linux (CUDA Programming Guide, "Unified
 * Memory": pages are populated on first touch and migrate to the processor that faults on them;
 * CUDA driver API cuMemAdvise and cuMemPrefetchAsync):
 *  - cuMemAllocManaged puts nothing on the device (cuda_mem.c); the bytes count as host memory;
 *  - a device touch (the built-in kernel "touch", cuda_module.c) migrates the allocation's host
 *    part onto its device as far as free device memory allows — unless the preferred location is
 *    the host: cuMemAdvise documents that "if the data is already in its preferred location and
 *    the faulting processor can establish a mapping without requiring the data to be migrated,
 *    then data migration will be avoided", so the device reads it where it is, over the link;
 *  - CU_MEM_ADVISE_SET_READ_MOSTLY: a device touch makes a read-only copy on the device (device
 *    memory in addition to the host copy), whatever the preferred location;
 *  - cuMemPrefetchAsync to a device migrates there (a prefetch overrides the preference); to the
 *    CPU it brings the device part back;
 *  - a kernel reads device-resident bytes at the device's memory_bandwidth and host-resident ones
 *    (pinned host memory, host-resident managed memory, host-located VMM handles) at its
 *    host_link_bandwidth.
 * Simplified: advice and prefetches apply to every whole allocation the range overlaps; migration
 * never evicts another process's managed memory (the real driver may); a migration or prefetch
 * takes no device time; a touch from a device other than the allocation's reads remotely.
 */
#include "fg_cuda.h"

#include <string.h>

#define CU_DEVICE_CPU (-1)
#define LOC_TYPE_DEVICE 1
#define LOC_TYPE_HOST 2
#define LOC_TYPE_HOST_NUMA 3
#define LOC_TYPE_HOST_NUMA_CURRENT 4

typedef struct {
    int type;
    int id;
} fg_location; /* CUmemLocation */

/* Moves up to `want` bytes of this process's managed memory on dev from host to device (dup: a
 * read-only copy, the host bytes stay), as far as the device has free memory; returns how many. */
static uint64_t move_in(int dev, uint64_t want, int dup)
{
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_reap();
    struct fg_pdev *p = &st->slots[fg_g.slot].dev[dev];
    uint64_t used = fg_dev_used(st, dev) + st->cfg[dev].reserved, mem = st->cfg[dev].memory;
    uint64_t fr = used < mem ? mem - used : 0, take = want < fr ? want : fr;
    p->mem_managed_dev += take;
    if (!dup)
        p->mem_managed_host -= take <= p->mem_managed_host ? take : p->mem_managed_host;
    if (take) {
        st->ds[dev].used_total += take; /* the device's running total (fg_state.h) */
        fg_note_high(st, dev);
    }
    fg_unlock();
    return take;
}

/* n bytes of device-resident managed memory leave the device (the caller holds the lock) */
static uint64_t leave_locked(int dev, uint64_t n)
{
    struct fg_state *st = fg_g.st;
    struct fg_pdev *p = &st->slots[fg_g.slot].dev[dev];
    n = n <= p->mem_managed_dev ? n : p->mem_managed_dev;
    p->mem_managed_dev -= n;
    uint64_t *t = &st->ds[dev].used_total;
    *t = *t >= n ? *t - n : 0;
    return n;
}

static void move_out(int dev, uint64_t n)
{
    fg_lock();
    fg_g.st->slots[fg_g.slot].dev[dev].mem_managed_host += leave_locked(dev, n);
    fg_unlock();
}

/* read-only device copies of read-mostly memory go away (the host copy stays) */
static void drop_copies(int dev, uint64_t n)
{
    fg_lock();
    leave_locked(dev, n);
    fg_unlock();
}

/* a device touch or prefetch of a managed allocation on its own device */
static void populate(struct fg_alloc *a, int force)
{
    if (a->um.read_mostly && !force) {
        uint64_t want = a->charged < a->size ? a->size - a->charged : 0;
        a->charged += move_in(a->dev, want, 1);
        return;
    }
    if (a->um.pref == FG_LOC_HOST && !force)
        return; /* mapped where it is */
    uint64_t take = move_in(a->dev, a->host, 0);
    a->charged += take;
    a->host -= take;
}

struct touch {
    int dev;
    uint64_t lo, hi, dev_bytes, host_bytes;
};

static void touch_one(struct fg_alloc *a, void *arg)
{
    struct touch *t = arg;
    uint64_t lo = t->lo > a->ptr ? t->lo : a->ptr, end = a->ptr + a->size, hi = t->hi < end ? t->hi : end;
    uint64_t len = hi > lo ? hi - lo : 0, on_dev = len;
    switch (a->kind) {
    case FG_ALLOC_HOST:
        on_dev = 0;
        break;
    case FG_ALLOC_VA:
        on_dev = fg_vmm_host(lo) ? 0 : len;
        break;
    case FG_ALLOC_MANAGED:
        if (a->dev == t->dev)
            populate(a, 0);
        if (a->dev != t->dev || a->charged == 0) {
            on_dev = 0;
        } else if (a->charged < a->size) {
            /* the resident part is spread evenly over the allocation */
            on_dev = (uint64_t)((double)len * (double)a->charged / (double)a->size);
        }
        break;
    default: /* device memory of this process */
        break;
    }
    t->dev_bytes += on_dev;
    t->host_bytes += len - on_dev;
}

CUresult fg_um_touch_ns(int dev, uint64_t ptr, uint64_t bytes, uint64_t *ns)
{
    struct touch t = {.dev = dev, .lo = ptr, .hi = ptr + bytes < ptr ? UINT64_MAX : ptr + bytes};
    *ns = 0;
    if (bytes == 0)
        return CUDA_SUCCESS;
    if (fg_alloc_each(ptr, bytes, touch_one, &t) == 0 || t.dev_bytes + t.host_bytes < bytes)
        return CUDA_ERROR_INVALID_VALUE; /* the real device faults on an address outside memory */
    const struct fg_devcfg *c = &fg_g.st->cfg[dev];
    double s = (double)t.dev_bytes / (double)c->memory_bandwidth + (double)t.host_bytes / (double)c->host_link_bandwidth;
    *ns = (uint64_t)(s * 1e9);
    return CUDA_SUCCESS;
}

/* --- advice ------------------------------------------------------------------------------- */

struct advice {
    int advice, loc, dev; /* loc FG_LOC_*, dev a state index with FG_LOC_DEVICE */
    int bad;
};

static void check_managed(struct fg_alloc *a, void *arg)
{
    if (a->kind != FG_ALLOC_MANAGED)
        ((struct advice *)arg)->bad = 1;
}

static void advise_one(struct fg_alloc *a, void *arg)
{
    struct advice *v = arg;
    struct fg_um_advice *u = &a->um;
    switch (v->advice) {
    case 1: /* SET_READ_MOSTLY */
        u->read_mostly = 1;
        break;
    case 2: /* UNSET_READ_MOSTLY: duplicates are dropped, the device keeps what is not one */
        if (u->read_mostly && a->charged + a->host > a->size) {
            uint64_t dup = a->charged + a->host - a->size;
            dup = dup < a->charged ? dup : a->charged;
            drop_copies(a->dev, dup);
            a->charged -= dup;
        }
        u->read_mostly = 0;
        break;
    case 3: /* SET_PREFERRED_LOCATION: guides later faults, migrates nothing now */
        u->pref = v->loc;
        u->pref_dev = v->dev;
        break;
    case 4: /* UNSET_PREFERRED_LOCATION */
        u->pref = FG_LOC_NONE;
        break;
    case 5: /* SET_ACCESSED_BY: a mapping, no migration */
        if (v->loc == FG_LOC_DEVICE)
            u->accessed_by |= 1u << v->dev;
        break;
    case 6:
        if (v->loc == FG_LOC_DEVICE)
            u->accessed_by &= ~(1u << v->dev);
        break;
    }
}

static CUresult advise(CUdeviceptr p, size_t n, int advice, int loc, int dev)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (n == 0 || advice < 1 || advice > 6)
        return CUDA_ERROR_INVALID_VALUE;
    struct advice v = {.advice = advice, .loc = loc, .dev = dev};
    /* "the memory range must refer to managed memory" */
    if (fg_alloc_each(p, n, check_managed, &v) == 0 || v.bad)
        return CUDA_ERROR_INVALID_VALUE;
    fg_alloc_each(p, n, advise_one, &v);
    return CUDA_SUCCESS;
}

/* CUDA_ERROR_INVALID_DEVICE for an ordinal that is not a device */
static CUresult location(int type, int id, int *loc, int *dev)
{
    if (type == LOC_TYPE_DEVICE) {
        int d = fg_phys(id);
        if (d < 0)
            return CUDA_ERROR_INVALID_DEVICE;
        *loc = FG_LOC_DEVICE;
        *dev = d;
        return CUDA_SUCCESS;
    }
    if (type == LOC_TYPE_HOST || type == LOC_TYPE_HOST_NUMA || type == LOC_TYPE_HOST_NUMA_CURRENT) {
        *loc = FG_LOC_HOST;
        *dev = -1;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice device)
{
    int loc, dev;
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    rc = location(device == CU_DEVICE_CPU ? LOC_TYPE_HOST : LOC_TYPE_DEVICE, device, &loc, &dev);
    return rc ? rc : advise(p, n, advice, loc, dev);
}

FG_API CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, fg_location l)
{
    int loc, dev;
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    rc = location(l.type, l.id, &loc, &dev);
    return rc ? rc : advise(p, n, advice, loc, dev);
}

/* --- prefetch ----------------------------------------------------------------------------- */

struct prefetch {
    int loc, dev, bad;
};

static void prefetch_one(struct fg_alloc *a, void *arg)
{
    struct prefetch *f = arg;
    if (a->kind != FG_ALLOC_MANAGED) {
        f->bad = 1;
        return;
    }
    if (f->loc == FG_LOC_DEVICE) {
        if (a->dev == f->dev)
            populate(a, 1);
    } else if (a->charged) {
        uint64_t back = a->charged + a->host > a->size ? a->size - a->host : a->charged;
        move_out(a->dev, back);
        a->charged -= back;
        a->host += back;
    }
}

static CUresult prefetch(CUdeviceptr p, size_t n, int type, int id, unsigned flags, CUstream s, int per_thread)
{
    int sdev = 0, sidx = 0, loc, dev;
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (n == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fg_stream_resolve(s, per_thread, &sdev, &sidx)) || (rc = location(type, id, &loc, &dev)))
        return rc;
    struct prefetch f = {.loc = loc, .dev = dev};
    if (fg_alloc_each(p, n, prefetch_one, &f) == 0 || f.bad)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dst, CUstream s)
{
    return prefetch(p, n, dst == CU_DEVICE_CPU ? LOC_TYPE_HOST : LOC_TYPE_DEVICE, dst, 0, s, 0);
}

FG_API CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice dst, CUstream s)
{
    return prefetch(p, n, dst == CU_DEVICE_CPU ? LOC_TYPE_HOST : LOC_TYPE_DEVICE, dst, 0, s, 1);
}

FG_API CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, fg_location l, unsigned flags, CUstream s)
{
    return prefetch(p, n, l.type, l.id, flags, s, 0);
}

FG_API CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, fg_location l, unsigned flags, CUstream s)
{
    return prefetch(p, n, l.type, l.id, flags, s, 1);
}
