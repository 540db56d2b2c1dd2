/* fakegpu libcuda: modules, kernels and launches.
 *
 * Any module image is accepted; every module provides the built-in kernels whose run time comes
 * from their first parameter:
 *   "spin"    (unsigned long long ns)  runs ns nanoseconds
 *   "spin_us" (unsigned long long us)  runs us microseconds
 *   "noop"    ()                       runs 0 ns
 * (fakegpu-burn ships PTX with a "spin" kernel of the same signature that spins on %globaltimer,
 * so the same program runs on a real GPU.)  Other names: CUDA_ERROR_NOT_FOUND.
 */
#include "fg_cuda.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KIND_SPIN_NS 1
#define KIND_SPIN_US 2
#define KIND_NOOP 3
#define MAX_KERNEL_NS (3600ULL * 1000000000ULL)

struct fg_module {
    uint32_t magic;
};

struct fg_func {
    uint32_t magic;
    int kind;
    struct fg_module *mod;
};

static CUresult module_new(CUmodule *pm)
{
    CUresult rc;
    if (!pm)
        return CUDA_ERROR_INVALID_VALUE;
    if (!fg_current(&rc))
        return rc;
    struct fg_module *m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = FG_MAGIC_MOD;
    *pm = m;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleLoadData(CUmodule *pm, const void *image)
{
    if (!image)
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(pm);
}

FG_API CUresult cuModuleLoadDataEx(CUmodule *pm, const void *image, unsigned int n, void *opts, void **vals)
{
    (void)opts;
    (void)vals;
    (void)n;
    return cuModuleLoadData(pm, image);
}

FG_API CUresult cuModuleLoad(CUmodule *pm, const char *fname)
{
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    if (access(fname, R_OK) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return module_new(pm);
}

FG_API CUresult cuModuleUnload(CUmodule m)
{
    if (!m || m->magic != FG_MAGIC_MOD)
        return CUDA_ERROR_INVALID_HANDLE;
    m->magic = 0; /* functions keep pointing at it: leaked on purpose, they become invalid */
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleGetFunction(CUfunction *pf, CUmodule m, const char *name)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!pf || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != FG_MAGIC_MOD)
        return CUDA_ERROR_INVALID_HANDLE;
    int kind = !strcmp(name, "spin") ? KIND_SPIN_NS : !strcmp(name, "spin_us") ? KIND_SPIN_US
               : !strcmp(name, "noop") ? KIND_NOOP : 0;
    if (!kind)
        return CUDA_ERROR_NOT_FOUND;
    struct fg_func *f = calloc(1, sizeof(*f));
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    f->magic = FG_MAGIC_FUNC;
    f->kind = kind;
    f->mod = m;
    *pf = f;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleGetLoadingMode(int *mode)
{
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    *mode = 1; /* CU_MODULE_EAGER_LOADING */
    return CUDA_SUCCESS;
}

/* The kernel's first 8-byte argument, from kernelParams or the `extra` buffer form
 * (CU_LAUNCH_PARAM_BUFFER_POINTER = 1, CU_LAUNCH_PARAM_BUFFER_SIZE = 2, END = 0). */
static int first_arg(void **params, void **extra, uint64_t *out)
{
    if (params) {
        if (!params[0])
            return -1;
        memcpy(out, params[0], sizeof(*out));
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
    if (!buf || size < sizeof(*out))
        return -1;
    memcpy(out, buf, sizeof(*out));
    return 0;
}

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
    if (!f || f->magic != FG_MAGIC_FUNC || !f->mod || f->mod->magic != FG_MAGIC_MOD)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024 || bz > 64)
        return CUDA_ERROR_INVALID_VALUE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t dur = 0, arg = 0;
    if (f->kind != KIND_NOOP) {
        if (first_arg(params, extra, &arg) != 0)
            return CUDA_ERROR_INVALID_VALUE;
        dur = f->kind == KIND_SPIN_US ? (arg > MAX_KERNEL_NS / 1000 ? MAX_KERNEL_NS : arg * 1000) : arg;
        if (dur > MAX_KERNEL_NS)
            dur = MAX_KERNEL_NS;
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

FG_API CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f)
{
    if (!pi || !f || f->magic != FG_MAGIC_FUNC)
        return CUDA_ERROR_INVALID_VALUE;
    *pi = attrib == 0 ? 1024 : 0; /* CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK */
    return CUDA_SUCCESS;
}
