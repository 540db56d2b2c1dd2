/* track.h — per-process maps from driver objects (device pointers, VMM
 * handles, mapped ranges, arrays, pools) to what was charged for them. */
#ifndef VGPU_TRACK_H
#define VGPU_TRACK_H

#include <pthread.h>
#include <stdint.h>

struct vgpu_rec {
    uint64_t key;   /* 0 = empty, UINT64_MAX = deleted */
    uint64_t size;  /* bytes charged */
    uint64_t aux;   /* per-table meaning (VMM: handle; map: mapping count) */
    uint64_t ext;   /* per-table meaning (a shared-ledger reference; a pool's live allocations) */
    uint32_t dev;   /* limits index */
    uint32_t kind;  /* VGPU_KIND_* or table-specific flags */
};

struct vgpu_track {
    pthread_mutex_t mu;
    struct vgpu_rec *tab; /* mmap'd, so growth never re-enters malloc */
    uint64_t cap;         /* power of two, 0 before first use */
    uint64_t used;        /* live + deleted */
    uint64_t live;
};

#define VGPU_TRACK_INIT {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0}

/* insert or replace; 0 ok, -1 out of memory */
int vgpu_track_put(struct vgpu_track *t, const struct vgpu_rec *r);
/* copy the record out; 1 found, 0 not */
int vgpu_track_get(struct vgpu_track *t, uint64_t key, struct vgpu_rec *out);
/* remove and copy out; 1 found, 0 not */
int vgpu_track_take(struct vgpu_track *t, uint64_t key, struct vgpu_rec *out);
/* atomically update in place via a callback under the table lock; returns
 * the callback's result, or -1 if the key is absent.  The callback may set
 * *remove to delete the record. */
int vgpu_track_update(struct vgpu_track *t, uint64_t key, int (*fn)(struct vgpu_rec *, void *, int *remove), void *arg);
uint64_t vgpu_track_count(struct vgpu_track *t);

void vgpu_track_lock(struct vgpu_track *t);
void vgpu_track_unlock(struct vgpu_track *t);
/* after fork in the child: forget everything (the child owns no GPU memory) */
void vgpu_track_reset_child(struct vgpu_track *t);

/* call fn on every record, in place, under the table lock (fn must not call
 * back into this table) */
void vgpu_track_each(struct vgpu_track *t, void (*fn)(struct vgpu_rec *, void *), void *arg);

#endif

#ifndef VGPU_TRACK_SCAN
#define VGPU_TRACK_SCAN
#include <stddef.h>
/* 1 if a record of this kind covers part of [lo, hi) ([key, key + size)). */
int vgpu_track_overlaps(struct vgpu_track *t, uint64_t lo, uint64_t hi, uint32_t kind);
/* copy up to max records out (any order); returns the count */
size_t vgpu_track_snapshot(struct vgpu_track *t, struct vgpu_rec *out, size_t max);
#endif

#ifndef VGPU_TRACK_RANGE
#define VGPU_TRACK_RANGE
/* remove every record with lo <= key < hi, calling fn on each (under the lock;
 * fn must not call back into this table).  Returns the count. */
int vgpu_track_take_range(struct vgpu_track *t, uint64_t lo, uint64_t hi, void (*fn)(const struct vgpu_rec *, void *),
                          void *arg);
#endif
