/*
 * hooks_graph.c — CUDA graphs with memory nodes: the device's graph memory pool.
 *
 * A graph's memory allocation nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync while a stream
 * is being captured) take physical memory when a launch (or cuGraphUpload) maps it, from a
 * per-device graph memory pool that keeps it after the allocations are freed, until
 * cuDeviceGraphMemTrim (CUDA Driver API, "Graph Management": cuGraphAddMemAllocNode,
 * cuGraphLaunch, cuDeviceGraphMemTrim, cuDeviceGetGraphMemAttribute; CUDA C++ Programming
 * Guide, "Graph Memory Nodes": physical memory management, physical memory footprint).  So:
 *  - at instantiation, the graph's memory nodes are read (cuGraphGetNodes, cuGraphNodeGetType,
 *    cuGraphMemAllocNodeGetParams, cuGraphMemFreeNodeGetParams) and the executable graph
 *    remembers its allocations (each rounded up to 2 MiB) and the addresses it frees;
 *  - a launch or upload of such a graph charges what it can add to the pool first — its
 *    allocations less the memory the pool holds idle (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
 *    minus USED_MEM_CURRENT), less its own live allocations when it was instantiated with
 *    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH — refusing with CUDA_ERROR_OUT_OF_MEMORY
 *    over the limit (a captured graph cannot exceed the slice), calls the driver, and settles
 *    the graph pool's charge on the reservation the driver reports;
 *  - which graph allocations are live is followed from the launches, their free nodes and the
 *    frees (cuMemFree, cuMemFreeAsync outside a capture) of graph addresses;
 *  - cuDeviceGraphMemTrim settles the charge again (down to what the pool still holds).
 * Launches of graphs without memory nodes stay a forwarder: one load of a counter (zero while
 * no such graph exists) besides the real pointer; no lock, syscall or allocation.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "vgpu.h"

#define GRAN (2ull << 20)
#define INST_AUTO_FREE_ON_LAUNCH 1ull
#define NODE_MEM_FREE 11
#define GMEM_USED_CURRENT 0

extern pthread_mutex_t vgpu_cache_mu; /* hooks_pool.c: pools and the graph pool share it */
#define g_graph_mu vgpu_cache_mu

static int g_mem_execs;                       /* executable graphs with memory nodes */
static uint64_t g_charged[VGPU_MAX_DEVICES];  /* graph pool charge per limits index */
static int g_ordinal[VGPU_MAX_DEVICES];       /* its CUDA ordinal + 1, 0 unknown */

/* vgpu_t_gptr: graph allocation address -> rsize, dev, aux = live, kind = freed in its graph */
static struct vgpu_track g_gptr = VGPU_TRACK_INIT;

struct galloc {
    uint64_t ptr, rsize;
    int idx;
    int freed_in_graph;
};

/* what an executable graph does with memory (hung off its vgpu_t_exec record) */
struct exec_info {
    unsigned long long flags;
    uint64_t bytes[VGPU_MAX_DEVICES]; /* its allocations per limits index */
    unsigned mask;
    size_t nalloc, nfree;
    struct galloc *allocs;
    uint64_t *frees; /* addresses its free nodes free */
};

static int gmem_attr(int d, int attr, uint64_t *v)
{
    int ord = g_ordinal[d] - 1;
    return ord >= 0 && REAL(cuDeviceGetGraphMemAttribute) && REAL(cuDeviceGetGraphMemAttribute)(ord, attr, v) ==
                                                                  CUDA_SUCCESS
               ? 0
               : -1;
}

