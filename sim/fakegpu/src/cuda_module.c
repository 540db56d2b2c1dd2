/* fakegpu libcuda: modules, libraries, kernels and launches.
 *
 * A module (cuModuleLoad*, cuModuleLoadFatBinary, cuLibraryLoad*, and the runtime's
 * CUDART_INTERFACE slots) is read far enough to know its kernels and global variables
 * (cuda_fatbin.c): an image that is none of fatbin, cubin or PTX is CUDA_ERROR_INVALID_IMAGE and a
 * name the image does not define is CUDA_ERROR_NOT_FOUND, as on the real driver.  Kernels are not
 * executed; a launch is timed work in the kernel model:
 *   "spin"    (unsigned long long ns)  runs ns nanoseconds
 *   "spin_us" (unsigned long long us)  runs us microseconds
 *   "noop"    ()                       runs 0 ns
 *   "touch"   (CUdeviceptr p, unsigned long long bytes)  reads [p, p+bytes) once: its run time is
 *             what that costs where the bytes live (cuda_um.c: device memory at the device's
 *             memory bandwidth, host memory at its host-link bandwidth; managed memory migrates
 *             first, as on a fault)
 *   any other kernel                   runs FG_KERNEL_NS
 * (fakegpu-burn ships PTX with a "spin" kernel of the same signature that spins on %globaltimer,
 * so the same program runs on a real GPU.)  Global variables get host-backed memory of their size
 * when first looked up, so cudaMemcpyToSymbol and friends move real bytes; like module code they
 * are not charged to the device (a simplification, docs/developers/simulators.md).
 *
 * A library (CUDA 12's context-independent loading) holds one module; its CUkernel handles are
 * the module's CUfunction handles (CUDA accepts a CUkernel wherever a CUfunction is launched).
 */
#include "fg_cuda.h"

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define KIND_SPIN_NS 1
#define KIND_SPIN_US 2
#define KIND_NOOP 3
#define KIND_OTHER 4
#define KIND_TOUCH 5
#define MAX_KERNEL_NS (3600ULL * 1000000000ULL)
#define FG_MAGIC_LIB 0x42494c46u

struct fg_func {
    uint32_t magic;
    int kind;
    struct fg_module *mod;
    char *name;
    int max_dyn_smem; /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as set */
    int carveout;
    int cache_config;
    struct fg_func *next;
};

struct modvar {
    char *name;
    uint64_t size, ptr; /* ptr 0 until first looked up */
};

struct fg_module {
    uint32_t magic;
    int opaque; /* an entry could not be read: names are taken as asked */
    char **kern;
    int nkern;
    struct modvar *vars;
    int nvars;
    struct fg_func *funcs;
    pthread_mutex_t mu;
};

struct fg_library {
    uint32_t magic;
    struct fg_module *mod;
};

static int func_kind(const char *name)
{
    return !strcmp(name, "spin") ? KIND_SPIN_NS : !strcmp(name, "spin_us") ? KIND_SPIN_US
           : !strcmp(name, "noop")                                      ? KIND_NOOP
           : !strcmp(name, "touch")                                     ? KIND_TOUCH
                                                                         : KIND_OTHER;
}

static void module_free(struct fg_module *m)
{
    for (int i = 0; i < m->nkern; i++)
        free(m->kern[i]);
    free(m->kern);
    for (int i = 0; i < m->nvars; i++) {
        if (m->vars[i].ptr) {
            struct fg_alloc a;
            if (fg_alloc_remove(m->vars[i].ptr, &a) == 0)
                fg_unmap_bytes(a.ptr, a.size);
        }
        free(m->vars[i].name);
    }
    free(m->vars);
    /* function handles stay allocated (a stale handle must read as invalid, not as freed memory) */
    for (struct fg_func *f = m->funcs; f; f = f->next)
        f->magic = 0;
    m->magic = 0;
}

