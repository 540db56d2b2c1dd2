/*
 * bench_intercept — the measuring side of tests/bench/bench_intercept.py.
 * Driver functions come through cuGetProcAddress (cudart's path), so the
 * same binary measures "direct" (no preload) and "through libvgpu.so".
 *
 *   bench_intercept launch N        ns per cuLaunchKernel call (N calls)
 *   bench_intercept allocfree K S   K alloc+free pairs of S bytes, after a
 *                                   start barrier (stdin EOF): ns per pair
 *   bench_intercept init [FILE [FD]]
 *                                   after the barrier: cuInit + context +
 *                                   first alloc/free; wall ns (and, with FILE,
 *                                   the latency from the CLOCK_MONOTONIC ns
 *                                   the releaser wrote there); with FD, a
 *                                   "done" line and then alive until FD
 *                                   reads EOF (a worker that keeps running)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

static long long ns(clockid_t c)
{
    struct timespec t;
    clock_gettime(c, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void barrier_on(int fd)
{
    char b[16];
    while (read(fd, b, sizeof b) > 0)
        ;
}

static void barrier(void) { barrier_on(0); }

static void init_ctx(void)
{
    CUdevice d;
    CUcontext c;
    if (A.cuInit(0) || A.cuDeviceGet(&d, 0) || A.cuDevicePrimaryCtxRetain(&c, d) || A.cuCtxSetCurrent(c))
        die("init failed");
}

int main(int argc, char **argv)
{
    if (argc < 2)
        die("usage: bench_intercept launch N | allocfree K SIZE | init");
    load_api("gpa");
    if (!strcmp(argv[1], "launch") && argc == 3) {
        init_ctx();
        long long n = atoll(argv[2]);
        /* A launch the simulator rejects at its entry (NULL function): the
         * driver part of each call is a constant few ns, so the wrapper's
         * cost is what differs between the two runs. */
        CUresult (*volatile f)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               CUstream, void **, void **) = A.cuLaunchKernel;
        CUresult (*fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **) = f;
        long long t0 = ns(CLOCK_MONOTONIC);
        for (long long i = 0; i < n; i++)
            fn(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        long long t1 = ns(CLOCK_MONOTONIC);
        printf("launch_ns %.4f\n", (double)(t1 - t0) / (double)n);
        return 0;
    }
    if (!strcmp(argv[1], "allocfree") && argc == 4) {
        init_ctx();
        long long k = atoll(argv[2]);
        size_t size = (size_t)atoll(argv[3]);
        CUdeviceptr p;
        if (A.cuMemAlloc_v2(&p, size) || A.cuMemFree_v2(p)) /* warm: region joined, device mapped */
            die("warm-up alloc failed");
        printf("ready\n");
        fflush(stdout);
        barrier();
        long long w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_PROCESS_CPUTIME_ID);
        for (long long i = 0; i < k; i++) {
            if (A.cuMemAlloc_v2(&p, size) != CUDA_SUCCESS)
                die("alloc failed");
            A.cuMemFree_v2(p);
        }
        long long w1 = ns(CLOCK_MONOTONIC), c1 = ns(CLOCK_PROCESS_CPUTIME_ID);
        printf("pair_wall_ns %.1f\npair_cpu_ns %.1f\n", (double)(w1 - w0) / (double)k, (double)(c1 - c0) / (double)k);
        return 0;
    }
    if (!strcmp(argv[1], "init") && argc >= 2 && argc <= 4) {
        printf("ready\n");
        fflush(stdout);
        barrier();
        struct rusage r0, r1;
        getrusage(RUSAGE_SELF, &r0);
        long long w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_PROCESS_CPUTIME_ID);
        init_ctx();
        CUdeviceptr p;
        if (A.cuMemAlloc_v2(&p, 4096) || A.cuMemFree_v2(p))
            die("first alloc failed");
        long long w1 = ns(CLOCK_MONOTONIC), c1 = ns(CLOCK_PROCESS_CPUTIME_ID);
        getrusage(RUSAGE_SELF, &r1);
        printf("init_wall_ns %lld\ninit_cpu_ns %lld\n", w1 - w0, c1 - c0);
        printf("init_minflt %ld\ninit_nvcsw %ld\n", r1.ru_minflt - r0.ru_minflt, r1.ru_nvcsw - r0.ru_nvcsw);
        if (argc >= 3) {
            FILE *f = fopen(argv[2], "r");
            long long rel = 0;
            if (!f || fscanf(f, "%lld", &rel) != 1)
                die("no release time in %s", argv[2]);
            fclose(f);
            printf("init_latency_ns %lld\n", w1 - rel);
        }
        if (argc == 4) {
            printf("done\n");
            fflush(stdout);
            barrier_on(atoi(argv[3]));
        }
        return 0;
    }
    die("bad arguments");
}
