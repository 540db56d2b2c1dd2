/* fakegpu libcuda: stream capture, CUDA graphs, graph memory nodes and the graph memory pool.
 *
 * Written from NVIDIA's CUDA Driver API reference ("Stream Management": cuStreamBeginCapture,
 * cuStreamEndCapture, cuStreamIsCapturing, cuStreamGetCaptureInfo, cuThreadExchangeStreamCaptureMode;
 * "Graph Management": cuGraphCreate, cuGraphAddMemAllocNode, cuGraphAddMemFreeNode,
 * cuGraphInstantiateWithFlags/WithParams, cuGraphUpload, cuGraphLaunch, cuGraphExecDestroy,
 * cuGraphDestroy, cuDeviceGraphMemTrim, cuDeviceGetGraphMemAttribute,
 * cuDeviceSetGraphMemAttribute) and the CUDA C++ Programming Guide ("CUDA Graphs: Stream
 * Capture"; "Graph Memory Nodes": allocation lifetime, physical memory management and sharing,
 * physical memory footprint).  The model:
 *
 *  - A capture records into a graph what is issued to the capturing stream: kernels become
 *    kernel nodes, cuMemAllocAsync a memory allocation node, cuMemFreeAsync of a graph allocation
 *    a free node.  Nothing runs and no memory is taken while capturing.  Capturing the legacy
 *    stream, synchronising or querying a capturing stream (or the context while a capture is
 *    active) is CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture; operations on
 *    an invalidated capture are CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, and so is its end.
 *  - An allocation node gets its virtual address when it is created (fixed across instantiations
 *    and launches); the allocation lives from the moment a launch reaches it until a free node,
 *    cuMemFreeAsync or cuMemFree frees it.  Graph destruction does not free it.
 *  - Physical memory comes from the device's graph memory pool (per process, as the context's):
 *    USED_MEM_CURRENT is what live graph allocations take (each rounded up to the 2 MiB
 *    granularity), RESERVED_MEM_CURRENT the physical memory the pool holds, charged to the
 *    device.  A launch (or cuGraphUpload) that needs more grows the pool — or fails with
 *    CUDA_ERROR_OUT_OF_MEMORY when the device is full; freed graph memory stays in the pool for
 *    later launches until cuDeviceGraphMemTrim gives back what no live allocation uses.
 *  - A graph with memory nodes has at most one executable graph at a time; launching one whose
 *    allocations from an earlier launch are still live is CUDA_ERROR_INVALID_VALUE unless it was
 *    instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH (they are freed first).
 *
 * Simplifications: a launch performs its memory nodes at once, in node order (so memory is
 * taken no later than on a GPU); copies and memsets issued to a capturing stream execute
 * immediately instead of becoming nodes; dependencies are recorded but every graph runs in node
 * creation order, which is a valid topological order.
 */
#include "fg_cuda.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define GRAN (2ULL << 20)
#define FG_MAGIC_GRAPH 0x48505247u
#define FG_MAGIC_GNODE 0x444f4e47u
#define FG_MAGIC_GEXEC 0x43455847u
#define FG_MAGIC_GRAPH_GONE 0x44415247u
#define MAX_CAPTURES 64

/* CUgraphNodeType */
#define NT_KERNEL 0
#define NT_EMPTY 5
#define NT_MEM_ALLOC 10
#define NT_MEM_FREE 11
/* CUstreamCaptureStatus / CUstreamCaptureMode */
#define CAP_NONE 0
#define CAP_ACTIVE 1
#define CAP_INVALIDATED 2
#define MODE_GLOBAL 0
#define MODE_THREAD_LOCAL 1
#define MODE_RELAXED 2
/* CUgraphInstantiate_flags */
#define INST_AUTO_FREE_ON_LAUNCH 1ULL
#define INST_FLAGS_ALL 0xfULL
/* CUgraphMem_attribute */
#define GMEM_USED_CURRENT 0
#define GMEM_USED_HIGH 1
#define GMEM_RESERVED_CURRENT 2
#define GMEM_RESERVED_HIGH 3

