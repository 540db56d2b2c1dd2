/*
 * matrix — the bypass matrix: N processes of one container run a seeded random mix of every
 * allocation path against one limit (tests/libcuda_intercept/test_bypass_matrix.py).
 *
 *   matrix MODE FIRST LAST PROCS OPS LIMIT HW CTX CTL [-v]
 *
 * For each seed FIRST..LAST: PROCS worker processes (forked before any CUDA call, each its own
 * CUDA process) run OPS operations drawn from the seed: cuMemAlloc / pitch / managed /
 * stream-ordered allocations and frees, pools (thresholds, trims, destroys, exports), arrays,
 * VMM create / map / unmap / release at device and host locations, exports and imports of
 * POSIX descriptors, legacy IPC handles and pool pointers between the workers, stream captures
 * and graphs with memory nodes (launches, frees, trims), synchronisations, and rarely a worker
 * that dies on the spot.  After every operation a worker checks the container's views:
 * cuMemGetInfo and NVML (through libvgpu.so) never underflow, never report more than the
 * hardware (HW) and agree on the total.  When every worker is done, worker 0 checks, while
 * nothing moves, that cuMemGetInfo and NVML report the same free memory and that the region
 * never shows less than the simulated GPU's own per-process count (NVML's process list, which
 * the library does not touch) beyond one context reserve (CTX) per process.  After the workers
 * exit, the simulated GPU's high-water marks (CTL high --reset) must show that the container's
 * allocations never exceeded LIMIT, nor allocations plus contexts LIMIT + PROCS x CTX, and that
 * nothing is left allocated.  A failure prints "FAIL seed=S ..." and exits 1.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define MiB (1ull << 20)
#define NOBJ 12
#define MBOX 48
#define MAXW 16

enum { PUB_VMM = 1, PUB_IPC = 2, PUB_POOLPTR = 3 };

struct pub {
    uint32_t gen;   /* odd while being written */
    int32_t type;   /* PUB_*, 0 empty */
    int32_t pid, fd; /* the exporter's descriptor (VMM: the allocation; pool pointer: the pool) */
    uint64_t size;
    unsigned char data[64];
};

struct shm {
    int done, died, checked, failed;
    char msg[512];
    struct pub box[MBOX];
};

static struct shm *S;
static unsigned long long g_seed;
static int g_worker, g_procs, g_ops;
static uint64_t g_limit, g_hw, g_ctx;
static int g_verbose;

/* ------------------------------------------------------------------ rng */

static uint64_t g_rng;
static uint64_t rnd(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }
static size_t size_pick(void)
{
    /* mostly MiB-sized, sometimes tiny or large against the limit */
    switch (below(4)) {
    case 0: return 1 + below(64 << 10);
    case 1: return (1 + below(8)) * MiB;
    case 2: return (1 + below(24)) * MiB + below(MiB);
    default: return (size_t)(g_limit / (2 + below(4)));
    }
}

/* ---------------------------------------------------------------- failing */

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
    char buf[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!__atomic_exchange_n(&S->failed, 1, __ATOMIC_SEQ_CST))
        snprintf(S->msg, sizeof S->msg, "worker=%d %s", g_worker, buf);
    _exit(1);
}

/* results that mean the library or the simulator broke, whatever the operation */
static void ok_rc(const char *what, CUresult rc)
{
    if (rc == 3 || rc == 4 || rc == CUDA_ERROR_NOT_PERMITTED || rc == 999 || rc == CUDA_ERROR_NOT_FOUND)
        fail("%s returned %d", what, rc);
}

/* ------------------------------------------------------------------ NVML */

static struct {
    int (*init)(void);
    int (*handle)(unsigned, void **);
    int (*meminfo)(void *, unsigned long long *);
    int (*procs)(void *, unsigned *, void *);
    void *dev;
} NV;

static void nvml_open(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h)
        fail("dlopen(libnvidia-ml.so.1): %s", dlerror());
    NV.init = (int (*)(void))dlsym(h, "nvmlInit_v2");
    NV.handle = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    NV.meminfo = (int (*)(void *, unsigned long long *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    NV.procs = (int (*)(void *, unsigned *, void *))dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!NV.init || !NV.handle || !NV.meminfo || !NV.procs || NV.init() != 0 || NV.handle(0, &NV.dev) != 0)
        fail("NVML unusable");
}

