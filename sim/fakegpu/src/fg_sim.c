/* fakegpu: the kernel model.
 *
 * Each device executes one kernel at a time.  Kernels wait in per-stream FIFO queues in the
 * shared state (run-length encoded: a saturating loop of equal kernels is one entry).  Between
 * processes the device time-slices round-robin (timeslice_ns, preempting a running kernel at the
 * end of a slice, like compute preemption); inside a process's slice its streams take turns at
 * slice boundaries.  The simulation is advanced lazily, to "now", by whichever process touches the
 * state (a launch, a synchronisation, an NVML query, fakegpu-ctl), so the outcome does not depend
 * on which process advances it nor on the launching process running: the queue of a stopped
 * process drains exactly as if it were running.  Executed time is credited to the process and to
 * utilisation periods of period_ns (NVML samples).
 */
#include "fg_state.h"

#include <string.h>

static uint32_t pdev_pending(const struct fg_pdev *p)
{
    uint32_t n = 0;
    for (int i = 0; i < FG_MAX_STREAMS; i++)
        n += p->streams[i].count;
    return n;
}

uint32_t fg_sim_pending(const struct fg_state *st, int slot, int dev, int stream)
{
    const struct fg_pdev *p = &st->slots[slot].dev[dev];
    return stream < 0 ? pdev_pending(p) : p->streams[stream].count;
}

uint64_t fg_sim_pending_ns(const struct fg_state *st, int slot, int dev, int stream)
{
    const struct fg_pdev *p = &st->slots[slot].dev[dev];
    if (stream >= 0)
        return p->streams[stream].pending_ns - p->streams[stream].progress;
    uint64_t n = 0;
    for (int i = 0; i < FG_MAX_STREAMS; i++)
        n += p->streams[i].pending_ns - p->streams[i].progress;
    return n;
}

int64_t fg_ts_us(const struct fg_state *st, uint64_t mono_ns)
{
    return ((int64_t)mono_ns + st->h.real_minus_mono) / 1000;
}

