/* fakegpu: CUDA driver API types (ABI-compatible with cuda.h for the parts implemented) and the
 * process-local driver state shared by the cuda_*.c files. */
#ifndef FG_CUDA_H
#define FG_CUDA_H

#include "fg_state.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define FG_API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct fg_ctx *CUcontext;
typedef struct fg_streamh *CUstream;
typedef struct fg_module *CUmodule;
typedef struct fg_func *CUfunction;
typedef struct fg_pool *CUmemoryPool;
typedef struct fg_array *CUarray;
typedef struct fg_event *CUevent;
typedef struct fg_graphexec *CUgraphExec;
typedef struct fg_graph *CUgraph;
typedef struct fg_gnode *CUgraphNode;
typedef struct {
    char bytes[16];
} CUuuid;

/* cuda.h cudaError_enum values */
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ARRAY_IS_MAPPED = 207,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_MAP_FAILED = 205,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_INVALID_SOURCE = 300,
    CUDA_ERROR_FILE_NOT_FOUND = 301,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    CUDA_ERROR_UNKNOWN = 999,
};

/* CUstream special handles */
#define FG_STREAM_LEGACY ((CUstream)0x1)
#define FG_STREAM_PER_THREAD ((CUstream)0x2)
#define FG_SIDX_LEGACY 0
#define FG_SIDX_PTDS 1

#define FG_MAGIC_CTX 0x43545846u
#define FG_MAGIC_STREAM 0x53545246u
#define FG_MAGIC_MOD 0x4d4f4446u
#define FG_MAGIC_FUNC 0x46554e46u
#define FG_MAGIC_POOL 0x504f4f46u
#define FG_MAGIC_ARRAY 0x41525246u
#define FG_MAGIC_EVENT 0x45564e46u

#define FG_MAX_CTX 256

struct fg_ctx {
    uint32_t magic;
    int dev;
    int primary;
    unsigned flags;
    int active; /* a primary context's handle outlives its activity (release/reset, retain again) */
    unsigned long long id; /* cuCtxGetId: unique in the process */
};

struct fg_streamh {
    uint32_t magic;
    int dev;
    int idx;
    unsigned flags;
    struct fg_ctx *ctx;
    int priority;
    unsigned long long id;
};

/* process-local driver state */
struct fg_drv {
    int inited;
    pthread_mutex_t mu; /* taken before the global state lock, never after */
    struct fg_ctx ctxs[FG_MAX_CTX];
    unsigned primary_refs[FG_MAX_DEV];
    unsigned primary_flags[FG_MAX_DEV];
    int primary_idx[FG_MAX_DEV]; /* index into ctxs, -1 if not active */
    unsigned next_stream[FG_MAX_DEV];
};

extern struct fg_drv fg_drv;

/* cuda_init.c */
CUresult fg_check_init(void);
CUresult fg_check_dev(CUdevice dev);
/* The current context (validated), or NULL with *err set. */
struct fg_ctx *fg_current(CUresult *err);
int fg_ctx_valid(const struct fg_ctx *c);
/* Charge/uncharge device memory of this process (lock taken inside).  Returns CUDA_SUCCESS or
 * CUDA_ERROR_OUT_OF_MEMORY when it does not fit physically. */
CUresult fg_charge(int dev, uint64_t bytes, int kind);
void fg_uncharge(int dev, uint64_t bytes, int kind);
#define FG_KIND_DEVICE 0
#define FG_KIND_MANAGED_DEV 1
#define FG_KIND_MANAGED_HOST 2
CUresult fg_ctx_charge(int dev, int add); /* +1/-1 context */
int fg_dev_lost(int dev);
int fg_phys(CUdevice d);          /* CUDA ordinal -> state index, -1 if invalid */
int fg_ordinal_of(int physdev);    /* state index -> CUDA ordinal, -1 if hidden */
uint64_t fg_dev_free(int dev);     /* physically free bytes */
int fg_vmm_mapped(uint64_t p, uint64_t n);
int fg_vmm_host(uint64_t p);      /* 1 if p is mapped to a host-located handle (cuda_vmm.c) */

/* cuda_um.c: unified memory.  Advice of a managed allocation (whole allocations: a range
 * advised applies to every allocation it overlaps). */