/* bring limits index idx's graph-pool charge from `charged` to the pool's reservation */
static int settle(int idx, uint64_t charged)
{
    uint64_t now;
    if (gmem_attr(idx, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &now) != 0)
        now = charged;
    if (now < charged)
        vgpu_rgn_uncharge((unsigned)idx, charged - now, VGPU_KIND_DEVICE);
    else if (now > charged) /* mapped where the hooks did not charge it: counted, whatever the limit */
        vgpu_rgn_charge((unsigned)idx, now - charged, UINT64_MAX, UINT64_MAX, vgpu_ctx_reserve(), VGPU_KIND_DEVICE);
    g_charged[idx] = now;
    return now < charged;
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

static void info_free(struct exec_info *in)
{
    if (!in)
        return;
    free(in->allocs);
    free(in->frees);
    free(in);
}

/* The graph's memory nodes.  0 (*out: NULL when it has none), or -1 with *rc (an allocation on a
 * device without a slice: CUDA_ERROR_OUT_OF_MEMORY, as the allocation itself would be). */
static int info_of(CUgraph g, struct exec_info **out, CUresult *rc)
{
    *out = NULL;
    size_t n = 0;
    if (!REAL(cuGraphGetNodes) || !REAL(cuGraphNodeGetType) || !REAL(cuGraphMemAllocNodeGetParams) ||
        REAL(cuGraphGetNodes)(g, NULL, &n) != CUDA_SUCCESS || n == 0)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    struct exec_info *in = calloc(1, sizeof *in);
    if (in) {
        in->allocs = calloc(n, sizeof *in->allocs);
        in->frees = calloc(n, sizeof *in->frees);
    }
    if (!nodes || !in || !in->allocs || !in->frees) {
        free(nodes);
        info_free(in);
        *rc = CUDA_ERROR_OUT_OF_MEMORY;
        return -1;
    }
    if (REAL(cuGraphGetNodes)(g, nodes, &n) != CUDA_SUCCESS)
        n = 0;
    int ret = 0;
    for (size_t i = 0; i < n && ret == 0; i++) {
        int type = -1;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUdeviceptr fp;
        if (REAL(cuGraphNodeGetType)(nodes[i], &type) != CUDA_SUCCESS)
            continue;
        if (type == NODE_MEM_FREE && REAL(cuGraphMemFreeNodeGetParams) &&
            REAL(cuGraphMemFreeNodeGetParams)(nodes[i], &fp) == CUDA_SUCCESS) {
            in->frees[in->nfree++] = fp;
            continue;
        }
        if (type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || REAL(cuGraphMemAllocNodeGetParams)(nodes[i], &p) != CUDA_SUCCESS)
            continue;
        int ord = p.poolProps.location.id, idx = vgpu_dev_index(ord);
        if (idx < 0) {
            *rc = idx == -2 ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_OUT_OF_MEMORY;
            ret = -1;
            break;
        }
        uint64_t r = p.bytesize > UINT64_MAX - GRAN ? UINT64_MAX : (p.bytesize + GRAN - 1) / GRAN * GRAN;
        in->allocs[in->nalloc++] = (struct galloc){p.dptr, r, idx, 0};
        in->bytes[idx] = vgpu_sat_add(in->bytes[idx], r);
        in->mask |= 1u << idx;
        g_ordinal[idx] = ord + 1;
    }
    free(nodes);
    for (size_t a = 0; a < in->nalloc; a++)
        for (size_t f = 0; f < in->nfree; f++)
            if (in->frees[f] == in->allocs[a].ptr)
                in->allocs[a].freed_in_graph = 1;
    if (ret != 0 || !in->mask) {
        info_free(in);
        return ret;
    }
    *out = in;
    return 0;
}

static int set_live(struct vgpu_rec *r, void *arg, int *rm)
{
    (void)rm;
    r->aux = (uint64_t)(uintptr_t)arg;
    return 0;
}

static void mark(uint64_t ptr, int live)
{
    vgpu_track_update(&g_gptr, ptr, set_live, (void *)(uintptr_t)live);
}

static int is_live(uint64_t ptr)
{
    struct vgpu_rec r;
    return vgpu_track_get(&g_gptr, ptr, &r) && r.aux;
}

/* What the launch of `in` can add to each graph pool: its allocations, less what the pool holds
 * idle (which the launch reuses), less its own live allocations when the launch frees them
 * first (AUTO_FREE_ON_LAUNCH).  Charged (lock held): 0, or -1 with nothing charged. */
static int precharge(const struct exec_info *in, uint64_t need[VGPU_MAX_DEVICES])
{
    uint64_t own[VGPU_MAX_DEVICES] = {0};
    if (in->flags & INST_AUTO_FREE_ON_LAUNCH)
        for (size_t a = 0; a < in->nalloc; a++)
            if (is_live(in->allocs[a].ptr))
                own[in->allocs[a].idx] += in->allocs[a].rsize;
    for (int d = 0; d < (int)VGPU_MAX_DEVICES; d++) {
        need[d] = 0;
        if (!(in->mask & (1u << d)))
            continue;
        uint64_t used = 0, reserved = 0;
        if (gmem_attr(d, GMEM_USED_CURRENT, &used) != 0 ||
            gmem_attr(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) != 0) {
            need[d] = in->bytes[d];
        } else {
            uint64_t after = vgpu_sat_add(used > own[d] ? used - own[d] : 0, in->bytes[d]);
            need[d] = after > reserved ? after - reserved : 0;
        }
        if (!need[d] || vgpu_charge(d, need[d], VGPU_KIND_DEVICE) == 0)
            continue;
        for (int e = 0; e < d; e++)
            if (need[e])
                vgpu_rgn_uncharge((unsigned)e, need[e], VGPU_KIND_DEVICE);
        return -1;
    }
    return 0;
}

static void settle_all(const struct exec_info *in, const uint64_t need[VGPU_MAX_DEVICES])
{
    for (int d = 0; d < (int)VGPU_MAX_DEVICES; d++)
        if (in->mask & (1u << d))
            settle(d, g_charged[d] + need[d]);
}

/* after a launch: what is live now */
static void launched(const struct exec_info *in)
{
    for (size_t a = 0; a < in->nalloc; a++)
        mark(in->allocs[a].ptr, !in->allocs[a].freed_in_graph);
    for (size_t f = 0; f < in->nfree; f++)
        mark(in->frees[f], 0);
}

static struct exec_info *info_get(CUgraphExec x)
{
    struct vgpu_rec r;
    return vgpu_track_get(&vgpu_t_exec, (uint64_t)(uintptr_t)x, &r) ? (struct exec_info *)(uintptr_t)r.ext : NULL;
}

void vgpu_graph_freed(CUdeviceptr p)
{
    if (vgpu_track_count(&g_gptr))
        mark(p, 0);
}

/* ------------------------------------------------------ instantiation */

static CUresult instantiate(CUgraphExec *px, CUgraph g, unsigned long long flags, int upload,
                            CUresult (*call)(const void *), const void *args)
{
    if (!vgpu_hook_active())
        return call(args);
    struct exec_info *in;
    CUresult rc = CUDA_SUCCESS;
    if (info_of(g, &in, &rc) != 0)
        return rc;
    if (!in)
        return call(args);
    in->flags = flags;
    pthread_mutex_lock(&g_graph_mu);
    uint64_t need[VGPU_MAX_DEVICES] = {0};
    if (upload && precharge(in, need) != 0) { /* instantiate-and-upload maps the memory now */
        pthread_mutex_unlock(&g_graph_mu);
        info_free(in);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_in_hook++;
    rc = call(args);
    vgpu_in_hook--;
    if (upload)
        settle_all(in, need);
    if (rc == CUDA_SUCCESS && px) {
        int ok = 1;
        for (size_t a = 0; ok && a < in->nalloc; a++) {
            struct vgpu_rec gr = {.key = in->allocs[a].ptr, .size = in->allocs[a].rsize,
                                  .dev = (uint32_t)in->allocs[a].idx};
            if (!vgpu_track_get(&g_gptr, gr.key, NULL))
                ok = vgpu_track_put(&g_gptr, &gr) == 0;
        }
        struct vgpu_rec r = {.key = (uint64_t)(uintptr_t)*px, .aux = in->mask, .ext = (uint64_t)(uintptr_t)in};
        if (ok && vgpu_track_put(&vgpu_t_exec, &r) == 0) {
            __atomic_add_fetch(&g_mem_execs, 1, __ATOMIC_SEQ_CST);
            in = NULL;
        } else {
            VLOG(VGPU_LOG_WARN, "graph tracking failed: its launches are charged after the fact");
        }
    }
    pthread_mutex_unlock(&g_graph_mu);
    info_free(in);
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
    return instantiate(px, g, 0, 0, call5, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *px, CUgraph g, CUgraphNode *err, char *log, size_t sz)
{
    NEED(cuGraphInstantiate_v2);
    struct inst5 a = {REAL(cuGraphInstantiate_v2), px, g, err, log, sz};
    return instantiate(px, g, 0, 0, call5, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *px, CUgraph g, unsigned long long flags)
{
    NEED(cuGraphInstantiateWithFlags);
    struct instf a = {REAL(cuGraphInstantiateWithFlags), px, g, flags};
    return instantiate(px, g, flags, 0, callf, &a);
}

static CUresult inst_params(CUresult (*fn)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *), CUgraphExec *px,
                            CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    struct instp a = {fn, px, g, p};
    unsigned long long flags = p ? p->flags : 0;
    return instantiate(px, g, flags, (flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) != 0, callp, &a);
}

VGPU_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *px, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    NEED(cuGraphInstantiateWithParams);
    return inst_params(REAL(cuGraphInstantiateWithParams), px, g, p);
}

VGPU_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *px, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    NEED(cuGraphInstantiateWithParams_ptsz);
    return inst_params(REAL(cuGraphInstantiateWithParams_ptsz), px, g, p);
}

VGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec x)
{
    NEED(cuGraphExecDestroy);
    CUresult rc = REAL(cuGraphExecDestroy)(x);
    if (rc == CUDA_SUCCESS && __atomic_load_n(&g_mem_execs, __ATOMIC_RELAXED) && vgpu_hook_active()) {
        struct vgpu_rec r;
        pthread_mutex_lock(&g_graph_mu);
        if (vgpu_track_take(&vgpu_t_exec, (uint64_t)(uintptr_t)x, &r)) {
            info_free((struct exec_info *)(uintptr_t)r.ext);
            __atomic_sub_fetch(&g_mem_execs, 1, __ATOMIC_SEQ_CST);
        }
        pthread_mutex_unlock(&g_graph_mu);
        /* what its launches mapped stays in the graph pool (and charged) until trimmed; its
         * live allocations stay live (and followed) until freed */
    }
    return rc;
}

