/*
 * paths — the allocation paths beyond cuMemAlloc, driven by the command line
 * (like cutest): stream capture and graphs with memory nodes, memory pools,
 * host locations and registered host memory, and sharing between processes
 * (POSIX file descriptors, legacy IPC, pool exports).
 *
 *   paths MODE CMD [ARGS]... [CMD [ARGS]...]...
 *
 * Each command prints one "name key=value..." line.  Objects are numbered in
 * the order they are made, per kind: d (device pointers: alloc, async, pool,
 * graph, IPC, pool imports), v (VMM handles).  Processes exchange what they
 * share through files: "PID FD" for a descriptor (the importer takes it with
 * pidfd_getfd, as a process receiving it over a socket would) and the raw
 * bytes of an IPC handle or pool pointer export.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define MAXO 256
#define MiB (1ull << 20)

static CUdevice cur_dev;
static CUstream stream;
static CUdeviceptr dptr[MAXO];
static size_t dsize[MAXO];
static int nd;
static CUmemGenericAllocationHandle vh[MAXO];
static size_t vsz[MAXO];
static CUdeviceptr vva[MAXO];
static int nv;
static CUgraph graph;
static CUgraphExec gexec;
static CUmemoryPool pool, ipool;
static void *hostbuf;

static unsigned long long num(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        die("bad number %s", s);
    return v;
}

#define NEEDF(f)                                                \
    do {                                                        \
        if (!A.f)                                               \
            die("%s unavailable in mode %s", #f, api_mode);     \
    } while (0)

static int add_d(CUdeviceptr p, size_t n)
{
    if (nd >= MAXO)
        die("too many pointers");
    dptr[nd] = p;
    dsize[nd] = n;
    return nd++;
}

static int idx(const char *s, int n)
{
    long i = (long)num(s);
    if (i < 0 || i >= n)
        die("index %ld out of range", i);
    return (int)i;
}

static void write_file(const char *path, const void *buf, size_t n)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(buf, 1, n, f) != n || fclose(f) != 0 || rename(tmp, path) != 0)
        die("cannot write %s", path);
}

static size_t read_file(const char *path, void *buf, size_t n)
{
    for (int i = 0; i < 3000; i++) { /* the other process may not have written it yet */
        FILE *f = fopen(path, "rb");
        if (f) {
            size_t got = fread(buf, 1, n, f);
            fclose(f);
            return got;
        }
        usleep(10000);
    }
    die("%s never appeared", path);
}

/* a descriptor of another process, as SCM_RIGHTS would deliver it */
static int take_fd(const char *path)
{
    char buf[64] = {0};
    read_file(path, buf, sizeof buf - 1);
    int pid = 0, fd = -1;
    if (sscanf(buf, "%d %d", &pid, &fd) != 2)
        die("bad fd file %s", path);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0)
        die("pidfd_open(%d): %s", pid, strerror(errno));
    int got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    close(pidfd);
    if (got < 0)
        die("pidfd_getfd: %s", strerror(errno));
    return got;
}

static void give_fd(const char *path, int fd)
{
    char buf[64];
    int n = snprintf(buf, sizeof buf, "%d %d\n", (int)getpid(), fd);
    write_file(path, buf, (size_t)n);
}

static void cmd_init(int dev)
{
    CUresult rc = A.cuInit(0);
    CUcontext ctx;
    if (!rc)
        rc = A.cuDeviceGet(&cur_dev, dev);
    if (!rc)
        rc = A.cuDevicePrimaryCtxRetain(&ctx, cur_dev);
    if (!rc)
        rc = A.cuCtxSetCurrent(ctx);
    if (!rc && A.cuStreamCreate)
        rc = A.cuStreamCreate(&stream, 1);
    printf("init rc=%d\n", rc);
    if (rc)
        exit(3);
}

