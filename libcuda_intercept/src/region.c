/*
 * region.c — the per-container accounting region (vgpu_region.h).
 *
 * Concurrency model
 *  - Cross-process: an OFD write lock on VGPU_REGION_LOCK_BYTE serialises every
 *    check-and-charge, slot take-over and reclaim.  OFD locks belong to the
 *    open file description, so the kernel drops them when the holder dies:
 *    no owner-pid guessing (HAMi-core#86, PR#248, PR#260).
 *  - Threads of one process share the description, and OFD locks never
 *    conflict with themselves, so a process-local mutex is taken first.
 *  - Liveness: a slot is owned while its process holds an OFD read lock on
 *    VGPU_REGION_SLOT_LOCK_BASE + index.  F_OFD_GETLK tells whether anyone
 *    still does; if not, the slot is dead and its usage is returned.
 *  - A process lowers only its own slot's counters, lock-free with atomics,
 *    after the driver has freed the memory: a concurrent checker sees at
 *    worst the old (higher) value, which is conservative.
 *  - Slots never move (HAMi-core PR#242).
 *
 * The region is writable by everything in the container, so every value read
 * from it is bounds-checked and every sum saturates; the limits come from the
 * limits file, never from the region.
 */
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "sysio.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_fd = -1;
static struct vgpu_region *g_r;
static int g_slot = -1;
static unsigned g_ndev;

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

static int ofd_lock(int fd, short type, uint64_t byte, int wait)
{
    struct flock l;
    memset(&l, 0, sizeof l);
    l.l_type = type;
    l.l_whence = SEEK_SET;
    l.l_start = (off_t)byte;
    l.l_len = 1;
    while (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &l) != 0) {
        if (errno != EINTR)
            return -1;
    }
    return 0;
}

/* 1 if some process holds a lock on the slot byte, 0 if none, -1 error */
static int slot_alive(int fd, unsigned i)
{
    struct flock l;
    memset(&l, 0, sizeof l);
    l.l_type = F_WRLCK;
    l.l_whence = SEEK_SET;
    l.l_start = (off_t)(VGPU_REGION_SLOT_LOCK_BASE + i);
    l.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &l) != 0)
        return -1;
    return l.l_type != F_UNLCK;
}

static void lock_region(void)
{
    pthread_mutex_lock(&g_mu);
    if (ofd_lock(g_fd, F_WRLCK, VGPU_REGION_LOCK_BYTE, 1) != 0)
        VLOG(VGPU_LOG_WARN, "region lock failed: %s", strerror(errno));
}

static void unlock_region(void)
{
    ofd_lock(g_fd, F_UNLCK, VGPU_REGION_LOCK_BYTE, 0);
    pthread_mutex_unlock(&g_mu);
}

static unsigned hwm(void)
{
    uint32_t h = __atomic_load_n(&g_r->slot_hwm, __ATOMIC_SEQ_CST);
    return h > VGPU_MAX_SLOTS ? VGPU_MAX_SLOTS : h;
}

static void header_init(struct vgpu_region *r)
{
    memset(r, 0, sizeof *r);
    r->magic = VGPU_REGION_MAGIC;
    r->version = VGPU_REGION_VERSION;
    r->size = (uint32_t)sizeof *r;
    r->num_slots = VGPU_MAX_SLOTS;
    r->created = (uint64_t)time(NULL);
}

static int header_zero(const struct vgpu_region *r)
{
    const unsigned char *p = (const unsigned char *)r;
    for (size_t i = 0; i < offsetof(struct vgpu_region, devices); i++)
        if (p[i])
            return 0;
    return 1;
}

static const char *header_problem(const struct vgpu_region *r)
{
    if (r->magic != VGPU_REGION_MAGIC)
        return "bad magic";
    if (r->version != VGPU_REGION_VERSION)
        return "unknown version";
    if (r->size != sizeof *r)
        return "size field mismatch";
    if (r->num_slots != VGPU_MAX_SLOTS)
        return "bad slot count";
    if (r->num_devices > VGPU_MAX_DEVICES)
        return "bad device count";
    return NULL;
}

