/* A CUDA runtime program as users write them, linked against NVIDIA's libcudart.so.12 or .13 from
 * PyPI (the test builds it with gcc; no nvcc).  The few runtime prototypes it uses are declared
 * here with the ABI of cuda_runtime_api.h.  Output: "name k=v ..." lines.
 *
 *   cudart_prog info                 device count, properties, cudaMemGetInfo
 *   cudart_prog roundtrip            copies, sets, pitch, managed, pools, streams, events, a kernel
 *                                    from a registered fatbin, a device variable
 *   cudart_prog fill KIND CHUNK [N]  allocate CHUNK bytes with KIND (malloc, pitch, managed, async,
 *                                    pool, graph: a captured cudaMallocAsync, instantiated and
 *                                    launched) until it fails (or N times), then report the error
 *   cudart_prog hold                 print "holding" and keep everything until stdin closes
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUmemPool_st *cudaMemPool_t;
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct {
    unsigned x, y, z;
} dim3;

enum { H2D = 1, D2H = 2, D2D = 3, DEFAULT = 4 };

cudaError_t cudaGetDeviceCount(int *);
cudaError_t cudaSetDevice(int);
cudaError_t cudaDeviceGetAttribute(int *, int, int);
cudaError_t cudaMemGetInfo(size_t *, size_t *);
cudaError_t cudaDriverGetVersion(int *);
cudaError_t cudaRuntimeGetVersion(int *);
const char *cudaGetErrorName(cudaError_t);
cudaError_t cudaGetLastError(void);
cudaError_t cudaMalloc(void **, size_t);
cudaError_t cudaFree(void *);
cudaError_t cudaMallocPitch(void **, size_t *, size_t, size_t);
cudaError_t cudaMallocManaged(void **, size_t, unsigned);
cudaError_t cudaMallocHost(void **, size_t);
cudaError_t cudaFreeHost(void *);
cudaError_t cudaMemcpy(void *, const void *, size_t, int);
cudaError_t cudaMemcpyAsync(void *, const void *, size_t, int, cudaStream_t);
cudaError_t cudaMemcpy2D(void *, size_t, const void *, size_t, size_t, size_t, int);
cudaError_t cudaMemset(void *, int, size_t);
cudaError_t cudaMemsetAsync(void *, int, size_t, cudaStream_t);
cudaError_t cudaMemset2D(void *, size_t, int, size_t, size_t);
cudaError_t cudaMallocAsync(void **, size_t, cudaStream_t);
cudaError_t cudaFreeAsync(void *, cudaStream_t);
cudaError_t cudaMallocFromPoolAsync(void **, size_t, cudaMemPool_t, cudaStream_t);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *, int);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, int, void *);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, int, void *);
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t);
cudaError_t cudaStreamCreate(cudaStream_t *);
cudaError_t cudaStreamDestroy(cudaStream_t);
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaEventCreate(cudaEvent_t *);
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t);
cudaError_t cudaEventSynchronize(cudaEvent_t);
cudaError_t cudaEventElapsedTime(float *, cudaEvent_t, cudaEvent_t);
cudaError_t cudaEventDestroy(cudaEvent_t);
cudaError_t cudaLaunchKernel(const void *, dim3, dim3, void **, size_t, cudaStream_t);
cudaError_t cudaMemcpyToSymbol(const void *, const void *, size_t, size_t, int);
cudaError_t cudaMemcpyFromSymbol(void *, const void *, size_t, size_t, int);
cudaError_t cudaFuncGetAttributes(void *, const void *);
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *, const void *, int, size_t);
cudaError_t cudaStreamBeginCapture(cudaStream_t, int);
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *, cudaGraph_t, unsigned long long);
cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t);
cudaError_t cudaGraphDestroy(cudaGraph_t);
void **__cudaRegisterFatBinary(void *);
void __cudaRegisterFatBinaryEnd(void **);
void __cudaUnregisterFatBinary(void **);
void __cudaRegisterFunction(void **, const char *, char *, const char *, int, void *, void *, void *, void *, int *);
void __cudaRegisterVar(void **, char *, char *, const char *, int, size_t, int, int);

static int fails;

static void check(const char *what, cudaError_t e)
{
    if (e) {
        printf("fail what=%s err=%d name=%s\n", what, e, cudaGetErrorName(e));
        fails++;
    }
}

/* --- a fatbin made by hand: one PTX entry (the fatbin layout of cuda_fatbin.c) ---------------- */

