/*
 * hooks_graph.c — CUDA graphs with memory nodes: the device's graph memory pool.
 *
 * A graph's memory allocation nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync while a stream
 * is being captured) take physical memory when a launch (or cuGraphUpload) maps it, from a
 * per-device graph memory pool that keeps it after the allocations are freed, until
 * cuDeviceGraphMemTrim (CUDA Driver API, "Graph Management": cuGraphAddMemAllocNode,
 * cuGraphLaunch, cuDeviceGraphMemTrim, cuDeviceGetGraphMemAttribute; CUDA C++ Programming
 * Guide, "Graph Memory Nodes": physical memory management, physical memory footprint).  So:
 *  - at instantiation, the graph's allocation nodes are read (cuGraphGetNodes,
 *    cuGraphNodeGetType, cuGraphMemAllocNodeGetParams) and the executable graph remembers its
 *    footprint per device: the allocations, each rounded up to 2 MiB;
 *  - a launch or upload of such a graph charges the footprint first (refused with
 *    CUDA_ERROR_OUT_OF_MEMORY over the limit: a captured graph cannot exceed the slice), calls
 *    the driver, and settles the graph pool's charge on CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT;
 *  - cuDeviceGraphMemTrim settles it again (down to what the pool still holds).
 * Launches of graphs without memory nodes stay a forwarder: one load of a counter (zero while
 * no such graph exists) besides the real pointer; no lock, syscall or allocation.
 */
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

#include "log.h"
#include "vgpu.h"

#define GRAN (2ull << 20)
#define DEV_KEY(x, d) ((uint64_t)(uintptr_t)(x) ^ ((uint64_t)((d) + 1) << 56))

extern pthread_mutex_t vgpu_cache_mu; /* hooks_pool.c */
#define g_graph_mu vgpu_cache_mu
static int g_mem_execs;                       /* executable graphs with memory nodes */
static uint64_t g_charged[VGPU_MAX_DEVICES];  /* graph pool charge per limits index */
static int g_ordinal[VGPU_MAX_DEVICES];       /* its CUDA ordinal + 1, 0 unknown */

#define NEED(fn)                            \
    do {                                    \
        vgpu_resolve_cuda();                \
        if (UNLIKELY(!REAL(fn)))            \
            return CUDA_ERROR_NOT_FOUND;    \
    } while (0)

static int active(void) { return !vgpu_in_hook && vgpu_status() != VGPU_ST_INACTIVE; }

/* bring limits index idx's graph-pool charge from `charged` to the pool's reservation */
static int settle(int idx, uint64_t charged)
{
    uint64_t now = charged;
    int ord = g_ordinal[idx] - 1;
    if (ord < 0 || !REAL(cuDeviceGetGraphMemAttribute) ||
        REAL(cuDeviceGetGraphMemAttribute)(ord, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &now) != CUDA_SUCCESS)
        now = charged;
    int released = now < charged;
    if (now < charged)
        vgpu_rgn_uncharge((unsigned)idx, charged - now, VGPU_KIND_DEVICE);
    else if (now > charged) /* mapped where the hooks did not charge it: counted, whatever the limit */
        vgpu_rgn_charge((unsigned)idx, now - charged, UINT64_MAX, vgpu_ctx_reserve(), VGPU_KIND_DEVICE);
    g_charged[idx] = now;
    return released;
}

int vgpu_graph_refresh(int idx)
{
    if (idx < 0 || idx >= (int)VGPU_MAX_DEVICES || !g_ordinal[idx])
        return 0;
    pthread_mutex_lock(&g_graph_mu);
    int r = settle(idx, g_charged[idx]);
    pthread_mutex_unlock(&g_graph_mu);
    return r;
}

struct footprint {
    uint64_t bytes[VGPU_MAX_DEVICES];
    unsigned mask; /* limits indices with allocation nodes */
};

/* The graph's allocation nodes per limits index.  0, or -1 with *rc (a device without a slice:
 * CUDA_ERROR_OUT_OF_MEMORY, as an allocation there would be). */
