/* fakegpu libcuda: initialisation, device enumeration and attributes, memory charging. */
#include "fg_cuda.h"
#include "fg_mig.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct fg_drv fg_drv = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* CUDA ordinal -> index in the state, built at cuInit from CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER */
static int g_map[FG_MAX_DEV];
static int g_count;
static int g_atfork_done;

static void cuda_atfork_child(void)
{
    /* CUDA is not usable in a child forked after cuInit: it must call cuInit again, and then
     * registers as a process of its own. */
    fg_atfork_child();
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memset(&fg_drv, 0, sizeof(fg_drv));
    fg_drv.mu = fresh;
}

static int busid_cmp(const void *a, const void *b)
{
    const struct fg_state *st = fg_g.st;
    return strcmp(st->cfg[*(const int *)a].pci_bus_id, st->cfg[*(const int *)b].pci_bus_id);
}

/* The CUDA devices of this process, in ordinal order before CUDA_VISIBLE_DEVICES: each visible GPU,
 * or for a GPU in MIG mode one MIG device of each of its GPU instances (MIG user guide, "CUDA
 * Device Enumeration": "If CUDA_VISIBLE_DEVICES is not set, CUDA will pick one from each GPU
 * instance"), the one with the lowest CI id among those the process may use. */
static int enumerate(const struct fg_state *st, const int *gpus, int n, int out[FG_MAX_DEV])
{
    int k = 0;
    for (int i = 0; i < n && k < FG_MAX_DEV; i++) {
        if (!fg_mig_enabled(st, gpus[i])) {
            out[k++] = gpus[i];
            continue;
        }
        int units[FG_MAX_DEV], nu = fg_mig_units(st, gpus[i], units);
        for (int j = 0; j < nu && k < FG_MAX_DEV; j++) {
            int dup = 0;
            for (int m = 0; m < k; m++)
                dup |= fg_unit_is_mig(st, out[m]) && st->unit[out[m]].parent == st->unit[units[j]].parent &&
                       st->unit[out[m]].gi == st->unit[units[j]].gi;
            if (!dup && fg_mig_visible(st, units[j]))
                out[k++] = units[j];
        }
    }
    return k;
}

/* A MIG UUID (or a prefix of one) of a MIG device this process may use: "You can specify compute
 * instance UUIDs (at most one per GPU instance)". */
static int mig_by_uuid(const struct fg_state *st, const int *gpus, int n, const char *tok)
{
    for (int i = 0; i < n; i++) {
        int units[FG_MAX_DEV], nu = fg_mig_enabled(st, gpus[i]) ? fg_mig_units(st, gpus[i], units) : 0;
        for (int j = 0; j < nu; j++)
            if (!strncmp(st->cfg[units[j]].uuid, tok, strlen(tok)) && fg_mig_visible(st, units[j]))
                return units[j];
    }
    return -1;
}

static void build_map(void)
{
    struct fg_state *st = fg_g.st;
    int gpus[FG_MAX_DEV], all[FG_MAX_DEV];
    int ngpu = fg_visible_map(st, gpus);
    const char *order = getenv("CUDA_DEVICE_ORDER");
    if (order && !strcmp(order, "PCI_BUS_ID"))
        qsort(gpus, (size_t)ngpu, sizeof(int), busid_cmp);
    int n = enumerate(st, gpus, ngpu, all);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    g_count = 0;
    if (!vis) {
        for (int i = 0; i < n; i++)
            g_map[g_count++] = all[i];
        return;
    }
    /* Like the real driver: entries are ordinals, GPU UUID prefixes or MIG UUIDs; the list ends
     * at the first entry that is invalid or repeated; a second MIG device of one GPU instance is
     * left out ("CUDA will pick one from the list"). */
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", vis);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*tok))
            tok++;
        int found = -1, same_gi = 0;
        char *end;
        long v = strtol(tok, &end, 10);
        if (end != tok && *end == '\0') {
            if (v >= 0 && v < n)
                found = all[v];
        } else if (!strncmp(tok, "GPU-", 4) && strlen(tok) > 4) {
            for (int i = 0; i < n; i++)
                if (!fg_unit_is_mig(st, all[i]) && !strncmp(st->cfg[all[i]].uuid, tok, strlen(tok))) {
                    found = all[i];
                    break;
                }
        } else if (!strncmp(tok, "MIG-", 4) && strlen(tok) > 4) {
            found = mig_by_uuid(st, gpus, ngpu, tok);
        }
        for (int j = 0; j < g_count && found >= 0; j++) {
            if (g_map[j] == found)
                found = -1;
            else if (fg_unit_is_mig(st, found) && fg_unit_is_mig(st, g_map[j]) &&
                     st->unit[found].parent == st->unit[g_map[j]].parent && st->unit[found].gi == st->unit[g_map[j]].gi)
                same_gi = 1;
        }
        if (same_gi)
            continue;
        if (found < 0 || g_count >= FG_MAX_DEV)
            break;
        g_map[g_count++] = found;
    }
}