/* Loads an image into a new module; needs no context (libraries) when ctx_free is set. */
static CUresult module_load(struct fg_module **pm, const void *image, int need_ctx)
{
    CUresult rc;
    if (!pm || !image)
        return CUDA_ERROR_INVALID_VALUE;
    if (need_ctx) {
        if (!fg_current(&rc))
            return rc;
    } else if ((rc = fg_check_init())) {
        return rc;
    }
    struct fg_image_syms syms;
    if (fg_image_parse(image, &syms) != 0) {
        fg_trace("module load: not a fatbin, cubin or PTX image: CUDA_ERROR_INVALID_IMAGE");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    struct fg_module *m = calloc(1, sizeof(*m));
    struct modvar *vars = calloc((size_t)syms.nvars + 1, sizeof(*vars));
    if (!m || !vars) {
        free(m);
        free(vars);
        fg_image_free(&syms);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    m->mu = fresh;
    m->opaque = syms.opaque;
    m->kern = syms.kern;
    m->nkern = syms.nkern;
    for (int i = 0; i < syms.nvars; i++) {
        vars[i].name = syms.vars[i].name;
        vars[i].size = syms.vars[i].size;
    }
    free(syms.vars);
    m->vars = vars;
    m->nvars = syms.nvars;
    m->magic = FG_MAGIC_MOD;
    fg_trace("module %p: %d kernels, %d variables%s", (void *)m, m->nkern, m->nvars, m->opaque ? ", opaque" : "");
    *pm = m;
    return CUDA_SUCCESS;
}

static int module_valid(const struct fg_module *m)
{
    return m && m->magic == FG_MAGIC_MOD;
}

static CUresult module_function(CUfunction *pf, struct fg_module *m, const char *name);

FG_API CUresult cuModuleLoadData(CUmodule *pm, const void *image)
{
    return module_load(pm, image, 1);
}

/* JIT options only steer compilation, which the simulator does not do. */
FG_API CUresult cuModuleLoadDataEx(CUmodule *pm, const void *image, unsigned int n, void *opts, void **vals)
{
    if (n && (!opts || !vals))
        return CUDA_ERROR_INVALID_VALUE;
    return cuModuleLoadData(pm, image);
}

FG_API CUresult cuModuleLoadFatBinary(CUmodule *pm, const void *fatbin)
{
    return cuModuleLoadData(pm, fatbin);
}

/* The runtime's CUDART_INTERFACE hands over the __fatBinC_Wrapper_t of a registered fatbin. */
CUresult fg_module_load_fatbin_wrapper(CUmodule *pm, const void *wrapper)
{
    return module_load(pm, wrapper, 1);
}

static CUresult load_file(const char *fname, void **buf)
{
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = open(fname, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || sb.st_size <= 0 || sb.st_size > (512 << 20)) {
        close(fd);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    char *b = malloc((size_t)sb.st_size + 1);
    if (!b) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t got = 0;
    while (got < (size_t)sb.st_size) {
        ssize_t r = read(fd, b + got, (size_t)sb.st_size - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    b[got] = 0;
    *buf = b;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleLoad(CUmodule *pm, const char *fname)
{
    if (!pm)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    void *buf = NULL;
    if ((rc = load_file(fname, &buf)))
        return rc;
    rc = cuModuleLoadData(pm, buf);
    free(buf);
    return rc;
}

FG_API CUresult cuModuleUnload(CUmodule m)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(m); /* the struct is leaked on purpose: stale handles read as invalid */
    return CUDA_SUCCESS;
}

static CUresult module_function(CUfunction *pf, struct fg_module *m, const char *name)
{
    int known = m->opaque;
    for (int i = 0; i < m->nkern && !known; i++)
        known = !strcmp(m->kern[i], name);
    if (!known) {
        fg_trace("module %p: no kernel %s: CUDA_ERROR_NOT_FOUND", (void *)m, name);
        return CUDA_ERROR_NOT_FOUND;
    }
    pthread_mutex_lock(&m->mu);
    struct fg_func *f;
    for (f = m->funcs; f; f = f->next)
        if (!strcmp(f->name, name))
            break;
    if (!f) {
        f = calloc(1, sizeof(*f));
        char *nm = strdup(name);
        if (!f || !nm) {
            free(f);
            free(nm);
            pthread_mutex_unlock(&m->mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        f->magic = FG_MAGIC_FUNC;
        f->kind = func_kind(name);
        f->mod = m;
        f->name = nm;
        f->cache_config = 0;
        f->carveout = -1;
        f->next = m->funcs;
        m->funcs = f;
    }
    pthread_mutex_unlock(&m->mu);
    *pf = f;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleGetFunction(CUfunction *pf, CUmodule m, const char *name)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pf || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_function(pf, m, name);
}

FG_API CUresult cuModuleGetFunctionCount(unsigned int *count, CUmodule m)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    *count = (unsigned)m->nkern;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleEnumerateFunctions(CUfunction *fns, unsigned int n, CUmodule m)
{
    if (!fns)
        return CUDA_ERROR_INVALID_VALUE;
    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    for (unsigned i = 0; i < n && (int)i < m->nkern; i++) {
        CUresult rc = module_function(&fns[i], m, m->kern[i]);
        if (rc)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* Device variables: host-backed memory of the variable's size, zero-filled, in the allocation
 * table (kind FG_ALLOC_MODULE: copies reach it, cuMemFree refuses it). */
static CUresult module_global(CUdeviceptr *dptr, size_t *bytes, struct fg_module *m, const char *name)
{
    struct modvar *v = NULL;
    for (int i = 0; i < m->nvars && !v; i++)
        if (!strcmp(m->vars[i].name, name))
            v = &m->vars[i];
    if (!v) {
        fg_trace("module %p: no variable %s: CUDA_ERROR_NOT_FOUND", (void *)m, name);
        return CUDA_ERROR_NOT_FOUND;
    }
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&m->mu);
    if (!v->ptr) {
        void *p = fg_map_bytes(v->size);
        struct fg_alloc a = {.ptr = (uint64_t)(uintptr_t)p, .size = v->size, .kind = FG_ALLOC_MODULE};
        if (!p || fg_alloc_insert(&a) != 0) {
            if (p)
                fg_unmap_bytes(a.ptr, v->size);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            v->ptr = a.ptr;
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (rc)
        return rc;
    if (dptr)
        *dptr = v->ptr;
    if (bytes)
        *bytes = v->size;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_global(dptr, bytes, m, name);
}

FG_API CUresult cuModuleGetLoadingMode(int *mode)
{
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    *mode = 1; /* CU_MODULE_EAGER_LOADING */
    return CUDA_SUCCESS;
}

/* --- libraries (CUDA 12.0) ------------------------------------------------------------------ */

static int lib_valid(const struct fg_library *l)
{
    return l && l->magic == FG_MAGIC_LIB && module_valid(l->mod);
}

static CUresult library_load(struct fg_library **pl, const void *code, unsigned njit, void *jopts, void **jvals,
                             unsigned nlib, void *lopts, void **lvals)
{
    if (!pl || !code || (njit && (!jopts || !jvals)) || (nlib && (!lopts || !lvals)))
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_library *l = calloc(1, sizeof(*l));
    if (!l)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = module_load(&l->mod, code, 0);
    if (rc) {
        free(l);
        return rc;
    }
    l->magic = FG_MAGIC_LIB;
    *pl = l;
    return CUDA_SUCCESS;
}

FG_API CUresult cuLibraryLoadData(struct fg_library **pl, const void *code, void *jopts, void **jvals, unsigned njit,
                                  void *lopts, void **lvals, unsigned nlib)
{
    return library_load(pl, code, njit, jopts, jvals, nlib, lopts, lvals);
}

FG_API CUresult cuLibraryLoadFromFile(struct fg_library **pl, const char *fname, void *jopts, void **jvals,
                                      unsigned njit, void *lopts, void **lvals, unsigned nlib)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    void *buf = NULL;
    if ((rc = load_file(fname, &buf)))
        return rc;
    rc = library_load(pl, buf, njit, jopts, jvals, nlib, lopts, lvals);
    free(buf);
    return rc;
}

FG_API CUresult cuLibraryUnload(struct fg_library *l)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(l->mod);
    l->magic = 0;
    return CUDA_SUCCESS;
}

FG_API CUresult cuLibraryGetKernel(CUfunction *pk, struct fg_library *l, const char *name)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pk || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_function(pk, l->mod, name);
}

FG_API CUresult cuLibraryGetKernelCount(unsigned int *count, struct fg_library *l)
{
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    return cuModuleGetFunctionCount(count, l->mod);
}

FG_API CUresult cuLibraryEnumerateKernels(CUfunction *ks, unsigned int n, struct fg_library *l)
{
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    return cuModuleEnumerateFunctions(ks, n, l->mod);
}

FG_API CUresult cuLibraryGetModule(CUmodule *pm, struct fg_library *l)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!pm)
        return CUDA_ERROR_INVALID_VALUE;
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    *pm = l->mod;
    return CUDA_SUCCESS;
}

FG_API CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, struct fg_library *l, const char *name)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_global(dptr, bytes, l->mod, name);
}

/* __managed__ variables: not parsed out of images (their sections are not read): NOT_FOUND. */
FG_API CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, struct fg_library *l, const char *name)
{
    (void)dptr;
    (void)bytes;
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    fg_trace("library %p: no managed variable %s: CUDA_ERROR_NOT_FOUND", (void *)l, name);
    return CUDA_ERROR_NOT_FOUND;
}

FG_API CUresult cuLibraryGetUnifiedFunction(void **fptr, struct fg_library *l, const char *name)
{
    if (!fptr || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!lib_valid(l))
        return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_ERROR_NOT_FOUND;
}

static int func_valid(const struct fg_func *f)
{
    return f && f->magic == FG_MAGIC_FUNC && f->mod && f->mod->magic == FG_MAGIC_MOD;
}

FG_API CUresult cuKernelGetFunction(CUfunction *pf, CUfunction k)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    if (!pf)
        return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(k))
        return CUDA_ERROR_INVALID_HANDLE;
    *pf = k;
    return CUDA_SUCCESS;
}

