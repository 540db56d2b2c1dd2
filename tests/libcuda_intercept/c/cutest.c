/*
 * cutest — a driver-API test program driven by its command line.
 *
 *   cutest MODE CMD [ARGS]... [CMD [ARGS]...]...
 *
 * MODE is how the driver functions are obtained: dlsym, gpa (cudart's
 * pattern), and — in the linked build link_cutest — link, gpa-linked.
 * Each command prints one "name key=value..." line on stdout; see usage().
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define MAXP 4096
static CUdeviceptr ptrs[MAXP];
static size_t sizes[MAXP];
static int nptr;
static CUmemGenericAllocationHandle vh[MAXP];
static size_t vsz[MAXP];
static CUdeviceptr vva[MAXP];
static int nvh;
static CUarray arrs[MAXP];
static int narr;
static CUmemoryPool pool;
static CUdevice cur_dev;
static CUcontext cur_ctx;
static CUfunction noop_fn;
static CUfunction touch_fn;

static const char noop_ptx[] = ".version 6.0\n.target sm_50\n.address_size 64\n.visible .entry noop()\n{\n ret;\n}\n";

static void usage(void)
{
    fprintf(stderr,
            "usage: cutest MODE CMD...\n"
            " MODE: dlsym | gpa | link | gpa-linked (last two: link_cutest)\n"
            " init [DEV]          cuInit + primary context of DEV current\n"
            " alloc SIZE          cuMemAlloc_v2          free I / freeall\n"
            " pitch W H           cuMemAllocPitch_v2     managed SIZE\n"
            " async SIZE          cuMemAllocAsync(ptsz)  afree I (cuMemFreeAsync + sync)\n"
            " pool SIZE           cuMemAllocFromPoolAsync on a pool of the current device\n"
            " pooltrim / pooldestroy\n"
            " vmm SIZE            cuMemCreate; vmap I, vunmap I, vrelease I\n"
            " vfull SIZE          cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess (device)\n"
            " vmmfd SIZE          cuMemCreate exportable as a descriptor; vexport I: export it\n"
            " advise I ADV TYPE ID  cuMemAdvise_v2 on allocation I; prefetch I TYPE ID (+ sync)\n"
            " touch / touchq      one pass of the kernel \"touch\" over every allocation and mapping\n"
            "                     (+ sync / queued only); afreeq I: cuMemFreeAsync without sync\n"
            " touchfor SEC        passes back to back for SEC seconds (one queued ahead): completion times\n"
            " array W H           cuArrayCreate_v2 (1 channel float); adestroy I\n"
            " info / total        cuMemGetInfo_v2 / cuDeviceTotalMem_v2\n"
            " uuid                cuDeviceGetUuid of the current device, as GPU-...\n"
            " launch N            N x cuLaunchKernel (prints ns per call)\n"
            " hooks               which entry points resolve into libvgpu\n"
            " race ITER MAX SEED [US]  random alloc/free (<=16 live) of 1..MAX bytes, US us apart\n"
            " threads NT ITER SIZE  NT threads x ITER alloc+free\n"
            " fork CMD... end     run CMD... in a forked child; waitchild\n"
            " rtld_next           dlsym(RTLD_NEXT) resolves relative to the caller\n"
            " wait                block until stdin closes; sleepms N\n");
    exit(2);
}

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

#define NEEDF(f)                                      \
    do {                                              \
        if (!A.f)                                     \
            die("%s unavailable in mode %s", #f, api_mode); \
    } while (0)

static unsigned long long num(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        die("bad number %s", s);
    return v;
}

static void cmd_init(int dev)
{
    NEEDF(cuInit);
    CUresult rc = A.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("init rc=%d\n", rc);
        fflush(stdout);
        exit(3);
    }
    CUcontext ctx;
    NEEDF(cuDeviceGet);
    NEEDF(cuDevicePrimaryCtxRetain);
    NEEDF(cuCtxSetCurrent);
    if ((rc = A.cuDeviceGet(&cur_dev, dev)) || (rc = A.cuDevicePrimaryCtxRetain(&ctx, cur_dev)) ||
        (rc = A.cuCtxSetCurrent(ctx))) {
        cur_ctx = NULL;
        printf("init rc=%d\n", rc);
        fflush(stdout);
        exit(3);
    }
    cur_ctx = ctx;
    printf("init rc=0 dev=%d\n", dev);
}

static void add_ptr(CUdeviceptr p, size_t n)
{
    if (nptr >= MAXP)
        die("too many pointers");
    ptrs[nptr] = p;
    sizes[nptr++] = n;
}

static int idx_arg(const char *s, int n)
{
    long i = (long)num(s);
    if (i < 0 || i >= n)
        die("index %ld out of range", i);
    return (int)i;
}

struct thr {
    int iter;
    size_t size;
    int fails;
};

static void *thr_main(void *arg)
{
    struct thr *t = arg;
    if (cur_ctx)
        A.cuCtxSetCurrent(cur_ctx); /* contexts are current per thread */
    for (int i = 0; i < t->iter; i++) {
        CUdeviceptr p;
        if (A.cuMemAlloc_v2(&p, t->size) != CUDA_SUCCESS) {
            t->fails++;
            continue;
        }
        if (A.cuMemFree_v2(p) != CUDA_SUCCESS)
            t->fails++;
    }
    return NULL;
}