FG_API CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_drv.mu);
    if (fg_drv.inited) {
        pthread_mutex_unlock(&fg_drv.mu);
        return CUDA_SUCCESS;
    }
    if (!g_atfork_done) {
        pthread_atfork(NULL, NULL, cuda_atfork_child);
        g_atfork_done = 1;
    }
    CUresult rc = CUDA_SUCCESS;
    if (fg_open(0) != 0) {
        rc = CUDA_ERROR_NO_DEVICE;
    } else {
        fg_identify();
        fg_lock();
        int r = fg_register();
        fg_unlock();
        if (r != 0) {
            fprintf(stderr, "fakegpu: no free process slot (%d)\n", FG_MAX_SLOTS);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            build_map();
            for (int i = 0; i < FG_MAX_DEV; i++)
                fg_drv.primary_idx[i] = -1;
            fg_drv.inited = 1;
        }
    }
    pthread_mutex_unlock(&fg_drv.mu);
    return rc;
}

CUresult fg_check_init(void)
{
    return __atomic_load_n(&fg_drv.inited, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* physical index of a CUDA ordinal, -1 if invalid */
static int phys(CUdevice d)
{
    return (d >= 0 && d < g_count) ? g_map[d] : -1;
}

/* after fg_check_dev succeeded */
static int physok(CUdevice d)
{
    int p = phys(d);
    return p < 0 ? 0 : p;
}

int fg_ordinal_of(int physdev)
{
    for (int i = 0; i < g_count; i++)
        if (g_map[i] == physdev)
            return i;
    return -1;
}

int fg_phys(CUdevice d)
{
    return phys(d);
}

CUresult fg_check_dev(CUdevice d)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    return phys(d) < 0 ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

int fg_dev_lost(int dev)
{
    /* a MIG device is lost with its GPU */
    return __atomic_load_n(&fg_g.st->ds[fg_unit_root(fg_g.st, dev)].lost, __ATOMIC_RELAXED) != 0;
}

FG_API CUresult cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (fg_open(1) == 0)
        *v = fg_g.st->h.cuda_version;
    else
        *v = 13000;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetCount(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    *count = g_count;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_check_dev(ordinal);
    if (rc)
        return rc;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", fg_g.st->cfg[physok(dev)].name);
    return CUDA_SUCCESS;
}

static CUresult device_uuid(CUuuid *uuid, CUdevice dev, int mig)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned char b[16];
    int unit = physok(dev);
    if (!mig)
        unit = fg_unit_root(fg_g.st, unit);
    if (fg_uuid_bytes(fg_g.st->cfg[unit].uuid, b) != 0)
        return CUDA_ERROR_UNKNOWN;
    memcpy(uuid->bytes, b, 16);
    return CUDA_SUCCESS;
}

/* cuda.h: cuDeviceGetUuid_v2 "If the device is in MIG mode, returns its MIG UUID which uniquely
 * identifies the subscribed MIG compute instance" (cuda.h maps the name cuDeviceGetUuid to it since
 * CUDA 11.4).  The older entry point is modelled as giving the GPU's UUID: the reason _v2 was added. */
FG_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return device_uuid(uuid, dev, 0);
}

