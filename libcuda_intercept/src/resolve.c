/*
 * resolve.c — how programs reach the hooks, and how the hooks reach the driver.
 *
 * Rules (docs/developers/intercept.md, reference/cuda-interception.md §1):
 *  - The real driver is reached through dlopen("libcuda.so.1") /
 *    dlopen("libnvidia-ml.so.1") and the real dlsym, never RTLD_NEXT (a
 *    libcuda that the program dlopens RTLD_LOCAL is not in global scope).
 *  - dlsym is overridden.  Only exact names in the hook table are ever
 *    substituted, and only when the lookup would have produced the real
 *    driver function (handle lookups) or is a pseudo-handle lookup; every
 *    other call is forwarded untouched by a tail jump, so glibc sees the
 *    caller's own return address (RTLD_NEXT stays relative to the caller).
 *  - cuGetProcAddress / _v2 forward to the driver, which maps base name +
 *    version + flags to a concrete entry point; the returned pointer is then
 *    matched against the real pointers of hooked functions and replaced by
 *    the hook with exactly that signature.  We never guess suffixes.  Only if
 *    a driver hands out pointers that are not its exported symbols does a
 *    small explicit version map for the hooked names stand in.
 *  - Asked for "cuGetProcAddress" itself, it returns our hook (v1 or v2
 *    signature by version), so cudart keeps resolving through us.
 *  - Resolution is lock-free and idempotent (threads may race to store the
 *    same values), and a lookup made from inside our own dlopen (a driver
 *    constructor) gets the real function.
 */
#include <dlfcn.h>
#include <string.h>

/* The library is bind-mounted into containers and loaded by *their* glibc.
 * ld.so ignores a preload it cannot load (the process would run unlimited),
 * so it must not need symbol versions newer than the oldest glibc a CUDA image
 * may have (2.17): bind the dl functions to their original versions, which
 * glibc >= 2.34 still provides in libc.so.6 and older ones in libdl.so.2
 * (linked as a dependency).  tests/libcuda_intercept/test_glibc.py checks this. */
#if defined(__x86_64__)
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");
__asm__(".symver dlvsym,dlvsym@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver dlopen,dlopen@GLIBC_2.17");
__asm__(".symver dlerror,dlerror@GLIBC_2.17");
__asm__(".symver dlvsym,dlvsym@GLIBC_2.17");
#endif

#include "log.h"
#include "vgpu.h"

#define DEF_REAL_CUDA(name, params) CUresult(*real_##name) params;
#define DEF_REAL_NVML(name, params) nvmlReturn_t(*real_##name) params;
VGPU_REAL_CUDA(DEF_REAL_CUDA)
VGPU_REAL_NVML(DEF_REAL_NVML)

/* our exported hooks (defined in hooks_*.c) */
#define DECL_HOOK_CUDA(name, params) VGPU_EXPORT CUresult name params;
#define DECL_HOOK_NVML(name, params) VGPU_EXPORT nvmlReturn_t name params;
VGPU_REAL_CUDA(DECL_HOOK_CUDA)
VGPU_REAL_NVML(DECL_HOOK_NVML)

enum { LIB_CUDA = 0, LIB_NVML = 1 };

struct hook {
    const char *name; /* concrete exported name */
    const char *base; /* base name as passed to cuGetProcAddress */
    int minver, maxver; /* CUDA versions this concrete name serves for base (fallback map) */
    int ptds;           /* per-thread default stream variant */
    int lib;
    void *hook;  /* NULL: real-only entry */
    void **real;
};

#define H(n, b, lo, hi, p) {#n, b, lo, hi, p, LIB_CUDA, (void *)n, (void **)&real_##n}
#define R(n) {#n, NULL, 0, 0, 0, LIB_CUDA, NULL, (void **)&real_##n}
#define N(n, hk) {#n, NULL, 0, 0, 0, LIB_NVML, hk, (void **)&real_##n}
#define MAXV 0x7fffffff