FG_API CUresult cuKernelGetName(const char **name, CUfunction k)
{
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(k))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = k->name;
    return CUDA_SUCCESS;
}

FG_API CUresult cuFuncGetName(const char **name, CUfunction f)
{
    return cuKernelGetName(name, f);
}

FG_API CUresult cuKernelGetLibrary(struct fg_library **pl, CUfunction k)
{
    (void)pl;
    if (!func_valid(k))
        return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_ERROR_NOT_SUPPORTED;
}

FG_API CUresult cuFuncGetModule(CUmodule *pm, CUfunction f)
{
    if (!pm)
        return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    *pm = f->mod;
    return CUDA_SUCCESS;
}

/* CU_FUNCTION_LOADING_STATE_LOADED = 1: modules load eagerly */
FG_API CUresult cuFuncIsLoaded(int *state, CUfunction f)
{
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    *state = 1;
    return CUDA_SUCCESS;
}

FG_API CUresult cuFuncLoad(CUfunction f)
{
    return func_valid(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* The kernel's k-th 8-byte argument (k < 2), from kernelParams or the `extra` buffer form
 * (CU_LAUNCH_PARAM_BUFFER_POINTER = 1, CU_LAUNCH_PARAM_BUFFER_SIZE = 2, END = 0). */
static int nth_arg(void **params, void **extra, unsigned k, uint64_t *out)
{
    if (params) {
        if (!params[k])
            return -1;
        memcpy(out, params[k], sizeof(*out));
        return 0;
    }
    if (!extra)
        return -1;
    void *buf = NULL;
    size_t size = 0;
    for (int i = 0; i < 64 && extra[i] != (void *)0; i += 2) {
        if (extra[i] == (void *)1)
            buf = extra[i + 1];
        else if (extra[i] == (void *)2 && extra[i + 1])
            size = *(size_t *)extra[i + 1];
        else
            return -1;
    }
    if (!buf || size < (k + 1) * sizeof(*out))
        return -1;
    memcpy(out, (const char *)buf + k * sizeof(*out), sizeof(*out));
    return 0;
}

static int first_arg(void **params, void **extra, uint64_t *out) { return nth_arg(params, extra, 0, out); }

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    nanosleep(&ts, NULL);
}

CUresult fg_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   CUstream s, void **params, void **extra, int per_thread)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024 || bz > 64)
        return CUDA_ERROR_INVALID_VALUE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t dur = 0, arg = 0, bytes = 0;
    if (f->kind == KIND_OTHER) {
        dur = FG_KERNEL_NS;
    } else if (f->kind != KIND_NOOP) {
        if (first_arg(params, extra, &arg) != 0 || (f->kind == KIND_TOUCH && nth_arg(params, extra, 1, &bytes) != 0))
            return CUDA_ERROR_INVALID_VALUE;
        dur = f->kind == KIND_SPIN_US ? (arg > MAX_KERNEL_NS / 1000 ? MAX_KERNEL_NS : arg * 1000) : arg;
    }
    int dev = 0, idx = 0;
    if ((rc = fg_stream_resolve(s, per_thread, &dev, &idx)))
        return rc;
    if (fg_capture_count) {
        /* a capturing stream records a kernel node (cuda_graph.c) */
        unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
        void *first[1] = {&arg};
        if (fg_capture_kernel(s, per_thread, f, grid, block, f->kind != KIND_NOOP ? first : NULL, &rc))
            return rc;
    }
    if (f->kind == KIND_TOUCH && (rc = fg_um_touch_ns(dev, arg, bytes, &dur)))
        return rc;
    if (dur > MAX_KERNEL_NS)
        dur = MAX_KERNEL_NS;
    struct fg_state *st = fg_g.st;
    for (;;) {
        fg_lock();
        uint64_t now = fg_now();
        fg_sim_advance(st, dev, now);
        int lost = (int)st->ds[dev].lost;
        int full = lost ? 0 : fg_sim_enqueue(st, fg_g.slot, dev, idx, dur);
        uint64_t head_left = fg_sim_pending_ns(st, fg_g.slot, dev, idx);
        fg_unlock();
        if (lost)
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        if (!full)
            return CUDA_SUCCESS;
        /* queue full: like the real driver, the launch blocks until an earlier kernel finished */
        uint64_t nap = head_left / (st->h.queue_depth ? st->h.queue_depth : 1);
        if (nap < 50000)
            nap = 50000;
        if (nap > 2000000)
            nap = 2000000;
        sleep_ns(nap);
    }
}