#define FG_LOC_NONE 0
#define FG_LOC_DEVICE 1
#define FG_LOC_HOST 2
struct fg_um_advice {
    int pref;             /* FG_LOC_*: preferred location */
    int pref_dev;         /* state index, with FG_LOC_DEVICE */
    uint32_t accessed_by; /* state indices with SET_ACCESSED_BY */
    int read_mostly;
};
/* Device time of a kernel that reads [ptr, ptr+bytes) once on device dev (state index): device
 * memory at memory_bandwidth, host memory (pinned, host-resident managed, host-NUMA VMM) at
 * host_link_bandwidth; managed memory without a host preference migrates to the device first
 * where it fits.  CUDA_SUCCESS, or CUDA_ERROR_INVALID_VALUE for an address outside any
 * allocation. */
CUresult fg_um_touch_ns(int dev, uint64_t ptr, uint64_t bytes, uint64_t *ns);

/* cuda_mem.c: the allocation table */
#define FG_ALLOC_DEVICE 1
#define FG_ALLOC_PITCH 2
#define FG_ALLOC_MANAGED 3
#define FG_ALLOC_ASYNC 4
#define FG_ALLOC_HOST 5
#define FG_ALLOC_VA 6 /* cuMemAddressReserve range */
#define FG_ALLOC_MODULE 7 /* a module's global variable: not charged, not freeable */
#define FG_ALLOC_GRAPH 8 /* a graph allocation's range (cuda_graph.c) */
#define FG_ALLOC_HOSTREG 9 /* host memory registered with cuMemHostRegister (cuda_ipc.c) */
#define FG_ALLOC_IMPORT 10 /* a cuIpcOpenMemHandle mapping (cuda_ipc.c) */
#define FG_ALLOC_POOLIMPORT 11 /* a cuMemPoolImportPointer mapping (cuda_pool.c) */
struct fg_alloc {
    uint64_t ptr;
    uint64_t size;     /* bytes usable */
    uint64_t charged;  /* bytes charged to the device (managed: resident part) */
    uint64_t host;     /* managed bytes not on the device (host-resident or not yet touched) */
    int dev;
    int kind;
    struct fg_ctx *ctx;
    struct fg_pool *pool;
    int shared;        /* index + 1 of its entry in the state's shared table (cuda_ipc.c), 0 none */
    uint64_t shared_gen;
    int refs;          /* FG_ALLOC_IMPORT: cuIpcOpenMemHandle opens of the same handle */
    struct fg_um_advice um; /* managed: the cuMemAdvise state (cuda_um.c) */
};
/* Replaces the record of the allocation at ptr (same start). 0 or -1. */
int fg_alloc_update(const struct fg_alloc *a);
/* The allocation of that kind mapping shared entry (shared, gen): 0, or -1. */
int fg_alloc_find_shared(int kind, int shared, uint64_t gen, struct fg_alloc *out);
int fg_alloc_insert(const struct fg_alloc *a);
int fg_alloc_remove(uint64_t ptr, struct fg_alloc *out); /* exact start */
/* Finds the allocation containing [p, p+n); 0 or -1. */
int fg_alloc_find(uint64_t p, uint64_t n, struct fg_alloc *out);
/* Calls fn on every allocation overlapping [p, p+n) under the table lock, in address order
 * (fn may charge and uncharge; it must not call the table).  Returns how many. */
int fg_alloc_each(uint64_t p, uint64_t n, void (*fn)(struct fg_alloc *, void *), void *arg);
void fg_alloc_free_ctx(struct fg_ctx *c); /* frees every allocation of a context */
void *fg_map_bytes(uint64_t size);
/* [p, p+n) inside one device allocation (or mapped VMM range) of this process: 0 or an error */
CUresult fg_check_dev_range(CUdeviceptr p, size_t n);
/* before a synchronous copy/set: waits for the (per-thread or legacy) default stream's work */
CUresult fg_copy_sync(int per_thread);
/* before an asynchronous copy/set on stream s: waits for that stream's earlier kernels */
CUresult fg_copy_async(CUstream s, int per_thread);
void fg_unmap_bytes(uint64_t ptr, uint64_t size);