/* under the lock: recompute hwm and the informational totals */
static void recompute_locked(void)
{
    unsigned last = 0;
    uint64_t dev[VGPU_MAX_DEVICES] = {0}, host[VGPU_MAX_DEVICES] = {0};
    for (unsigned i = 0; i < VGPU_MAX_SLOTS; i++) {
        struct vgpu_slot *s = &g_r->slots[i];
        if (LD(&s->state) != VGPU_SLOT_ACTIVE)
            continue;
        last = i + 1;
        for (unsigned d = 0; d < g_ndev; d++) {
            dev[d] = vgpu_sat_add(dev[d], LD(&s->dev[d].device_bytes));
            host[d] = vgpu_sat_add(host[d], LD(&s->dev[d].host_bytes));
        }
    }
    ST(&g_r->slot_hwm, last);
    for (unsigned d = 0; d < g_ndev; d++) {
        ST(&g_r->devices[d].used_device, dev[d]);
        ST(&g_r->devices[d].used_host, host[d]);
    }
    __atomic_add_fetch(&g_r->generation, 1, __ATOMIC_RELAXED);
}

static void shared_release_slot_locked(unsigned slot, int32_t pid);

/* under the lock: clear slots whose owner is gone; returns count */
static int reclaim_locked(void)
{
    int n = 0;
    for (unsigned i = 0; i < VGPU_MAX_SLOTS; i++) {
        struct vgpu_slot *s = &g_r->slots[i];
        uint32_t st = LD(&s->state);
        if (st == VGPU_SLOT_FREE || (int)i == g_slot)
            continue;
        if (st == VGPU_SLOT_ACTIVE && slot_alive(g_fd, i) != 0)
            continue; /* alive (or cannot tell: keep it) */
        VLOG(VGPU_LOG_DEBUG, "reclaiming slot %u (pid %d)", i, (int)LD(&s->pid));
        /* a dead process lets go of what it shared; what others still hold stays counted */
        shared_release_slot_locked(i, LD(&s->pid));
        memset(s, 0, sizeof *s);
        n++;
    }
    return n;
}

static int devices_match(const struct vgpu_region *r, const struct vgpu_limits *lim)
{
    if (LD(&r->num_devices) != lim->count)
        return 0;
    for (unsigned i = 0; i < lim->count; i++) {
        const struct vgpu_region_device *d = &r->devices[i];
        if (strncmp(d->uuid, lim->dev[i].uuid, VGPU_UUID_LEN) != 0 || LD(&d->memory_limit) != lim->dev[i].memory_limit ||
            LD(&d->device_limit) != lim->dev[i].device_limit || LD(&d->core_percent) != lim->dev[i].core_percent ||
            LD(&d->flags) != (lim->dev[i].oversubscribe ? VGPU_DEV_OVERSUBSCRIBE : 0u))
            return 0;
    }
    return 1;
}

/* under the lock: make the header valid (or say why it cannot be) and the
 * device table a copy of the limits file, which is the authority */
static const char *fix_locked(struct vgpu_region *r, int fresh, const struct vgpu_limits *lim)
{
    if (fresh || header_zero(r)) {
        header_init(r);
    } else {
        const char *p = header_problem(r);
        if (p)
            return p;
    }
    for (unsigned i = 0; i < lim->count; i++) {
        struct vgpu_region_device *d = &r->devices[i];
        if (strncmp(d->uuid, lim->dev[i].uuid, VGPU_UUID_LEN) != 0) {
            memset(d, 0, sizeof *d);
            snprintf(d->uuid, sizeof d->uuid, "%s", lim->dev[i].uuid);
        }
        d->memory_limit = lim->dev[i].memory_limit;
        d->device_limit = lim->dev[i].device_limit;
        d->core_percent = lim->dev[i].core_percent;
        d->flags = lim->dev[i].oversubscribe ? VGPU_DEV_OVERSUBSCRIBE : 0;
    }
    r->num_devices = lim->count;
    return NULL;
}