/* CUmemPoolProps (88 bytes) and CUDA_MEM_ALLOC_NODE_PARAMS_v1 (cuda.h) */
struct pool_props {
    int allocType, handleTypes, locType, locId;
    void *win32;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
};
struct alloc_params {
    struct pool_props poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
};
_Static_assert(sizeof(struct pool_props) == 88, "CUmemPoolProps size");
_Static_assert(offsetof(struct alloc_params, bytesize) == 104, "CUDA_MEM_ALLOC_NODE_PARAMS layout");
_Static_assert(sizeof(struct alloc_params) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS size");

/* CUDA_KERNEL_NODE_PARAMS (v1; _v2 appends CUkernel kern, CUcontext ctx) */
struct kernel_params {
    CUfunction func;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams;
    void **extra;
};
_Static_assert(offsetof(struct kernel_params, kernelParams) == 40, "CUDA_KERNEL_NODE_PARAMS layout");

/* CUDA_GRAPH_INSTANTIATE_PARAMS */
struct inst_params {
    unsigned long long flags;
    CUstream hUploadStream;
    void *hErrNode_out;
    int result_out;
};

/* a graph allocation: the virtual range of one allocation node */
struct galloc {
    uint64_t ptr, size, rsize;
    int dev;
    int live;           /* between the launch that reached its node and its free */
    int freed_in_graph; /* its graph has a free node for it: cannot be freed outside */
    int refs;           /* the node and the executable graphs made from it */
    struct galloc *next;
};

struct fg_gnode {
    uint32_t magic;
    int type;
    struct fg_graph *g;
    struct fg_gnode *next;
    /* kernel */
    CUfunction f;
    unsigned grid[3], block[3];
    uint64_t arg0;
    int has_arg0;
    /* alloc / free */
    struct galloc *ga;
    struct alloc_params ap;
    uint64_t fptr;
};

struct fg_graph {
    uint32_t magic;
    int has_mem;
    int execs;
    size_t n;
    struct fg_gnode *head, *tail;
};

struct xnode {
    int type;
    CUfunction f;
    unsigned grid[3], block[3];
    uint64_t arg0;
    int has_arg0;
    struct galloc *ga;
};

struct fg_graphexec {
    uint32_t magic;
    unsigned long long flags;
    struct fg_graph *src; /* NULL once the graph is destroyed */
    size_t n;
    struct xnode *nodes;
};

struct capture {
    int used;
    CUstream key;    /* a created stream, or FG_STREAM_PER_THREAD */
    int origin;      /* begun here (not joined through an event) */
    int status;
    int mode;
    pthread_t thread;
    uint64_t id;
    struct fg_graph *g;
    struct fg_gnode *dep; /* the last node: the dependency of the next one */
};

static pthread_mutex_t g_gmu = PTHREAD_MUTEX_INITIALIZER;
static struct galloc *g_allocs;
static struct {
    uint64_t reserved, used, reserved_high, used_high;
} g_pool[FG_MAX_DEV];
static struct capture g_caps[MAX_CAPTURES];
static uint64_t g_capture_id;
int fg_capture_count; /* active capture records of this process (read without the lock) */
static __thread int tls_mode = MODE_GLOBAL;

static int graph_ok(const struct fg_graph *g)
{
    return g && g->magic == FG_MAGIC_GRAPH;
}

static int exec_ok(const struct fg_graphexec *x)
{
    return x && x->magic == FG_MAGIC_GEXEC;
}

static void ga_put(struct galloc *ga)
{
    if (--ga->refs > 0 || ga->live)
        return;
    struct fg_alloc a;
    fg_alloc_remove(ga->ptr, &a);
    fg_unmap_bytes(ga->ptr, ga->size);
    for (struct galloc **pp = &g_allocs; *pp; pp = &(*pp)->next)
        if (*pp == ga) {
            *pp = ga->next;
            break;
        }
    free(ga);
}

static struct galloc *ga_find(uint64_t ptr)
{
    for (struct galloc *ga = g_allocs; ga; ga = ga->next)
        if (ga->ptr == ptr)
            return ga;
    return NULL;
}

/* --- the graph memory pool (lock held) ------------------------------------------------- */

static CUresult pool_reserve(int dev, uint64_t need)
{
    if (need <= g_pool[dev].reserved)
        return CUDA_SUCCESS;
    uint64_t grow = need - g_pool[dev].reserved;
    CUresult rc = fg_charge(dev, grow, FG_KIND_DEVICE);
    if (rc)
        return rc;
    g_pool[dev].reserved += grow;
    if (g_pool[dev].reserved > g_pool[dev].reserved_high)
        g_pool[dev].reserved_high = g_pool[dev].reserved;
    return CUDA_SUCCESS;
}

static CUresult ga_make_live(struct galloc *ga)
{
    CUresult rc = pool_reserve(ga->dev, g_pool[ga->dev].used + ga->rsize);
    if (rc)
        return rc;
    g_pool[ga->dev].used += ga->rsize;
    if (g_pool[ga->dev].used > g_pool[ga->dev].used_high)
        g_pool[ga->dev].used_high = g_pool[ga->dev].used;
    ga->live = 1;
    return CUDA_SUCCESS;
}

static void ga_free(struct galloc *ga)
{
    ga->live = 0;
    g_pool[ga->dev].used -= ga->rsize <= g_pool[ga->dev].used ? ga->rsize : g_pool[ga->dev].used;
    madvise((void *)(uintptr_t)ga->ptr, ga->size, MADV_DONTNEED); /* contents do not survive */
    if (ga->refs == 0) {
        ga->refs = 1;
        ga_put(ga);
    }
}

/* --- graphs and nodes ------------------------------------------------------------------ */

static struct fg_graph *graph_new(void)
{
    struct fg_graph *g = calloc(1, sizeof(*g));
    if (g)
        g->magic = FG_MAGIC_GRAPH;
    return g;
}

static struct fg_gnode *node_add(struct fg_graph *g, int type)
{
    struct fg_gnode *n = calloc(1, sizeof(*n));
    if (!n)
        return NULL;
    n->magic = FG_MAGIC_GNODE;
    n->type = type;
    n->g = g;
    if (g->tail)
        g->tail->next = n;
    else
        g->head = n;
    g->tail = n;
    g->n++;
    return n;
}

static void graph_free(struct fg_graph *g)
{
    struct fg_gnode *n = g->head;
    while (n) {
        struct fg_gnode *next = n->next;
        if (n->type == NT_MEM_ALLOC && n->ga)
            ga_put(n->ga);
        n->magic = 0;
        free(n);
        n = next;
    }
    g->head = g->tail = NULL;
    g->n = 0;
    if (g->execs > 0) {
        g->magic = FG_MAGIC_GRAPH_GONE; /* freed when its last executable graph goes */
    } else {
        g->magic = 0;
        free(g);
    }
}

static int deps_ok(const struct fg_graph *g, struct fg_gnode *const *deps, size_t n)
{
    if (n && !deps)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (!deps[i] || deps[i]->magic != FG_MAGIC_GNODE || deps[i]->g != g)
            return 0;
        for (size_t j = 0; j < i; j++)
            if (deps[j] == deps[i])
                return 0; /* "dependencies may not have any duplicate entries" */
    }
    return 1;
}