/* cuda_stream.c */
/* Resolves a stream handle: device and queue index.  per_thread: the _ptsz/_ptds variant. */
CUresult fg_stream_resolve(CUstream s, int per_thread, int *dev, int *idx);
CUresult fg_wait_idle(int dev, int idx); /* idx -1: every stream of the device */
CUresult fg_pools_sync(int dev); /* releases pool memory above thresholds (cuda_pool.c) */

/* cuda_graph.c: stream capture and graph allocations.  fg_capture_count: active captures in
 * this process (0: the fast path of every hook below). */
extern int fg_capture_count;
/* 1 if stream s captures: the operation became a graph node (or failed: *rc) */
int fg_capture_alloc(CUstream s, int per_thread, int dev, uint64_t size, CUdeviceptr *dptr, CUresult *rc);
int fg_capture_free(CUstream s, int per_thread, CUdeviceptr p, CUresult *rc);
int fg_capture_kernel(CUstream s, int per_thread, CUfunction f, const unsigned grid[3], const unsigned block[3],
                      void **params, CUresult *rc);
/* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (and the capture invalidated) when s captures */
CUresult fg_capture_forbid(CUstream s, int per_thread);
CUresult fg_capture_forbid_ctx(void); /* the same for a context-wide synchronisation */
uint64_t fg_capture_event_record(CUstream s, int per_thread); /* capture id of s, 0 none */
CUresult fg_capture_join(CUstream s, int per_thread, uint64_t id);
CUresult fg_graph_free_ptr(uint64_t ptr); /* cuMemFree(Async) of a graph allocation */
int fg_graph_live(uint64_t p, uint64_t n);

/* cuda_ipc.c: allocations shared between processes (the state's shared table, fg_shared.c).
 * fg_share_new: a new entry held by this process (counting `counted` bytes of its charge) and its
 * backing file of size bytes: the open descriptor, or -1 with *rc.  fg_share_open: becomes a
 * holder of entry (idx, gen) of that kind and opens its file (size, device set): fd or -1 (*rc).
 * fg_share_import_fd: becomes a holder of the entry whose file fd is: 0, or -1.
 * fg_share_drop: lets go of it.  fg_share_map: maps a file MAP_SHARED (at: MAP_FIXED there). */
int fg_share_new(uint32_t kind, int dev, uint64_t size, uint64_t counted, int *idx, uint64_t *gen, CUresult *rc);
int fg_share_open(int idx, uint64_t gen, uint32_t kind, uint64_t *size, int *dev, CUresult *rc);
int fg_share_import_fd(int fd, uint32_t kind, int *idx, uint64_t *gen, uint64_t *size, int *dev);
void fg_share_drop(int idx, uint64_t gen);
void *fg_share_map(int fd, uint64_t size, uint64_t at);
/* Releases an allocation that maps a shared entry (exported, IPC-opened, pool-imported): 1 if
 * it was one (unmapped, this process no longer holds it), 0 otherwise. */
int fg_ipc_free(const struct fg_alloc *a);

/* cuda_module.c */
CUresult fg_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   CUstream s, void **params, void **extra, int per_thread);

/* cuda_module.c: a kernel that is not one of the built-in spin/spin_us/noop runs this long */
#define FG_KERNEL_NS 10000ULL
CUresult fg_module_load_fatbin_wrapper(CUmodule *pm, const void *wrapper);

/* cuda_fatbin.c: kernels and variables of a module image */
struct fg_image_var {
    char *name;
    uint64_t size;
};
struct fg_image_syms {
    char **kern;
    int nkern;
    struct fg_image_var *vars;
    int nvars;
    int opaque; /* an entry could not be read (zstd without libzstd): names are taken as asked */
};
int fg_image_parse(const void *image, struct fg_image_syms *out); /* 0, or -1: not an image */
void fg_image_free(struct fg_image_syms *s);

/* cuda_ctx.c: the device's primary context handle without retaining it (CUDART_INTERFACE[2]) */
CUresult fg_primary_ctx_handle(CUcontext *pctx, CUdevice dev);
CUresult fg_ctx_id(CUcontext ctx, unsigned long long *id); /* NULL: the current context */
/* cuda_export.c */
void fg_cls_ctx_destroyed(struct fg_ctx *ctx); /* runs the runtime's context-local destructors */
int fg_trace_on(void);
void fg_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