/* after every operation: the container's views make sense on their own */
static void check_views(const char *after)
{
    size_t f = 0, t = 0;
    CUresult rc = A.cuMemGetInfo_v2(&f, &t);
    uint64_t want = g_limit < g_hw ? g_limit : g_hw;
    if (rc != CUDA_SUCCESS)
        fail("after %s: cuMemGetInfo rc=%d", after, rc);
    if (t != want || f > t)
        fail("after %s: cuMemGetInfo free=%zu total=%zu (limit %llu)", after, f, t, (unsigned long long)want);
    unsigned long long m[3] = {0, 0, 0}; /* total, free, used */
    if (NV.meminfo(NV.dev, m) != 0)
        fail("after %s: nvmlDeviceGetMemoryInfo failed", after);
    if (m[0] != want || m[1] > m[0] || m[2] > m[0] || m[0] > g_hw)
        fail("after %s: NVML total=%llu free=%llu used=%llu", after, m[0], m[1], m[2]);
}

/* the simulated GPU's own count of the container's processes (NVML's process list, untouched
 * by the library) */
static unsigned long long raw_used(void)
{
    struct {
        unsigned pid;
        unsigned long long used;
        unsigned gi, ci;
    } rows[64];
    unsigned n = 64;
    if (NV.procs(NV.dev, &n, rows) != 0)
        fail("nvmlDeviceGetComputeRunningProcesses failed");
    unsigned long long sum = 0;
    for (unsigned i = 0; i < n; i++)
        sum += rows[i].used;
    return sum;
}

/* --------------------------------------------------------------- objects */

static CUdevice dev;
static CUstream strm;

struct plain { CUdeviceptr p; int box; };
struct vmm { CUmemGenericAllocationHandle h; size_t n; CUdeviceptr va; int mapped, released, host, exportable, box, fd; };
struct graphx { CUgraph g; CUgraphExec x; CUdeviceptr a[3]; int na; int freed_in_graph[3]; };
struct ipool { int pid, fd; uint32_t gen; CUmemoryPool pool; };

static struct plain plains[NOBJ];
static CUdeviceptr asyncs[NOBJ], poolp[NOBJ];
static int poolbox[NOBJ];
static CUarray arrays[NOBJ];
static struct vmm vmms[NOBJ];
static CUdeviceptr ipcs[NOBJ], pimps[NOBJ];
static struct graphx graphs[4];
static CUdeviceptr gptrs[NOBJ]; /* graph allocations that outlive their launch */
static CUmemoryPool pool;
static int pool_exportable;
static struct ipool ipools[4];

static int free_slot_p(CUdeviceptr *a) { for (int i = 0; i < NOBJ; i++) if (!a[i]) return i; return -1; }
static int used_slot_p(CUdeviceptr *a)
{
    int k = (int)below(NOBJ);
    for (int i = 0; i < NOBJ; i++)
        if (a[(k + i) % NOBJ])
            return (k + i) % NOBJ;
    return -1;
}

/* ------------------------------------------------------------- mailbox */

static int publish(int type, int fd, uint64_t size, const void *data, size_t n)
{
    int k = (int)below(MBOX);
    for (int i = 0; i < MBOX; i++) {
        struct pub *b = &S->box[(k + i) % MBOX];
        int32_t zero = 0;
        if (__atomic_load_n(&b->type, __ATOMIC_ACQUIRE) != 0)
            continue;
        /* claim it: the type is set last, under an odd generation */
        uint32_t g = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
        if (g & 1 || !__atomic_compare_exchange_n(&b->gen, &g, g + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        b->pid = (int32_t)getpid();
        b->fd = fd;
        b->size = size;
        memset(b->data, 0, sizeof b->data);
        if (data)
            memcpy(b->data, data, n);
        __atomic_store_n(&b->type, type, __ATOMIC_RELEASE);
        __atomic_add_fetch(&b->gen, 1, __ATOMIC_RELEASE);
        (void)zero;
        return (k + i) % MBOX;
    }
    return -1;
}

static void unpublish(int k)
{
    if (k < 0)
        return;
    struct pub *b = &S->box[k];
    __atomic_add_fetch(&b->gen, 2, __ATOMIC_ACQ_REL); /* importers reading it see the change */
    __atomic_store_n(&b->type, 0, __ATOMIC_RELEASE);
}

/* a consistent copy of a published entry of that type (not ours), or -1 */
static int pick(int type, struct pub *out)
{
    int k = (int)below(MBOX);
    for (int i = 0; i < MBOX; i++) {
        struct pub *b = &S->box[(k + i) % MBOX];
        uint32_t g = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
        if (g & 1 || __atomic_load_n(&b->type, __ATOMIC_ACQUIRE) != type || b->pid == (int32_t)getpid())
            continue;
        memcpy(out, b, sizeof *out);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) != g)
            continue;
        out->gen = g;
        return (k + i) % MBOX;
    }
    return -1;
}