int vgpu_rgn_map(const char *path, int create, const struct vgpu_limits *lim, char *err, size_t errlen)
{
    pthread_mutex_lock(&g_mu);
    if (g_r) {
        pthread_mutex_unlock(&g_mu);
        return 0;
    }
    int fd;
    if (path) {
        /* O_NOFOLLOW: the path is fixed (/run/vgpu/region) or comes from a test env */
        fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY | O_NONBLOCK | (create ? O_CREAT : 0), 0666);
    } else {
        fd = vgpu_memfd("vgpu-region");
    }
    if (fd < 0) {
        snprintf(err, errlen, "cannot open: %s", strerror(errno));
        pthread_mutex_unlock(&g_mu);
        return -1;
    }
    struct vgpu_region *r = MAP_FAILED;
    int locked = 0;
    const char *problem = NULL;
    struct stat st;
    for (;;) {
        if (vgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
            problem = "not a regular file";
            break;
        }
        int fresh = st.st_size == 0;
        if (fresh && !locked) {
            /* create under the lock (another process may be doing the same) */
            if (ofd_lock(fd, F_WRLCK, VGPU_REGION_LOCK_BYTE, 1) != 0) {
                problem = "cannot lock";
                break;
            }
            locked = 1;
            continue;
        }
        if (fresh && ftruncate(fd, (off_t)sizeof(struct vgpu_region)) != 0) {
            problem = "cannot size the file";
            break;
        }
        if (!fresh && (uint64_t)st.st_size < sizeof(struct vgpu_region)) {
            problem = "corrupt: short file";
            break;
        }
        if (r == MAP_FAILED)
            r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r == MAP_FAILED) {
            problem = "mmap failed";
            break;
        }
        /* the common case: a valid header that already mirrors the limits, no lock needed */
        if (!fresh && !locked && !header_problem(r) && devices_match(r, lim))
            break;
        if (!locked) {
            if (ofd_lock(fd, F_WRLCK, VGPU_REGION_LOCK_BYTE, 1) != 0) {
                problem = "cannot lock";
                break;
            }
            locked = 1;
            continue; /* look again under the lock */
        }
        const char *p = fix_locked(r, fresh, lim);
        if (p) {
            snprintf(err, errlen, "corrupt: %s", p);
            problem = err;
        }
        break;
    }
    if (locked)
        ofd_lock(fd, F_UNLCK, VGPU_REGION_LOCK_BYTE, 0);
    if (problem) {
        if (problem != err)
            snprintf(err, errlen, "%s", problem);
        if (r != MAP_FAILED)
            munmap(r, sizeof *r);
        close(fd);
        pthread_mutex_unlock(&g_mu);
        return -1;
    }
    g_r = r;
    g_fd = fd;
    g_ndev = lim->count;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

int vgpu_rgn_mapped(void) { return g_r != NULL; }
int vgpu_rgn_slot(void) { return g_slot; }

static uint64_t self_start_time(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may contain spaces */
    if (!p)
        return 0;
    /* after ") " come fields 3..; start_time is field 22 */
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    return strtoull(p, NULL, 10);
}