static const char PTX[] = ".version 7.0\n.target sm_50\n.address_size 64\n"
                          ".visible .global .align 4 .b8 table[64];\n"
                          ".visible .entry scale(.param .u64 p, .param .u32 n)\n{\n  ret;\n}\n";

static struct {
    uint32_t magic;
    uint16_t version, header_size;
    uint64_t size;
    struct {
        uint16_t kind, version;
        uint32_t header_size, payload_size, unknown0, compressed_size, unknown1, unknown2, sm, bits, unknown3;
        uint64_t flags, unknown5, uncompressed;
    } entry;
    char payload[256];
} __attribute__((aligned(8))) g_fatbin;

static struct {
    uint32_t magic, version;
    const void *data;
    void *list;
} g_wrapper;

static char scale_stub; /* the "host function" the kernel is registered under */
static char table_shadow[64];

static void **register_module(void)
{
    memset(&g_fatbin, 0, sizeof(g_fatbin));
    g_fatbin.magic = 0xba55ed50u;
    g_fatbin.version = 1;
    g_fatbin.header_size = 16;
    g_fatbin.entry.kind = 1; /* PTX */
    g_fatbin.entry.version = 0x101;
    g_fatbin.entry.header_size = 64;
    g_fatbin.entry.payload_size = sizeof(g_fatbin.payload);
    g_fatbin.entry.sm = 50;
    g_fatbin.entry.bits = 64;
    g_fatbin.entry.flags = 0x11;
    memcpy(g_fatbin.payload, PTX, sizeof(PTX));
    g_fatbin.size = sizeof(g_fatbin.entry) + sizeof(g_fatbin.payload);
    g_wrapper.magic = 0x466243b1u;
    g_wrapper.version = 1;
    g_wrapper.data = &g_fatbin;
    void **h = __cudaRegisterFatBinary(&g_wrapper);
    __cudaRegisterFunction(h, &scale_stub, "scale", "scale", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterVar(h, table_shadow, "table", "table", 0, sizeof(table_shadow), 0, 0);
    __cudaRegisterFatBinaryEnd(h);
    return h;
}

/* --- commands --------------------------------------------------------------------------------- */

static void info(void)
{
    int n = -1, drv = 0, rt = 0, sms = 0, major = 0;
    size_t fr = 0, tot = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    printf("info err=%d devices=%d driver=%d runtime=%d\n", e, n, drv, rt);
    check("setdevice", cudaSetDevice(0));
    check("attr", cudaDeviceGetAttribute(&sms, 16, 0));
    check("attr", cudaDeviceGetAttribute(&major, 75, 0));
    check("meminfo", cudaMemGetInfo(&fr, &tot));
    printf("device sms=%d cc_major=%d free=%zu total=%zu\n", sms, major, fr, tot);
}

static int same(const unsigned char *a, int v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != (unsigned char)v)
            return 0;
    return 1;
}