FG_API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shmem, CUstream s, void **params, void **extra)
{
    (void)shmem;
    return fg_launch(f, gx, gy, gz, bx, by, bz, s, params, extra, 0);
}

FG_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                    unsigned bz, unsigned shmem, CUstream s, void **params, void **extra)
{
    (void)shmem;
    return fg_launch(f, gx, gy, gz, bx, by, bz, s, params, extra, 1);
}

FG_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                          unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params)
{
    (void)shmem;
    return fg_launch(f, gx, gy, gz, bx, by, bz, s, params, NULL, 0);
}

FG_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                               unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params)
{
    (void)shmem;
    return fg_launch(f, gx, gy, gz, bx, by, bz, s, params, NULL, 1);
}

/* CUlaunchConfig of cuda.h (x86-64): 7 unsigned, CUstream at 32, attrs at 40, numAttrs at 48 */
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ;
    unsigned blockDimX, blockDimY, blockDimZ;
    unsigned sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned numAttrs;
} fg_launch_config;

_Static_assert(offsetof(fg_launch_config, hStream) == 32, "CUlaunchConfig layout");
_Static_assert(sizeof(fg_launch_config) == 56, "CUlaunchConfig size");

static CUresult launch_ex(const fg_launch_config *c, CUfunction f, void **params, void **extra, int per_thread)
{
    if (!c || (c->numAttrs && !c->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    return fg_launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->hStream,
                     params, extra, per_thread);
}

FG_API CUresult cuLaunchKernelEx(const fg_launch_config *c, CUfunction f, void **params, void **extra)
{
    return launch_ex(c, f, params, extra, 0);
}

FG_API CUresult cuLaunchKernelEx_ptsz(const fg_launch_config *c, CUfunction f, void **params, void **extra)
{
    return launch_ex(c, f, params, extra, 1);
}

/* --- function attributes and occupancy ------------------------------------------------------
 * CUfunction_attribute of cuda.h: 0 MAX_THREADS_PER_BLOCK, 1 SHARED_SIZE_BYTES, 2 CONST_SIZE_BYTES,
 * 3 LOCAL_SIZE_BYTES, 4 NUM_REGS, 5 PTX_VERSION, 6 BINARY_VERSION, 7 CACHE_MODE_CA,
 * 8 MAX_DYNAMIC_SHARED_SIZE_BYTES, 9 PREFERRED_SHARED_MEMORY_CARVEOUT, 10 CLUSTER_SIZE_MUST_BE_SET,
 * 11-13 REQUIRED_CLUSTER_WIDTH/HEIGHT/DEPTH, 14 NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
 * 15 CLUSTER_SCHEDULING_POLICY_PREFERENCE.  The image's real register and shared-memory use is not
 * read: a kernel reads as using 32 registers, no static shared memory, 48 KiB of dynamic shared
 * memory unless raised (the real default), the device's compute capability as its versions. */
#define ATTR_MAX 16

static CUresult func_attr(int *pi, int attrib, const struct fg_func *f)
{
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    if (attrib < 0 || attrib >= ATTR_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    int v = 0;
    switch (attrib) {
    case 0: v = 1024; break;
    case 4: v = 32; break;
    case 5: case 6: v = 90; break;
    case 8: v = f->max_dyn_smem ? f->max_dyn_smem : 48 * 1024; break;
    case 9: v = f->carveout; break;
    case 14: v = 1; break;
    default: v = 0;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

static CUresult func_set_attr(struct fg_func *f, int attrib, int value)
{
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    if (attrib == 8) { /* up to MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
        if (value < 0 || value > 232448)
            return CUDA_ERROR_INVALID_VALUE;
        f->max_dyn_smem = value;
        return CUDA_SUCCESS;
    }
    if (attrib == 9) {
        if (value < -1 || value > 100)
            return CUDA_ERROR_INVALID_VALUE;
        f->carveout = value;
        return CUDA_SUCCESS;
    }
    if (attrib == 10 || (attrib >= 11 && attrib <= 15))
        return value >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return CUDA_ERROR_INVALID_VALUE; /* read-only attributes */
}

FG_API CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f)
{
    return func_attr(pi, attrib, f);
}

FG_API CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value)
{
    return func_set_attr(f, attrib, value);
}

FG_API CUresult cuFuncSetCacheConfig(CUfunction f, int config)
{
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    if (config < 0 || config > 3)
        return CUDA_ERROR_INVALID_VALUE;
    f->cache_config = config;
    return CUDA_SUCCESS;
}

FG_API CUresult cuFuncSetSharedMemConfig(CUfunction f, int config)
{
    if (!func_valid(f))
        return CUDA_ERROR_INVALID_HANDLE;
    return config >= 0 && config <= 2 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuKernelGetAttribute(int *pi, int attrib, CUfunction k, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    return rc ? rc : func_attr(pi, attrib, k);
}

FG_API CUresult cuKernelSetAttribute(int attrib, int value, CUfunction k, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    return rc ? rc : func_set_attr(k, attrib, value);
}

FG_API CUresult cuKernelSetCacheConfig(CUfunction k, int config, CUdevice dev)
{
    CUresult rc = fg_check_dev(dev);
    return rc ? rc : cuFuncSetCacheConfig(k, config);
}

/* Occupancy: with 32 registers a thread and no static shared memory, a block of B threads is
 * limited by 2048 threads and 32 blocks per SM and by the shared memory it asks for (228 KiB an
 * SM, 1 KiB reserved per block), as the CUDA occupancy calculator computes for compute
 * capability 9.0. */
static int blocks_per_sm(int block, size_t smem)
{
    if (block <= 0 || block > 1024)
        return 0;
    int warps = (block + 31) / 32;
    int by_threads = 64 / warps;
    int by_blocks = 32;
    size_t per_block = smem + 1024;
    int by_smem = (int)((233472) / per_block);
    int n = by_threads < by_blocks ? by_threads : by_blocks;
    return n < by_smem ? n : by_smem;
}

static CUresult occ_check(const struct fg_func *f)
{
    CUresult rc;
    if (!fg_current(&rc))
        return rc;
    return func_valid(f) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FG_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, CUfunction f, int block, size_t smem,
                                                                      unsigned flags)
{
    CUresult rc = occ_check(f);
    if (rc)
        return rc;
    if (!n || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    *n = blocks_per_sm(block, smem);
    return CUDA_SUCCESS;
}

FG_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t smem)
{
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n, f, block, smem, 0);
}

typedef size_t (*fg_b2d)(int);

FG_API CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *min_grid, int *block_out, CUfunction f, fg_b2d cb,
                                                          size_t smem, int limit, unsigned flags)
{
    CUresult rc = occ_check(f);
    if (rc)
        return rc;
    if (!min_grid || !block_out || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    int max = limit > 0 && limit < 1024 ? limit : 1024;
    int best = 0, best_b = 32;
    for (int b = 32; b <= max; b += 32) {
        int occ = blocks_per_sm(b, cb ? cb(b) : smem) * b;
        if (occ >= best) {
            best = occ;
            best_b = b;
        }
    }
    int sms = 0;
    cuDeviceGetAttribute(&sms, 16, 0);
    *block_out = best_b;
    *min_grid = (best / best_b) * (sms > 0 ? sms : 1);
    return CUDA_SUCCESS;
}

FG_API CUresult cuOccupancyMaxPotentialBlockSize(int *min_grid, int *block_out, CUfunction f, fg_b2d cb, size_t smem,
                                                 int limit)
{
    return cuOccupancyMaxPotentialBlockSizeWithFlags(min_grid, block_out, f, cb, smem, limit, 0);
}

FG_API CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *out, CUfunction f, int nblocks, int block)
{
    CUresult rc = occ_check(f);
    if (rc)
        return rc;
    if (!out || nblocks <= 0 || block <= 0 || block > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    size_t per = 233472 / (size_t)nblocks;
    *out = per > 1024 ? per - 1024 : 0;
    if (*out > 232448)
        *out = 232448;
    return CUDA_SUCCESS;
}