static void add_period(struct fg_period *ring, uint64_t idx, uint64_t v)
{
    struct fg_period *e = &ring[idx % FG_RING];
    if (e->idx != idx) {
        /* idx before busy: lock-free readers re-check idx around busy (fg_period_read) */
        __atomic_store_n(&e->idx, idx, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        __atomic_store_n(&e->busy, 0, __ATOMIC_RELAXED);
    }
    e->busy += v;
}

static void account(struct fg_state *st, int slot, int dev, uint64_t t, uint64_t run)
{
    struct fg_pdev *p = &st->slots[slot].dev[dev];
    struct fg_devstate *ds = &st->ds[dev];
    uint64_t P = st->h.period_ns;
    p->exec_ns += run;
    ds->busy_ns += run;
    while (run > 0) {
        uint64_t idx = t / P, end = (idx + 1) * P;
        uint64_t piece = end - t < run ? end - t : run;
        add_period(p->periods, idx, piece);
        add_period(ds->periods, idx, piece);
        t += piece;
        run -= piece;
    }
}

static void pop(struct fg_pdev *p, struct fg_stream *s, uint32_t k)
{
    struct fg_qent *e = &s->q[s->head];
    e->n -= k;
    s->count -= k;
    s->pending_ns -= (uint64_t)k * e->dur;
    s->progress = 0;
    p->completed += k;
    if (e->n == 0) {
        s->head = (s->head + 1) % FG_QENT;
        s->nent--;
    }
}

static int pick_next(struct fg_state *st, int dev, uint32_t cur)
{
    for (int k = 1; k <= FG_MAX_SLOTS; k++) {
        int s = (int)((cur + (uint32_t)k) % FG_MAX_SLOTS);
        if (cur >= FG_MAX_SLOTS)
            s = k - 1;
        if (st->live_map[s] && pdev_pending(&st->slots[s].dev[dev]) > 0)
            return s;
    }
    return -1;
}

static int pick_stream(struct fg_pdev *p)
{
    for (int k = 0; k < FG_MAX_STREAMS; k++) {
        int i = (int)((p->rr_stream + (uint32_t)k) % FG_MAX_STREAMS);
        if (p->streams[i].count > 0) {
            p->rr_stream = (uint32_t)i;
            return i;
        }
    }
    return -1;
}

void fg_sim_advance(struct fg_state *st, int dev, uint64_t now)
{
    struct fg_devstate *ds = &st->ds[dev];
    uint64_t t = ds->sim_time;
    if (t == 0 || t >= now) {
        if (t == 0)
            ds->sim_time = now;
        return;
    }
    /* bounded: a snapshot read without the lock may hold a half-made change (fg_read_begin) */
    for (unsigned long guard = 0; t < now && guard < 4000000UL; guard++) {
        uint32_t cur = ds->cur_slot;
        if (cur >= FG_MAX_SLOTS || ds->slice_left == 0 || st->slots[cur].state != FG_SLOT_LIVE ||
            pdev_pending(&st->slots[cur].dev[dev]) == 0) {
            int nx = pick_next(st, dev, cur);
            if (nx < 0) {
                ds->cur_slot = FG_MAX_SLOTS;
                break; /* idle until now */
            }
            if ((uint32_t)nx != cur || ds->slice_left == 0) {
                ds->slice_left = st->h.timeslice_ns;
                /* the process's streams take turns, one per slice */
                struct fg_pdev *np = &st->slots[nx].dev[dev];
                np->rr_stream = (np->rr_stream + 1) % FG_MAX_STREAMS;
            }
            ds->cur_slot = cur = (uint32_t)nx;
        }
        struct fg_pdev *p = &st->slots[cur].dev[dev];
        int si = pick_stream(p);
        if (si < 0)
            break;
        struct fg_stream *s = &p->streams[si];
        struct fg_qent *e = &s->q[s->head];
        uint64_t avail = now - t < ds->slice_left ? now - t : ds->slice_left;
        uint64_t rem = e->dur - s->progress;
        if (rem > avail) {
            s->progress += avail;
            account(st, (int)cur, dev, t, avail);
            t += avail;
            ds->slice_left -= avail;
            continue;
        }
        if (rem > 0)
            account(st, (int)cur, dev, t, rem);
        t += rem;
        ds->slice_left -= rem;
        uint64_t dur = e->dur;
        pop(p, s, 1);
        /* whole kernels of the same length that fit in the slice, at once */
        if (s->count > 0 && s->q[s->head].dur == dur) {
            e = &s->q[s->head];
            uint64_t room = now - t < ds->slice_left ? now - t : ds->slice_left;
            uint64_t k = dur ? room / dur : e->n;
            if (k > e->n)
                k = e->n;
            if (k > 0) {
                if (dur)
                    account(st, (int)cur, dev, t, k * dur);
                t += k * dur;
                ds->slice_left -= k * dur;
                pop(p, s, (uint32_t)k);
            }
        }
    }
    /* release: lock-free readers take the periods before sim_time as final (fg_sim_settled) */
    __atomic_store_n(&ds->sim_time, now, __ATOMIC_RELEASE);
}

void fg_sim_advance_all(struct fg_state *st, uint64_t now)
{
    for (int d = 0; d < FG_MAX_DEV; d++)
        if (fg_unit_live(st, d))
            fg_sim_advance(st, d, now);
}

int fg_sim_enqueue(struct fg_state *st, int slot, int dev, int stream, uint64_t dur)
{
    struct fg_pdev *p = &st->slots[slot].dev[dev];
    struct fg_stream *s = &p->streams[stream];
    if (s->count >= st->h.queue_depth)
        return 1;
    uint32_t tail = (s->head + s->nent + FG_QENT - 1) % FG_QENT;
    if (s->nent > 0 && s->q[tail].dur == dur && s->q[tail].n < UINT32_MAX) {
        s->q[tail].n++;
    } else {
        if (s->nent >= FG_QENT)
            return 1; /* too many different lengths queued: behaves as a full queue */
        tail = (s->head + s->nent) % FG_QENT;
        s->q[tail].dur = dur;
        s->q[tail].n = 1;
        s->nent++;
    }
    s->in_use = 1;
    s->count++;
    s->pending_ns += dur;
    p->launched++;
    return 0;
}

void fg_sim_drop(struct fg_state *st, int slot, int dev, int stream)
{
    struct fg_pdev *p = &st->slots[slot].dev[dev];
    for (int i = 0; i < FG_MAX_STREAMS; i++) {
        if (stream >= 0 && i != stream)
            continue;
        struct fg_stream *s = &p->streams[i];
        s->count = 0;
        s->head = 0;
        s->nent = 0;
        s->progress = 0;
        s->pending_ns = 0;
        memset(s->q, 0, sizeof(s->q));
    }
}