static void roundtrip(void)
{
    const size_t n = 1 << 20;
    unsigned char *h = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        h[i] = (unsigned char)(i * 7 + 3);
    void *d = NULL, *d2 = NULL;
    check("malloc", cudaMalloc(&d, n));
    check("malloc2", cudaMalloc(&d2, n));
    check("h2d", cudaMemcpy(d, h, n, H2D));
    check("d2d", cudaMemcpy(d2, d, n, D2D));
    memset(back, 0, n);
    check("d2h", cudaMemcpy(back, d2, n, D2H));
    printf("copy ok=%d\n", !memcmp(h, back, n));
    check("memset", cudaMemset(d, 0x5a, n / 2));
    check("d2h", cudaMemcpy(back, d, n, DEFAULT));
    printf("memset ok=%d rest_ok=%d\n", same(back, 0x5a, n / 2), !memcmp(back + n / 2, h + n / 2, n / 2));

    cudaStream_t s;
    cudaEvent_t e0, e1;
    check("stream", cudaStreamCreate(&s));
    check("event", cudaEventCreate(&e0));
    check("event", cudaEventCreate(&e1));
    check("record", cudaEventRecord(e0, s));
    check("memsetasync", cudaMemsetAsync(d2, 0x11, n, s));
    check("d2hasync", cudaMemcpyAsync(back, d2, n, D2H, s));
    check("record", cudaEventRecord(e1, s));
    check("evsync", cudaEventSynchronize(e1));
    float ms = -1;
    check("elapsed", cudaEventElapsedTime(&ms, e0, e1));
    printf("async ok=%d elapsed_ok=%d\n", same(back, 0x11, n), ms >= 0);

    /* pitched: 1000 x 64 rows */
    void *p = NULL;
    size_t pitch = 0;
    check("pitch", cudaMallocPitch(&p, &pitch, 1000, 64));
    check("memset2d", cudaMemset2D(p, pitch, 0x22, 1000, 64));
    check("copy2d", cudaMemcpy2D(back, 1000, p, pitch, 1000, 64, D2H));
    int pitch_ok = same(back, 0x22, 1000 * 64);
    check("copy2d_h2d", cudaMemcpy2D(p, pitch, h, 1000, 1000, 64, H2D));
    check("copy2d_d2h", cudaMemcpy2D(back, 1000, p, pitch, 1000, 64, D2H));
    printf("pitch pitch=%zu ok=%d rows_ok=%d\n", pitch, pitch_ok, !memcmp(back, h, 1000 * 64));

    /* managed: the host writes, the device copies */
    unsigned char *m = NULL;
    check("managed", cudaMallocManaged((void **)&m, n, 1));
    if (m)
        memcpy(m, h, n);
    check("m2d", cudaMemcpy(d, m, n, DEFAULT));
    check("d2h", cudaMemcpy(back, d, n, D2H));
    printf("managed ok=%d\n", !memcmp(back, h, n));

    /* stream-ordered: default pool and an explicit pool */
    void *a = NULL;
    check("mallocasync", cudaMallocAsync(&a, n, s));
    check("h2dasync", cudaMemcpyAsync(a, h, n, H2D, s));
    check("d2hasync", cudaMemcpyAsync(back, a, n, D2H, s));
    check("freeasync", cudaFreeAsync(a, s));
    check("sync", cudaStreamSynchronize(s));
    cudaMemPool_t pool;
    check("defpool", cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t used = 0;
    check("poolattr", cudaMemPoolGetAttribute(pool, 7, &used)); /* cudaMemPoolAttrUsedMemCurrent */
    printf("async ok=%d pool_used_after_free=%llu\n", !memcmp(back, h, n), (unsigned long long)used);

    /* a kernel from a registered fatbin, and its device variable */
    void **mod = register_module();
    unsigned cnt = 16;
    void *args[] = {&d, &cnt};
    dim3 g = {4, 1, 1}, b = {128, 1, 1};
    check("launch", cudaLaunchKernel(&scale_stub, g, b, args, 0, s));
    check("sync", cudaStreamSynchronize(s));
    int occ = 0;
    check("occupancy", cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, &scale_stub, 128, 0));
    char tab[64], tab_back[64];
    for (int i = 0; i < 64; i++)
        tab[i] = (char)(100 + i);
    check("tosymbol", cudaMemcpyToSymbol(table_shadow, tab, sizeof(tab), 0, H2D));
    check("fromsymbol", cudaMemcpyFromSymbol(tab_back, table_shadow, sizeof(tab), 0, D2H));
    printf("kernel occupancy=%d symbol_ok=%d\n", occ, !memcmp(tab, tab_back, 64));
    __cudaUnregisterFatBinary(mod);

    check("free", cudaFree(d));
    check("free", cudaFree(d2));
    check("free", cudaFree(p));
    check("free", cudaFree(m));
    check("devsync", cudaDeviceSynchronize());
    check("last", cudaGetLastError());
    printf("roundtrip fails=%d\n", fails);
    free(h);
    free(back);
}

