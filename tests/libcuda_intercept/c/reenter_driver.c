/*
 * reenter_driver — a test "driver" (soname libcuda.so.1) in front of the
 * simulator, which calls back into the *exported* driver API from inside its
 * own entry points, the way a driver calling its own public functions, or a
 * driver thread, would reach libvgpu.so's hooks again:
 *
 *  - cuMemAllocPitch_v2 is implemented with the exported cuMemAlloc_v2
 *    (a hook called from inside a hook: must not be charged twice);
 *  - cuMemAlloc_v2 runs a thread of its own that calls the exported
 *    cuMemGetInfo_v2 and cuMemAlloc_v2/cuMemFree_v2 and waits for it (a hook
 *    called from a driver thread while a hook is active: must not deadlock).
 *
 * Everything else is forwarded to the simulator, opened from $REENTER_REAL.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_abi.h"

#define API __attribute__((visibility("default")))

static void *real;
static void *R(const char *name)
{
    if (!real) {
        const char *p = getenv("REENTER_REAL");
        real = p ? dlopen(p, RTLD_NOW | RTLD_LOCAL) : NULL;
        if (!real) {
            fprintf(stderr, "reenter_driver: cannot open REENTER_REAL: %s\n", dlerror());
            abort();
        }
    }
    void *f = dlsym(real, name);
    if (!f) {
        fprintf(stderr, "reenter_driver: %s missing\n", name);
        abort();
    }
    return f;
}

#define FWD(ret, name, params, args)              \
    API ret name params                           \
    {                                             \
        static ret(*fp_) params;                  \
        if (!fp_)                                 \
            fp_ = (ret(*) params)R(#name);        \
        return fp_ args;                          \
    }

FWD(CUresult, cuInit, (unsigned x), (x))
FWD(CUresult, cuCtxGetDevice, (CUdevice * d), (d))
FWD(CUresult, cuDeviceGetUuid, (CUuuid * u, CUdevice d), (u, d))
FWD(CUresult, cuMemGetInfo_v2, (size_t * f, size_t *t), (f, t))
FWD(CUresult, cuDeviceTotalMem_v2, (size_t * b, CUdevice d), (b, d))
FWD(CUresult, cuMemFree_v2, (CUdeviceptr p), (p))
FWD(CUresult, cuCtxGetCurrent, (CUcontext * c), (c))
FWD(CUresult, cuCtxSetCurrent, (CUcontext c), (c))

/* the exported entry points, as a driver calling its own API would reach them */
static void *global(const char *name) { return dlsym(RTLD_DEFAULT, name); }

struct thr_arg {
    CUcontext ctx;
    int ok;
};

static void *driver_thread(void *p)
{
    struct thr_arg *a = p;
    CUresult (*setc)(CUcontext) = (CUresult(*)(CUcontext))global("cuCtxSetCurrent");
    CUresult (*info)(size_t *, size_t *) = (CUresult(*)(size_t *, size_t *))global("cuMemGetInfo_v2");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))global("cuMemAlloc_v2");
    CUresult (*fr)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))global("cuMemFree_v2");
    size_t f, t;
    CUdeviceptr d;
    a->ok = setc && info && alloc && fr && setc(a->ctx) == CUDA_SUCCESS && info(&f, &t) == CUDA_SUCCESS &&
            alloc(&d, 4096) == CUDA_SUCCESS && fr(d) == CUDA_SUCCESS;
    return NULL;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t n)
{
    static CUresult (*f)(CUdeviceptr *, size_t);
    if (!f)
        f = (CUresult(*)(CUdeviceptr *, size_t))R("cuMemAlloc_v2");
    if (n >= 4096 * 2) { /* the thread's own 4 KiB allocation must not recurse */
        struct thr_arg a = {0};
        cuCtxGetCurrent(&a.ctx);
        pthread_t th;
        if (pthread_create(&th, NULL, driver_thread, &a) == 0) {
            pthread_join(th, NULL);
            if (!a.ok)
                return CUDA_ERROR_NOT_PERMITTED; /* surfaces as a test failure */
        }
    }
    return f(dptr, n);
}

/* pitch allocation built on the exported cuMemAlloc_v2 */
API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned elem)
{
    (void)elem;
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))global("cuMemAlloc_v2");
    size_t p = (w + 511) & ~(size_t)511;
    CUresult rc = alloc(dptr, p * h);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

static void *mine(void *p)
{
    static const char *names[] = {"cuInit", "cuCtxGetDevice", "cuDeviceGetUuid", "cuMemGetInfo_v2",
                                  "cuDeviceTotalMem_v2", "cuMemFree_v2", "cuMemAlloc_v2", "cuMemAllocPitch_v2"};
    static void *ours[] = {(void *)cuInit, (void *)cuCtxGetDevice, (void *)cuDeviceGetUuid, (void *)cuMemGetInfo_v2,
                           (void *)cuDeviceTotalMem_v2, (void *)cuMemFree_v2, (void *)cuMemAlloc_v2,
                           (void *)cuMemAllocPitch_v2};
    for (unsigned i = 0; i < sizeof names / sizeof names[0]; i++)
        if (p == R(names[i]))
            return ours[i];
    return p;
}

API CUresult cuGetProcAddress_v2(const char *s, void **pfn, int v, cuuint64_t fl, CUdriverProcAddressQueryResult *st)
{
    CUresult (*f)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        (CUresult(*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))R("cuGetProcAddress_v2");
    CUresult rc = f(s, pfn, v, fl, st);
    if (rc == CUDA_SUCCESS && pfn && *pfn)
        *pfn = mine(*pfn);
    return rc;
}

API CUresult cuGetProcAddress(const char *s, void **pfn, int v, cuuint64_t fl)
{
    return cuGetProcAddress_v2(s, pfn, v, fl, NULL);
}
