/* fakegpu libcuda: streams, synchronisation and events.
 *
 * A stream is a queue in the shared state: (process slot, device, index).  Index 0 is the legacy
 * default stream, 1 the per-thread default stream (one for all threads of the process: a
 * simplification), 2..15 are shared round-robin by created streams (two created streams may share
 * a queue: ordering is then stricter than on a real GPU, never looser).
 */
#include "fg_cuda.h"

#include <stdlib.h>
#include <time.h>

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    nanosleep(&ts, NULL);
}

CUresult fg_stream_resolve(CUstream s, int per_thread, int *dev, int *idx)
{
    CUresult rc;
    if (s == NULL || s == FG_STREAM_LEGACY || s == FG_STREAM_PER_THREAD) {
        struct fg_ctx *c = fg_current(&rc);
        if (!c)
            return rc;
        *dev = c->dev;
        *idx = (s == FG_STREAM_PER_THREAD || (s == NULL && per_thread)) ? FG_SIDX_PTDS : FG_SIDX_LEGACY;
        return CUDA_SUCCESS;
    }
    if ((rc = fg_check_init()))
        return rc;
    if (s->magic != FG_MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    if (fg_dev_lost(s->dev))
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    *dev = s->dev;
    *idx = s->idx;
    return CUDA_SUCCESS;
}

/* Waits until the queue(s) drained.  The kernels run in the simulation whatever this process
 * does; this only polls it, sleeping about as long as the remaining work. */
CUresult fg_wait_idle(int dev, int idx)
{
    struct fg_state *st = fg_g.st;
    for (;;) {
        fg_lock();
        fg_sim_advance(st, dev, fg_now());
        uint64_t left = fg_sim_pending(st, fg_g.slot, dev, idx) ? fg_sim_pending_ns(st, fg_g.slot, dev, idx) : 0;
        int n = (int)fg_sim_pending(st, fg_g.slot, dev, idx);
        int lost = (int)st->ds[dev].lost;
        fg_unlock();
        if (n == 0)
            return CUDA_SUCCESS;
        if (lost)
            return CUDA_ERROR_DEVICE_UNAVAILABLE;
        if (left < 50000)
            left = 50000;
        if (left > 5000000)
            left = 5000000;
        sleep_ns(left);
    }
}

static CUresult stream_create(CUstream *ps, unsigned flags, int priority)
{
    if (!ps || (flags & ~1u)) /* CU_STREAM_NON_BLOCKING = 1 */
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    struct fg_ctx *c = fg_current(&rc);
    if (!c)
        return rc;
    struct fg_streamh *s = calloc(1, sizeof(*s));
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&fg_drv.mu);
    unsigned k = fg_drv.next_stream[c->dev]++;
    pthread_mutex_unlock(&fg_drv.mu);
    s->magic = FG_MAGIC_STREAM;
    s->dev = c->dev;
    s->idx = 2 + (int)(k % (FG_MAX_STREAMS - 2));
    s->flags = flags;
    s->ctx = c;
    /* cuCtxGetStreamPriorityRange: 0 (least) .. -5 (greatest); others are clamped, as documented */
    s->priority = priority > 0 ? 0 : priority < -5 ? -5 : priority;
    static unsigned long long next_id = 100;
    s->id = __atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED);
    *ps = s;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamCreate(CUstream *ps, unsigned int flags)
{
    return stream_create(ps, flags, 0);
}

FG_API CUresult cuStreamCreateWithPriority(CUstream *ps, unsigned int flags, int priority)
{
    return stream_create(ps, flags, priority);
}

FG_API CUresult cuStreamDestroy_v2(CUstream s)
{
    CUresult rc = fg_check_init();
    if (rc)
        return rc;
    if (!s || s == FG_STREAM_LEGACY || s == FG_STREAM_PER_THREAD || s->magic != FG_MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    /* Work already queued still completes (it lives in the shared queue). */
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}

static CUresult stream_sync(CUstream s, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    if ((rc = fg_capture_forbid(s, per_thread))) /* "invalid to synchronize ... a stream being captured" */
        return rc;
    rc = fg_wait_idle(dev, idx);
    fg_pools_sync(dev);
    return rc;
}

FG_API CUresult cuStreamSynchronize(CUstream s)
{
    return stream_sync(s, 0);
}

FG_API CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return stream_sync(s, 1);
}