static void get_noop(void)
{
    if (noop_fn || !A.cuModuleLoadData || !A.cuModuleGetFunction)
        return;
    CUmodule m;
    if (A.cuModuleLoadData(&m, noop_ptx) == CUDA_SUCCESS)
        A.cuModuleGetFunction(&noop_fn, m, "noop");
}

static void get_touch(void)
{
    if (touch_fn || !A.cuModuleLoadData || !A.cuModuleGetFunction)
        return;
    CUmodule m;
    if (A.cuModuleLoadData(&m, touch_ptx) == CUDA_SUCCESS)
        A.cuModuleGetFunction(&touch_fn, m, "touch");
}

static CUresult touch_one(CUdeviceptr p, size_t n)
{
    unsigned long long a = p, b = n;
    void *args[2] = {&a, &b};
    return A.cuLaunchKernel(touch_fn, 1024, 1, 1, 256, 1, 1, 0, NULL, args, NULL);
}

/* one pass over every allocation and mapping: the first error, or 0 */
static CUresult touch_pass(unsigned long long *bytes)
{
    CUresult rc = CUDA_SUCCESS;
    *bytes = 0;
    for (int k = 0; k < nptr && !rc; k++)
        if (ptrs[k]) {
            rc = touch_one(ptrs[k], sizes[k]);
            *bytes += sizes[k];
        }
    for (int k = 0; k < nvh && !rc; k++)
        if (vva[k]) {
            rc = touch_one(vva[k], vsz[k]);
            *bytes += vsz[k];
        }
    return rc;
}

static pid_t child_pid;

