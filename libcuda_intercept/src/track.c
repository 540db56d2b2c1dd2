/* track.c — open-addressing hash map, linear probing, tombstones, mmap storage. */
#include "track.h"

#include <string.h>
#include <sys/mman.h>

#define EMPTY 0ull
#define DELETED UINT64_MAX

static uint64_t mix(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static struct vgpu_rec *alloc_tab(uint64_t cap)
{
    void *p = mmap(NULL, cap * sizeof(struct vgpu_rec), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* index of key, or of the slot where it would go (first deleted/empty) */
static uint64_t find(const struct vgpu_track *t, uint64_t key, int *found)
{
    uint64_t m = t->cap - 1, i = mix(key) & m, first_del = UINT64_MAX;
    for (uint64_t n = 0; n < t->cap; n++, i = (i + 1) & m) {
        uint64_t k = t->tab[i].key;
        if (k == key) {
            *found = 1;
            return i;
        }
        if (k == EMPTY) {
            *found = 0;
            return first_del != UINT64_MAX ? first_del : i;
        }
        if (k == DELETED && first_del == UINT64_MAX)
            first_del = i;
    }
    *found = 0;
    return first_del;
}

static int grow(struct vgpu_track *t)
{
    uint64_t ncap = t->cap ? t->cap : 256;
    while ((t->live + 1) * 2 > ncap) /* after the rehash: at most half full */
        ncap *= 2;
    struct vgpu_rec *nt = alloc_tab(ncap);
    if (!nt)
        return -1;
    struct vgpu_track old = *t;
    t->tab = nt;
    t->cap = ncap;
    t->used = t->live = 0;
    for (uint64_t i = 0; i < old.cap; i++) {
        uint64_t k = old.tab[i].key;
        if (k == EMPTY || k == DELETED)
            continue;
        int f;
        uint64_t j = find(t, k, &f);
        t->tab[j] = old.tab[i];
        t->used++;
        t->live++;
    }
    if (old.tab)
        munmap(old.tab, old.cap * sizeof(struct vgpu_rec));
    return 0;
}

int vgpu_track_put(struct vgpu_track *t, const struct vgpu_rec *r)
{
    if (r->key == EMPTY || r->key == DELETED)
        return -1;
    pthread_mutex_lock(&t->mu);
    if ((t->cap == 0 || (t->used + 1) * 10 >= t->cap * 7) && grow(t) != 0) {
        pthread_mutex_unlock(&t->mu);
        return -1;
    }
    int f;
    uint64_t i = find(t, r->key, &f);
    if (!f) {
        if (t->tab[i].key == EMPTY)
            t->used++;
        t->live++;
    }
    t->tab[i] = *r;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static int lookup(struct vgpu_track *t, uint64_t key, struct vgpu_rec *out, int take)
{
    if (key == EMPTY || key == DELETED)
        return 0;
    pthread_mutex_lock(&t->mu);
    int f = 0;
    if (t->cap) {
        uint64_t i = find(t, key, &f);
        if (f) {
            if (out)
                *out = t->tab[i];
            if (take) {
                t->tab[i].key = DELETED;
                t->live--;
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
    return f;
}

int vgpu_track_get(struct vgpu_track *t, uint64_t key, struct vgpu_rec *out) { return lookup(t, key, out, 0); }
int vgpu_track_take(struct vgpu_track *t, uint64_t key, struct vgpu_rec *out) { return lookup(t, key, out, 1); }

int vgpu_track_update(struct vgpu_track *t, uint64_t key, int (*fn)(struct vgpu_rec *, void *, int *), void *arg)
{
    if (key == EMPTY || key == DELETED)
        return -1;
    int rc = -1;
    pthread_mutex_lock(&t->mu);
    if (t->cap) {
        int f;
        uint64_t i = find(t, key, &f);
        if (f) {
            int rm = 0;
            rc = fn(&t->tab[i], arg, &rm);
            if (rm) {
                t->tab[i].key = DELETED;
                t->live--;
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

uint64_t vgpu_track_count(struct vgpu_track *t)
{
    pthread_mutex_lock(&t->mu);
    uint64_t n = t->live;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void vgpu_track_lock(struct vgpu_track *t) { pthread_mutex_lock(&t->mu); }
void vgpu_track_unlock(struct vgpu_track *t) { pthread_mutex_unlock(&t->mu); }

void vgpu_track_reset_child(struct vgpu_track *t)
{
    pthread_mutex_init(&t->mu, NULL);
    if (t->tab)
        munmap(t->tab, t->cap * sizeof(struct vgpu_rec));
    t->tab = NULL;
    t->cap = t->used = t->live = 0;
}

int vgpu_track_take_range(struct vgpu_track *t, uint64_t lo, uint64_t hi, void (*fn)(const struct vgpu_rec *, void *),
                          void *arg)
{
    int n = 0;
    pthread_mutex_lock(&t->mu);
    for (uint64_t i = 0; i < t->cap; i++) {
        uint64_t k = t->tab[i].key;
        if (k == EMPTY || k == DELETED || k < lo || k >= hi)
            continue;
        fn(&t->tab[i], arg);
        t->tab[i].key = DELETED;
        t->live--;
        n++;
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

void vgpu_track_each(struct vgpu_track *t, void (*fn)(struct vgpu_rec *, void *), void *arg)
{
    pthread_mutex_lock(&t->mu);
    for (uint64_t i = 0; i < t->cap; i++) {
        uint64_t k = t->tab[i].key;
        if (k != EMPTY && k != DELETED)
            fn(&t->tab[i], arg);
    }
    pthread_mutex_unlock(&t->mu);
}

int vgpu_track_overlaps(struct vgpu_track *t, uint64_t lo, uint64_t hi, uint32_t kind)
{
    int hit = 0;
    pthread_mutex_lock(&t->mu);
    for (uint64_t i = 0; i < t->cap && !hit; i++) {
        const struct vgpu_rec *r = &t->tab[i];
        if (r->key == EMPTY || r->key == DELETED || r->kind != kind)
            continue;
        uint64_t end = r->key + r->size < r->key ? UINT64_MAX : r->key + r->size;
        hit = r->key < hi && lo < end;
    }
    pthread_mutex_unlock(&t->mu);
    return hit;
}

size_t vgpu_track_snapshot(struct vgpu_track *t, struct vgpu_rec *out, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&t->mu);
    for (uint64_t i = 0; i < t->cap && n < max; i++) {
        uint64_t k = t->tab[i].key;
        if (k != EMPTY && k != DELETED)
            out[n++] = t->tab[i];
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}