/* An allocation node of size bytes on device dev (lock held). */
static CUresult add_alloc(struct fg_graph *g, int dev, uint64_t size, struct fg_gnode **out)
{
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct galloc *ga = calloc(1, sizeof(*ga));
    void *p = ga ? fg_map_bytes(size) : NULL;
    if (!p) {
        free(ga);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ga->ptr = (uint64_t)(uintptr_t)p;
    ga->size = size;
    ga->rsize = (size + GRAN - 1) / GRAN * GRAN;
    ga->dev = dev;
    ga->refs = 1;
    struct fg_alloc a = {.ptr = ga->ptr, .size = size, .dev = dev, .kind = FG_ALLOC_GRAPH};
    struct fg_gnode *n = NULL;
    if (fg_alloc_insert(&a) != 0 || !(n = node_add(g, NT_MEM_ALLOC))) {
        struct fg_alloc tmp;
        fg_alloc_remove(ga->ptr, &tmp);
        fg_unmap_bytes(ga->ptr, size);
        free(ga);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ga->next = g_allocs;
    g_allocs = ga;
    n->ga = ga;
    memset(&n->ap, 0, sizeof(n->ap));
    n->ap.poolProps.allocType = 1;
    n->ap.poolProps.locType = 1;
    n->ap.poolProps.locId = fg_ordinal_of(dev);
    n->ap.bytesize = size;
    n->ap.dptr = ga->ptr;
    g->has_mem = 1;
    *out = n;
    return CUDA_SUCCESS;
}

/* A free node for ptr (lock held): ptr must be an allocation node's address, freed once. */
static CUresult add_free(struct fg_graph *g, uint64_t ptr, struct fg_gnode **out)
{
    struct galloc *ga = ga_find(ptr);
    if (!ga)
        return CUDA_ERROR_INVALID_VALUE;
    for (struct fg_gnode *n = g->head; n; n = n->next)
        if (n->type == NT_MEM_FREE && n->fptr == ptr)
            return CUDA_ERROR_INVALID_VALUE; /* "an allocation twice in the same graph" */
    struct fg_gnode *n = node_add(g, NT_MEM_FREE);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    n->fptr = ptr;
    for (struct fg_gnode *m = g->head; m; m = m->next)
        if (m->type == NT_MEM_ALLOC && m->ga == ga)
            ga->freed_in_graph = 1;
    g->has_mem = 1;
    *out = n;
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphCreate(CUgraph *pg, unsigned int flags)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pg || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_graph *g = graph_new();
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pg = g;
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphDestroy(CUgraph g)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&g_gmu);
    if (!graph_ok(g)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* executable graphs made from it stay valid: they hold their own references */
    graph_free(g);
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphAddMemAllocNode(CUgraphNode *pn, CUgraph g, CUgraphNode const *deps, size_t ndeps,
                                       struct alloc_params *p)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pn || !p)
        return CUDA_ERROR_INVALID_VALUE;
    /* pinned device memory only; graph allocations are not exportable */
    if (p->poolProps.allocType != 1 || p->poolProps.locType != 1 || p->poolProps.handleTypes != 0 ||
        p->bytesize == 0 || (p->accessDescCount && !p->accessDescs))
        return CUDA_ERROR_INVALID_VALUE;
    int dev = fg_phys(p->poolProps.locId);
    if (dev < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_gmu);
    if (!graph_ok(g) || !deps_ok(g, deps, ndeps)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fg_gnode *n = NULL;
    rc = add_alloc(g, dev, p->bytesize, &n);
    if (rc == CUDA_SUCCESS) {
        n->ap.poolProps = p->poolProps;
        p->dptr = n->ga->ptr;
        *pn = n;
    }
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

FG_API CUresult cuGraphAddMemFreeNode(CUgraphNode *pn, CUgraph g, CUgraphNode const *deps, size_t ndeps,
                                      CUdeviceptr ptr)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pn)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_gmu);
    if (!graph_ok(g) || !deps_ok(g, deps, ndeps)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fg_gnode *n = NULL;
    rc = add_free(g, ptr, &n);
    if (rc == CUDA_SUCCESS)
        *pn = n;
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

static CUresult add_kernel(CUgraphNode *pn, CUgraph g, CUgraphNode const *deps, size_t ndeps,
                           const struct kernel_params *p)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pn || !p || !p->func || (p->kernelParams && p->extra))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_gmu);
    if (!graph_ok(g) || !deps_ok(g, deps, ndeps)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fg_gnode *n = node_add(g, NT_KERNEL);
    if (!n) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    n->f = p->func;
    unsigned v[6] = {p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ};
    memcpy(n->grid, v, sizeof(n->grid));
    memcpy(n->block, v + 3, sizeof(n->block));
    if (p->kernelParams && p->kernelParams[0]) { /* the kernel model reads the first argument */
        memcpy(&n->arg0, p->kernelParams[0], sizeof(n->arg0));
        n->has_arg0 = 1;
    }
    *pn = n;
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphAddKernelNode(CUgraphNode *pn, CUgraph g, CUgraphNode const *deps, size_t ndeps,
                                     const struct kernel_params *p)
{
    return add_kernel(pn, g, deps, ndeps, p);
}

FG_API CUresult cuGraphAddKernelNode_v2(CUgraphNode *pn, CUgraph g, CUgraphNode const *deps, size_t ndeps,
                                        const struct kernel_params *p)
{
    return add_kernel(pn, g, deps, ndeps, p);
}

FG_API CUresult cuGraphAddEmptyNode(CUgraphNode *pn, CUgraph g, CUgraphNode const *deps, size_t ndeps)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pn)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_gmu);
    struct fg_gnode *n = NULL;
    if (!graph_ok(g) || !deps_ok(g, deps, ndeps))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (!(n = node_add(g, NT_EMPTY)))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else
        *pn = n;
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