/* the exporter's descriptor, as a socket would deliver it; -1 if it is gone */
static int take(const struct pub *p, int k)
{
    int pidfd = (int)syscall(SYS_pidfd_open, p->pid, 0);
    if (pidfd < 0)
        return -1;
    int fd = (int)syscall(SYS_pidfd_getfd, pidfd, p->fd, 0);
    close(pidfd);
    if (fd >= 0 && __atomic_load_n(&S->box[k].gen, __ATOMIC_ACQUIRE) != p->gen) {
        close(fd); /* withdrawn meanwhile: the number may name something else now */
        return -1;
    }
    return fd;
}

/* -------------------------------------------------------------- operations */

static void vmm_drop(struct vmm *v)
{
    if (v->mapped) {
        ok_rc("cuMemUnmap", A.cuMemUnmap(v->va, v->n));
        A.cuMemAddressFree(v->va, v->n);
        v->mapped = 0;
    }
    if (!v->released)
        ok_rc("cuMemRelease", A.cuMemRelease(v->h));
    unpublish(v->box);
    if (v->fd >= 0)
        close(v->fd);
    memset(v, 0, sizeof *v);
    v->box = v->fd = -1;
}

static int vmm_free_slot(void)
{
    for (int i = 0; i < NOBJ; i++)
        if (!vmms[i].h)
            return i;
    return -1;
}

static CUresult vmm_new(struct vmm *v, size_t n, int loc, int exportable)
{
    struct {
        CUmemAllocationProp p;
        unsigned char flags[8];
    } prop;
    memset(&prop, 0, sizeof prop);
    prop.p.type = 1;
    prop.p.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0;
    prop.p.location.type = loc;
    prop.p.location.id = loc == CU_MEM_LOCATION_TYPE_DEVICE ? dev : 0;
    memset(v, 0, sizeof *v);
    v->box = v->fd = -1;
    CUresult rc = A.cuMemCreate(&v->h, n, &prop.p, 0);
    ok_rc("cuMemCreate", rc);
    if (rc) {
        v->h = 0;
        return rc;
    }
    v->n = n;
    v->host = loc != CU_MEM_LOCATION_TYPE_DEVICE;
    v->exportable = exportable;
    return rc;
}

static void vmm_map(struct vmm *v)
{
    if (v->mapped || v->released)
        return;
    if (A.cuMemAddressReserve(&v->va, v->n, 0, 0, 0) != CUDA_SUCCESS)
        return;
    CUresult rc = A.cuMemMap(v->va, v->n, 0, v->h, 0);
    ok_rc("cuMemMap", rc);
    if (rc == CUDA_SUCCESS)
        v->mapped = 1;
    else
        A.cuMemAddressFree(v->va, v->n);
}

static size_t gran(size_t n) { return (n + 2 * MiB - 1) / (2 * MiB) * (2 * MiB); }

static void ensure_pool(void)
{
    if (pool)
        return;
    CUmemPoolProps p;
    memset(&p, 0, sizeof p);
    p.allocType = 1;
    pool_exportable = (int)below(2);
    p.handleTypes = pool_exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    CUresult rc = A.cuMemPoolCreate(&pool, &p);
    ok_rc("cuMemPoolCreate", rc);
    if (rc) {
        pool = NULL;
        return;
    }
    cuuint64_t thr = below(2) ? 0 : g_limit;
    A.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr);
}

static void graph_drop(struct graphx *gx)
{
    if (gx->x)
        ok_rc("cuGraphExecDestroy", A.cuGraphExecDestroy(gx->x));
    if (gx->g)
        ok_rc("cuGraphDestroy", A.cuGraphDestroy(gx->g));
    memset(gx, 0, sizeof *gx);
}

static void keep_gptr(CUdeviceptr p)
{
    int k = free_slot_p(gptrs);
    if (k >= 0)
        gptrs[k] = p;
    else
        A.cuMemFree_v2(p); /* no room to remember it: freed at once */
}