static void pool_props(CUmemPoolProps *p, int loc, int ht)
{
    memset(p, 0, sizeof *p);
    p->allocType = 1;
    p->handleTypes = ht;
    p->location.type = loc;
    p->location.id = loc == CU_MEM_LOCATION_TYPE_DEVICE ? cur_dev : 0;
}

static unsigned long long gattr(int a)
{
    cuuint64_t v = 0;
    NEEDF(cuDeviceGetGraphMemAttribute);
    if (A.cuDeviceGetGraphMemAttribute(cur_dev, a, &v) != CUDA_SUCCESS)
        return ~0ull;
    return v;
}

static unsigned long long pattr(CUmemoryPool p, int a)
{
    cuuint64_t v = 0;
    NEEDF(cuMemPoolGetAttribute);
    if (A.cuMemPoolGetAttribute(p, a, &v) != CUDA_SUCCESS)
        return ~0ull;
    return v;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: paths MODE CMD... (see the source)\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    load_api(argv[1]);
    for (int i = 2; i < argc; i++) {
        const char *c = argv[i];
#define ARG() (i + 1 < argc ? argv[++i] : (die("%s: argument missing", c), ""))
#define OPT(def) (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9' ? num(argv[++i]) : (def))
        if (!strcmp(c, "init")) {
            cmd_init((int)OPT(0));
        } else if (!strcmp(c, "info")) {
            size_t f = 0, t = 0;
            CUresult rc = A.cuMemGetInfo_v2(&f, &t);
            printf("info rc=%d free=%zu total=%zu\n", rc, f, t);
        } else if (!strcmp(c, "alloc")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            CUresult rc = A.cuMemAlloc_v2(&p, n);
            printf("alloc rc=%d idx=%d\n", rc, rc ? -1 : add_d(p, n));
        } else if (!strcmp(c, "free")) {
            int k = idx(ARG(), nd);
            printf("free idx=%d rc=%d\n", k, A.cuMemFree_v2(dptr[k]));
        } else if (!strcmp(c, "afree")) {
            int k = idx(ARG(), nd);
            printf("afree idx=%d rc=%d\n", k, A.cuMemFreeAsync(dptr[k], stream));
        } else if (!strcmp(c, "sync")) {
            printf("sync rc=%d\n", A.cuStreamSynchronize(stream));
        } else if (!strcmp(c, "ctxsync")) {
            printf("ctxsync rc=%d\n", A.cuCtxSynchronize());
        } else if (!strcmp(c, "write")) {
            int k = idx(ARG(), nd);
            unsigned char b = (unsigned char)num(ARG());
            unsigned char buf[4096];
            memset(buf, b, sizeof buf);
            size_t n = dsize[k] < sizeof buf ? dsize[k] : sizeof buf;
            printf("write idx=%d rc=%d\n", k, A.cuMemcpyHtoD_v2(dptr[k], buf, n));
        } else if (!strcmp(c, "read")) {
            int k = idx(ARG(), nd);
            unsigned char b = 0;
            CUresult rc = A.cuMemcpyDtoH_v2(&b, dptr[k], 1);
            printf("read idx=%d rc=%d byte=%u\n", k, rc, b);
        /* ---------------------------------------------------------- graphs */
        } else if (!strcmp(c, "cap_begin")) {
            NEEDF(cuStreamBeginCapture_v2);
            printf("cap_begin rc=%d\n", A.cuStreamBeginCapture_v2(stream, (int)OPT(0)));
        } else if (!strcmp(c, "cap_alloc")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            CUresult rc = A.cuMemAllocAsync(&p, n, stream);
            printf("cap_alloc rc=%d idx=%d\n", rc, rc ? -1 : add_d(p, n));
        } else if (!strcmp(c, "cap_end")) {
            NEEDF(cuStreamEndCapture);
            CUresult rc = A.cuStreamEndCapture(stream, &graph);
            printf("cap_end rc=%d graph=%d\n", rc, graph != NULL);
        } else if (!strcmp(c, "iscap")) {
            int st = -1;
            CUresult rc = A.cuStreamIsCapturing(stream, &st);
            printf("iscap rc=%d status=%d\n", rc, st);
        } else if (!strcmp(c, "gnew")) {
            NEEDF(cuGraphCreate);
            printf("gnew rc=%d\n", A.cuGraphCreate(&graph, 0));
        } else if (!strcmp(c, "galloc")) {
            size_t n = num(ARG());
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            p.poolProps.allocType = 1;
            p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            p.poolProps.location.id = cur_dev;
            p.bytesize = n;
            CUgraphNode node;
            NEEDF(cuGraphAddMemAllocNode);
            CUresult rc = A.cuGraphAddMemAllocNode(&node, graph, NULL, 0, &p);
            printf("galloc rc=%d idx=%d\n", rc, rc ? -1 : add_d(p.dptr, n));
        } else if (!strcmp(c, "gfree")) {
            int k = idx(ARG(), nd);
            CUgraphNode node;
            NEEDF(cuGraphAddMemFreeNode);
            printf("gfree idx=%d rc=%d\n", k, A.cuGraphAddMemFreeNode(&node, graph, NULL, 0, dptr[k]));
        } else if (!strcmp(c, "inst")) {
            NEEDF(cuGraphInstantiateWithFlags);
            printf("inst rc=%d\n", A.cuGraphInstantiateWithFlags(&gexec, graph, OPT(0)));
        } else if (!strcmp(c, "instp")) {
            CUDA_GRAPH_INSTANTIATE_PARAMS p = {.flags = OPT(0), .hUploadStream = stream};
            NEEDF(cuGraphInstantiateWithParams);
            CUresult rc = A.cuGraphInstantiateWithParams(&gexec, graph, &p);
            printf("instp rc=%d result=%d\n", rc, p.result_out);
        } else if (!strcmp(c, "launch")) {
            NEEDF(cuGraphLaunch);
            printf("launch rc=%d\n", A.cuGraphLaunch(gexec, stream));
        } else if (!strcmp(c, "upload")) {
            NEEDF(cuGraphUpload);
            printf("upload rc=%d\n", A.cuGraphUpload(gexec, stream));
        } else if (!strcmp(c, "xdestroy")) {
            printf("xdestroy rc=%d\n", A.cuGraphExecDestroy(gexec));
            gexec = NULL;
        } else if (!strcmp(c, "gdestroy")) {
            printf("gdestroy rc=%d\n", A.cuGraphDestroy(graph));
            graph = NULL;
        } else if (!strcmp(c, "trim")) {
            NEEDF(cuDeviceGraphMemTrim);
            printf("trim rc=%d\n", A.cuDeviceGraphMemTrim(cur_dev));
        } else if (!strcmp(c, "gattr")) {
            printf("gattr used=%llu used_high=%llu reserved=%llu reserved_high=%llu\n", gattr(0), gattr(1), gattr(2),
                   gattr(3));
        } else if (!strcmp(c, "gattr_reset")) {
            cuuint64_t zero = 0, one = 1;
            NEEDF(cuDeviceSetGraphMemAttribute);
            printf("gattr_reset rc=%d bad=%d current=%d\n", A.cuDeviceSetGraphMemAttribute(cur_dev, 3, &zero),
                   A.cuDeviceSetGraphMemAttribute(cur_dev, 3, &one), A.cuDeviceSetGraphMemAttribute(cur_dev, 2, &zero));
        /* ----------------------------------------------------------- pools */
        } else if (!strcmp(c, "pcreate")) {
            int loc = (int)OPT(CU_MEM_LOCATION_TYPE_DEVICE), ht = (int)OPT(0);
            CUmemPoolProps p;
            pool_props(&p, loc, ht);
            printf("pcreate rc=%d\n", A.cuMemPoolCreate(&pool, &p));
        } else if (!strcmp(c, "pdefault")) {
            printf("pdefault rc=%d\n", A.cuDeviceGetDefaultMemPool(&pool, cur_dev));
        } else if (!strcmp(c, "palloc")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            CUresult rc = A.cuMemAllocFromPoolAsync(&p, n, pool, stream);
            printf("palloc rc=%d idx=%d\n", rc, rc ? -1 : add_d(p, n));
        } else if (!strcmp(c, "dalloc")) {
            size_t n = num(ARG());
            CUdeviceptr p = 0;
            CUresult rc = A.cuMemAllocAsync(&p, n, stream);
            printf("dalloc rc=%d idx=%d\n", rc, rc ? -1 : add_d(p, n));
        } else if (!strcmp(c, "pthreshold")) {
            cuuint64_t v = num(ARG());
            printf("pthreshold rc=%d\n", A.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v));
        } else if (!strcmp(c, "ptrim")) {
            printf("ptrim rc=%d\n", A.cuMemPoolTrimTo(pool, num(ARG())));
        } else if (!strcmp(c, "pdestroy")) {
            printf("pdestroy rc=%d\n", A.cuMemPoolDestroy(pool));
        } else if (!strcmp(c, "pattr")) {
            printf("pattr reserved=%llu used=%llu\n", pattr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
                   pattr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT));
        /* ------------------------------------------------------------- VMM */
        } else if (!strcmp(c, "vmm")) {
            size_t n = num(ARG());
            int loc = (int)OPT(CU_MEM_LOCATION_TYPE_DEVICE), ht = (int)OPT(0);
            struct {
                CUmemAllocationProp p;
                unsigned char flags[8];
            } prop;
            memset(&prop, 0, sizeof prop);
            prop.p.type = 1;
            prop.p.requestedHandleTypes = ht;
            prop.p.location.type = loc;
            prop.p.location.id = loc == CU_MEM_LOCATION_TYPE_DEVICE ? cur_dev : 0;
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = A.cuMemCreate(&h, n, &prop.p, 0);
            printf("vmm rc=%d idx=%d\n", rc, rc ? -1 : nv);
            if (!rc) {
                vh[nv] = h;
                vsz[nv++] = n;
            }
        } else if (!strcmp(c, "vmap")) {
            int k = idx(ARG(), nv);
            CUresult rc = A.cuMemAddressReserve(&vva[k], vsz[k], 0, 0, 0);
            if (!rc)
                rc = A.cuMemMap(vva[k], vsz[k], 0, vh[k], 0);
            printf("vmap idx=%d rc=%d d=%d\n", k, rc, rc ? -1 : add_d(vva[k], vsz[k]));
        } else if (!strcmp(c, "vunmap")) {
            int k = idx(ARG(), nv);
            CUresult rc = A.cuMemUnmap(vva[k], vsz[k]);
            if (!rc)
                A.cuMemAddressFree(vva[k], vsz[k]);
            printf("vunmap idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "vrelease")) {
            int k = idx(ARG(), nv);
            printf("vrelease idx=%d rc=%d\n", k, A.cuMemRelease(vh[k]));
        } else if (!strcmp(c, "vexport")) {
            int k = idx(ARG(), nv);
            const char *path = ARG();
            int fd = -1;
            NEEDF(cuMemExportToShareableHandle);
            CUresult rc = A.cuMemExportToShareableHandle(&fd, vh[k], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            if (!rc)
                give_fd(path, fd);
            printf("vexport idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "vimport")) {
            int fd = take_fd(ARG());
            size_t n = num(ARG());
            CUmemGenericAllocationHandle h = 0;
            NEEDF(cuMemImportFromShareableHandle);
            CUresult rc = A.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            close(fd); /* the importer's copy: the imported handle does not need it */
            printf("vimport rc=%d idx=%d\n", rc, rc ? -1 : nv);
            if (!rc) {
                vh[nv] = h;
                vsz[nv++] = n;
            }
        /* ------------------------------------------------------ legacy IPC */
        } else if (!strcmp(c, "ipc_get")) {
            int k = idx(ARG(), nd);
            const char *path = ARG();
            CUipcMemHandle h;
            NEEDF(cuIpcGetMemHandle);
            CUresult rc = A.cuIpcGetMemHandle(&h, dptr[k]);
            if (!rc)
                write_file(path, &h, sizeof h);
            printf("ipc_get idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "ipc_open")) {
            CUipcMemHandle h;
            if (read_file(ARG(), &h, sizeof h) != sizeof h)
                die("short IPC handle");
            CUdeviceptr p = 0;
            NEEDF(cuIpcOpenMemHandle_v2);
            CUresult rc = A.cuIpcOpenMemHandle_v2(&p, h, 1);
            printf("ipc_open rc=%d idx=%d\n", rc, rc ? -1 : add_d(p, 1));
        } else if (!strcmp(c, "ipc_close")) {
            int k = idx(ARG(), nd);
            printf("ipc_close idx=%d rc=%d\n", k, A.cuIpcCloseMemHandle(dptr[k]));
        /* ------------------------------------------------- pool exports */
        } else if (!strcmp(c, "pexport")) {
            int fd = -1;
            NEEDF(cuMemPoolExportToShareableHandle);
            CUresult rc = A.cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            if (!rc)
                give_fd(ARG(), fd);
            else
                ARG();
            printf("pexport rc=%d\n", rc);
        } else if (!strcmp(c, "pexptr")) {
            int k = idx(ARG(), nd);
            const char *path = ARG();
            unsigned char data[64];
            NEEDF(cuMemPoolExportPointer);
            CUresult rc = A.cuMemPoolExportPointer(data, dptr[k]);
            if (!rc)
                write_file(path, data, sizeof data);
            printf("pexptr idx=%d rc=%d\n", k, rc);
        } else if (!strcmp(c, "pimport")) {
            int fd = take_fd(ARG());
            NEEDF(cuMemPoolImportFromShareableHandle);
            CUresult rc = A.cuMemPoolImportFromShareableHandle(&ipool, (void *)(intptr_t)fd,
                                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            close(fd);
            printf("pimport rc=%d\n", rc);
        } else if (!strcmp(c, "pimptr")) {
            unsigned char data[64];
            if (read_file(ARG(), data, sizeof data) != sizeof data)
                die("short pointer export");
            CUdeviceptr p = 0;
            NEEDF(cuMemPoolImportPointer);
            CUresult rc = A.cuMemPoolImportPointer(&p, ipool, data);
            printf("pimptr rc=%d idx=%d\n", rc, rc ? -1 : add_d(p, 1));
        /* ----------------------------------------------------- host memory */
        } else if (!strcmp(c, "hostreg")) {
            size_t n = num(ARG());
            hostbuf = aligned_alloc(4096, n);
            if (!hostbuf)
                die("out of host memory");
            memset(hostbuf, 1, n);
            NEEDF(cuMemHostRegister_v2);
            printf("hostreg rc=%d\n", A.cuMemHostRegister_v2(hostbuf, n, 0));
        } else if (!strcmp(c, "hostunreg")) {
            NEEDF(cuMemHostUnregister);
            printf("hostunreg rc=%d\n", A.cuMemHostUnregister(hostbuf));
            free(hostbuf);
            hostbuf = NULL;
        /* ------------------------------------------------ between processes */
        } else if (!strcmp(c, "signal")) {
            write_file(ARG(), "1", 1);
            printf("signal\n");
        } else if (!strcmp(c, "await")) {
            char b;
            read_file(ARG(), &b, 1);
            printf("await\n");
        } else if (!strcmp(c, "sleepms")) {
            usleep((useconds_t)num(ARG()) * 1000);
        } else {
            die("unknown command %s", c);
        }
    }
    return 0;
}