/* ------------------------------------------------------- launch, upload */

/* A launch or upload of a graph with memory nodes: an allocation. */
static __attribute__((noinline)) CUresult launch_mem(CUresult (*fn)(CUgraphExec, CUstream), CUgraphExec x, CUstream s,
                                                     int is_launch)
{
    if (!fn)
        return CUDA_ERROR_NOT_FOUND;
    if (!vgpu_hook_active())
        return fn(x, s);
    pthread_mutex_lock(&g_graph_mu);
    struct exec_info *in = info_get(x);
    if (!in) {
        pthread_mutex_unlock(&g_graph_mu);
        return fn(x, s);
    }
    uint64_t need[VGPU_MAX_DEVICES] = {0};
    int own_live = 0;
    for (size_t a = 0; a < in->nalloc && !own_live; a++)
        own_live = is_live(in->allocs[a].ptr);
    /* a launch whose earlier allocations are still live is refused by the driver
     * (CUDA_ERROR_INVALID_VALUE) unless it frees them first: nothing to charge then */
    if (!(is_launch && own_live && !(in->flags & INST_AUTO_FREE_ON_LAUNCH)) && precharge(in, need) != 0) {
        pthread_mutex_unlock(&g_graph_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    vgpu_in_hook++;
    CUresult rc = fn(x, s);
    vgpu_in_hook--;
    settle_all(in, need); /* a failed launch: the pool did not grow, the charge goes back */
    if (rc == CUDA_SUCCESS && is_launch)
        launched(in);
    pthread_mutex_unlock(&g_graph_mu);
    return rc;
}

static __attribute__((noinline)) CUresult launch_slow(CUresult (**slot)(CUgraphExec, CUstream), CUgraphExec x,
                                                     CUstream s, int is_launch)
{
    vgpu_resolve_cuda();
    return launch_mem(__atomic_load_n(slot, __ATOMIC_RELAXED), x, s, is_launch);
}

/* the launch path: one load of the real pointer, one of the counter, a tail call */
#define GRAPH_FWD(name, is_launch)                                                          \
    VGPU_EXPORT CUresult name(CUgraphExec x, CUstream s)                                    \
    {                                                                                       \
        CUresult (*f)(CUgraphExec, CUstream) = REAL(name);                                  \
        if (LIKELY(f != NULL) && LIKELY(!__atomic_load_n(&g_mem_execs, __ATOMIC_RELAXED)))  \
            return f(x, s);                                                                 \
        return launch_slow(&real_##name, x, s, is_launch);                                  \
    }

GRAPH_FWD(cuGraphLaunch, 1)
GRAPH_FWD(cuGraphLaunch_ptsz, 1)
GRAPH_FWD(cuGraphUpload, 0)
GRAPH_FWD(cuGraphUpload_ptsz, 0)

VGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    NEED(cuDeviceGraphMemTrim);
    CUresult rc = REAL(cuDeviceGraphMemTrim)(dev);
    if (rc == CUDA_SUCCESS && vgpu_hook_active()) {
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
void vgpu_share_atfork_child(void);

void vgpu_hooks_atfork_child(void)
{
    vgpu_share_atfork_child();
    g_mem_execs = 0;
    memset(g_charged, 0, sizeof g_charged);
    vgpu_track_reset_child(&g_gptr);
    vgpu_pool_atfork_child();
}