static const struct hook g_hooks[] = {
    H(cuInit, "cuInit", 2000, MAXV, 0),
    H(cuGetProcAddress, "cuGetProcAddress", 11030, 12000, 0),
    H(cuGetProcAddress_v2, "cuGetProcAddress", 12000, MAXV, 0),
    R(cuCtxGetDevice),
    R(cuDeviceGetUuid),
    R(cuDeviceGetUuid_v2),
    H(cuMemAlloc_v2, "cuMemAlloc", 3020, MAXV, 0),
    H(cuMemAlloc, "cuMemAlloc", 0, 3020, 0),
    H(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, MAXV, 0),
    H(cuMemAllocPitch, "cuMemAllocPitch", 0, 3020, 0),
    H(cuMemAllocManaged, "cuMemAllocManaged", 6000, MAXV, 0),
    H(cuMemFree_v2, "cuMemFree", 3020, MAXV, 0),
    H(cuMemAllocAsync, "cuMemAllocAsync", 11020, MAXV, 0),
    H(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, MAXV, 1),
    H(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, MAXV, 0),
    H(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, MAXV, 1),
    H(cuMemFreeAsync, "cuMemFreeAsync", 11020, MAXV, 0),
    H(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, MAXV, 1),
    H(cuMemPoolCreate, "cuMemPoolCreate", 11020, MAXV, 0),
    H(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, MAXV, 0),
    H(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, MAXV, 0),
    H(cuMemCreate, "cuMemCreate", 10020, MAXV, 0),
    H(cuMemRelease, "cuMemRelease", 10020, MAXV, 0),
    H(cuMemMap, "cuMemMap", 10020, MAXV, 0),
    H(cuMemUnmap, "cuMemUnmap", 10020, MAXV, 0),
    H(cuArrayCreate_v2, "cuArrayCreate", 3020, MAXV, 0),
    H(cuArrayCreate, "cuArrayCreate", 0, 3020, 0),
    H(cuArray3DCreate_v2, "cuArray3DCreate", 3020, MAXV, 0),
    H(cuArray3DCreate, "cuArray3DCreate", 0, 3020, 0),
    H(cuArrayDestroy, "cuArrayDestroy", 2000, MAXV, 0),
    H(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, MAXV, 0),
    H(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, MAXV, 0),
    H(cuMemGetInfo_v2, "cuMemGetInfo", 3020, MAXV, 0),
    H(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, MAXV, 0),
    H(cuLaunchKernel, "cuLaunchKernel", 4000, MAXV, 0),
    H(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, MAXV, 1),
    H(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, MAXV, 0),
    H(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, MAXV, 1),
    H(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, MAXV, 0),
    H(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, MAXV, 1),
    H(cuGraphLaunch, "cuGraphLaunch", 10000, MAXV, 0),
    H(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, MAXV, 1),
    H(cuGraphUpload, "cuGraphUpload", 11010, MAXV, 0),
    H(cuGraphUpload_ptsz, "cuGraphUpload", 11010, MAXV, 1),
    H(cuGraphInstantiate, "cuGraphInstantiate", 10000, 11000, 0),
    H(cuGraphInstantiate_v2, "cuGraphInstantiate", 11000, 12000, 0),
    H(cuGraphInstantiateWithFlags, "cuGraphInstantiate", 12000, MAXV, 0),
    H(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, MAXV, 0),
    H(cuGraphInstantiateWithParams_ptsz, "cuGraphInstantiateWithParams", 12000, MAXV, 1),
    H(cuGraphExecDestroy, "cuGraphExecDestroy", 10000, MAXV, 0),
    H(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 11040, MAXV, 0),
    R(cuDeviceGetGraphMemAttribute),
    R(cuGraphGetNodes),
    R(cuGraphNodeGetType),
    R(cuGraphMemAllocNodeGetParams),
    R(cuGraphMemFreeNodeGetParams),
    R(cuStreamIsCapturing),
    R(cuStreamIsCapturing_ptsz),
    H(cuStreamSynchronize, "cuStreamSynchronize", 2000, MAXV, 0),
    H(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, MAXV, 1),
    H(cuCtxSynchronize, "cuCtxSynchronize", 2000, 13000, 0),
    H(cuCtxSynchronize_v2, "cuCtxSynchronize", 13000, MAXV, 0),
    H(cuEventSynchronize, "cuEventSynchronize", 2000, MAXV, 0),
    R(cuMemPoolGetAttribute),
    H(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 11020, MAXV, 0),
    H(cuDeviceGetMemPool, "cuDeviceGetMemPool", 11020, MAXV, 0),
    H(cuIpcGetMemHandle, "cuIpcGetMemHandle", 4010, MAXV, 0),
    H(cuIpcOpenMemHandle, "cuIpcOpenMemHandle", 4010, 11000, 0),
    H(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000, MAXV, 0),
    H(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 4010, MAXV, 0),
    H(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 10020, MAXV, 0),
    H(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 10020, MAXV, 0),
    R(cuMemGetAllocationPropertiesFromHandle),
    R(cuMemGetAddressRange_v2),
    H(cuMemAdvise, "cuMemAdvise", 8000, 12020, 0),
    H(cuMemAdvise_v2, "cuMemAdvise", 12020, MAXV, 0),
    H(cuMemPrefetchAsync, "cuMemPrefetchAsync", 8000, 12020, 0),
    H(cuMemPrefetchAsync_ptsz, "cuMemPrefetchAsync", 8000, 12020, 1),
    H(cuMemPrefetchAsync_v2, "cuMemPrefetchAsync", 12020, MAXV, 0),
    H(cuMemPrefetchAsync_v2_ptsz, "cuMemPrefetchAsync", 12020, MAXV, 1),
    H(cuMemPrefetchBatchAsync, "cuMemPrefetchBatchAsync", 13000, MAXV, 0),
    H(cuMemPrefetchBatchAsync_ptsz, "cuMemPrefetchBatchAsync", 13000, MAXV, 1),
    H(cuMemDiscardAndPrefetchBatchAsync, "cuMemDiscardAndPrefetchBatchAsync", 13000, MAXV, 0),
    H(cuMemDiscardAndPrefetchBatchAsync_ptsz, "cuMemDiscardAndPrefetchBatchAsync", 13000, MAXV, 1),
    R(cuDeviceGetAttribute),
    R(cuEventCreate),
    R(cuEventRecord),
    R(cuEventRecord_ptsz),
    R(cuEventQuery),
    R(cuEventDestroy_v2),
    R(cuMemDiscardBatchAsync),
    R(cuMemDiscardBatchAsync_ptsz),
    N(nvmlDeviceGetUUID, NULL),
    N(nvmlDeviceGetMemoryInfo, (void *)nvmlDeviceGetMemoryInfo),
    N(nvmlDeviceGetMemoryInfo_v2, (void *)nvmlDeviceGetMemoryInfo_v2),
};
#define NHOOKS (sizeof g_hooks / sizeof g_hooks[0])