/* nodes NULL: *count = the number of nodes; else up to *count handles (*count = copied) */
FG_API CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *count)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_gmu);
    if (!graph_ok(g)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!nodes) {
        *count = g->n;
    } else {
        size_t k = 0;
        for (struct fg_gnode *n = g->head; n && k < *count; n = n->next)
            nodes[k++] = n;
        *count = k;
    }
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphNodeGetType(CUgraphNode n, int *type)
{
    if (!n || n->magic != FG_MAGIC_GNODE || !type)
        return CUDA_ERROR_INVALID_VALUE;
    *type = n->type;
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode n, struct alloc_params *out)
{
    if (!n || n->magic != FG_MAGIC_GNODE || n->type != NT_MEM_ALLOC || !out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = n->ap;
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphMemFreeNodeGetParams(CUgraphNode n, CUdeviceptr *out)
{
    if (!n || n->magic != FG_MAGIC_GNODE || n->type != NT_MEM_FREE || !out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = n->fptr;
    return CUDA_SUCCESS;
}

/* --- executable graphs ----------------------------------------------------------------- */

static CUresult instantiate(CUgraphExec *px, CUgraph g, unsigned long long flags, int *result)
{
    CUresult rc = fg_check_init();
    if (result)
        *result = 1; /* CUDA_GRAPH_INSTANTIATE_ERROR */
    if (rc)
        return rc;
    if (!px || (flags & ~INST_FLAGS_ALL))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_gmu);
    if (!graph_ok(g) || (g->has_mem && g->execs > 0)) {
        /* "Only one instantiation of the graph may exist at any point in time" */
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fg_graphexec *x = calloc(1, sizeof(*x));
    struct xnode *nodes = g->n ? calloc(g->n, sizeof(*nodes)) : NULL;
    if (!x || (g->n && !nodes)) {
        free(x);
        free(nodes);
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t k = 0;
    for (struct fg_gnode *n = g->head; n; n = n->next, k++) {
        struct xnode *xn = &nodes[k];
        xn->type = n->type;
        xn->f = n->f;
        memcpy(xn->grid, n->grid, sizeof(xn->grid));
        memcpy(xn->block, n->block, sizeof(xn->block));
        xn->arg0 = n->arg0;
        xn->has_arg0 = n->has_arg0;
        if (n->type == NT_MEM_ALLOC) {
            xn->ga = n->ga;
            n->ga->refs++;
        } else if (n->type == NT_MEM_FREE) {
            xn->ga = ga_find(n->fptr);
            if (xn->ga)
                xn->ga->refs++;
        }
    }
    x->magic = FG_MAGIC_GEXEC;
    x->flags = flags;
    x->src = g;
    x->n = g->n;
    x->nodes = nodes;
    g->execs++;
    pthread_mutex_unlock(&g_gmu);
    *px = x;
    if (result)
        *result = 0;
    return CUDA_SUCCESS;
}

/* CUDA 10: (exec, graph, errorNode, logBuffer, bufferSize); _v2 (11.0) has the same parameters */
FG_API CUresult cuGraphInstantiate(CUgraphExec *px, CUgraph g, CUgraphNode *err, char *log, size_t logsz)
{
    if (err)
        *err = NULL;
    if (log && logsz)
        log[0] = '\0';
    return instantiate(px, g, 0, NULL);
}

FG_API CUresult cuGraphInstantiate_v2(CUgraphExec *px, CUgraph g, CUgraphNode *err, char *log, size_t logsz)
{
    return cuGraphInstantiate(px, g, err, log, logsz);
}

FG_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *px, CUgraph g, unsigned long long flags)
{
    return instantiate(px, g, flags, NULL);
}

static CUresult upload(CUgraphExec x, CUstream s, int per_thread);

static CUresult inst_params(CUgraphExec *px, CUgraph g, struct inst_params *p, int per_thread)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    p->hErrNode_out = NULL;
    CUresult rc = instantiate(px, g, p->flags, &p->result_out);
    if (rc == CUDA_SUCCESS && (p->flags & 2)) /* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD */
        rc = upload(*px, p->hUploadStream, per_thread);
    return rc;
}

FG_API CUresult cuGraphInstantiateWithParams(CUgraphExec *px, CUgraph g, struct inst_params *p)
{
    return inst_params(px, g, p, 0);
}

FG_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *px, CUgraph g, struct inst_params *p)
{
    return inst_params(px, g, p, 1);
}

FG_API CUresult cuGraphExecDestroy(CUgraphExec x)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&g_gmu);
    if (!exec_ok(x)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* live allocations it made stay allocated (they are freed by cuMemFree(Async) or a graph) */
    for (size_t i = 0; i < x->n; i++)
        if (x->nodes[i].ga)
            ga_put(x->nodes[i].ga);
    struct fg_graph *src = x->src;
    if (src && src->execs > 0 && --src->execs == 0 && src->magic == FG_MAGIC_GRAPH_GONE) {
        src->magic = 0;
        free(src);
    }
    x->magic = 0;
    free(x->nodes);
    free(x);
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

static CUresult resolve_plain(CUstream s, int per_thread, int *dev, int *idx)
{
    CUresult rc = fg_stream_resolve(s, per_thread, dev, idx);
    if (rc)
        return rc;
    if (fg_capture_count && fg_capture_forbid(s, per_thread) != CUDA_SUCCESS)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* a graph launched into a capture: not modelled */
    return CUDA_SUCCESS;
}

/* cuGraphUpload: maps the physical memory the graph's allocations will need, so that the launch
 * does not have to. */
static CUresult upload(CUgraphExec x, CUstream s, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = resolve_plain(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    pthread_mutex_lock(&g_gmu);
    if (!exec_ok(x)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t need[FG_MAX_DEV] = {0};
    for (size_t i = 0; i < x->n; i++)
        if (x->nodes[i].type == NT_MEM_ALLOC && !x->nodes[i].ga->live)
            need[x->nodes[i].ga->dev] += x->nodes[i].ga->rsize;
    for (int d = 0; d < FG_MAX_DEV && rc == CUDA_SUCCESS; d++)
        if (need[d])
            rc = pool_reserve(d, g_pool[d].used + need[d]);
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

FG_API CUresult cuGraphUpload(CUgraphExec x, CUstream s)
{
    return upload(x, s, 0);
}

FG_API CUresult cuGraphUpload_ptsz(CUgraphExec x, CUstream s)
{
    return upload(x, s, 1);
}

static CUresult launch(CUgraphExec x, CUstream s, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = resolve_plain(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    pthread_mutex_lock(&g_gmu);
    if (!exec_ok(x)) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < x->n; i++) {
        struct xnode *xn = &x->nodes[i];
        if (xn->type == NT_MEM_ALLOC && xn->ga->live) {
            if (!(x->flags & INST_AUTO_FREE_ON_LAUNCH)) {
                pthread_mutex_unlock(&g_gmu);
                return CUDA_ERROR_INVALID_VALUE; /* allocations of an earlier launch are unfreed */
            }
            ga_free(xn->ga);
        }
    }
    /* memory nodes in order; an allocation that does not fit undoes this launch's allocations */
    for (size_t i = 0; i < x->n && rc == CUDA_SUCCESS; i++) {
        struct xnode *xn = &x->nodes[i];
        if (xn->type == NT_MEM_ALLOC) {
            rc = ga_make_live(xn->ga);
            if (rc)
                for (size_t j = 0; j < i; j++)
                    if (x->nodes[j].type == NT_MEM_ALLOC && x->nodes[j].ga->live)
                        ga_free(x->nodes[j].ga);
        } else if (xn->type == NT_MEM_FREE && xn->ga && xn->ga->live) {
            ga_free(xn->ga);
        }
    }
    pthread_mutex_unlock(&g_gmu);
    if (rc)
        return rc;
    for (size_t i = 0; i < x->n; i++) {
        struct xnode *xn = &x->nodes[i];
        if (xn->type != NT_KERNEL)
            continue;
        void *params[1] = {&xn->arg0};
        rc = fg_launch(xn->f, xn->grid[0], xn->grid[1], xn->grid[2], xn->block[0], xn->block[1], xn->block[2], s,
                       xn->has_arg0 ? params : NULL, NULL, per_thread);
        if (rc)
            return rc;
    }
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphLaunch(CUgraphExec x, CUstream s)
{
    return launch(x, s, 0);
}

FG_API CUresult cuGraphLaunch_ptsz(CUgraphExec x, CUstream s)
{
    return launch(x, s, 1);
}

/* --- frees of graph allocations outside graphs (cuda_mem.c, cuda_pool.c) ---------------- */

CUresult fg_graph_free_ptr(uint64_t ptr)
{
    pthread_mutex_lock(&g_gmu);
    struct galloc *ga = ga_find(ptr);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (ga && ga->live && !ga->freed_in_graph) {
        ga_free(ga);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

int fg_graph_live(uint64_t p, uint64_t n)
{
    int ok = 0;
    pthread_mutex_lock(&g_gmu);
    for (struct galloc *ga = g_allocs; ga; ga = ga->next)
        if (ga->live && p >= ga->ptr && n <= ga->size && p - ga->ptr <= ga->size - n) {
            ok = 1;
            break;
        }
    pthread_mutex_unlock(&g_gmu);
    return ok;
}

/* --- the graph memory pool's API ------------------------------------------------------ */

FG_API CUresult cuDeviceGraphMemTrim(CUdevice d)
{
    CUresult rc = fg_check_dev(d);
    if (rc)
        return rc;
    int dev = fg_phys(d);
    pthread_mutex_lock(&g_gmu);
    /* what no live allocation uses goes back (launches complete their memory work at once) */
    if (g_pool[dev].reserved > g_pool[dev].used) {
        fg_uncharge(dev, g_pool[dev].reserved - g_pool[dev].used, FG_KIND_DEVICE);
        g_pool[dev].reserved = g_pool[dev].used;
    }
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *value)
{
    CUresult rc = fg_check_dev(d);
    if (rc)
        return rc;
    if (!value || attr < GMEM_USED_CURRENT || attr > GMEM_RESERVED_HIGH)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = fg_phys(d);
    pthread_mutex_lock(&g_gmu);
    uint64_t v[] = {g_pool[dev].used, g_pool[dev].used_high, g_pool[dev].reserved, g_pool[dev].reserved_high};
    pthread_mutex_unlock(&g_gmu);
    *(uint64_t *)value = v[attr];
    return CUDA_SUCCESS;
}

/* only the high-water marks can be set, and only to 0 (reset to the current value) */
FG_API CUresult cuDeviceSetGraphMemAttribute(CUdevice d, int attr, void *value)
{
    CUresult rc = fg_check_dev(d);
    if (rc)
        return rc;
    if (!value || (attr != GMEM_USED_HIGH && attr != GMEM_RESERVED_HIGH) || *(uint64_t *)value != 0)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = fg_phys(d);
    pthread_mutex_lock(&g_gmu);
    if (attr == GMEM_USED_HIGH)
        g_pool[dev].used_high = g_pool[dev].used;
    else
        g_pool[dev].reserved_high = g_pool[dev].reserved;
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

/* --- stream capture ------------------------------------------------------------------- */

/* The capture key of a stream, 0 ok; legacy stream: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. */
static CUresult cap_key(CUstream s, int per_thread, CUstream *key)
{
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    if (idx == FG_SIDX_LEGACY)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    *key = idx == FG_SIDX_PTDS ? FG_STREAM_PER_THREAD : s;
    return CUDA_SUCCESS;
}

static struct capture *cap_find(CUstream key)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (g_caps[i].used && g_caps[i].key == key)
            return &g_caps[i];
    return NULL;
}

static struct capture *cap_of(CUstream s, int per_thread)
{
    CUstream key;
    if (s == FG_STREAM_LEGACY || (s == NULL && !per_thread))
        return NULL;
    if (cap_key(s, per_thread, &key) != CUDA_SUCCESS)
        return NULL;
    return cap_find(key);
}

static void cap_remove_all(uint64_t id)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (g_caps[i].used && g_caps[i].id == id) {
            g_caps[i].used = 0;
            __atomic_sub_fetch(&fg_capture_count, 1, __ATOMIC_RELAXED);
        }
}

static void cap_invalidate(uint64_t id)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (g_caps[i].used && g_caps[i].id == id)
            g_caps[i].status = CAP_INVALIDATED;
}

static CUresult begin_capture(CUstream s, int mode, int per_thread)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstream key;
    if ((rc = cap_key(s, per_thread, &key)))
        return rc;
    pthread_mutex_lock(&g_gmu);
    struct capture *c = NULL;
    if (cap_find(key)) {
        rc = CUDA_ERROR_ILLEGAL_STATE; /* already capturing */
    } else {
        for (int i = 0; i < MAX_CAPTURES && !c; i++)
            if (!g_caps[i].used)
                c = &g_caps[i];
        struct fg_graph *g = c ? graph_new() : NULL;
        if (!g) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *c = (struct capture){.used = 1, .key = key, .origin = 1, .status = CAP_ACTIVE, .mode = mode,
                                  .thread = pthread_self(), .id = ++g_capture_id, .g = g};
            __atomic_add_fetch(&fg_capture_count, 1, __ATOMIC_RELAXED);
        }
    }
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

FG_API CUresult cuStreamBeginCapture(CUstream s)
{
    return begin_capture(s, MODE_GLOBAL, 0);
}

FG_API CUresult cuStreamBeginCapture_v2(CUstream s, int mode)
{
    return begin_capture(s, mode, 0);
}

FG_API CUresult cuStreamBeginCapture_ptsz(CUstream s, int mode)
{
    return begin_capture(s, mode, 1);
}

static CUresult end_capture(CUstream s, CUgraph *pg, int per_thread)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pg)
        return CUDA_ERROR_INVALID_VALUE;
    CUstream key;
    if ((rc = cap_key(s, per_thread, &key)))
        return rc == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ? CUDA_ERROR_ILLEGAL_STATE : rc;
    pthread_mutex_lock(&g_gmu);
    struct capture *c = cap_find(key);
    if (!c || !c->origin) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_ILLEGAL_STATE; /* not capturing (or not where the capture began) */
    }
    if (c->mode != MODE_RELAXED && !pthread_equal(c->thread, pthread_self())) {
        pthread_mutex_unlock(&g_gmu);
        return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    }
    struct fg_graph *g = c->g;
    int status = c->status;
    cap_remove_all(c->id);
    if (status == CAP_INVALIDATED) {
        graph_free(g);
        *pg = NULL;
        rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else {
        *pg = g;
    }
    pthread_mutex_unlock(&g_gmu);
    return rc;
}

FG_API CUresult cuStreamEndCapture(CUstream s, CUgraph *pg)
{
    return end_capture(s, pg, 0);
}

FG_API CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *pg)
{
    return end_capture(s, pg, 1);
}

static CUresult capture_info(CUstream s, int per_thread, int *status, uint64_t *id, CUgraph *graph,
                             CUgraphNode const **deps, size_t *ndeps)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = 0, idx = 0;
    if ((rc = fg_stream_resolve(s, per_thread, &dev, &idx)))
        return rc;
    pthread_mutex_lock(&g_gmu);
    struct capture *c = idx == FG_SIDX_LEGACY ? NULL : cap_of(s, per_thread);
    *status = c ? c->status : CAP_NONE;
    if (c && id)
        *id = c->id;
    if (graph)
        *graph = c ? c->g : NULL;
    if (deps)
        *deps = c && c->dep ? (CUgraphNode const *)&c->dep : NULL;
    if (ndeps)
        *ndeps = c && c->dep ? 1 : 0;
    pthread_mutex_unlock(&g_gmu);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamIsCapturing(CUstream s, int *status)
{
    return capture_info(s, 0, status, NULL, NULL, NULL, NULL);
}

FG_API CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status)
{
    return capture_info(s, 1, status, NULL, NULL, NULL, NULL);
}