int vgpu_rgn_join(char *err, size_t errlen)
{
    if (!g_r) {
        snprintf(err, errlen, "region not mapped");
        return -1;
    }
    if (g_slot >= 0)
        return 0;
    uint64_t start = self_start_time();
    lock_region();
    if (g_slot >= 0) {
        unlock_region();
        return 0;
    }
    /* Take the lowest FREE slot.  Dead slots are not probed here (that is
     * a syscall per live process, under the lock): they are reclaimed when
     * their memory is needed (a charge over the limit, a report) or when
     * no slot is free. */
    int got = -1;
    for (int pass = 0; pass < 2 && got < 0; pass++) {
        if (pass == 1 && reclaim_locked() == 0)
            break;
        for (unsigned i = 0; i < VGPU_MAX_SLOTS; i++) {
            if (LD(&g_r->slots[i].state) != VGPU_SLOT_FREE)
                continue;
            if (ofd_lock(g_fd, F_RDLCK, VGPU_REGION_SLOT_LOCK_BASE + i, 0) != 0)
                continue;
            got = (int)i;
            break;
        }
    }
    if (got < 0) {
        unlock_region();
        snprintf(err, errlen, "no free slot (%u processes)", VGPU_MAX_SLOTS);
        return -1;
    }
    struct vgpu_slot *s = &g_r->slots[got];
    memset(s, 0, sizeof *s);
    s->pid = (int32_t)getpid();
    s->host_pid = 0; /* unknown inside a container; the monitor maps it */
    s->start_time = start;
    __atomic_store_n(&s->state, VGPU_SLOT_ACTIVE, __ATOMIC_SEQ_CST);
    g_slot = got;
    /* seq_cst, like the charges: a charger that sees our first charge also
     * sees the slot as active and below the high-water mark */
    if ((unsigned)got >= hwm())
        __atomic_store_n(&g_r->slot_hwm, (uint32_t)got + 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&g_r->generation, 1, __ATOMIC_RELAXED);
    unlock_region();
    VLOG(VGPU_LOG_DEBUG, "joined region slot %d", got);
    return 0;
}

static void sat_sub(uint64_t *p, uint64_t n);

static unsigned shared_hwm(void)
{
    uint32_t h = __atomic_load_n(&g_r->shared_hwm, __ATOMIC_SEQ_CST);
    return h > VGPU_MAX_SHARED ? VGPU_MAX_SHARED : h;
}

/* device memory of the container's shared allocations on dev */
static uint64_t shared_of(unsigned dev)
{
    unsigned h = shared_hwm();
    uint64_t sum = 0;
    for (unsigned i = 0; i < h; i++) {
        const struct vgpu_shared *e = &g_r->shared[i];
        if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) == VGPU_SHARED_LIVE && LD(&e->dev) == dev)
            sum = vgpu_sat_add(sum, LD(&e->bytes));
    }
    return sum;
}

/* usage of device dev over the active slots (ours included) and the shared allocations:
 * everything, and the device-resident part (everything but host_bytes; shared allocations are
 * device memory) */
static void usage_of(unsigned dev, uint64_t *all, uint64_t *resident)
{
    unsigned h = hwm();
    if ((unsigned)g_slot >= h)
        h = (unsigned)g_slot + 1;
    uint64_t res = shared_of(dev), sum = res;
    for (unsigned i = 0; i < h; i++) {
        const struct vgpu_slot *s = &g_r->slots[i];
        if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != VGPU_SLOT_ACTIVE)
            continue;
        /* every counter read once: a sum never mixes two values of one counter */
        const struct vgpu_slot_device *sd = &s->dev[dev];
        uint64_t e = LD(&sd->extra_bytes), c = LD(&sd->ctx_reserve);
        uint64_t r = vgpu_sat_add(LD(&sd->device_bytes), e > c ? e : c);
        res = vgpu_sat_add(res, r);
        sum = vgpu_sat_add(sum, vgpu_sat_add(r, LD(&sd->host_bytes)));
    }
    *all = sum;
    *resident = res;
}

/* the bounds a device charge must keep: 0, VGPU_OVER_SLICE or VGPU_OVER_SHARE */
static int over(unsigned dev, uint64_t limit, uint64_t dev_limit, int kind)
{
    uint64_t all, res;
    usage_of(dev, &all, &res);
    return all > limit ? VGPU_OVER_SLICE : (kind == VGPU_KIND_DEVICE && res > dev_limit) ? VGPU_OVER_SHARE : 0;
}