/* a captured (or built) graph, instantiated and launched */
static void op_graph(int explicit_api)
{
    int k = -1;
    for (int i = 0; i < 4; i++)
        if (!graphs[i].g) {
            k = i;
            break;
        }
    if (k < 0) {
        graph_drop(&graphs[below(4)]);
        return;
    }
    struct graphx *gx = &graphs[k];
    int na = 1 + (int)below(3);
    CUresult rc;
    if (explicit_api) {
        if (A.cuGraphCreate(&gx->g, 0) != CUDA_SUCCESS)
            return;
        for (int i = 0; i < na; i++) {
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            p.poolProps.allocType = 1;
            p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            p.poolProps.location.id = dev;
            p.bytesize = size_pick();
            CUgraphNode n;
            if (A.cuGraphAddMemAllocNode(&n, gx->g, NULL, 0, &p) == CUDA_SUCCESS)
                gx->a[gx->na++] = p.dptr;
        }
        for (int i = 0; i < gx->na; i++)
            if (below(2)) {
                CUgraphNode n;
                if (A.cuGraphAddMemFreeNode(&n, gx->g, NULL, 0, gx->a[i]) == CUDA_SUCCESS)
                    gx->freed_in_graph[i] = 1;
            }
    } else {
        if (A.cuStreamBeginCapture_v2(strm, (int)below(3)) != CUDA_SUCCESS)
            return;
        for (int i = 0; i < na; i++) {
            CUdeviceptr p = 0;
            rc = A.cuMemAllocAsync(&p, size_pick(), strm);
            ok_rc("capture cuMemAllocAsync", rc);
            if (rc == CUDA_SUCCESS)
                gx->a[gx->na++] = p;
        }
        for (int i = 0; i < gx->na; i++)
            if (below(2) && A.cuMemFreeAsync(gx->a[i], strm) == CUDA_SUCCESS)
                gx->freed_in_graph[i] = 1;
        rc = A.cuStreamEndCapture(strm, &gx->g);
        ok_rc("cuStreamEndCapture", rc);
        if (rc != CUDA_SUCCESS) {
            gx->g = NULL;
            memset(gx, 0, sizeof *gx);
            return;
        }
    }
    unsigned long long flags = below(3) == 0 ? 1 : 0; /* AUTO_FREE_ON_LAUNCH */
    if (below(4) == 0) {
        CUDA_GRAPH_INSTANTIATE_PARAMS ip = {.flags = flags | 2, .hUploadStream = strm}; /* + UPLOAD */
        rc = A.cuGraphInstantiateWithParams(&gx->x, gx->g, &ip);
    } else {
        rc = A.cuGraphInstantiateWithFlags(&gx->x, gx->g, flags);
    }
    ok_rc("cuGraphInstantiate", rc);
    if (rc != CUDA_SUCCESS) {
        gx->x = NULL;
        return;
    }
    int launches = 1 + (int)below(2);
    for (int l = 0; l < launches; l++) {
        rc = A.cuGraphLaunch(gx->x, strm);
        ok_rc("cuGraphLaunch", rc);
        if (rc != CUDA_SUCCESS)
            break;
        if (!flags || l == launches - 1)
            for (int i = 0; i < gx->na; i++)
                if (!gx->freed_in_graph[i] && below(2)) {
                    CUresult fr = below(2) ? A.cuMemFree_v2(gx->a[i]) : A.cuMemFreeAsync(gx->a[i], strm);
                    ok_rc("free of a graph allocation", fr);
                }
        if (!flags)
            break; /* a second launch would need every allocation freed */
    }
    /* allocations left live outlive the graph: remembered, freed later */
    if (below(2)) {
        for (int i = 0; i < gx->na; i++)
            if (!gx->freed_in_graph[i])
                keep_gptr(gx->a[i]); /* freeing one twice is CUDA_ERROR_INVALID_VALUE: harmless */
        graph_drop(gx);
    }
}