FG_API CUresult cuStreamGetCaptureInfo(CUstream s, int *status, uint64_t *id)
{
    return capture_info(s, 0, status, id, NULL, NULL, NULL);
}

FG_API CUresult cuStreamGetCaptureInfo_ptsz(CUstream s, int *status, uint64_t *id)
{
    return capture_info(s, 1, status, id, NULL, NULL, NULL);
}

FG_API CUresult cuStreamGetCaptureInfo_v2(CUstream s, int *status, uint64_t *id, CUgraph *graph,
                                          CUgraphNode const **deps, size_t *ndeps)
{
    return capture_info(s, 0, status, id, graph, deps, ndeps);
}

FG_API CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream s, int *status, uint64_t *id, CUgraph *graph,
                                               CUgraphNode const **deps, size_t *ndeps)
{
    return capture_info(s, 1, status, id, graph, deps, ndeps);
}

/* _v3 (12.3) adds the edge data of the dependencies (none here: default edges) */
FG_API CUresult cuStreamGetCaptureInfo_v3(CUstream s, int *status, uint64_t *id, CUgraph *graph,
                                          CUgraphNode const **deps, const void **edges, size_t *ndeps)
{
    if (edges)
        *edges = NULL;
    return capture_info(s, 0, status, id, graph, deps, ndeps);
}

