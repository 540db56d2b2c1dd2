/* fakegpu-burn: the standard driver-API workload (needs only libc and libcuda.so.1).
 *
 *   --device N       CUDA ordinal (default 0)
 *   --alloc BYTES    cuMemAlloc_v2 this much first (suffixes k/m/g, 1024-based); OOM exits 3
 *   --kernel-us US   length of each spin kernel (default 1000)
 *   --seconds S      launch back to back for S seconds, then synchronise (0: no launches)
 *   --sync-every N   synchronise after every N launches (default 0: only at the end)
 *   --hold S         then sleep S seconds keeping the context and the allocation
 *
 * The kernel is a "spin" kernel (one u64 parameter: nanoseconds) shipped as PTX that busy-waits
 * on %globaltimer, so the same binary loads on a real GPU; the simulated driver runs it for the
 * given time.  One JSON line on stdout when the work is done (before --hold), e.g.
 * {"pid":1,"device":0,"uuid":"GPU-…","alloc_bytes":0,"alloc_result":0,"mem_free":…,"mem_total":…,
 *  "kernels":10,"kernel_ns":1000000,"kernel_ns_total":10000000,"launch_result":0,"sync_result":0,
 *  "elapsed_s":0.01}
 * Exit status: 0 ok, 1 CUDA error, 2 usage, 3 out of memory on --alloc.
 */
#include <ctype.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef struct {
    unsigned char bytes[16];
} CUuuid;

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetUuid(CUuuid *, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);

static const char PTX[] =
    ".version 6.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    ".visible .entry spin(.param .u64 spin_param_0)\n"
    "{\n"
    "  .reg .pred %p<2>;\n"
    "  .reg .b64 %rd<6>;\n"
    "  ld.param.u64 %rd1, [spin_param_0];\n"
    "  mov.u64 %rd2, %globaltimer;\n"
    "  add.s64 %rd3, %rd2, %rd1;\n"
    "$L_loop:\n"
    "  mov.u64 %rd4, %globaltimer;\n"
    "  setp.lt.u64 %p1, %rd4, %rd3;\n"
    "  @%p1 bra $L_loop;\n"
    "  ret;\n"
    "}\n";

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void usage(void)
{
    fputs("usage: fakegpu-burn [--device N] [--alloc BYTES] [--kernel-us US] [--seconds S] [--sync-every N] "
          "[--hold S]\n",
          stderr);
    exit(2);
}

static unsigned long long parse_bytes(const char *s)
{
    char *end;
    if (!isdigit((unsigned char)*s))
        usage();
    unsigned long long v = strtoull(s, &end, 10);
    unsigned long long m = 1;
    if (*end == 'k' || *end == 'K')
        m = 1ULL << 10, end++;
    else if (*end == 'm' || *end == 'M')
        m = 1ULL << 20, end++;
    else if (*end == 'g' || *end == 'G')
        m = 1ULL << 30, end++;
    if (*end)
        usage();
    return v * m;
}

static double parse_num(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || v < 0 || v > 1e9)
        usage();
    return v;
}

int main(int argc, char **argv)
{
    int device = 0;
    unsigned long long alloc = 0, sync_every = 0;
    double kernel_us = 1000, seconds = 0, hold = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h"))
            usage();
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--device"))
            device = (int)parse_num(v);
        else if (!strcmp(a, "--alloc"))
            alloc = parse_bytes(v);
        else if (!strcmp(a, "--kernel-us"))
            kernel_us = parse_num(v);
        else if (!strcmp(a, "--seconds"))
            seconds = parse_num(v);
        else if (!strcmp(a, "--sync-every"))
            sync_every = (unsigned long long)parse_num(v);
        else if (!strcmp(a, "--hold"))
            hold = parse_num(v);
        else
            usage();
    }
    double t0 = now_s();
    CUresult rc;
    CUdevice dev;
    CUcontext ctx;
    if ((rc = cuInit(0)) || (rc = cuDeviceGet(&dev, device)) || (rc = cuDevicePrimaryCtxRetain(&ctx, dev)) ||
        (rc = cuCtxSetCurrent(ctx))) {
        fprintf(stderr, "fakegpu-burn: CUDA initialisation failed: %d\n", rc);
        printf("{\"pid\":%d,\"device\":%d,\"init_result\":%d}\n", (int)getpid(), device, rc);
        return rc == 2 ? 3 : 1;
    }
    CUuuid u;
    char uuid[64] = "";
    if (cuDeviceGetUuid(&u, dev) == 0) {
        const unsigned char *b = u.bytes;
        snprintf(uuid, sizeof(uuid), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    }
    CUdeviceptr ptr = 0;
    CUresult alloc_rc = 0;
    if (alloc)
        alloc_rc = cuMemAlloc_v2(&ptr, (size_t)alloc);
    size_t fr = 0, total = 0;
    cuMemGetInfo_v2(&fr, &total);
    unsigned long long kernels = 0, kernel_ns = (unsigned long long)(kernel_us * 1000.0);
    CUresult launch_rc = 0, sync_rc = 0;
    if (alloc_rc == 0 && seconds > 0) {
        CUmodule mod;
        CUfunction fn;
        if ((launch_rc = cuModuleLoadData(&mod, PTX)) == 0 && (launch_rc = cuModuleGetFunction(&fn, mod, "spin")) == 0) {
            void *params[] = {&kernel_ns};
            double end = now_s() + seconds;
            while (now_s() < end) {
                if ((launch_rc = cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) != 0)
                    break;
                kernels++;
                if (sync_every && kernels % sync_every == 0 && (sync_rc = cuCtxSynchronize()) != 0)
                    break;
            }
        }
        CUresult r = cuCtxSynchronize();
        if (!sync_rc)
            sync_rc = r;
    }
    printf("{\"pid\":%d,\"device\":%d,\"uuid\":\"%s\",\"alloc_bytes\":%llu,\"alloc_result\":%d,\"mem_free\":%zu,"
           "\"mem_total\":%zu,\"kernels\":%llu,\"kernel_ns\":%llu,\"kernel_ns_total\":%llu,\"launch_result\":%d,"
           "\"sync_result\":%d,\"elapsed_s\":%.6f}\n",
           (int)getpid(), device, uuid, alloc, alloc_rc, fr, total, kernels, kernel_ns, kernels * kernel_ns,
           launch_rc, sync_rc, now_s() - t0);
    fflush(stdout);
    if (hold > 0) {
        struct timespec ts = {(time_t)hold, (long)((hold - (double)(time_t)hold) * 1e9)};
        while (nanosleep(&ts, &ts) != 0)
            ;
    }
    if (ptr)
        cuMemFree_v2(ptr);
    cuDevicePrimaryCtxRelease_v2(dev);
    if (alloc_rc == 2)
        return 3;
    return (alloc_rc || launch_rc || sync_rc) ? 1 : 0;
}