/*
 * Add, then check: the charge is added to this slot first, then the whole
 * usage (ours included) is summed, and the charge is taken back if that sum
 * is over the limit.  Adds are sequentially consistent read-modify-writes
 * followed by a full fence, so of any two concurrent chargers at least the
 * later one (in the total order of adds) sees the other's add; hence the
 * charger that added last among all committed ones has checked the sum of
 * all of them: committed charges never exceed the limit together, and no
 * lock or syscall is needed on this path.  A tentative add that is about to
 * be taken back can make a concurrent charger near the limit see too much;
 * such a "no" is therefore re-examined under the region lock after dead
 * slots are reclaimed, a few times, before it becomes CUDA_ERROR_OUT_OF_MEMORY.
 *
 * Two bounds are checked in the same pass: the whole usage against the slice
 * (every charge), and the device-resident usage against the physical share
 * (device charges only: a host charge does not change it).  The argument
 * holds for each sum on its own: the last device charger has seen every
 * device charge, the last charger of any kind every charge.
 */
static int try_charge(unsigned dev, uint64_t n, uint64_t limit, uint64_t dev_limit, uint64_t *ctr, int kind)
{
    __atomic_add_fetch(ctr, n, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int r = over(dev, limit, dev_limit, kind);
    if (r)
        sat_sub(ctr, n);
    return r;
}

int vgpu_rgn_charge(unsigned dev, uint64_t n, uint64_t limit, uint64_t dev_limit, uint64_t reserve, int kind)
{
    if (!g_r || g_slot < 0 || dev >= g_ndev)
        return VGPU_OVER_SLICE;
    struct vgpu_slot_device *me = &g_r->slots[g_slot].dev[dev];
    /* this process's context reserve (set once, never lowered) */
    uint64_t old = LD(&me->ctx_reserve);
    while (old < reserve && !__atomic_compare_exchange_n(&me->ctx_reserve, &old, reserve, 1, __ATOMIC_SEQ_CST,
                                                         __ATOMIC_RELAXED))
        ;
    uint64_t *ctr = kind == VGPU_KIND_HOST ? &me->host_bytes : &me->device_bytes;
    int ok = try_charge(dev, n, limit, dev_limit, ctr, kind);
    if (ok != 0) {
        lock_region();
        for (int attempt = 0; attempt < 4 && ok != 0; attempt++) {
            if (attempt == 0 && reclaim_locked() > 0)
                recompute_locked();
            else if (attempt > 0)
                sched_yield(); /* let a concurrent tentative charge be taken back */
            ok = try_charge(dev, n, limit, dev_limit, ctr, kind);
        }
        unlock_region();
    }
    if (ok == 0) {
        __atomic_add_fetch(kind == VGPU_KIND_HOST ? &g_r->devices[dev].used_host : &g_r->devices[dev].used_device, n,
                           __ATOMIC_RELAXED);
        __atomic_add_fetch(&g_r->generation, 1, __ATOMIC_RELAXED);
    }
    return ok;
}

static void sat_sub(uint64_t *p, uint64_t n)
{
    uint64_t cur = LD(p), next;
    do {
        next = cur > n ? cur - n : 0;
    } while (!__atomic_compare_exchange_n(p, &cur, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

void vgpu_rgn_uncharge(unsigned dev, uint64_t n, int kind)
{
    if (!g_r || g_slot < 0 || dev >= g_ndev)
        return;
    struct vgpu_slot_device *me = &g_r->slots[g_slot].dev[dev];
    sat_sub(kind == VGPU_KIND_HOST ? &me->host_bytes : &me->device_bytes, n);
    sat_sub(kind == VGPU_KIND_HOST ? &g_r->devices[dev].used_host : &g_r->devices[dev].used_device, n);
    __atomic_add_fetch(&g_r->generation, 1, __ATOMIC_RELAXED);
}

void vgpu_rgn_to_host(unsigned dev, uint64_t n)
{
    if (!g_r || g_slot < 0 || dev >= g_ndev)
        return;
    struct vgpu_slot_device *me = &g_r->slots[g_slot].dev[dev];
    /* host first: the slot's sum never dips below the truth meanwhile */
    __atomic_add_fetch(&me->host_bytes, n, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_r->devices[dev].used_host, n, __ATOMIC_RELAXED);
    sat_sub(&me->device_bytes, n);
    sat_sub(&g_r->devices[dev].used_device, n);
}

void vgpu_rgn_usage(unsigned dev, struct vgpu_usage *u)
{
    memset(u, 0, sizeof *u);
    if (!g_r || dev >= g_ndev)
        return;
    unsigned h = hwm();
    if (g_slot >= 0 && (unsigned)g_slot >= h)
        h = (unsigned)g_slot + 1;
    for (unsigned i = 0; i < h; i++) {
        const struct vgpu_slot *s = &g_r->slots[i];
        if (LD(&s->state) != VGPU_SLOT_ACTIVE)
            continue;
        const struct vgpu_slot_device *sd = &s->dev[dev];
        uint64_t e = LD(&sd->extra_bytes), c = LD(&sd->ctx_reserve);
        u->device = vgpu_sat_add(u->device, LD(&sd->device_bytes));
        u->host = vgpu_sat_add(u->host, LD(&sd->host_bytes));
        u->extra = vgpu_sat_add(u->extra, e > c ? e : c);
    }
    u->device = vgpu_sat_add(u->device, shared_of(dev));
}

int vgpu_rgn_reclaim(void)
{
    if (!g_r)
        return 0;
    lock_region();
    int n = reclaim_locked();
    if (n)
        recompute_locked();
    unlock_region();
    return n;
}

void vgpu_rgn_atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
void vgpu_rgn_atfork_parent(void) { pthread_mutex_unlock(&g_mu); }

/* The child shares the parent's open file description: keeping it would let
 * the child keep the parent's slot alive and share its (non-conflicting) OFD
 * locks.  Drop it; the child maps and joins with its own description and slot
 * on its first CUDA use, and costs nothing if it never makes one.  (A private
 * memfd region cannot be reopened: such a child gets a fresh private one.) */
void vgpu_rgn_atfork_child(void)
{
    pthread_mutex_init(&g_mu, NULL);
    g_slot = -1;
    if (g_fd >= 0)
        close(g_fd);
    g_fd = -1;
    if (g_r)
        munmap(g_r, sizeof *g_r);
    g_r = NULL;
}

/* ------------------------------------------------------------ shared ledger
 *
 * Memory shared between processes of the container counts once, in an entry
 * of shared[] held by every slot that holds it, whatever the order in which
 * they free it.  Entries change only under the region lock; chargers read
 * them lock-free (usage_of), which sees an entry's bytes from the moment it
 * is LIVE: an entry is made LIVE before the bytes it takes over leave the
 * slot that charged them, so a concurrent checker can only see too much.
 * A reference is (index + 1) | generation << 32.
 */

#include <sys/syscall.h>

#ifndef KCMP_FILE
#define KCMP_FILE 0
#endif

static uint64_t ref_of(unsigned i) { return (uint64_t)(i + 1) | (LD(&g_r->shared[i].generation) << 32); }

/* the live entry a reference names, or NULL (under the lock) */
static struct vgpu_shared *entry_locked(uint64_t ref)
{
    uint64_t i = (ref & 0xffffffffu) - 1;
    if (!g_r || i >= VGPU_MAX_SHARED)
        return NULL;
    struct vgpu_shared *e = &g_r->shared[i];
    if (LD(&e->state) != VGPU_SHARED_LIVE || (LD(&e->generation) & 0xffffffffu) != (ref >> 32))
        return NULL;
    return e;
}

static void set_holder(struct vgpu_shared *e, unsigned slot, int on)
{
    uint64_t bit = 1ull << (slot % 64);
    if (on)
        __atomic_or_fetch(&e->holders[slot / 64], bit, __ATOMIC_RELAXED);
    else
        __atomic_and_fetch(&e->holders[slot / 64], ~bit, __ATOMIC_RELAXED);
}

static int has_holders(const struct vgpu_shared *e)
{
    for (unsigned w = 0; w < VGPU_MAX_SLOTS / 64; w++)
        if (LD(&e->holders[w]))
            return 1;
    return 0;
}

static void recompute_shared_hwm_locked(void)
{
    unsigned last = 0;
    for (unsigned i = 0; i < VGPU_MAX_SHARED; i++)
        if (LD(&g_r->shared[i].state) == VGPU_SHARED_LIVE)
            last = i + 1;
    __atomic_store_n(&g_r->shared_hwm, last, __ATOMIC_SEQ_CST);
}

static void free_entry_locked(struct vgpu_shared *e)
{
    __atomic_store_n(&e->state, VGPU_SHARED_FREE, __ATOMIC_SEQ_CST);
    recompute_shared_hwm_locked();
    __atomic_add_fetch(&g_r->generation, 1, __ATOMIC_RELAXED);
}

/* a new LIVE entry of n bytes on dev held by this slot, or NULL (full) */
static struct vgpu_shared *new_entry_locked(unsigned dev, uint64_t n)
{
    for (unsigned i = 0; i < VGPU_MAX_SHARED; i++) {
        struct vgpu_shared *e = &g_r->shared[i];
        if (LD(&e->state) == VGPU_SHARED_LIVE)
            continue;
        uint64_t gen = LD(&e->generation) + 1;
        memset(e, 0, sizeof *e);
        ST(&e->generation, gen);
        ST(&e->dev, dev);
        ST(&e->bytes, n);
        set_holder(e, (unsigned)g_slot, 1);
        __atomic_store_n(&e->state, VGPU_SHARED_LIVE, __ATOMIC_SEQ_CST);
        if (i + 1 > shared_hwm())
            __atomic_store_n(&g_r->shared_hwm, i + 1, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        return e;
    }
    return NULL;
}

static void release_locked(struct vgpu_shared *e, unsigned slot, int32_t pid)
{
    for (unsigned k = 0; k < VGPU_SHARED_FDS; k++)
        if (LD(&e->export_pid[k]) == pid) {
            if (pid == (int32_t)getpid() && (int)slot == g_slot)
                close(LD(&e->export_fd[k])); /* our descriptor kept for kcmp */
            ST(&e->export_pid[k], 0);
        }
    set_holder(e, slot, 0);
    if (!has_holders(e))
        free_entry_locked(e);
}

static void shared_release_slot_locked(unsigned slot, int32_t pid)
{
    unsigned h = shared_hwm();
    for (unsigned i = 0; i < h; i++) {
        struct vgpu_shared *e = &g_r->shared[i];
        if (LD(&e->state) == VGPU_SHARED_LIVE && (LD(&e->holders[slot / 64]) >> (slot % 64)) & 1)
            release_locked(e, slot, pid);
    }
}

uint64_t vgpu_rgn_share(unsigned dev, uint64_t n)
{
    if (!g_r || g_slot < 0 || dev >= g_ndev)
        return 0;
    lock_region();
    struct vgpu_shared *e = new_entry_locked(dev, n);
    uint64_t ref = e ? ref_of((unsigned)(e - g_r->shared)) : 0;
    unlock_region();
    if (e) /* the entry counts the bytes now: the slot lets them go */
        vgpu_rgn_uncharge(dev, n, VGPU_KIND_DEVICE);
    else
        VLOG(VGPU_LOG_WARN, "shared-allocation ledger full (%u): %llu bytes stay with this process", VGPU_MAX_SHARED,
             (unsigned long long)n);
    return ref;
}

int vgpu_rgn_share_charge(unsigned dev, uint64_t n, uint64_t limit, uint64_t dev_limit, uint64_t *ref)
{
    *ref = 0;
    if (!g_r || g_slot < 0 || dev >= g_ndev)
        return -1;
    lock_region();
    struct vgpu_shared *e = new_entry_locked(dev, n);
    int rc = -1;
    if (e && over(dev, limit, dev_limit, VGPU_KIND_DEVICE) == 0) { /* added, then checked: as try_charge */
        *ref = ref_of((unsigned)(e - g_r->shared));
        rc = 0;
    } else if (e) {
        free_entry_locked(e);
    }
    unlock_region();
    return rc;
}

uint64_t vgpu_rgn_share_find_key(uint64_t key)
{
    if (!g_r || g_slot < 0 || key == 0)
        return 0;
    uint64_t ref = 0;
    lock_region();
    unsigned h = shared_hwm();
    for (unsigned i = 0; i < h && !ref; i++) {
        struct vgpu_shared *e = &g_r->shared[i];
        if (LD(&e->state) != VGPU_SHARED_LIVE)
            continue;
        for (unsigned k = 0; k < VGPU_SHARED_KEYS; k++)
            if (LD(&e->keys[k]) == key) {
                set_holder(e, (unsigned)g_slot, 1);
                ref = ref_of(i);
                break;
            }
    }
    unlock_region();
    return ref;
}

void vgpu_rgn_share_add_key(uint64_t ref, uint64_t key)
{
    if (!g_r || key == 0)
        return;
    lock_region();
    struct vgpu_shared *e = entry_locked(ref);
    if (e) {
        unsigned k, free_k = VGPU_SHARED_KEYS;
        for (k = 0; k < VGPU_SHARED_KEYS; k++) {
            if (LD(&e->keys[k]) == key)
                break;
            if (!LD(&e->keys[k]) && free_k == VGPU_SHARED_KEYS)
                free_k = k;
        }
        if (k == VGPU_SHARED_KEYS && free_k < VGPU_SHARED_KEYS)
            ST(&e->keys[free_k], key);
    }
    unlock_region();
}

int vgpu_rgn_share_add_fd(uint64_t ref, int fd)
{
    int rc = -1;
    if (!g_r)
        return rc;
    lock_region();
    struct vgpu_shared *e = entry_locked(ref);
    for (unsigned k = 0; e && k < VGPU_SHARED_FDS; k++)
        if (LD(&e->export_pid[k]) == 0) {
            ST(&e->export_fd[k], fd);
            ST(&e->export_pid[k], (int32_t)getpid());
            rc = 0;
            break;
        }
    unlock_region();
    return rc;
}

uint64_t vgpu_rgn_share_find_fd(int fd)
{
    if (!g_r || g_slot < 0 || fd < 0)
        return 0;
    uint64_t ref = 0;
    pid_t self = getpid();
    lock_region();
    unsigned h = shared_hwm();
    for (unsigned i = 0; i < h && !ref; i++) {
        struct vgpu_shared *e = &g_r->shared[i];
        if (LD(&e->state) != VGPU_SHARED_LIVE)
            continue;
        for (unsigned k = 0; k < VGPU_SHARED_FDS; k++) {
            int32_t pid = LD(&e->export_pid[k]);
            /* the same open file as the exporter's descriptor (passed with SCM_RIGHTS or
             * pidfd_getfd): the same allocation.  Needs ptrace-read access to the exporter
             * (same user, same container); where kcmp is refused the importer counts it. */
            if (pid > 0 && syscall(SYS_kcmp, (pid_t)self, (pid_t)pid, KCMP_FILE, fd, LD(&e->export_fd[k])) == 0) {
                set_holder(e, (unsigned)g_slot, 1);
                ref = ref_of(i);
                break;
            }
        }
    }
    unlock_region();
    return ref;
}

void vgpu_rgn_share_drop(uint64_t ref)
{
    if (!g_r || g_slot < 0)
        return;
    lock_region();
    struct vgpu_shared *e = entry_locked(ref);
    if (e)
        release_locked(e, (unsigned)g_slot, (int32_t)getpid());
    unlock_region();
}