FG_API CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream s, int *status, uint64_t *id, CUgraph *graph,
                                               CUgraphNode const **deps, const void **edges, size_t *ndeps)
{
    if (edges)
        *edges = NULL;
    return capture_info(s, 1, status, id, graph, deps, ndeps);
}

FG_API CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    if (!mode || *mode < MODE_GLOBAL || *mode > MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    int old = tls_mode;
    tls_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* The work of a capturing stream: 1 when s captures (*rc is the answer), 0 to run it. */
static struct capture *capturing(CUstream s, int per_thread, CUresult *rc)
{
    struct capture *c = cap_of(s, per_thread);
    if (c && c->status == CAP_INVALIDATED)
        *rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    return c;
}

int fg_capture_alloc(CUstream s, int per_thread, int dev, uint64_t size, CUdeviceptr *dptr, CUresult *rc)
{
    if (!__atomic_load_n(&fg_capture_count, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&g_gmu);
    *rc = CUDA_SUCCESS;
    struct capture *c = capturing(s, per_thread, rc);
    if (c && *rc == CUDA_SUCCESS) {
        struct fg_gnode *n = NULL;
        *rc = add_alloc(c->g, dev, size, &n);
        if (*rc == CUDA_SUCCESS) {
            c->dep = n;
            *dptr = n->ga->ptr;
        }
    }
    pthread_mutex_unlock(&g_gmu);
    return c != NULL;
}

int fg_capture_free(CUstream s, int per_thread, CUdeviceptr p, CUresult *rc)
{
    if (!__atomic_load_n(&fg_capture_count, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&g_gmu);
    *rc = CUDA_SUCCESS;
    struct capture *c = capturing(s, per_thread, rc);
    if (c && *rc == CUDA_SUCCESS) {
        struct fg_gnode *n = NULL;
        *rc = add_free(c->g, p, &n);
        if (*rc == CUDA_SUCCESS)
            c->dep = n;
    }
    pthread_mutex_unlock(&g_gmu);
    return c != NULL;
}

int fg_capture_kernel(CUstream s, int per_thread, CUfunction f, const unsigned grid[3], const unsigned block[3],
                      void **params, CUresult *rc)
{
    if (!__atomic_load_n(&fg_capture_count, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&g_gmu);
    *rc = CUDA_SUCCESS;
    struct capture *c = capturing(s, per_thread, rc);
    if (c && *rc == CUDA_SUCCESS) {
        struct fg_gnode *n = node_add(c->g, NT_KERNEL);
        if (!n) {
            *rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            n->f = f;
            memcpy(n->grid, grid, sizeof(n->grid));
            memcpy(n->block, block, sizeof(n->block));
            if (params && params[0]) {
                memcpy(&n->arg0, params[0], sizeof(n->arg0));
                n->has_arg0 = 1;
            }
            c->dep = n;
        }
    }
    pthread_mutex_unlock(&g_gmu);
    return c != NULL;
}

CUresult fg_capture_forbid(CUstream s, int per_thread)
{
    if (!__atomic_load_n(&fg_capture_count, __ATOMIC_RELAXED))
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_gmu);
    struct capture *c = cap_of(s, per_thread);
    if (c)
        cap_invalidate(c->id);
    pthread_mutex_unlock(&g_gmu);
    return c ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

CUresult fg_capture_forbid_ctx(void)
{
    if (!__atomic_load_n(&fg_capture_count, __ATOMIC_RELAXED))
        return CUDA_SUCCESS;
    /* synchronising the context while any of its streams captures: every capture is broken */
    pthread_mutex_lock(&g_gmu);
    int any = 0;
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (g_caps[i].used) {
            g_caps[i].status = CAP_INVALIDATED;
            any = 1;
        }
    pthread_mutex_unlock(&g_gmu);
    return any ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* Events recorded in a capture: the capture id (0: none); a stream waiting on such an event
 * joins the capture. */
uint64_t fg_capture_event_record(CUstream s, int per_thread)
{
    if (!__atomic_load_n(&fg_capture_count, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&g_gmu);
    struct capture *c = cap_of(s, per_thread);
    uint64_t id = c ? c->id : 0;
    pthread_mutex_unlock(&g_gmu);
    return id;
}

CUresult fg_capture_join(CUstream s, int per_thread, uint64_t id)
{
    CUstream key;
    CUresult rc = cap_key(s, per_thread, &key);
    if (rc)
        return rc == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : rc;
    pthread_mutex_lock(&g_gmu);
    struct capture *src = NULL;
    for (int i = 0; i < MAX_CAPTURES && !src; i++)
        if (g_caps[i].used && g_caps[i].id == id)
            src = &g_caps[i];
    struct capture *c = cap_find(key);
    if (!src) {
        rc = CUDA_SUCCESS; /* that capture has ended */
    } else if (c) {
        rc = c->id == id ? CUDA_SUCCESS : CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
    } else {
        for (int i = 0; i < MAX_CAPTURES && !c; i++)
            if (!g_caps[i].used)
                c = &g_caps[i];
        if (!c) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *c = *src;
            c->key = key;
            c->origin = 0;
            __atomic_add_fetch(&fg_capture_count, 1, __ATOMIC_RELAXED);
        }
    }
    pthread_mutex_unlock(&g_gmu);
    return rc;
}