static int footprint_of(CUgraph g, struct footprint *fp, CUresult *rc)
{
    memset(fp, 0, sizeof *fp);
    size_t n = 0;
    if (!REAL(cuGraphGetNodes) || !REAL(cuGraphNodeGetType) || !REAL(cuGraphMemAllocNodeGetParams) ||
        REAL(cuGraphGetNodes)(g, NULL, &n) != CUDA_SUCCESS || n == 0)
        return 0;
    CUgraphNode stackbuf[256], *nodes = stackbuf;
    size_t cap = n;
    if (n > 256) {
        nodes = mmap(NULL, n * sizeof *nodes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (nodes == MAP_FAILED) {
            *rc = CUDA_ERROR_OUT_OF_MEMORY;
            return -1;
        }
    }
    int ret = 0;
    if (REAL(cuGraphGetNodes)(g, nodes, &n) != CUDA_SUCCESS)
        n = 0;
    for (size_t i = 0; i < n && ret == 0; i++) {
        int type = -1;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        if (REAL(cuGraphNodeGetType)(nodes[i], &type) != CUDA_SUCCESS || type != CU_GRAPH_NODE_TYPE_MEM_ALLOC ||
            REAL(cuGraphMemAllocNodeGetParams)(nodes[i], &p) != CUDA_SUCCESS)
            continue;
        int ord = p.poolProps.location.id, idx = vgpu_dev_index(ord);
        if (idx < 0) {
            *rc = idx == -2 ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_OUT_OF_MEMORY;
            ret = -1;
            break;
        }
        uint64_t r = p.bytesize > UINT64_MAX - GRAN ? UINT64_MAX : (p.bytesize + GRAN - 1) / GRAN * GRAN;
        fp->bytes[idx] = vgpu_sat_add(fp->bytes[idx], r);
        fp->mask |= 1u << idx;
        g_ordinal[idx] = ord + 1;
    }
    if (nodes != stackbuf)
        munmap(nodes, cap * sizeof *nodes);
    return ret;
}

/* Charges the footprint on every device (lock held); 0, or -1 with nothing charged. */
static int precharge(const struct footprint *fp)
{
    for (int d = 0; d < (int)VGPU_MAX_DEVICES; d++) {
        if (!(fp->mask & (1u << d)) || vgpu_charge(d, fp->bytes[d], VGPU_KIND_DEVICE) == 0)
            continue;
        for (int e = 0; e < d; e++)
            if (fp->mask & (1u << e))
                vgpu_rgn_uncharge((unsigned)e, fp->bytes[e], VGPU_KIND_DEVICE);
        return -1;
    }
    return 0;
}

static void settle_all(const struct footprint *fp, int charged)
{
    for (int d = 0; d < (int)VGPU_MAX_DEVICES; d++)
        if (fp->mask & (1u << d))
            settle(d, g_charged[d] + (charged ? fp->bytes[d] : 0));
}

/* the footprint an executable graph was instantiated with; 0 if it has none */
static int exec_footprint(CUgraphExec x, struct footprint *fp)
{
    struct vgpu_rec r;
    if (!vgpu_track_get(&vgpu_t_exec, (uint64_t)(uintptr_t)x, &r))
        return 0;
    memset(fp, 0, sizeof *fp);
    fp->mask = (unsigned)r.aux;
    for (int d = 0; d < (int)VGPU_MAX_DEVICES; d++)
        if (fp->mask & (1u << d) && vgpu_track_get(&vgpu_t_exec, DEV_KEY(x, d), &r))
            fp->bytes[d] = r.size;
    return fp->mask != 0;
}

/* ------------------------------------------------------ instantiation */

static CUresult instantiate(CUgraphExec *px, CUgraph g, int upload, CUresult (*call)(const void *), const void *args)
{
    if (!active())
        return call(args);
    struct footprint fp;
    CUresult rc = CUDA_SUCCESS;
    if (footprint_of(g, &fp, &rc) != 0)
        return rc;
    if (!fp.mask)
        return call(args);
    pthread_mutex_lock(&g_graph_mu);
    if (upload && precharge(&fp) != 0) { /* instantiate-and-upload maps the memory now */
        pthread_mutex_unlock(&g_graph_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_in_hook++;
    rc = call(args);
    vgpu_in_hook--;
    if (rc == CUDA_SUCCESS && px) {
        struct vgpu_rec r = {.key = (uint64_t)(uintptr_t)*px, .aux = fp.mask};
        int ok = vgpu_track_put(&vgpu_t_exec, &r) == 0;
        for (int d = 0; ok && d < (int)VGPU_MAX_DEVICES; d++)
            if (fp.mask & (1u << d)) {
                struct vgpu_rec dr = {.key = DEV_KEY(*px, d), .size = fp.bytes[d], .dev = (uint32_t)d};
                ok = vgpu_track_put(&vgpu_t_exec, &dr) == 0;
            }
        if (ok)
            __atomic_add_fetch(&g_mem_execs, 1, __ATOMIC_SEQ_CST);
        else
            VLOG(VGPU_LOG_WARN, "graph tracking failed: its launches are charged when trimmed");
    }
    if (upload)
        settle_all(&fp, 1);
    pthread_mutex_unlock(&g_graph_mu);
    return rc;
}

struct inst5 {
    CUresult (*fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
    CUgraphExec *px;
    CUgraph g;
    CUgraphNode *err;
    char *log;
    size_t sz;
};
static CUresult call5(const void *a)
{
    const struct inst5 *x = a;
    return x->fn(x->px, x->g, x->err, x->log, x->sz);
}

struct instf {
    CUresult (*fn)(CUgraphExec *, CUgraph, unsigned long long);
    CUgraphExec *px;
    CUgraph g;
    unsigned long long flags;
};
static CUresult callf(const void *a)
{
    const struct instf *x = a;
    return x->fn(x->px, x->g, x->flags);
}

struct instp {
    CUresult (*fn)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
    CUgraphExec *px;
    CUgraph g;
    CUDA_GRAPH_INSTANTIATE_PARAMS *p;
};
static CUresult callp(const void *a)
{
    const struct instp *x = a;
    return x->fn(x->px, x->g, x->p);
}

VGPU_EXPORT CUresult cuGraphInstantiate(CUgraphExec *px, CUgraph g, CUgraphNode *err, char *log, size_t sz)
{
    NEED(cuGraphInstantiate);
    struct inst5 a = {REAL(cuGraphInstantiate), px, g, err, log, sz};
    return instantiate(px, g, 0, call5, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *px, CUgraph g, CUgraphNode *err, char *log, size_t sz)
{
    NEED(cuGraphInstantiate_v2);
    struct inst5 a = {REAL(cuGraphInstantiate_v2), px, g, err, log, sz};
    return instantiate(px, g, 0, call5, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *px, CUgraph g, unsigned long long flags)
{
    NEED(cuGraphInstantiateWithFlags);
    struct instf a = {REAL(cuGraphInstantiateWithFlags), px, g, flags};
    return instantiate(px, g, 0, callf, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *px, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    NEED(cuGraphInstantiateWithParams);
    struct instp a = {REAL(cuGraphInstantiateWithParams), px, g, p};
    return instantiate(px, g, p && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD), callp, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *px, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    NEED(cuGraphInstantiateWithParams_ptsz);
    struct instp a = {REAL(cuGraphInstantiateWithParams_ptsz), px, g, p};
    return instantiate(px, g, p && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD), callp, &a);
}

VGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec x)
{
    NEED(cuGraphExecDestroy);
    CUresult rc = REAL(cuGraphExecDestroy)(x);
    if (rc == CUDA_SUCCESS && __atomic_load_n(&g_mem_execs, __ATOMIC_RELAXED) && active()) {
        struct vgpu_rec r;
        if (vgpu_track_take(&vgpu_t_exec, (uint64_t)(uintptr_t)x, &r)) {
            for (int d = 0; d < (int)VGPU_MAX_DEVICES; d++)
                if (r.aux & (1u << d))
                    vgpu_track_take(&vgpu_t_exec, DEV_KEY(x, d), NULL);
            __atomic_sub_fetch(&g_mem_execs, 1, __ATOMIC_SEQ_CST);
        }
        /* what its launches mapped stays in the graph pool (and charged) until trimmed */
    }
    return rc;
}

/* ------------------------------------------------------- launch, upload */

/* A launch or upload of a graph with memory nodes: an allocation. */
static __attribute__((noinline)) CUresult launch_mem(CUresult (*fn)(CUgraphExec, CUstream), CUgraphExec x, CUstream s)
{
    struct footprint fp;
    if (!fn)
        return CUDA_ERROR_NOT_FOUND;
    if (!active() || !exec_footprint(x, &fp))
        return fn(x, s);
    pthread_mutex_lock(&g_graph_mu);
    if (precharge(&fp) != 0) {
        pthread_mutex_unlock(&g_graph_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_in_hook++;
    CUresult rc = fn(x, s);
    vgpu_in_hook--;
    settle_all(&fp, 1); /* failed launch: the pool did not grow, the footprint goes back */
    pthread_mutex_unlock(&g_graph_mu);
    return rc;
}

static __attribute__((noinline)) CUresult launch_slow(CUresult (**slot)(CUgraphExec, CUstream), CUgraphExec x,
                                                     CUstream s)
{
    vgpu_resolve_cuda();
    return launch_mem(__atomic_load_n(slot, __ATOMIC_RELAXED), x, s);
}

/* the launch path: one load of the real pointer, one of the counter, a tail call */
#define GRAPH_FWD(name)                                                           \
    VGPU_EXPORT CUresult name(CUgraphExec x, CUstream s)                          \
    {                                                                             \
        CUresult (*f)(CUgraphExec, CUstream) = REAL(name);                        \
        if (LIKELY(f != NULL) && LIKELY(!__atomic_load_n(&g_mem_execs, __ATOMIC_RELAXED))) \
            return f(x, s);                                                       \
        return launch_slow(&real_##name, x, s);                                   \
    }

GRAPH_FWD(cuGraphLaunch)
GRAPH_FWD(cuGraphLaunch_ptsz)
GRAPH_FWD(cuGraphUpload)
GRAPH_FWD(cuGraphUpload_ptsz)

VGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    NEED(cuDeviceGraphMemTrim);
    CUresult rc = REAL(cuDeviceGraphMemTrim)(dev);
    if (rc == CUDA_SUCCESS && active()) {
        int idx = vgpu_dev_index(dev);
        if (idx >= 0) {
            pthread_mutex_lock(&g_graph_mu);
            g_ordinal[idx] = dev + 1;
            settle(idx, g_charged[idx]);
            pthread_mutex_unlock(&g_graph_mu);
        }
    }
    return rc;
}

void vgpu_pool_atfork_child(void);

void vgpu_hooks_atfork_child(void)
{
    g_mem_execs = 0;
    memset(g_charged, 0, sizeof g_charged);
    vgpu_pool_atfork_child();
}