FG_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return device_uuid(uuid, dev, 1);
}

FG_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = fg_g.st->cfg[physok(dev)].memory;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetPCIBusId(char *buf, int len, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!buf || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned dom, bus, d, fn;
    if (fg_parse_busid(fg_g.st->cfg[physok(dev)].pci_bus_id, &dom, &bus, &d, &fn) != 0)
        return CUDA_ERROR_UNKNOWN;
    snprintf(buf, (size_t)len, "%04x:%02x:%02x.%x", dom, bus, d, fn);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *busid)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    unsigned a[4], b[4];
    if (!dev || !busid || fg_parse_busid(busid, &a[0], &a[1], &a[2], &a[3]) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < g_count; i++) {
        fg_parse_busid(fg_g.st->cfg[g_map[i]].pci_bus_id, &b[0], &b[1], &b[2], &b[3]);
        if (!memcmp(a, b, sizeof(a))) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

FG_API CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    *major = (int)fg_g.st->cfg[physok(dev)].cc_major;
    *minor = (int)fg_g.st->cfg[physok(dev)].cc_minor;
    return CUDA_SUCCESS;
}

/* CUdevice_attribute values of cuda.h; unlisted attributes below the maximum read 0. */
FG_API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    if (rc)
        return rc;
    if (!pi || attrib < 1 || attrib > 150)
        return CUDA_ERROR_INVALID_VALUE;
    const struct fg_devcfg *c = &fg_g.st->cfg[physok(dev)];
    unsigned dom = 0, bus = 0, d = 0, fn = 0;
    fg_parse_busid(c->pci_bus_id, &dom, &bus, &d, &fn);
    int v = 0;
    switch (attrib) {
    case 1: v = 1024; break;         /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: v = 1024; break; /* MAX_BLOCK_DIM_X/Y */
    case 4: v = 64; break;           /* MAX_BLOCK_DIM_Z */
    case 5: v = 2147483647; break;   /* MAX_GRID_DIM_X */
    case 6: case 7: v = 65535; break;
    case 8: v = 49152; break;        /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: v = 65536; break;        /* TOTAL_CONSTANT_MEMORY */
    case 10: v = 32; break;          /* WARP_SIZE */
    case 11: v = 2147483647; break;  /* MAX_PITCH */
    case 12: v = 65536; break;       /* MAX_REGISTERS_PER_BLOCK */
    case 13: v = 1980000; break;     /* CLOCK_RATE kHz */
    case 14: v = 512; break;         /* TEXTURE_ALIGNMENT */
    case 15: v = 1; break;           /* GPU_OVERLAP */
    case 16: v = (int)c->sm_count; break; /* MULTIPROCESSOR_COUNT */
    case 19: v = 1; break;           /* CAN_MAP_HOST_MEMORY */
    case 31: v = 1; break;           /* CONCURRENT_KERNELS */
    case 32: v = 1; break;           /* ECC_ENABLED */
    case 33: v = (int)bus; break;    /* PCI_BUS_ID */
    case 34: v = (int)d; break;      /* PCI_DEVICE_ID */
    case 36: v = 2619000; break;     /* MEMORY_CLOCK_RATE */
    case 37: v = 5120; break;        /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: v = 50 << 20; break;    /* L2_CACHE_SIZE */
    case 39: v = 2048; break;        /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: v = 3; break;           /* ASYNC_ENGINE_COUNT */
    case 41: v = 1; break;           /* UNIFIED_ADDRESSING */
    case 50: v = (int)dom; break;    /* PCI_DOMAIN_ID */
    case 75: v = (int)c->cc_major; break;
    case 76: v = (int)c->cc_minor; break;
    case 81: v = 233472; break;      /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: v = 65536; break;       /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: v = 1; break;           /* MANAGED_MEMORY */
    case 89: v = 1; break;           /* CONCURRENT_MANAGED_ACCESS */
    case 95: v = 1; break;           /* COOPERATIVE_LAUNCH */
    case 97: v = 232448; break;      /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 102: v = 1; break;          /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 115: v = 1; break;          /* MEMORY_POOLS_SUPPORTED */
    case 134: v = c->numa_node; break; /* HOST_NUMA_ID: -1 without NUMA */
    case 141: v = 1; break;          /* HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (cuda_vmm.c) */
    default: v = 0;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

/* 1 if bytes more fit on the device (lock held); dead processes' memory is reclaimed first
 * when they would not. */
static int fits(struct fg_state *st, int dev, uint64_t bytes)
{
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            fg_reap();
        uint64_t used = fg_dev_used(st, dev) + st->cfg[dev].reserved;
        if (bytes <= st->cfg[dev].memory && used + bytes <= st->cfg[dev].memory)
            return 1;
    }
    return 0;
}