static cudaMemPool_t g_pool;
static cudaStream_t g_stream;

static cudaError_t alloc_one(const char *kind, size_t chunk, void **out)
{
    size_t pitch;
    if (!strcmp(kind, "malloc"))
        return cudaMalloc(out, chunk);
    if (!strcmp(kind, "pitch")) /* rows of 1 MiB: the pitch is the width, no padding */
        return cudaMallocPitch(out, &pitch, 1 << 20, chunk >> 20);
    if (!strcmp(kind, "managed"))
        return cudaMallocManaged(out, chunk, 1);
    if (!strcmp(kind, "async"))
        return cudaMallocAsync(out, chunk, g_stream);
    if (!strcmp(kind, "pool"))
        return cudaMallocFromPoolAsync(out, chunk, g_pool, g_stream);
    if (!strcmp(kind, "graph")) { /* a graph with one memory node; its allocation outlives the launch */
        cudaGraph_t g;
        cudaGraphExec_t x;
        cudaError_t e = cudaStreamBeginCapture(g_stream, 0); /* cudaStreamCaptureModeGlobal */
        if (e)
            return e;
        cudaError_t ea = cudaMallocAsync(out, chunk, g_stream);
        if ((e = cudaStreamEndCapture(g_stream, &g)))
            return e;
        if (ea)
            return ea;
        if ((e = cudaGraphInstantiate(&x, g, 0)))
            return e;
        if ((e = cudaGraphLaunch(x, g_stream)))
            return e;
        return cudaStreamSynchronize(g_stream);
    }
    return 1;
}

static void fill(const char *kind, size_t chunk, long max)
{
    check("stream", cudaStreamCreate(&g_stream));
    if (!strcmp(kind, "pool")) {
        check("defpool", cudaDeviceGetDefaultMemPool(&g_pool, 0));
        uint64_t keep = UINT64_MAX; /* keep what is freed: the pool's reservation is the usage */
        check("threshold", cudaMemPoolSetAttribute(g_pool, 4, &keep));
    }
    size_t total = 0;
    long n = 0;
    cudaError_t e = 0;
    for (; max <= 0 || n < max; n++) {
        void *p = NULL;
        e = alloc_one(kind, chunk, &p);
        if (e)
            break;
        total += chunk;
    }
    if (!strcmp(kind, "async") || !strcmp(kind, "pool") || !strcmp(kind, "graph"))
        cudaStreamSynchronize(g_stream);
    cudaGetLastError();
    printf("fill kind=%s chunk=%zu count=%ld total=%zu err=%d name=%s\n", kind, chunk, n, total, e,
           e ? cudaGetErrorName(e) : "cudaSuccess");
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "info")) {
            info();
        } else if (!strcmp(argv[i], "roundtrip")) {
            roundtrip();
        } else if (!strcmp(argv[i], "fill") && i + 2 < argc) {
            const char *kind = argv[i + 1];
            size_t chunk = strtoull(argv[i + 2], NULL, 0);
            long max = 0;
            i += 2;
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9')
                max = strtol(argv[++i], NULL, 0);
            fill(kind, chunk, max);
        } else if (!strcmp(argv[i], "hold")) {
            printf("holding\n");
            while (getchar() != EOF)
                ;
        } else {
            fprintf(stderr, "usage: cudart_prog info | roundtrip | fill KIND CHUNK [N] | hold\n");
            return 2;
        }
    }
    return fails ? 1 : 0;
}
