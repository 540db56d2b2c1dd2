/* common.c — filling the function table the way real programs do. */
#include "common.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct api A;
const char *api_mode = "";
int gpa_self_hooked = -1;
int (*link_hook)(const char *mode);

#define API_META(name, base, ver, flags, params) {#name, base, ver, flags},
const struct api_meta api_meta[API_N] = {API_FUNCS(API_META)};

/* The loads feed an xor that is stored only if it equals a value it practically never has, so
 * the compiler keeps every load and the kernel writes nothing. */
const char touch_ptx[] = ".version 7.0\n"
                         ".target sm_70\n"
                         ".address_size 64\n"
                         ".visible .entry touch(.param .u64 p, .param .u64 n)\n"
                         "{\n"
                         "  .reg .pred %q<2>;\n"
                         "  .reg .b32 %r<6>;\n"
                         "  .reg .b64 %rd<12>;\n"
                         "  ld.param.u64 %rd1, [p];\n"
                         "  ld.param.u64 %rd2, [n];\n"
                         "  cvta.to.global.u64 %rd1, %rd1;\n"
                         "  mov.u32 %r1, %ctaid.x;\n"
                         "  mov.u32 %r2, %ntid.x;\n"
                         "  mov.u32 %r3, %tid.x;\n"
                         "  mov.u32 %r4, %nctaid.x;\n"
                         "  mul.wide.u32 %rd3, %r1, %r2;\n"
                         "  cvt.u64.u32 %rd4, %r3;\n"
                         "  add.u64 %rd3, %rd3, %rd4;\n"
                         "  mul.wide.u32 %rd5, %r4, %r2;\n"
                         "  shr.u64 %rd6, %rd2, 3;\n"
                         "  mov.u64 %rd7, 0;\n"
                         "LOOP:\n"
                         "  setp.ge.u64 %q1, %rd3, %rd6;\n"
                         "  @%q1 bra DONE;\n"
                         "  shl.b64 %rd8, %rd3, 3;\n"
                         "  add.u64 %rd9, %rd1, %rd8;\n"
                         "  ld.global.u64 %rd10, [%rd9];\n"
                         "  xor.b64 %rd7, %rd7, %rd10;\n"
                         "  add.u64 %rd3, %rd3, %rd5;\n"
                         "  bra LOOP;\n"
                         "DONE:\n"
                         "  setp.ne.u64 %q1, %rd7, 6510615555426900570;\n"
                         "  @%q1 bra END;\n"
                         "  st.global.u64 [%rd1], %rd7;\n"
                         "END:\n"
                         "  ret;\n"
                         "}\n";

void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cutest: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(2);
}

int in_libvgpu(const void *p)
{
    Dl_info di;
    if (!p || !dladdr(p, &di) || !di.dli_fname)
        return 0;
    return strstr(di.dli_fname, "libvgpu") != NULL;
}

typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);

/* cudart's documented pattern (reference/cuda-interception.md §2): one
 * dlopen, one dlsym of cuGetProcAddress_v2, a probe, cuInit@2000, re-fetch
 * cuGetProcAddress at 11030 and 12000, then everything by base name + version
 * (+ per-thread-stream flags) through the re-fetched pointer. */
int load_gpa(gpa2_fn first);
int load_gpa(gpa2_fn first)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    first("", &p, 0, 0, &st); /* probe, result ignored like cudart does */
    void *init = NULL;
    if (first("cuInit", &init, 2000, 0, &st) != CUDA_SUCCESS)
        die("cuGetProcAddress(cuInit) failed");
    void *g1 = NULL, *g2 = NULL;
    if (first("cuGetProcAddress", &g1, 11030, 0, &st) != CUDA_SUCCESS || !g1)
        die("cuGetProcAddress(cuGetProcAddress@11030) failed");
    if (first("cuGetProcAddress", &g2, 12000, 0, &st) != CUDA_SUCCESS || !g2)
        die("cuGetProcAddress(cuGetProcAddress@12000) failed");
    gpa_self_hooked = in_libvgpu(g1) && in_libvgpu(g2);
    gpa2_fn gpa = (gpa2_fn)g2;
    /* v1 signature must work too */
    void *probe = NULL;
    if (((gpa1_fn)g1)("cuMemAlloc", &probe, 3020, 0) != CUDA_SUCCESS || !probe)
        die("v1 cuGetProcAddress(cuMemAlloc@3020) failed");
    void **slots = (void **)&A;
    for (int i = 0; i < API_N; i++) {
        void *f = NULL;
        CUresult r = gpa(api_meta[i].base, &f, api_meta[i].ver, (cuuint64_t)api_meta[i].flags, &st);
        slots[i] = r == CUDA_SUCCESS ? f : NULL;
    }
    return 0;
}

int load_api(const char *mode)
{
    api_mode = mode;
    memset(&A, 0, sizeof A);
    if (link_hook && link_hook(mode) == 0)
        return 0;
    void *h = dlopen("libcuda.so.1", RTLD_NOW); /* RTLD_LOCAL, as cudart */
    if (!h)
        die("dlopen(libcuda.so.1): %s", dlerror());
    if (strcmp(mode, "dlsym") == 0) {
        void **slots = (void **)&A;
        for (int i = 0; i < API_N; i++)
            slots[i] = dlsym(h, api_meta[i].name);
        return 0;
    }
    if (strcmp(mode, "gpa") == 0) {
        gpa2_fn first = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
        if (!first)
            die("dlsym(cuGetProcAddress_v2): %s", dlerror());
        return load_gpa(first);
    }
    die("unknown mode %s", mode);
}