CUresult fg_charge(int dev, uint64_t bytes, int kind)
{
    struct fg_state *st = fg_g.st;
    CUresult rc = CUDA_SUCCESS;
    fg_lock();
    fg_reap_lazy();
    struct fg_pdev *p = &st->slots[fg_g.slot].dev[dev];
    if (kind != FG_KIND_MANAGED_HOST && !fits(st, dev, bytes))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (kind == FG_KIND_DEVICE)
        p->mem_device += bytes;
    else if (kind == FG_KIND_MANAGED_DEV)
        p->mem_managed_dev += bytes;
    else
        p->mem_managed_host += bytes;
    if (rc == CUDA_SUCCESS && kind != FG_KIND_MANAGED_HOST) {
        st->ds[dev].used_total += bytes;
        fg_note_high(st, dev);
    }
    fg_unlock();
    return rc;
}

/* Physically free bytes of a device (for managed allocations). */
uint64_t fg_dev_free(int dev)
{
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_reap_lazy();
    uint64_t used = fg_dev_used(st, dev) + st->cfg[dev].reserved;
    uint64_t fr = used < st->cfg[dev].memory ? st->cfg[dev].memory - used : 0;
    fg_unlock();
    return fr;
}

void fg_uncharge(int dev, uint64_t bytes, int kind)
{
    struct fg_pdev *p = &fg_g.st->slots[fg_g.slot].dev[dev];
    fg_lock();
    uint64_t *f = kind == FG_KIND_DEVICE ? &p->mem_device
                  : kind == FG_KIND_MANAGED_DEV ? &p->mem_managed_dev
                                                : &p->mem_managed_host;
    uint64_t n = *f >= bytes ? bytes : *f;
    *f -= n;
    if (kind != FG_KIND_MANAGED_HOST) {
        uint64_t *t = &fg_g.st->ds[dev].used_total;
        *t = *t >= n ? *t - n : 0;
    }
    fg_unlock();
}

CUresult fg_ctx_charge(int dev, int add)
{
    struct fg_state *st = fg_g.st;
    CUresult rc = CUDA_SUCCESS;
    fg_lock();
    fg_reap_lazy();
    struct fg_pdev *p = &st->slots[fg_g.slot].dev[dev];
    if (add > 0) {
        if (!fits(st, dev, st->cfg[dev].context_overhead)) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            p->contexts++;
            st->ds[dev].used_total += st->cfg[dev].context_overhead;
            st->ds[dev].ctx_total += st->cfg[dev].context_overhead;
            fg_note_high(st, dev);
        }
    } else if (p->contexts > 0) {
        p->contexts--;
        uint64_t o = st->cfg[dev].context_overhead;
        st->ds[dev].used_total = st->ds[dev].used_total >= o ? st->ds[dev].used_total - o : 0;
        st->ds[dev].ctx_total = st->ds[dev].ctx_total >= o ? st->ds[dev].ctx_total - o : 0;
        if (p->contexts == 0) {
            /* the last context of the process on this device is gone: so is its queued work */
            fg_sim_advance(st, dev, fg_now());
            fg_sim_drop(st, fg_g.slot, dev, -1);
        }
    }
    fg_unlock();
    return rc;
}