static CUresult stream_query(CUstream s, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    if ((rc = fg_capture_forbid(s, per_thread)))
        return rc;
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_sim_advance(st, dev, fg_now());
    uint32_t n = fg_sim_pending(st, fg_g.slot, dev, idx);
    fg_unlock();
    return n ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

FG_API CUresult cuStreamQuery(CUstream s)
{
    return stream_query(s, 0);
}

FG_API CUresult cuStreamQuery_ptsz(CUstream s)
{
    return stream_query(s, 1);
}

FG_API CUresult cuStreamGetFlags(CUstream s, unsigned int *flags)
{
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, 0, &dev, &idx);
    if (rc)
        return rc;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = (s && s != FG_STREAM_LEGACY && s != FG_STREAM_PER_THREAD) ? s->flags : 0;
    return CUDA_SUCCESS;
}

/* --- events: a record marks the stream's queue; the event completes when it drained -------- */

struct fg_event {
    uint32_t magic;
    int dev, idx; /* -1: never recorded */
    uint64_t target; /* stream must have completed this many of the process's kernels */
    uint64_t done_ns;
    uint64_t capture; /* recorded in this capture (stream capture), 0 none */
};

/* A stream waiting on an event recorded in a capture joins that capture (the fork/join pattern
 * of multi-stream capture, CUDA Programming Guide "Cross-stream Dependencies and Events"). */
static CUresult wait_event(CUstream s, CUevent ev, int per_thread)
{
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    if (ev && ev->magic == FG_MAGIC_EVENT && ev->capture && fg_capture_count)
        return fg_capture_join(s, per_thread, ev->capture);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamWaitEvent(CUstream s, CUevent ev, unsigned int flags)
{
    (void)flags;
    return wait_event(s, ev, 0);
}

FG_API CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent ev, unsigned int flags)
{
    (void)flags;
    return wait_event(s, ev, 1);
}

FG_API CUresult cuEventCreate(CUevent *pe, unsigned int flags)
{
    (void)flags;
    CUresult rc;
    if (!pe)
        return CUDA_ERROR_INVALID_VALUE;
    if (!fg_current(&rc))
        return rc;
    struct fg_event *e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = FG_MAGIC_EVENT;
    e->dev = e->idx = -1;
    *pe = e;
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventDestroy_v2(CUevent e)
{
    if (!e || e->magic != FG_MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream s, int per_thread)
{
    if (!e || e->magic != FG_MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    int dev = 0, idx = 0;
    CUresult rc = fg_stream_resolve(s, per_thread, &dev, &idx);
    if (rc)
        return rc;
    e->capture = fg_capture_count ? fg_capture_event_record(s, per_thread) : 0;
    if (e->capture)
        return CUDA_SUCCESS; /* an event record node: nothing is queued */
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_sim_advance(st, dev, fg_now());
    const struct fg_pdev *p = &st->slots[fg_g.slot].dev[dev];
    /* completed counts are per process/device; the stream's pending kernels come first */
    uint32_t pending = fg_sim_pending(st, fg_g.slot, dev, -1);
    e->target = p->completed + pending;
    fg_unlock();
    e->dev = dev;
    e->idx = idx;
    /* nothing queued: complete now; else when first seen complete (the simulation does not keep
     * per-kernel completion times: a synchronised event is seen within the polling delay) */
    e->done_ns = pending ? 0 : fg_now();
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventRecord(CUevent e, CUstream s)
{
    return event_record(e, s, 0);
}

FG_API CUresult cuEventRecord_ptsz(CUevent e, CUstream s)
{
    return event_record(e, s, 1);
}

static int event_done(struct fg_event *e)
{
    if (e->dev < 0)
        return 1;
    if (e->done_ns)
        return 1;
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_sim_advance(st, e->dev, fg_now());
    int done = st->slots[fg_g.slot].dev[e->dev].completed >= e->target ||
               fg_sim_pending(st, fg_g.slot, e->dev, e->idx) == 0;
    fg_unlock();
    if (done)
        e->done_ns = fg_now();
    return done;
}

FG_API CUresult cuEventQuery(CUevent e)
{
    if (!e || e->magic != FG_MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    return event_done(e) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FG_API CUresult cuEventSynchronize(CUevent e)
{
    if (!e || e->magic != FG_MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    while (!event_done(e))
        sleep_ns(100000);
    if (e->dev >= 0)
        fg_pools_sync(e->dev); /* pools release above their threshold at event synchronisation too */
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    if (!ms || !a || !b || a->magic != FG_MAGIC_EVENT || b->magic != FG_MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if (a->dev < 0 || b->dev < 0)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!event_done(a) || !event_done(b))
        return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)((int64_t)b->done_ns - (int64_t)a->done_ns) / 1e6);
    return CUDA_SUCCESS;
}