/* ---------------------------------------------------------------- resolution */

void *vgpu_real_dlsym __attribute__((visibility("hidden")));
static VGPU_TLS int t_resolving;
static int g_cuda_done, g_nvml_done;

__attribute__((no_sanitize("address", "undefined"))) static void init_real_dlsym(void)
{
    if (__atomic_load_n(&vgpu_real_dlsym, __ATOMIC_ACQUIRE))
        return;
    void *p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
#if defined(__x86_64__)
    if (!p)
        p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
#elif defined(__aarch64__)
    if (!p)
        p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");
#endif
    if (!p) {
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        if (libc)
            p = dlvsym(libc, "dlsym", "GLIBC_2.34");
    }
    __atomic_store_n(&vgpu_real_dlsym, p, __ATOMIC_RELEASE);
}

typedef void *(*dlsym_fn)(void *, const char *);

static void resolve_lib(int lib, const char *soname, int *done)
{
    if (LIKELY(__atomic_load_n(done, __ATOMIC_ACQUIRE)) || t_resolving)
        return;
    t_resolving = 1;
    init_real_dlsym();
    dlsym_fn rd = (dlsym_fn)vgpu_real_dlsym;
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (h && rd) {
        for (unsigned i = 0; i < NHOOKS; i++) {
            if (g_hooks[i].lib != lib)
                continue;
            void *p = rd(h, g_hooks[i].name);
            /* never our own symbol (HAMi-core PR#215/#326) */
            if (p == g_hooks[i].hook)
                p = NULL;
            __atomic_store_n(g_hooks[i].real, p, __ATOMIC_RELAXED);
        }
    } else {
        VLOG(VGPU_LOG_DEBUG, "dlopen(%s) failed: %s", soname, dlerror());
    }
    __atomic_store_n(done, 1, __ATOMIC_RELEASE);
    t_resolving = 0;
}

void vgpu_resolve_cuda(void) { resolve_lib(LIB_CUDA, "libcuda.so.1", &g_cuda_done); }
void vgpu_resolve_nvml(void) { resolve_lib(LIB_NVML, "libnvidia-ml.so.1", &g_nvml_done); }
int vgpu_cuda_resolved(void) { return __atomic_load_n(&g_cuda_done, __ATOMIC_ACQUIRE); }

static const struct hook *by_name(const char *name)
{
    for (unsigned i = 0; i < NHOOKS; i++)
        if (strcmp(g_hooks[i].name, name) == 0)
            return &g_hooks[i];
    return NULL;
}

static const struct hook *by_real(void *p)
{
    for (unsigned i = 0; i < NHOOKS; i++)
        if (g_hooks[i].lib == LIB_CUDA && __atomic_load_n(g_hooks[i].real, __ATOMIC_RELAXED) == p)
            return &g_hooks[i];
    return NULL;
}

static const struct hook *by_base(const char *base, int ver, cuuint64_t flags)
{
    const struct hook *legacy = NULL, *ptds = NULL;
    for (unsigned i = 0; i < NHOOKS; i++) {
        const struct hook *e = &g_hooks[i];
        if (!e->hook || !e->base || strcmp(e->base, base) != 0 || ver < e->minver || ver >= e->maxver)
            continue;
        if (e->ptds)
            ptds = e;
        else
            legacy = e;
    }
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && ptds)
        return ptds;
    return legacy;
}

static void *hook_for_lib(const struct hook *e)
{
    if (e->lib == LIB_CUDA)
        vgpu_resolve_cuda();
    else
        vgpu_resolve_nvml();
    return e->hook;
}