static void op(int which)
{
    CUresult rc;
    int k;
    switch (which) {
    case 0: case 1: /* cuMemAlloc */
        for (k = 0; k < NOBJ && plains[k].p; k++)
            ;
        if (k == NOBJ)
            break;
        rc = A.cuMemAlloc_v2(&plains[k].p, size_pick());
        ok_rc("cuMemAlloc", rc);
        if (rc)
            plains[k].p = 0;
        plains[k].box = -1;
        break;
    case 2: /* free */
        k = (int)below(NOBJ);
        for (int n = 0; n < NOBJ && !plains[k].p; n++)
            k = (k + 1) % NOBJ;
        if (plains[k].p) {
            unpublish(plains[k].box);
            ok_rc("cuMemFree", A.cuMemFree_v2(plains[k].p));
            plains[k].p = 0;
        }
        break;
    case 3: { /* pitch */
        for (k = 0; k < NOBJ && plains[k].p; k++)
            ;
        if (k == NOBJ)
            break;
        size_t pitch = 0;
        rc = A.cuMemAllocPitch_v2(&plains[k].p, &pitch, 1 + below(8192), 1 + below(2048), 4);
        ok_rc("cuMemAllocPitch", rc);
        if (rc)
            plains[k].p = 0;
        plains[k].box = -1;
        break;
    }
    case 4: /* managed */
        for (k = 0; k < NOBJ && plains[k].p; k++)
            ;
        if (k == NOBJ)
            break;
        rc = A.cuMemAllocManaged(&plains[k].p, size_pick(), CU_MEM_ATTACH_GLOBAL);
        ok_rc("cuMemAllocManaged", rc);
        if (rc)
            plains[k].p = 0;
        plains[k].box = -2; /* not exportable */
        break;
    case 5: /* stream-ordered, the device's pool */
        if ((k = free_slot_p(asyncs)) >= 0) {
            rc = A.cuMemAllocAsync(&asyncs[k], size_pick(), strm);
            ok_rc("cuMemAllocAsync", rc);
            if (rc)
                asyncs[k] = 0;
        }
        break;
    case 6:
        if ((k = used_slot_p(asyncs)) >= 0) {
            ok_rc("cuMemFreeAsync", A.cuMemFreeAsync(asyncs[k], strm));
            asyncs[k] = 0;
            if (below(2))
                ok_rc("cuStreamSynchronize", A.cuStreamSynchronize(strm));
        }
        break;
    case 7: /* a pool of our own */
        ensure_pool();
        if (pool && (k = free_slot_p(poolp)) >= 0) {
            rc = A.cuMemAllocFromPoolAsync(&poolp[k], size_pick(), pool, strm);
            ok_rc("cuMemAllocFromPoolAsync", rc);
            if (rc)
                poolp[k] = 0;
            poolbox[k] = -1;
        }
        break;
    case 8:
        if ((k = used_slot_p(poolp)) >= 0) {
            unpublish(poolbox[k]);
            ok_rc("pool free", below(2) ? A.cuMemFreeAsync(poolp[k], strm) : A.cuMemFree_v2(poolp[k]));
            poolp[k] = 0;
        }
        break;
    case 9:
        if (!pool)
            break;
        if (below(3) == 0) {
            /* destroyed with allocations outstanding: they keep it until freed */
            for (int i = 0; i < NOBJ; i++)
                if (poolp[i] && below(2)) {
                    unpublish(poolbox[i]);
                    A.cuMemFreeAsync(poolp[i], strm);
                    poolp[i] = 0;
                }
            ok_rc("cuMemPoolDestroy", A.cuMemPoolDestroy(pool));
            pool = NULL;
        } else {
            ok_rc("cuMemPoolTrimTo", A.cuMemPoolTrimTo(pool, below(2) ? 0 : size_pick()));
        }
        break;
    case 10: { /* arrays */
        for (k = 0; k < NOBJ && arrays[k]; k++)
            ;
        if (k == NOBJ) {
            k = (int)below(NOBJ);
            ok_rc("cuArrayDestroy", A.cuArrayDestroy(arrays[k]));
            arrays[k] = NULL;
            break;
        }
        CUDA_ARRAY_DESCRIPTOR d = {.Width = 1 + below(4096), .Height = 1 + below(2048), .Format = 0x20,
                                   .NumChannels = 1u << below(3)};
        rc = A.cuArrayCreate_v2(&arrays[k], &d);
        ok_rc("cuArrayCreate", rc);
        if (rc)
            arrays[k] = NULL;
        break;
    }
    case 11: case 12: { /* VMM */
        if ((k = vmm_free_slot()) < 0) {
            vmm_drop(&vmms[below(NOBJ)]);
            break;
        }
        int exportable = which == 12;
        if (vmm_new(&vmms[k], gran(size_pick()), CU_MEM_LOCATION_TYPE_DEVICE, exportable) == CUDA_SUCCESS && below(4))
            vmm_map(&vmms[k]);
        break;
    }
    case 13: { /* unmap, release, in either order */
        k = (int)below(NOBJ);
        struct vmm *v = &vmms[k];
        if (!v->h)
            break;
        if (v->mapped && below(2)) {
            ok_rc("cuMemUnmap", A.cuMemUnmap(v->va, v->n));
            A.cuMemAddressFree(v->va, v->n);
            v->mapped = 0;
        } else if (!v->released) {
            ok_rc("cuMemRelease", A.cuMemRelease(v->h));
            v->released = 1;
        }
        if (v->released && !v->mapped)
            vmm_drop(v);
        break;
    }
    case 14: { /* host locations: count nowhere, never crash */
        struct vmm v;
        int loc = CU_MEM_LOCATION_TYPE_HOST + (int)below(3);
        if (vmm_new(&v, gran(size_pick()), loc, 0) == CUDA_SUCCESS) {
            vmm_map(&v);
            vmm_drop(&v);
        }
        break;
    }
    case 15: { /* export a descriptor */
        k = (int)below(NOBJ);
        struct vmm *v = &vmms[k];
        if (!v->h || !v->exportable || v->released || v->box >= 0)
            break;
        int fd = -1;
        rc = A.cuMemExportToShareableHandle(&fd, v->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        ok_rc("cuMemExportToShareableHandle", rc);
        if (rc == CUDA_SUCCESS) {
            v->fd = fd;
            v->box = publish(PUB_VMM, fd, v->n, NULL, 0);
        }
        break;
    }
    case 16: { /* import one */
        struct pub p;
        int b = pick(PUB_VMM, &p);
        if (b < 0 || (k = vmm_free_slot()) < 0)
            break;
        int fd = take(&p, b);
        if (fd < 0)
            break;
        struct vmm *v = &vmms[k];
        memset(v, 0, sizeof *v);
        v->box = v->fd = -1;
        rc = A.cuMemImportFromShareableHandle(&v->h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fd);
        ok_rc("cuMemImportFromShareableHandle", rc);
        if (rc != CUDA_SUCCESS) {
            v->h = 0;
            break;
        }
        v->n = p.size;
        vmm_map(v);
        break;
    }
    case 17: { /* legacy IPC export */
        k = (int)below(NOBJ);
        if (!plains[k].p || plains[k].box != -1)
            break;
        CUipcMemHandle h;
        rc = A.cuIpcGetMemHandle(&h, plains[k].p);
        ok_rc("cuIpcGetMemHandle", rc);
        if (rc == CUDA_SUCCESS)
            plains[k].box = publish(PUB_IPC, -1, 0, &h, sizeof h);
        break;
    }
    case 18: { /* IPC open */
        struct pub p;
        if (pick(PUB_IPC, &p) < 0 || (k = free_slot_p(ipcs)) < 0)
            break;
        CUipcMemHandle h;
        memcpy(&h, p.data, sizeof h);
        rc = A.cuIpcOpenMemHandle_v2(&ipcs[k], h, 1);
        ok_rc("cuIpcOpenMemHandle", rc);
        if (rc)
            ipcs[k] = 0;
        break;
    }
    case 19:
        if ((k = used_slot_p(ipcs)) >= 0) {
            ok_rc("cuIpcCloseMemHandle", A.cuIpcCloseMemHandle(ipcs[k]));
            ipcs[k] = 0;
        }
        break;
    case 20: { /* export a pool pointer (with the pool's descriptor) */
        k = used_slot_p(poolp);
        if (k < 0 || !pool || !pool_exportable || poolbox[k] >= 0)
            break;
        unsigned char data[64];
        int fd = -1;
        if (A.cuMemPoolExportPointer(data, poolp[k]) != CUDA_SUCCESS ||
            A.cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS)
            break; /* a pointer of a pool since destroyed: refused */
        poolbox[k] = publish(PUB_POOLPTR, fd, 0, data, sizeof data);
        break;
    }
    case 21: { /* import a pool pointer */
        struct pub p;
        int b = pick(PUB_POOLPTR, &p);
        if (b < 0 || (k = free_slot_p(pimps)) < 0)
            break;
        struct ipool *ip = &ipools[below(4)];
        if (!ip->pool || ip->pid != p.pid) {
            int fd = take(&p, b);
            if (fd < 0)
                break;
            if (ip->pool)
                A.cuMemPoolDestroy(ip->pool);
            memset(ip, 0, sizeof *ip);
            rc = A.cuMemPoolImportFromShareableHandle(&ip->pool, (void *)(intptr_t)fd,
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            close(fd);
            ok_rc("cuMemPoolImportFromShareableHandle", rc);
            if (rc) {
                ip->pool = NULL;
                break;
            }
            ip->pid = p.pid;
        }
        rc = A.cuMemPoolImportPointer(&pimps[k], ip->pool, p.data);
        ok_rc("cuMemPoolImportPointer", rc);
        if (rc)
            pimps[k] = 0;
        break;
    }
    case 22:
        if ((k = used_slot_p(pimps)) >= 0) {
            ok_rc("free of an imported pointer", A.cuMemFreeAsync(pimps[k], strm));
            pimps[k] = 0;
        }
        break;
    case 23: case 24:
        op_graph(which == 24);
        break;
    case 25:
        if ((k = used_slot_p(gptrs)) >= 0) {
            ok_rc("free of a graph allocation", A.cuMemFree_v2(gptrs[k]));
            gptrs[k] = 0;
        } else {
            graph_drop(&graphs[below(4)]);
        }
        break;
    case 26:
        ok_rc("cuDeviceGraphMemTrim", A.cuDeviceGraphMemTrim(dev));
        break;
    case 27:
        ok_rc("synchronize", below(2) ? A.cuStreamSynchronize(strm) : A.cuCtxSynchronize());
        break;
    case 28: /* rarely: a process dies holding what it holds */
        if (below(8) == 0) {
            __atomic_add_fetch(&S->died, 1, __ATOMIC_SEQ_CST);
            __atomic_add_fetch(&S->done, 1, __ATOMIC_SEQ_CST);
            _exit(0);
        }
        break;
    }
}
#define NOPS 29

static void cleanup(void)
{
    for (int i = 0; i < 4; i++)
        graph_drop(&graphs[i]);
    for (int i = 0; i < NOBJ; i++) {
        if (gptrs[i])
            A.cuMemFree_v2(gptrs[i]);
        if (plains[i].p) {
            unpublish(plains[i].box);
            ok_rc("cuMemFree", A.cuMemFree_v2(plains[i].p));
        }
        if (asyncs[i])
            ok_rc("cuMemFreeAsync", A.cuMemFreeAsync(asyncs[i], strm));
        if (poolp[i]) {
            unpublish(poolbox[i]);
            A.cuMemFreeAsync(poolp[i], strm);
        }
        if (arrays[i])
            ok_rc("cuArrayDestroy", A.cuArrayDestroy(arrays[i]));
        if (vmms[i].h)
            vmm_drop(&vmms[i]);
        if (ipcs[i])
            ok_rc("cuIpcCloseMemHandle", A.cuIpcCloseMemHandle(ipcs[i]));
        if (pimps[i])
            A.cuMemFreeAsync(pimps[i], strm);
    }
    if (pool)
        A.cuMemPoolDestroy(pool);
    A.cuDeviceGraphMemTrim(dev);
    A.cuStreamSynchronize(strm);
}

static void wait_for(int *ctr, int want, int *or_flag)
{
    for (int i = 0; i < 60000; i++) {
        if (__atomic_load_n(ctr, __ATOMIC_ACQUIRE) >= want || (or_flag && __atomic_load_n(or_flag, __ATOMIC_ACQUIRE)))
            return;
        if (__atomic_load_n(&S->failed, __ATOMIC_ACQUIRE))
            _exit(1);
        usleep(500);
    }
    fail("timed out waiting for the other workers");
}

static void worker(void)
{
    g_rng = g_seed * 1000003ull + (uint64_t)g_worker * 7919ull + 1;
    CUcontext ctx;
    CUresult rc = A.cuInit(0);
    if (!rc)
        rc = A.cuDeviceGet(&dev, 0);
    if (!rc)
        rc = A.cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!rc)
        rc = A.cuCtxSetCurrent(ctx);
    if (!rc)
        rc = A.cuStreamCreate(&strm, 1);
    if (rc)
        fail("init rc=%d", rc);
    nvml_open();
    memset(plains, 0, sizeof plains);
    for (int i = 0; i < NOBJ; i++) {
        vmms[i].box = vmms[i].fd = -1;
        poolbox[i] = -1;
    }
    char what[32];
    int trace = getenv("MATRIX_TRACE") != NULL;
    for (int i = 0; i < g_ops; i++) {
        int w = (int)below(NOPS);
        op(w);
        snprintf(what, sizeof what, "op %d (#%d)", w, i);
        check_views(what);
        if (trace) {
            size_t f = 0, t = 0;
            A.cuMemGetInfo_v2(&f, &t);
            fprintf(stderr, "seed=%llu worker=%d #%d op=%d used=%zu\n", g_seed, g_worker, i, w, t - f);
        }
    }
    __atomic_add_fetch(&S->done, 1, __ATOMIC_SEQ_CST);
    wait_for(&S->done, g_procs, NULL);
    if (g_worker == 0 && !__atomic_load_n(&S->died, __ATOMIC_ACQUIRE)) {
        /* nothing moves now: the two views agree, and the region is never below the device */
        size_t f = 0, t = 0;
        unsigned long long m[3];
        A.cuMemGetInfo_v2(&f, &t);
        if (NV.meminfo(NV.dev, m) != 0)
            fail("NVML failed");
        if (m[1] != f)
            fail("at rest: cuMemGetInfo free=%zu, NVML free=%llu", f, m[1]);
        unsigned long long raw = raw_used();
        if (m[2] + (unsigned long long)g_procs * g_ctx < raw && m[2] < t)
            fail("at rest: the region counts %llu bytes, the simulated GPU %llu", m[2], raw);
    }
    if (g_worker == 0)
        __atomic_store_n(&S->checked, 1, __ATOMIC_RELEASE);
    wait_for(&S->checked, 1, &S->died);
    if (below(4))
        cleanup(); /* else: exit holding everything */
    check_views("cleanup");
    _exit(0);
}

/* ------------------------------------------------------------ coordinator */

static int high_reset(const char *ctl, unsigned long long *alloc_high, unsigned long long *used_high,
                      unsigned long long *used)
{
    char watch[32];
    snprintf(watch, sizeof watch, "%llu", (unsigned long long)g_limit);
    int fds[2];
    if (pipe(fds) != 0)
        return -1;
    pid_t p = fork();
    if (p == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        unsetenv("LD_PRELOAD");
        execl(ctl, "fakegpu-ctl", "high", "--reset", "--watch", watch, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    char buf[4096];
    size_t n = 0;
    ssize_t r;
    while (n < sizeof buf - 1 && (r = read(fds[0], buf + n, sizeof buf - 1 - n)) > 0)
        n += (size_t)r;
    buf[n] = '\0';
    close(fds[0]);
    int st;
    waitpid(p, &st, 0);
    const char *a = strstr(buf, "\"alloc_high\":"), *u = strstr(buf, "\"used_high\":"), *c = strstr(buf, "\"used\":");
    if (!WIFEXITED(st) || WEXITSTATUS(st) || !a || !u || !c)
        return -1;
    *alloc_high = strtoull(a + 13, NULL, 10);
    *used_high = strtoull(u + 12, NULL, 10);
    *used = strtoull(c + 7, NULL, 10);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 10)
        die("usage: matrix MODE FIRST LAST PROCS OPS LIMIT HW CTX CTL [-v]");
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned long long first = strtoull(argv[2], NULL, 0), last = strtoull(argv[3], NULL, 0);
    g_procs = atoi(argv[4]);
    g_ops = atoi(argv[5]);
    g_limit = strtoull(argv[6], NULL, 0);
    g_hw = strtoull(argv[7], NULL, 0);
    g_ctx = strtoull(argv[8], NULL, 0);
    const char *ctl = argv[9];
    g_verbose = argc > 10 && !strcmp(argv[10], "-v");
    if (g_procs < 1 || g_procs > MAXW)
        die("1..%d processes", MAXW);
    load_api(argv[1]);
    S = mmap(NULL, sizeof *S, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (S == MAP_FAILED)
        die("mmap");
    unsigned long long ah, uh, u;
    if (high_reset(ctl, &ah, &uh, &u) != 0)
        die("fakegpu-ctl high failed");
    for (unsigned long long seed = first; seed <= last; seed++) {
        memset(S, 0, sizeof *S);
        pid_t pids[MAXW];
        for (int w = 0; w < g_procs; w++) {
            pids[w] = fork();
            if (pids[w] < 0)
                die("fork");
            if (pids[w] == 0) {
                g_seed = seed;
                g_worker = w;
                worker();
            }
        }
        int bad = 0;
        for (int w = 0; w < g_procs; w++) {
            int st;
            waitpid(pids[w], &st, 0);
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                bad = 1;
                if (!S->failed)
                    snprintf(S->msg, sizeof S->msg, "worker=%d ended with status %#x", w, st);
            }
        }
        if (bad || S->failed) {
            printf("FAIL seed=%llu %s\n", seed, S->msg);
            return 1;
        }
        if (high_reset(ctl, &ah, &uh, &u) != 0) {
            printf("FAIL seed=%llu fakegpu-ctl high failed\n", seed);
            return 1;
        }
        /* the simulated GPU's own count: allocations never above the limit; with the contexts,
         * never above limit + one context reserve per process; nothing left after the exits */
        if (ah > g_limit || uh > g_limit + (unsigned long long)g_procs * g_ctx || u != 0) {
            printf("FAIL seed=%llu device alloc_high=%llu used_high=%llu used_after=%llu limit=%llu\n", seed, ah, uh, u,
                   (unsigned long long)g_limit);
            return 1;
        }
        if (g_verbose)
            printf("seed=%llu ok alloc_high=%llu used_high=%llu\n", seed, ah, uh);
    }
    printf("matrix seeds=%llu-%llu procs=%d ops=%d ok\n", first, last, g_procs, g_ops);
    return 0;
}