int main(int argc, char **argv)
{
    if (argc < 3)
        usage();
    setvbuf(stdout, NULL, _IOLBF, 0);
    load_api(argv[1]);
    for (int i = 2; i < argc; i++) {
        const char *c = argv[i];
#define ARG() (i + 1 < argc ? argv[++i] : (usage(), ""))
        if (!strcmp(c, "init")) {
            int dev = 0;
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9')
                dev = (int)num(argv[++i]);
            cmd_init(dev);
        } else if (!strcmp(c, "alloc")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            NEEDF(cuMemAlloc_v2);
            double t0 = now_ns();
            CUresult rc = A.cuMemAlloc_v2(&p, n);
            double t1 = now_ns();
            printf("alloc size=%zu rc=%d idx=%d ns=%.0f\n", n, rc, rc ? -1 : nptr, t1 - t0);
            if (!rc)
                add_ptr(p, n);
        } else if (!strcmp(c, "free") || !strcmp(c, "afree") || !strcmp(c, "afreeq")) {
            int k = idx_arg(ARG(), nptr);
            CUresult rc;
            if (c[0] == 'a') {
                NEEDF(cuMemFreeAsync_ptsz);
                rc = A.cuMemFreeAsync_ptsz(ptrs[k], NULL);
                if (A.cuStreamSynchronize && !c[5]) /* afreeq: no synchronisation */
                    A.cuStreamSynchronize(NULL);
            } else {
                rc = A.cuMemFree_v2(ptrs[k]);
            }
            printf("%s idx=%d rc=%d\n", c, k, rc);
            if (!rc)
                ptrs[k] = 0;
        } else if (!strcmp(c, "freeall")) {
            int bad = 0;
            for (int k = 0; k < nptr; k++)
                if (ptrs[k] && A.cuMemFree_v2(ptrs[k]) != CUDA_SUCCESS)
                    bad++;
            nptr = 0;
            printf("freeall failed=%d\n", bad);
        } else if (!strcmp(c, "pitch")) {
            size_t w = num(ARG()), h = num(ARG()), pitch = 0;
            CUdeviceptr p = 0;
            NEEDF(cuMemAllocPitch_v2);
            CUresult rc = A.cuMemAllocPitch_v2(&p, &pitch, w, h, 4);
            printf("pitch rc=%d pitch=%zu idx=%d\n", rc, pitch, rc ? -1 : nptr);
            if (!rc)
                add_ptr(p, pitch * h);
        } else if (!strcmp(c, "managed")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            NEEDF(cuMemAllocManaged);
            CUresult rc = A.cuMemAllocManaged(&p, n, CU_MEM_ATTACH_GLOBAL);
            printf("managed size=%zu rc=%d idx=%d\n", n, rc, rc ? -1 : nptr);
            if (!rc)
                add_ptr(p, n);
        } else if (!strcmp(c, "async") || !strcmp(c, "pool")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            CUresult rc;
            if (c[0] == 'a') {
                NEEDF(cuMemAllocAsync_ptsz);
                rc = A.cuMemAllocAsync_ptsz(&p, n, NULL);
            } else {
                NEEDF(cuMemPoolCreate);
                NEEDF(cuMemAllocFromPoolAsync_ptsz);
                rc = CUDA_SUCCESS;
                if (!pool) {
                    struct {
                        int allocType, handleTypes;
                        CUmemLocation location;
                        void *sec;
                        size_t maxSize;
                        unsigned short usage;
                        unsigned char reserved[54];
                    } props;
                    memset(&props, 0, sizeof props);
                    props.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
                    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                    props.location.id = cur_dev;
                    rc = A.cuMemPoolCreate(&pool, &props);
                }
                if (!rc)
                    rc = A.cuMemAllocFromPoolAsync_ptsz(&p, n, pool, NULL);
            }
            if (!rc && A.cuStreamSynchronize)
                A.cuStreamSynchronize(NULL);
            printf("%s size=%zu rc=%d idx=%d\n", c, n, rc, rc ? -1 : nptr);
            if (!rc)
                add_ptr(p, n);
        } else if (!strcmp(c, "pooltrim")) {
            NEEDF(cuMemPoolTrimTo);
            printf("pooltrim rc=%d\n", pool ? A.cuMemPoolTrimTo(pool, 0) : -1);
        } else if (!strcmp(c, "pooldestroy")) {
            NEEDF(cuMemPoolDestroy);
            printf("pooldestroy rc=%d\n", pool ? A.cuMemPoolDestroy(pool) : -1);
            pool = NULL;
        } else if (!strcmp(c, "vmm") || !strcmp(c, "vmmfd")) {
            size_t n = num(ARG());
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = 1; /* PINNED */
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = cur_dev;
            if (c[3] == 'f')
                prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            char pad[64] = {0}; /* room for allocFlags of newer headers */
            (void)pad;
            NEEDF(cuMemCreate);
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = A.cuMemCreate(&h, n, &prop, 0);
            printf("vmm size=%zu rc=%d idx=%d\n", n, rc, rc ? -1 : nvh);
            if (!rc && nvh < MAXP) {
                vh[nvh] = h;
                vsz[nvh++] = n;
            }
        } else if (!strcmp(c, "vexport")) {
            int k = idx_arg(ARG(), nvh);
            NEEDF(cuMemExportToShareableHandle);
            int fd = -1;
            CUresult rc = A.cuMemExportToShareableHandle(&fd, vh[k], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            printf("vexport idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "vmap")) {
            int k = idx_arg(ARG(), nvh);
            NEEDF(cuMemAddressReserve);
            NEEDF(cuMemMap);
            CUresult rc = A.cuMemAddressReserve(&vva[k], vsz[k], 0, 0, 0);
            if (!rc)
                rc = A.cuMemMap(vva[k], vsz[k], 0, vh[k], 0);
            printf("vmap idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "vunmap")) {
            int k = idx_arg(ARG(), nvh);
            NEEDF(cuMemUnmap);
            CUresult rc = A.cuMemUnmap(vva[k], vsz[k]);
            if (!rc && A.cuMemAddressFree)
                A.cuMemAddressFree(vva[k], vsz[k]);
            printf("vunmap idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "vrelease")) {
            int k = idx_arg(ARG(), nvh);
            NEEDF(cuMemRelease);
            printf("vrelease idx=%d rc=%d\n", k, A.cuMemRelease(vh[k]));
        } else if (!strcmp(c, "vfull")) {
            size_t n = num(ARG());
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = 1; /* PINNED */
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = cur_dev;
            NEEDF(cuMemCreate);
            NEEDF(cuMemAddressReserve);
            NEEDF(cuMemMap);
            NEEDF(cuMemSetAccess);
            CUmemGenericAllocationHandle h = 0;
            CUdeviceptr va = 0;
            CUresult rc = A.cuMemCreate(&h, n, &prop, 0), rm = -1, ra = -1;
            if (!rc && nvh < MAXP) {
                struct {
                    CUmemLocation location;
                    int flags;
                } acc = {{CU_MEM_LOCATION_TYPE_DEVICE, cur_dev}, 3 /* READWRITE */};
                if (!(rm = A.cuMemAddressReserve(&va, n, 0, 0, 0)))
                    rm = A.cuMemMap(va, n, 0, h, 0);
                if (!rm)
                    ra = A.cuMemSetAccess(va, n, &acc, 1);
                vh[nvh] = h;
                vva[nvh] = rm ? 0 : va;
                vsz[nvh++] = n;
            }
            printf("vfull size=%zu rc=%d map=%d access=%d idx=%d\n", n, rc, rm, ra, rc ? -1 : nvh - 1);
        } else if (!strcmp(c, "advise") || !strcmp(c, "prefetch")) {
            int k = idx_arg(ARG(), nptr);
            int adv = c[0] == 'a' ? (int)num(ARG()) : 0;
            CUmemLocation loc = {.type = (int)num(ARG()), .id = (int)num(ARG())};
            CUresult rc;
            if (c[0] == 'a') {
                NEEDF(cuMemAdvise_v2);
                rc = A.cuMemAdvise_v2(ptrs[k], sizes[k], adv, loc);
            } else {
                NEEDF(cuMemPrefetchAsync_v2);
                rc = A.cuMemPrefetchAsync_v2(ptrs[k], sizes[k], loc, 0, NULL);
                if (!rc && A.cuCtxSynchronize)
                    rc = A.cuCtxSynchronize();
            }
            printf("%s idx=%d rc=%d\n", c, k, rc);
        } else if (!strcmp(c, "touch") || !strcmp(c, "touchq")) {
            NEEDF(cuLaunchKernel);
            NEEDF(cuCtxSynchronize);
            get_touch();
            unsigned long long bytes;
            double t0 = now_ns();
            CUresult rc = touch_pass(&bytes);
            CUresult rs = c[5] ? 0 : A.cuCtxSynchronize(); /* touchq: queued, not waited for */
            printf("touch rc=%d sync=%d bytes=%llu ns=%.0f\n", rc, rs, bytes, now_ns() - t0);
        } else if (!strcmp(c, "touchfor")) {
            /* Passes back to back, the next one queued before waiting for the last, so the device
             * never idles for a launch: prints each pass's completion time (CLOCK_MONOTONIC ns,
             * comparable across the processes of the machine). */
            double sec = (double)num(ARG());
            NEEDF(cuLaunchKernel);
            NEEDF(cuEventCreate);
            NEEDF(cuEventRecord);
            NEEDF(cuEventSynchronize);
            get_touch();
            CUevent ev[2];
            if (A.cuEventCreate(&ev[0], CU_EVENT_DISABLE_TIMING) || A.cuEventCreate(&ev[1], CU_EVENT_DISABLE_TIMING))
                die("cuEventCreate failed");
            unsigned long long bytes = 0, passes = 0;
            double start = now_ns();
            CUresult rc = touch_pass(&bytes);
            if (!rc)
                rc = A.cuEventRecord(ev[0], NULL);
            printf("touchfor start=%.0f bytes=%llu\n", start, bytes);
            for (int cur = 0; !rc;) {
                int more = now_ns() - start < sec * 1e9;
                if (more && !(rc = touch_pass(&bytes)))
                    rc = A.cuEventRecord(ev[cur ^ 1], NULL);
                if (rc || (rc = A.cuEventSynchronize(ev[cur])))
                    break;
                passes++;
                printf("pass n=%llu t=%.0f\n", passes, now_ns());
                if (!more)
                    break;
                cur ^= 1;
            }
            printf("touchfor rc=%d passes=%llu end=%.0f\n", rc, passes, now_ns());
        } else if (!strcmp(c, "array")) {
            CUDA_ARRAY_DESCRIPTOR d = {.Width = num(ARG()), .Height = 0, .Format = 0x20, .NumChannels = 1};
            d.Height = num(ARG());
            NEEDF(cuArrayCreate_v2);
            CUarray a = NULL;
            CUresult rc = A.cuArrayCreate_v2(&a, &d);
            printf("array rc=%d idx=%d\n", rc, rc ? -1 : narr);
            if (!rc && narr < MAXP)
                arrs[narr++] = a;
        } else if (!strcmp(c, "adestroy")) {
            int k = idx_arg(ARG(), narr);
            NEEDF(cuArrayDestroy);
            printf("adestroy idx=%d rc=%d\n", k, A.cuArrayDestroy(arrs[k]));
        } else if (!strcmp(c, "info")) {
            size_t f = 0, t = 0;
            NEEDF(cuMemGetInfo_v2);
            CUresult rc = A.cuMemGetInfo_v2(&f, &t);
            printf("info rc=%d free=%zu total=%zu\n", rc, f, t);
        } else if (!strcmp(c, "uuid")) {
            CUuuid u;
            NEEDF(cuDeviceGetUuid);
            CUresult rc = A.cuDeviceGetUuid(&u, cur_dev);
            const unsigned char *b = (const unsigned char *)u.bytes;
            printf("uuid rc=%d uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", rc, b[0],
                   b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        } else if (!strcmp(c, "total")) {
            size_t t = 0;
            NEEDF(cuDeviceTotalMem_v2);
            CUresult rc = A.cuDeviceTotalMem_v2(&t, cur_dev);
            printf("total rc=%d bytes=%zu\n", rc, t);
        } else if (!strcmp(c, "launch")) {
            unsigned long long n = num(ARG());
            NEEDF(cuLaunchKernel);
            get_noop();
            CUresult rc = CUDA_SUCCESS;
            double t0 = now_ns();
            for (unsigned long long k = 0; k < n; k++)
                rc = A.cuLaunchKernel(noop_fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            double t1 = now_ns();
            if (A.cuStreamSynchronize)
                A.cuStreamSynchronize(NULL);
            printf("launch n=%llu rc=%d ns_per_call=%.3f\n", n, rc, n ? (t1 - t0) / (double)n : 0.0);
        } else if (!strcmp(c, "hooks")) {
            const void **slots = (const void **)&A;
            for (int k = 0; k < API_N; k++)
                printf("hook name=%s base=%s ver=%d flags=%d found=%d libvgpu=%d\n", api_meta[k].name,
                       api_meta[k].base, api_meta[k].ver, api_meta[k].flags, slots[k] != NULL, in_libvgpu(slots[k]));
            printf("gpa_self libvgpu=%d\n", gpa_self_hooked);
        } else if (!strcmp(c, "race")) {
            unsigned long long iter = num(ARG()), max = num(ARG());
            unsigned seed = (unsigned)num(ARG());
            unsigned pause_us = 0; /* optional: pause between operations */
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9')
                pause_us = (unsigned)num(argv[++i]);
            CUdeviceptr live[16] = {0};
            unsigned long long ok = 0, oom = 0, other = 0;
            for (unsigned long long k = 0; k < iter; k++) {
                if (pause_us)
                    usleep(pause_us);
                int s = (int)(rand_r(&seed) % 16);
                if (live[s]) {
                    if (A.cuMemFree_v2(live[s]) != CUDA_SUCCESS)
                        other++;
                    live[s] = 0;
                } else {
                    size_t n = 1 + (size_t)((unsigned long long)rand_r(&seed) * 65537ull % max);
                    CUresult rc = A.cuMemAlloc_v2(&live[s], n);
                    if (rc == CUDA_SUCCESS)
                        ok++;
                    else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
                        oom++, live[s] = 0;
                    else
                        other++, live[s] = 0;
                }
            }
            for (int s = 0; s < 16; s++)
                if (live[s])
                    A.cuMemFree_v2(live[s]);
            printf("race ok=%llu oom=%llu other=%llu\n", ok, oom, other);
        } else if (!strcmp(c, "threads")) {
            int nt = (int)num(ARG());
            int iter = (int)num(ARG());
            size_t n = num(ARG());
            pthread_t th[64];
            struct thr ts[64];
            if (nt < 1 || nt > 64)
                die("threads: 1..64");
            for (int k = 0; k < nt; k++) {
                ts[k] = (struct thr){.iter = iter, .size = n, .fails = 0};
                pthread_create(&th[k], NULL, thr_main, &ts[k]);
            }
            int fails = 0;
            for (int k = 0; k < nt; k++) {
                pthread_join(th[k], NULL);
                fails += ts[k].fails;
            }
            printf("threads fails=%d\n", fails);
        } else if (!strcmp(c, "fork")) {
            fflush(stdout);
            pid_t p = fork();
            if (p < 0)
                die("fork: %s", strerror(errno));
            if (p > 0) {
                child_pid = p;
                while (i + 1 < argc && strcmp(argv[i + 1], "end") != 0)
                    i++;
                i++; /* skip "end" */
                printf("fork child=%d\n", (int)p);
            }
            /* child: runs the commands up to "end" */
        } else if (!strcmp(c, "end")) {
            fflush(stdout);
            _exit(0); /* only a forked child gets here */
        } else if (!strcmp(c, "waitchild")) {
            int st = 0;
            if (child_pid > 0)
                waitpid(child_pid, &st, 0);
            printf("waitchild status=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
        } else if (!strcmp(c, "rtld_next")) {
            /* From the program, RTLD_NEXT for "dlsym" must find the next
             * definition after the program (libvgpu's, when preloaded) — not
             * the one after libvgpu (libc's), which is what a wrapper that
             * forwarded the call itself would produce. */
            void *next = dlsym(RTLD_NEXT, "dlsym");
            void *dflt = dlsym(RTLD_DEFAULT, "dlsym");
            void *nx2 = dlsym(RTLD_NEXT, "cuDeviceGetCount"); /* not hooked: whatever is next */
            printf("rtld_next same=%d next_libvgpu=%d cu_unhooked_libvgpu=%d\n", next == dflt, in_libvgpu(next),
                   in_libvgpu(nx2));
        } else if (!strcmp(c, "wait")) {
            printf("waiting\n");
            fflush(stdout);
            char b[64];
            while (read(0, b, sizeof b) > 0)
                ;
        } else if (!strcmp(c, "sleepms")) {
            usleep((useconds_t)num(ARG()) * 1000);
        } else {
            usage();
        }
    }
    return 0;
}