/* ------------------------------------------------------------------- dlsym */

/* Returns the pointer to hand out, or NULL for "forward untouched". */
__attribute__((visibility("hidden"), used, no_sanitize("address", "undefined"))) void *vgpu_dlsym_decide(void *handle, const char *name)
{
    init_real_dlsym();
    if (!name || t_resolving)
        return NULL;
    if (!((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && strncmp(name, "nvml", 4) == 0)))
        return NULL;
    const struct hook *e = by_name(name);
    if (!e || !e->hook)
        return NULL;
    if (vgpu_status() == VGPU_ST_INACTIVE)
        return NULL;
    if (handle == RTLD_DEFAULT || handle == RTLD_NEXT)
        return hook_for_lib(e);
    hook_for_lib(e);
    void *r = ((dlsym_fn)vgpu_real_dlsym)(handle, name);
    if (!r)
        return NULL; /* forward: the real dlsym sets dlerror() */
    if (r == __atomic_load_n(e->real, __ATOMIC_RELAXED))
        return e->hook;
    return r;
}

/* dlsym itself: a stub that asks vgpu_dlsym_decide and otherwise *jumps* to
 * the real dlsym, so the caller's return address is what glibc sees. */
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        ".p2align 4\n"
        "dlsym:\n"
        "  .cfi_startproc\n"
        "  pushq %rdi\n"
        "  .cfi_adjust_cfa_offset 8\n"
        "  pushq %rsi\n"
        "  .cfi_adjust_cfa_offset 8\n"
        "  subq $8, %rsp\n"
        "  .cfi_adjust_cfa_offset 8\n"
        "  call vgpu_dlsym_decide\n"
        "  addq $8, %rsp\n"
        "  .cfi_adjust_cfa_offset -8\n"
        "  popq %rsi\n"
        "  .cfi_adjust_cfa_offset -8\n"
        "  popq %rdi\n"
        "  .cfi_adjust_cfa_offset -8\n"
        "  testq %rax, %rax\n"
        "  jz 1f\n"
        "  ret\n"
        "1:\n"
        "  jmp *vgpu_real_dlsym(%rip)\n"
        "  .cfi_endproc\n"
        ".size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        ".p2align 4\n"
        "dlsym:\n"
        "  stp x29, x30, [sp, #-32]!\n"
        "  mov x29, sp\n"
        "  stp x0, x1, [sp, #16]\n"
        "  bl vgpu_dlsym_decide\n"
        "  mov x2, x0\n"
        "  ldp x0, x1, [sp, #16]\n"
        "  ldp x29, x30, [sp], #32\n"
        "  cbz x2, 1f\n"
        "  mov x0, x2\n"
        "  ret\n"
        "1:\n"
        "  adrp x16, vgpu_real_dlsym\n"
        "  ldr x16, [x16, :lo12:vgpu_real_dlsym]\n"
        "  br x16\n"
        ".size dlsym, .-dlsym\n");
#else
#error "libvgpu.so: dlsym stub not written for this architecture"
#endif

/* -------------------------------------------------------- cuGetProcAddress */

static void *gpa_subst(const char *sym, void *p, int ver, cuuint64_t flags)
{
    if (strcmp(sym, "cuGetProcAddress") == 0)
        return ver >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    if (vgpu_status() == VGPU_ST_INACTIVE)
        return p;
    const struct hook *e = by_real(p);
    if (e)
        return e->hook ? e->hook : p;
    e = by_base(sym, ver, flags);
    if (e) {
        VLOG(VGPU_LOG_DEBUG, "cuGetProcAddress(%s@%d/%llu): driver pointer unknown, using %s", sym, ver,
             (unsigned long long)flags, e->name);
        return e->hook;
    }
    return p;
}

VGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *status)
{
    vgpu_resolve_cuda();
    CUresult rc;
    if (REAL(cuGetProcAddress_v2)) {
        rc = REAL(cuGetProcAddress_v2)(symbol, pfn, ver, flags, status);
    } else if (REAL(cuGetProcAddress)) {
        rc = REAL(cuGetProcAddress)(symbol, pfn, ver, flags);
        if (status)
            *status = rc == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    } else {
        if (status)
            *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn)
        *pfn = gpa_subst(symbol, *pfn, ver, flags);
    return rc;
}

VGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags)
{
    vgpu_resolve_cuda();
    CUresult rc;
    if (REAL(cuGetProcAddress))
        rc = REAL(cuGetProcAddress)(symbol, pfn, ver, flags);
    else if (REAL(cuGetProcAddress_v2))
        rc = REAL(cuGetProcAddress_v2)(symbol, pfn, ver, flags, NULL);
    else
        return CUDA_ERROR_NOT_FOUND;
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn)
        *pfn = gpa_subst(symbol, *pfn, ver, flags);
    return rc;
}
