/* fakegpu libcuda: stream-capture status queries.
 *
 * Frameworks ask before every allocation or copy whether a stream is being captured into a graph
 * (CuPy's memory pool and copies call cudaStreamIsCapturing; cudart asks the driver).  This file
 * answers those queries for a simulator in which no stream is captured: the capture itself
 * (cuStreamBeginCapture, graphs) is modelled elsewhere or not at all; these definitions are weak,
 * so that a model of capture linked into the library answers instead.  Signatures and enums: cuda.h (CUstreamCaptureStatus NONE = 0,
 * CUstreamCaptureMode GLOBAL 0 / THREAD_LOCAL 1 / RELAXED 2).
 */
#include "fg_cuda.h"

/* weak: a model of stream capture linked into the library replaces these answers */
#define FG_WEAK __attribute__((weak)) FG_API

static __thread int tls_capture_mode; /* CU_STREAM_CAPTURE_MODE_GLOBAL */

static CUresult capturing(CUstream s, int per_thread, int *status)
{
    int dev, idx;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    *status = 0; /* CU_STREAM_CAPTURE_STATUS_NONE */
    return CUDA_SUCCESS;
}

FG_WEAK CUresult cuStreamIsCapturing(CUstream s, int *status)
{
    return capturing(s, 0, status);
}

FG_WEAK CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status)
{
    return capturing(s, 1, status);
}

/* (stream, status, id) */
FG_WEAK CUresult cuStreamGetCaptureInfo(CUstream s, int *status, unsigned long long *id)
{
    CUresult rc = capturing(s, 0, status);
    if (!rc && id)
        *id = 0;
    return rc;
}

FG_WEAK CUresult cuStreamGetCaptureInfo_ptsz(CUstream s, int *status, unsigned long long *id)
{
    CUresult rc = capturing(s, 1, status);
    if (!rc && id)
        *id = 0;
    return rc;
}

/* _v2 (11.3): (stream, status, id, graph, dependencies, count); outputs other than the status
 * are left untouched when the stream is not capturing, as documented. */
FG_WEAK CUresult cuStreamGetCaptureInfo_v2(CUstream s, int *status, unsigned long long *id, void **graph,
                                          const void **deps, size_t *ndeps)
{
    (void)id;
    (void)graph;
    (void)deps;
    (void)ndeps;
    return capturing(s, 0, status);
}

FG_WEAK CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream s, int *status, unsigned long long *id, void **graph,
                                               const void **deps, size_t *ndeps)
{
    (void)id;
    (void)graph;
    (void)deps;
    (void)ndeps;
    return capturing(s, 1, status);
}

/* _v3 (12.3): (stream, status, id, graph, dependencies, edge data, count) */
FG_WEAK CUresult cuStreamGetCaptureInfo_v3(CUstream s, int *status, unsigned long long *id, void **graph,
                                          const void **deps, const void **edges, size_t *ndeps)
{
    (void)id;
    (void)graph;
    (void)deps;
    (void)edges;
    (void)ndeps;
    return capturing(s, 0, status);
}

FG_WEAK CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream s, int *status, unsigned long long *id, void **graph,
                                               const void **deps, const void **edges, size_t *ndeps)
{
    (void)id;
    (void)graph;
    (void)deps;
    (void)edges;
    (void)ndeps;
    return capturing(s, 1, status);
}

FG_WEAK CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!mode || *mode < 0 || *mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    int old = tls_capture_mode;
    tls_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}
