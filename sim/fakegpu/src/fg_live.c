/* fakegpu: lock-free reads for NVML queries.
 *
 * A monitor polls NVML every 100 ms while dozens of processes launch kernels: its queries must
 * neither wait for the state lock (nor copy the state when its holder is stopped) nor probe every
 * slot's liveness lock on each call.  Readers use the live mapping without the lock: the fields
 * they read are single aligned words, so each is seen whole, and results of the kernel model are
 * read only up to the device's settled time (sim_time, stored with release after a step).  Slot
 * liveness (the kernel-released slot lock, fg_slot_alive) is probed at most every
 * FG_LIVE_SWEEP_NS per process; a slot registered since (new generation) counts as live.
 */
#include "fg_state.h"

#include <pthread.h>
#include <string.h>

static pthread_mutex_t g_live_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_sweep_at;                 /* CLOCK_MONOTONIC ns of the last probe, 0: never */
static uint64_t g_dead_gen[FG_MAX_SLOTS];   /* generation found dead at the last probe, 0: none */
static uint64_t g_snap_at;                  /* last private copy made by fg_sim_view */

void fg_live_mask(struct fg_state *st, uint64_t mask[FG_MASK_WORDS])
{
    uint64_t now = fg_now();
    int dead = 0;
    memset(mask, 0, FG_MASK_WORDS * sizeof(uint64_t));
    pthread_mutex_lock(&g_live_mu);
    int sweep = g_sweep_at == 0 || now - g_sweep_at >= FG_LIVE_SWEEP_NS;
    for (int s = 0; s < FG_MAX_SLOTS; s++) {
        if (!__atomic_load_n(&st->live_map[s], __ATOMIC_ACQUIRE) ||
            __atomic_load_n(&st->slots[s].state, __ATOMIC_ACQUIRE) != FG_SLOT_LIVE)
            continue;
        uint64_t gen = __atomic_load_n(&st->slots[s].generation, __ATOMIC_RELAXED);
        int alive;
        if (sweep) {
            alive = fg_slot_alive(s);
            g_dead_gen[s] = alive ? 0 : gen;
        } else {
            alive = g_dead_gen[s] == 0 || g_dead_gen[s] != gen;
        }
        if (alive)
            mask[s / 64] |= 1ULL << (s % 64);
        else
            dead = 1;
    }
    if (sweep)
        g_sweep_at = now;
    pthread_mutex_unlock(&g_live_mu);
    if (dead && fg_lock_try() == 0) {
        /* the dead process's memory and queued work go at once, as the driver tears it down */
        fg_reap();
        fg_unlock();
    }
}

uint64_t fg_sim_settled(struct fg_state *st, int dev)
{
    if (fg_lock_try() == 0) {
        fg_sim_advance(st, dev, fg_now());
        fg_unlock();
    }
    return __atomic_load_n(&st->ds[dev].sim_time, __ATOMIC_ACQUIRE);
}

void fg_live_reset(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_live_mu = fresh;
    g_sweep_at = 0;
    g_snap_at = 0;
}

int fg_period_read(const struct fg_period *e, uint64_t idx, uint64_t *busy)
{
    /* a writer sets idx, then (release fence) busy: an entry being reused changes idx under us */
    if (__atomic_load_n(&e->idx, __ATOMIC_ACQUIRE) != idx)
        return 0;
    *busy = __atomic_load_n(&e->busy, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(&e->idx, __ATOMIC_RELAXED) == idx;
}

struct fg_state *fg_sim_view(int dev, uint64_t *settled, int *snap)
{
    struct fg_state *st = fg_g.st;
    uint64_t now = fg_now();
    *snap = 0;
    *settled = fg_sim_settled(st, dev);
    if (*settled >= now || now - *settled <= FG_STALE_NS)
        return st;
    /* No kernel pending on the device: it has been idle since it was last advanced (pending
     * counts only fall when the simulation advances), so everything up to now is settled. */
    int pending = 0;
    for (int s = 0; s < FG_MAX_SLOTS && !pending; s++)
        if (__atomic_load_n(&st->live_map[s], __ATOMIC_ACQUIRE))
            for (int k = 0; k < FG_MAX_STREAMS; k++)
                if (__atomic_load_n(&st->slots[s].dev[dev].streams[k].count, __ATOMIC_RELAXED)) {
                    pending = 1;
                    break;
                }
    if (!pending) {
        *settled = now;
        return st;
    }
    /* a copy costs about a millisecond: at most one per FG_SNAP_MIN_NS; in between, the last
     * copy is advanced further (the state it copied changes only under the lock, which has been
     * taken all along in the usual case: a stopped holder) */
    pthread_mutex_lock(&g_live_mu);
    int copy = g_snap_at == 0 || now - g_snap_at >= FG_SNAP_MIN_NS;
    if (copy)
        g_snap_at = now;
    pthread_mutex_unlock(&g_live_mu);
    if (!copy) {
        struct fg_state *c = fg_snapshot_last();
        if (!c)
            return st;
        fg_sim_advance(c, dev, now);
        *settled = now;
        *snap = 1;
        return c;
    }
    /* Nobody has advanced the device for FG_STALE_NS and the lock is held: the holder is stopped
     * (a monitor SIGSTOPs processes) or starved.  The device does not stop for that: advance a
     * private copy to now, as fakegpu-ctl dump does (rare: a copy of the whole state). */
    struct fg_state *c = fg_snapshot_begin();
    if (!c)
        return st;
    fg_reap_in(c);
    fg_sim_advance(c, dev, now);
    *settled = now;
    *snap = 1;
    return c;
}
