/* fakegpu: device allocations shared between processes of the node (the table of struct
 * fg_shared in the state; the driver API on top of it is cuda_ipc.c).
 *
 * Model (CUDA driver API, "Virtual Memory Management" cuMemExportToShareableHandle /
 * cuMemImportFromShareableHandle and "Memory Management" cuIpcGetMemHandle / cuIpcOpenMemHandle /
 * cuIpcCloseMemHandle): an allocation exported from one process and imported into others is one
 * piece of device memory; it stays allocated while any process holds it (a handle not released,
 * a mapping, an open IPC pointer) and is freed when the last one lets go.  Here it counts once,
 * in the mem_device of one holder (charged_slot: the allocating process while it holds it, then
 * another holder), so NVML's per-process figures add up to the device's used memory.  A holder
 * that dies drops its references like one that releases them.
 *
 * Every function here runs with the state lock held (or on a private snapshot: live = 0, which
 * never touches files).
 */
#include "fg_state.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

int fg_shared_path(int idx, uint64_t gen, char *buf, size_t len)
{
    int n = snprintf(buf, len, "%s.mem/%d.%llu", fg_state_path(), idx, (unsigned long long)gen);
    return n > 0 && (size_t)n < len ? 0 : -1;
}

static int holders_empty(const struct fg_shared *e)
{
    for (int w = 0; w < FG_MASK_WORDS; w++)
        if (e->holders[w])
            return 0;
    return 1;
}

static int first_holder(const struct fg_shared *e)
{
    for (int s = 0; s < FG_MAX_SLOTS; s++)
        if (fg_mask_has(e->holders, s))
            return s;
    return -1;
}

static void sub_sat(uint64_t *v, uint64_t n)
{
    *v = *v >= n ? *v - n : 0;
}

int fg_shared_new(struct fg_state *st, uint32_t kind, int dev, uint64_t bytes, int charged_slot, int holder)
{
    for (int i = 0; i < FG_MAX_SHARED; i++) {
        struct fg_shared *e = &st->shared[i];
        if (e->state != FG_SHARED_FREE)
            continue;
        memset(e, 0, sizeof(*e));
        e->state = FG_SHARED_LIVE;
        e->kind = kind;
        e->dev = dev;
        e->bytes = bytes;
        e->charged_slot = charged_slot;
        e->generation = ++st->h.shared_generation;
        if (holder >= 0)
            e->holders[holder / 64] |= 1ULL << (holder % 64);
        return i;
    }
    return -1;
}

void fg_shared_hold(struct fg_state *st, int idx, int slot)
{
    st->shared[idx].holders[slot / 64] |= 1ULL << (slot % 64);
}

int fg_shared_find(const struct fg_state *st, int idx, uint64_t gen)
{
    if (idx < 0 || idx >= FG_MAX_SHARED)
        return -1;
    const struct fg_shared *e = &st->shared[idx];
    return e->state == FG_SHARED_LIVE && e->generation == gen ? idx : -1;
}

int fg_shared_find_file(const struct fg_state *st, uint64_t ino, uint64_t fsdev)
{
    for (int i = 0; i < FG_MAX_SHARED; i++) {
        const struct fg_shared *e = &st->shared[i];
        if (e->state == FG_SHARED_LIVE && e->ino == ino && e->fsdev == fsdev)
            return i;
    }
    return -1;
}

void fg_shared_drop(struct fg_state *st, int idx, int slot, int live)
{
    struct fg_shared *e = &st->shared[idx];
    if (e->state != FG_SHARED_LIVE)
        return;
    e->holders[slot / 64] &= ~(1ULL << (slot % 64));
    int next = first_holder(e);
    if (e->charged_slot == slot) {
        /* the bytes move to another holder, or leave the device with the last one */
        sub_sat(&st->slots[slot].dev[e->dev].mem_device, e->bytes);
        if (next >= 0)
            st->slots[next].dev[e->dev].mem_device += e->bytes;
        else
            sub_sat(&st->ds[e->dev].used_total, e->bytes);
        e->charged_slot = next >= 0 ? next : -1;
    }
    if (holders_empty(e)) {
        if (e->charged_slot >= 0) {
            sub_sat(&st->slots[e->charged_slot].dev[e->dev].mem_device, e->bytes);
            sub_sat(&st->ds[e->dev].used_total, e->bytes);
        }
        char path[4200];
        if (live && fg_shared_path(idx, e->generation, path, sizeof(path)) == 0)
            unlink(path);
        e->state = FG_SHARED_FREE;
    }
}

void fg_shared_release_slot(struct fg_state *st, int slot, int live)
{
    for (int i = 0; i < FG_MAX_SHARED; i++)
        if (st->shared[i].state == FG_SHARED_LIVE &&
            (fg_mask_has(st->shared[i].holders, slot) || st->shared[i].charged_slot == slot))
            fg_shared_drop(st, i, slot, live);
}
