/* fakegpu: opening, creating, locking the shared state; process slots and their liveness. */
#include "fg_state.h"
#include "fg_mig.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct fg_handle fg_g = {NULL, -1, -1};
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_open_mu = PTHREAD_MUTEX_INITIALIZER;

uint64_t fg_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

const char *fg_state_path(void)
{
    const char *p = fg_env("FAKEGPU_STATE");
    return (p && *p) ? p : "/tmp/fakegpu.state";
}

static int ofd_lock(int fd, short type, off_t off, int wait)
{
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = off;
    fl.l_len = 1;
    for (;;) {
        if (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

void fg_lock(void)
{
    pthread_mutex_lock(&g_mu);
    if (ofd_lock(fg_g.fd, F_WRLCK, FG_LOCK_GLOBAL, 1) != 0) {
        /* Cannot happen on a valid fd; carrying on unlocked would corrupt the state. */
        perror("fakegpu: state lock");
        abort();
    }
}

void fg_unlock(void)
{
    ofd_lock(fg_g.fd, F_UNLCK, FG_LOCK_GLOBAL, 0);
    pthread_mutex_unlock(&g_mu);
}

int fg_lock_try(void)
{
    if (pthread_mutex_trylock(&g_mu) != 0)
        return -1;
    if (ofd_lock(fg_g.fd, F_WRLCK, FG_LOCK_GLOBAL, 0) != 0) {
        pthread_mutex_unlock(&g_mu);
        return -1;
    }
    return 0;
}

static void nap(uint64_t ns)
{
    struct timespec ts = {0, (long)ns};
    nanosleep(&ts, NULL);
}

int fg_lock_timed(uint64_t timeout_ns)
{
    uint64_t deadline = fg_now() + timeout_ns;
    struct timespec abs;
    clock_gettime(CLOCK_REALTIME, &abs);
    uint64_t ns = (uint64_t)abs.tv_nsec + timeout_ns;
    abs.tv_sec += (time_t)(ns / 1000000000ULL);
    abs.tv_nsec = (long)(ns % 1000000000ULL);
    /* another thread of this process may be blocked in the lock (on a stopped holder) */
    if (pthread_mutex_timedlock(&g_mu, &abs) != 0)
        return -1;
    uint64_t backoff = 20000;
    for (;;) {
        if (ofd_lock(fg_g.fd, F_WRLCK, FG_LOCK_GLOBAL, 0) == 0)
            return 0;
        uint64_t now = fg_now();
        if (now >= deadline) {
            pthread_mutex_unlock(&g_mu);
            return -1;
        }
        nap(backoff < deadline - now ? backoff : deadline - now);
        if (backoff < 1000000)
            backoff *= 2;
    }
}

static struct fg_state *g_snap;
static pthread_mutex_t g_snap_mu = PTHREAD_MUTEX_INITIALIZER;

struct fg_state *fg_read_begin(int *locked)
{
    if (fg_lock_timed(FG_READ_TIMEOUT_NS) == 0) {
        *locked = 1;
        return fg_g.st;
    }
    *locked = 0;
    struct fg_state *snap = fg_snapshot_begin();
    if (!snap) {
        fg_lock(); /* no memory for a snapshot: wait after all */
        *locked = 1;
        return fg_g.st;
    }
    return snap;
}

struct fg_state *fg_snapshot_begin(void)
{
    /* Reading without the lock may see a half-made change of the stopped holder: a snapshot is
     * good enough for a monitoring answer and never blocks.  One buffer per process, guarded. */
    pthread_mutex_lock(&g_snap_mu);
    if (!g_snap)
        g_snap = malloc(sizeof(*g_snap));
    if (!g_snap) {
        pthread_mutex_unlock(&g_snap_mu);
        return NULL;
    }
    memcpy(g_snap, fg_g.st, sizeof(*g_snap));
    return g_snap;
}

struct fg_state *fg_snapshot_last(void)
{
    pthread_mutex_lock(&g_snap_mu);
    if (!g_snap) {
        pthread_mutex_unlock(&g_snap_mu);
        return NULL;
    }
    return g_snap;
}

void fg_snapshot_end(void)
{
    pthread_mutex_unlock(&g_snap_mu);
}

void fg_read_end(int locked)
{
    if (locked)
        fg_unlock();
    else
        fg_snapshot_end();
}

static void init_state(struct fg_state *st, const struct fg_config *c)
{
    memset(st, 0, sizeof(*st));
    st->h.version = FG_VERSION;
    st->h.size = (uint32_t)sizeof(*st);
    st->h.ndev = c->ndev;
    st->h.queue_depth = c->queue_depth;
    st->h.timeslice_ns = c->timeslice_ns;
    st->h.period_ns = c->period_ns;
    st->h.util_window_ns = c->util_window_ns;
    uint64_t mono = fg_now(), real = realtime_ns();
    st->h.real_minus_mono = (int64_t)(real - mono);
    st->h.created_ns = real;
    st->h.generation = 1;
    memcpy(st->h.driver_version, c->driver_version, sizeof(st->h.driver_version));
    st->h.cuda_version = c->cuda_version;
    for (unsigned i = 0; i < FG_MAX_DEV; i++) {
        if (i < FG_MAX_GPU)
            st->cfg[i] = c->dev[i];
        st->ds[i].cur_slot = FG_MAX_SLOTS;
        st->unit[i].parent = -1;
    }
    for (unsigned i = 0; i < c->ndev; i++)
        if (fg_mig_table_of(st, (int)i))
            st->mig[i].mode = st->mig[i].pending = c->dev[i].mig_mode;
    __atomic_store_n(&st->h.magic, FG_MAGIC, __ATOMIC_RELEASE);
}

static int load_config(struct fg_config *c, int quiet)
{
    char err[256];
    if (fg_config_load(fg_env("FAKEGPU_CONFIG"), c, err, sizeof(err)) != 0) {
        if (!quiet)
            fprintf(stderr, "fakegpu: config: %s\n", err);
        return -1;
    }
    return 0;
}

int fg_open(int quiet)
{
    pthread_mutex_lock(&g_open_mu);
    if (fg_g.st) {
        pthread_mutex_unlock(&g_open_mu);
        return 0;
    }
    const char *path = fg_state_path();
    /* The default path lives in /tmp: refuse to follow a symlink someone else planted there. */
    int flags = O_RDWR | O_CREAT | O_CLOEXEC | (fg_env("FAKEGPU_STATE") ? 0 : O_NOFOLLOW);
    int fd = open(path, flags, 0666);
    if (fd < 0) {
        if (!quiet)
            fprintf(stderr, "fakegpu: %s: %s\n", path, strerror(errno));
        pthread_mutex_unlock(&g_open_mu);
        return -1;
    }
    fg_g.fd = fd;
    struct stat sb;
    int rc = -1;
    struct fg_state *st = MAP_FAILED;
    /* Fast path, without the lock (a dead or stuck holder must not keep others from opening):
     * a complete state file, whose magic is written last. */
    if (fstat(fd, &sb) == 0 && (size_t)sb.st_size == sizeof(struct fg_state)) {
        st = mmap(NULL, sizeof(struct fg_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (st != MAP_FAILED && __atomic_load_n(&st->h.magic, __ATOMIC_ACQUIRE) == FG_MAGIC &&
            st->h.version == FG_VERSION && st->h.size == sizeof(*st) && st->h.ndev >= 1 && st->h.ndev <= FG_MAX_GPU) {
            fg_g.st = st;
            pthread_mutex_unlock(&g_open_mu);
            return 0;
        }
        if (st != MAP_FAILED)
            munmap(st, sizeof(*st));
        st = MAP_FAILED;
    }
    fg_lock();
    if (fstat(fd, &sb) != 0)
        goto out;
    if (sb.st_size == 0) {
        /* Test tool: every local process (containers with other uids too) may use the node. */
        (void)fchmod(fd, 0666);
        if (ftruncate(fd, (off_t)sizeof(struct fg_state)) != 0)
            goto out;
    } else if ((size_t)sb.st_size != sizeof(struct fg_state)) {
        if (!quiet)
            fprintf(stderr, "fakegpu: %s: not a state file of this version (size %lld)\n", path,
                    (long long)sb.st_size);
        goto out;
    }
    st = mmap(NULL, sizeof(struct fg_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (st == MAP_FAILED)
        goto out;
    if (st->h.magic == 0) {
        struct fg_config c;
        if (load_config(&c, quiet) != 0)
            goto out;
        init_state(st, &c);
    } else if (st->h.magic != FG_MAGIC || st->h.version != FG_VERSION || st->h.size != sizeof(*st) ||
               st->h.ndev < 1 || st->h.ndev > FG_MAX_GPU) {
        if (!quiet)
            fprintf(stderr, "fakegpu: %s: incompatible state file\n", path);
        goto out;
    }
    rc = 0;
out:
    if (rc != 0 && !quiet && st == MAP_FAILED && errno)
        fprintf(stderr, "fakegpu: %s: %s\n", path, strerror(errno));
    if (rc == 0)
        fg_g.st = st;
    fg_unlock();
    if (rc != 0) {
        if (st != MAP_FAILED)
            munmap(st, sizeof(*st));
        close(fd);
        fg_g.fd = -1;
    }
    pthread_mutex_unlock(&g_open_mu);
    return rc;
}

int fg_reset(void)
{
    struct fg_config c;
    if (load_config(&c, 0) != 0)
        return -1;
    fg_lock();
    uint64_t gen = fg_g.st->h.generation;
    init_state(fg_g.st, &c);
    fg_g.st->h.generation = gen + 1;
    fg_unlock();
    return 0;
}

static uint64_t read_start_time(void)
{
    return fg_proc_start_time(0);
}

int fg_slot_alive(int slot)
{
    if (slot == fg_g.slot)
        return 1;
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = FG_LOCK_SLOT0 + slot;
    fl.l_len = 1;
    if (fcntl(fg_g.fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: keep it */
    return fl.l_type != F_UNLCK;
}

uint64_t fg_pdev_used(const struct fg_state *st, int slot, int dev)
{
    const struct fg_pdev *p = &st->slots[slot].dev[dev];
    return p->mem_device + p->mem_managed_dev + (uint64_t)p->contexts * st->cfg[dev].context_overhead;
}

static uint64_t unit_used(const struct fg_state *st, int dev)
{
    return st->ds[dev].used_total;
}

uint64_t fg_dev_used_scan(const struct fg_state *st, int dev)
{
    uint64_t u = 0;
    for (int s = 0; s < FG_MAX_SLOTS; s++)
        if (st->slots[s].state == FG_SLOT_LIVE)
            u += fg_pdev_used(st, s, dev);
    return u;
}

/* A MIG device's memory is its GPU instance's, shared by the GI's compute instances. */
uint64_t fg_dev_used(const struct fg_state *st, int dev)
{
    if (!fg_unit_is_mig(st, dev))
        return unit_used(st, dev);
    uint64_t u = 0;
    for (int d = (int)st->h.ndev; d < FG_MAX_DEV; d++)
        if (st->unit[d].parent == st->unit[dev].parent && st->unit[d].gi == st->unit[dev].gi)
            u += unit_used(st, d);
    return u;
}

int fg_unit_live(const struct fg_state *st, int dev)
{
    return (dev >= 0 && dev < (int)st->h.ndev) || fg_unit_is_mig(st, dev);
}

void fg_note_high(struct fg_state *st, int dev)
{
    struct fg_devstate *ds = &st->ds[dev];
    uint64_t all = ds->used_total, ctx = ds->ctx_total;
    if (ds->high_watch && st == fg_g.st && (all > ds->used_high || all - ctx > ds->alloc_high) &&
        (all > ds->high_watch || all - ctx > ds->high_watch)) {
        fg_reap(); /* a dead process's memory is not the device's any more */
        all = ds->used_total;
        ctx = ds->ctx_total;
    }
    if (all > ds->used_high)
        ds->used_high = all;
    if (all - ctx > ds->alloc_high)
        ds->alloc_high = all - ctx;
}

void fg_release_slot(struct fg_state *st, int slot)
{
    fg_shared_release_slot(st, slot, st == fg_g.st);
    for (unsigned d = 0; d < FG_MAX_DEV; d++) {
        if (st->slots[slot].state != FG_SLOT_LIVE)
            break;
        uint64_t u = fg_pdev_used(st, slot, (int)d);
        uint64_t c = (uint64_t)st->slots[slot].dev[d].contexts * st->cfg[d].context_overhead;
        struct fg_devstate *ds = &st->ds[d];
        ds->used_total = ds->used_total >= u ? ds->used_total - u : 0;
        ds->ctx_total = ds->ctx_total >= c ? ds->ctx_total - c : 0;
    }
    st->live_map[slot] = 0;
    memset(&st->slots[slot], 0, sizeof(st->slots[slot]));
    for (unsigned d = 0; d < FG_MAX_DEV; d++)
        if (st->ds[d].cur_slot == (uint32_t)slot)
            st->ds[d].slice_left = 0;
}

void fg_reap(void)
{
    fg_reap_in(fg_g.st);
    fg_g.st->h.reaped_ns = fg_now();
}

void fg_reap_lazy(void)
{
    uint64_t now = fg_now(), last = fg_g.st->h.reaped_ns;
    if (last == 0 || now < last || now - last >= FG_REAP_NS)
        fg_reap();
}

void fg_reap_in(struct fg_state *st)
{
    for (int s = 0; s < FG_MAX_SLOTS; s++) {
        if (!st->live_map[s] || s == fg_g.slot)
            continue;
        if (!fg_slot_alive(s)) {
            /* Queued work of a dead context is discarded, as when the driver tears it down. */
            uint64_t now = fg_now();
            for (int d = 0; d < FG_MAX_DEV; d++)
                if (fg_unit_live(st, d))
                    fg_sim_advance(st, d, now);
            fg_release_slot(st, s);
        }
    }
}

static int take_free_slot(struct fg_state *st);
static int fill_slot(struct fg_state *st, int s);

/* who this process is (read outside the lock: /proc reads take tens of microseconds) */
static struct {
    int ready;
    uint64_t pidns, start_time;
    char comm[16];
} g_id;

void fg_identify(void)
{
    if (g_id.ready)
        return;
    g_id.pidns = fg_self_pidns();
    g_id.start_time = read_start_time();
    FILE *f = fopen("/proc/self/comm", "re");
    if (f) {
        if (fgets(g_id.comm, sizeof(g_id.comm), f))
            g_id.comm[strcspn(g_id.comm, "\n")] = '\0';
        fclose(f);
    }
    g_id.ready = 1;
}

int fg_register(void)
{
    struct fg_state *st = fg_g.st;
    if (fg_g.slot >= 0)
        return 0;
    fg_identify();
    /* Dead slots are reclaimed lazily (a probe per live process would make a burst of N
     * processes starting together cost N^2 syscalls under the lock), and at once when no slot
     * is free. */
    fg_reap_lazy();
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            fg_reap();
        int s = take_free_slot(st);
        if (s >= 0)
            return fill_slot(st, s);
    }
    return -1;
}

static int take_free_slot(struct fg_state *st)
{
    for (int s = 0; s < FG_MAX_SLOTS; s++) {
        if (st->live_map[s])
            continue;
        if (ofd_lock(fg_g.fd, F_RDLCK, FG_LOCK_SLOT0 + s, 0) != 0)
            continue; /* a registration whose owner is still alive: leave it */
        return s;
    }
    return -1;
}

static int fill_slot(struct fg_state *st, int s)
{
    struct fg_slot *sl = &st->slots[s];
    /* a free slot is all zero (fg_release_slot, a fresh file): only its header is written,
     * not its 54 KiB of per-device queues and periods */
    sl->pid = (int32_t)getpid();
    sl->pidns = g_id.pidns;
    sl->host_pid = sl->pidns == FG_PIDNS_INIT ? sl->pid : 0; /* already a host pid */
    sl->start_time = g_id.start_time;
    sl->generation = ++st->h.generation;
    memcpy(sl->comm, g_id.comm, sizeof(sl->comm));
    sl->state = FG_SLOT_LIVE;
    st->live_map[s] = 1;
    fg_g.slot = s;
    return 0;
}

void fg_atfork_child(void)
{
    g_id.ready = 0; /* another process */
    /* The child shares the parent's open file description, and with it the parent's locks: it
     * must not use them.  Drop everything; the child opens the state anew when it initialises. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_mu = fresh;
    g_open_mu = fresh;
    g_snap_mu = fresh;
    if (fg_g.st)
        munmap(fg_g.st, sizeof(struct fg_state));
    if (fg_g.fd >= 0)
        close(fg_g.fd);
    fg_g.st = NULL;
    fg_g.fd = -1;
    fg_g.slot = -1;
    fg_pid_cache_reset();
    fg_live_reset();
}
