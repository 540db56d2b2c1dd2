/* fakegpu: MIG profiles, GPU and compute instances (fg_mig.h).  With the state lock held.
 *
 * Profile tables: NVIDIA MIG user guide, "Supported MIG Profiles" (A100, H100, H200 tables:
 * memory and SM fractions, engines, instance counts) and `nvidia-smi mig -lgip` of real GPUs
 * (profile IDs, memory in GiB, SM counts: A100-SXM4-40GB and H100 80GB as printed by drivers
 * 5xx; H200 rows 1g.18gb 16.00 GiB/16 SMs, 2g.35gb 32.50 GiB/32 SMs, 7g.141gb 140.00 GiB/132 SMs;
 * the H200's 1g.35gb, 3g.71gb and 4g.71gb take the memory of the same number of memory slices
 * (the guide: 2/8, 4/8, 4/8) and the SM counts of the H100's rows).  Placements: the guide's
 * `nvidia-smi mig -lgipp` ({0..6}:1, {0,2,4,6}:2 for the 1-slice profile with two memory slices,
 * {0,2,4}:2, {0,4}:4, {0}:4, {0}:8), the same on the three products.  Every value is cited in
 * docs/developers/simulators.md "MIG".
 */
#include "fg_mig.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { P1 = 0x0, P2 = 0x1, P3 = 0x2, P4 = 0x3, P7 = 0x4, P1ME = 0x7, P1R2 = 0x9 };

#define PL1 7, {0, 1, 2, 3, 4, 5, 6}
#define PL1R2 4, {0, 2, 4, 6}
#define PL2 3, {0, 2, 4}
#define PL3 2, {0, 4}
#define PL4 1, {0}

/* index, id, SM slices, memory slices, count, SMs, CE, DEC, ENC, JPEG, OFA, MiB, name, placements */
static const struct fg_mig_table g_tables[] = {
    {"a100-40gb",
     7,
     {{P1, 19, 1, 1, 7, 14, 1, 0, 0, 0, 0, 4864, "1g.5gb", PL1},
      {P1ME, 20, 1, 1, 1, 14, 1, 1, 0, 1, 1, 4864, "1g.5gb+me", PL1},
      {P1R2, 15, 1, 2, 4, 14, 1, 1, 0, 0, 0, 9856, "1g.10gb", PL1R2},
      {P2, 14, 2, 2, 3, 28, 2, 1, 0, 0, 0, 9856, "2g.10gb", PL2},
      {P3, 9, 3, 4, 2, 42, 3, 2, 0, 0, 0, 19968, "3g.20gb", PL3},
      {P4, 5, 4, 4, 1, 56, 4, 2, 0, 0, 0, 19968, "4g.20gb", PL4},
      {P7, 0, 7, 8, 1, 98, 7, 5, 0, 1, 1, 40192, "7g.40gb", PL4}}},
    {"h100-80gb",
     7,
     {{P1, 19, 1, 1, 7, 16, 1, 1, 0, 1, 0, 9984, "1g.10gb", PL1},
      {P1ME, 20, 1, 1, 1, 16, 1, 1, 0, 1, 1, 9984, "1g.10gb+me", PL1},
      {P1R2, 15, 1, 2, 4, 26, 1, 1, 0, 1, 0, 20096, "1g.20gb", PL1R2},
      {P2, 14, 2, 2, 3, 32, 2, 2, 0, 2, 0, 20096, "2g.20gb", PL2},
      {P3, 9, 3, 4, 2, 60, 3, 3, 0, 3, 0, 40448, "3g.40gb", PL3},
      {P4, 5, 4, 4, 1, 64, 4, 4, 0, 4, 0, 40448, "4g.40gb", PL4},
      {P7, 0, 7, 8, 1, 132, 8, 7, 0, 7, 1, 81152, "7g.80gb", PL4}}},
    {"h200-141gb",
     7,
     {{P1, 19, 1, 1, 7, 16, 1, 1, 0, 1, 0, 16384, "1g.18gb", PL1},
      {P1ME, 20, 1, 1, 1, 16, 1, 1, 0, 1, 1, 16384, "1g.18gb+me", PL1},
      {P1R2, 15, 1, 2, 4, 26, 1, 1, 0, 1, 0, 33280, "1g.35gb", PL1R2},
      {P2, 14, 2, 2, 3, 32, 2, 2, 0, 2, 0, 33280, "2g.35gb", PL2},
      {P3, 9, 3, 4, 2, 60, 3, 3, 0, 3, 0, 71680, "3g.71gb", PL3},
      {P4, 5, 4, 4, 1, 64, 4, 4, 0, 4, 0, 71680, "4g.71gb", PL4},
      {P7, 0, 7, 8, 1, 132, 8, 7, 0, 7, 1, 143360, "7g.141gb", PL4}}},
};
#define NTABLES (sizeof(g_tables) / sizeof(g_tables[0]))
#define MEM_SLICES 8u     /* "one eighth of the total GPU memory resources" */
#define COMPUTE_SLICES 7u /* "one seventh of the total number of SMs" */

int fg_mig_table_key(const char *key)
{
    if (!strcmp(key, "none"))
        return 0;
    for (unsigned i = 0; i < NTABLES; i++)
        if (!strcmp(key, g_tables[i].key))
            return (int)i + 1;
    return -1;
}

const struct fg_mig_table *fg_mig_table_of(const struct fg_state *st, int gpu)
{
    if (gpu < 0 || (unsigned)gpu >= st->h.ndev)
        return NULL;
    uint32_t t = st->cfg[gpu].mig_table;
    return (t >= 1 && t <= NTABLES) ? &g_tables[t - 1] : NULL;
}

const struct fg_gi_profile *fg_mig_gi_by_index(const struct fg_mig_table *t, uint32_t index)
{
    for (uint32_t i = 0; t && i < t->nprof; i++)
        if (t->p[i].index == index)
            return &t->p[i];
    return NULL;
}

const struct fg_gi_profile *fg_mig_gi_by_id(const struct fg_mig_table *t, uint32_t id)
{
    for (uint32_t i = 0; t && i < t->nprof; i++)
        if (t->p[i].id == id)
            return &t->p[i];
    return NULL;
}

/* The CI profiles of a GI with G SM slices: c slices for c in {1,2,3,4,7} where c <= G and, for
 * c < G, 2c <= G+1 (go-nvlib's VisitMigProfiles rule, pkg/nvlib/device/device.go); floor(G/c)
 * of them, at multiples of c (3 slices in 7: {0,4}, as NVIDIA's go-nvml H200 mock places them);
 * c < G has c x (the GI's SMs / G) SMs.  `nvidia-smi mig -lcip` on an A100 3g.20gb GI:
 * 1c.3g.20gb x3 14 SMs, 2c.3g.20gb x1 28 SMs, 3g.20gb x1 42 SMs. */
int fg_mig_ci_profile(const struct fg_gi_profile *g, uint32_t index, struct fg_ci_profile *out)
{
    static const uint32_t slices_of[] = {1, 2, 3, 4, 7};
    if (!g || index >= sizeof(slices_of) / sizeof(slices_of[0]))
        return -1;
    uint32_t c = slices_of[index], G = g->slices;
    if (c > G || (c < G && c * 2 > G + 1))
        return -1;
    memset(out, 0, sizeof(*out));
    out->index = index;
    out->slices = c;
    out->count = G / c;
    out->sm = c == G ? g->sm : g->sm * c / G;
    if (c == 3 && G == 7) {
        out->nplace = 2;
        out->starts[0] = 0;
        out->starts[1] = 4;
    } else {
        for (uint32_t s = 0; s + c <= G && out->nplace < 8; s += c)
            out->starts[out->nplace++] = s;
    }
    if (c == G)
        snprintf(out->name, sizeof(out->name), "%s", g->name);
    else
        snprintf(out->name, sizeof(out->name), "%uc.%s", c, g->name);
    return 0;
}

int fg_mig_enabled(const struct fg_state *st, int gpu)
{
    if (gpu < 0 || (unsigned)gpu >= st->h.ndev)
        return 0;
    return __atomic_load_n(&st->mig[gpu].mode, __ATOMIC_ACQUIRE) == 1;
}

int fg_unit_is_mig(const struct fg_state *st, int unit)
{
    return unit >= (int)st->h.ndev && unit < FG_MAX_DEV && __atomic_load_n(&st->unit[unit].parent, __ATOMIC_ACQUIRE) >= 0;
}

int fg_unit_root(const struct fg_state *st, int unit)
{
    return fg_unit_is_mig(st, unit) ? st->unit[unit].parent : unit;
}

unsigned fg_mig_cap_minor(unsigned gpu_minor, unsigned gi, int ci)
{
    /* /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, then per GPU minor 15 GIs of
     * (access, ci0..ci7): "gpu0/gi0/access 3 ... gpu31/gi14/ci7/access 4322" (MIG user guide) */
    return 3 + gpu_minor * 135 + gi * 9 + (ci < 0 ? 0 : 1 + (unsigned)ci);
}

static int unit_busy(const struct fg_state *st, int unit)
{
    for (int s = 0; s < FG_MAX_SLOTS; s++) {
        const struct fg_pdev *p = &st->slots[s].dev[unit];
        if (st->slots[s].state == FG_SLOT_LIVE && (p->contexts || p->mem_device || p->mem_managed_dev))
            return 1;
    }
    return 0;
}

int fg_mig_set_mode(struct fg_state *st, int gpu, unsigned mode, int *activation)
{
    if (!fg_mig_table_of(st, gpu))
        return FG_MIG_NOT_SUPPORTED;
    if (mode > 1)
        return FG_MIG_INVALID;
    struct fg_mig *m = &st->mig[gpu];
    fg_reap_in(st);
    m->pending = mode;
    int busy = unit_busy(st, gpu);
    for (int g = 0; g < FG_MIG_MAX_GI && mode == 0; g++)
        busy |= m->gi[g].used != 0;
    if (busy && m->mode != mode) {
        *activation = FG_MIG_IN_USE; /* "Warning: MIG mode is in pending ... state ... In use by another client" */
        return FG_MIG_OK;
    }
    __atomic_store_n(&m->mode, mode, __ATOMIC_RELEASE);
    *activation = FG_MIG_OK;
    return FG_MIG_OK;
}

struct fg_mig_gi *fg_mig_gi_get(struct fg_state *st, int gpu, uint32_t gi_id)
{
    if (gpu < 0 || (unsigned)gpu >= st->h.ndev)
        return NULL;
    for (int g = 0; g < FG_MIG_MAX_GI; g++)
        if (st->mig[gpu].gi[g].used && st->mig[gpu].gi[g].id == gi_id)
            return &st->mig[gpu].gi[g];
    return NULL;
}

struct fg_mig_ci *fg_mig_ci_get(struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_id)
{
    struct fg_mig_gi *gi = fg_mig_gi_get(st, gpu, gi_id);
    for (int c = 0; gi && c < FG_MIG_MAX_CI; c++)
        if (gi->ci[c].used && gi->ci[c].id == ci_id)
            return &gi->ci[c];
    return NULL;
}

/* memory slices taken and SM slices used by the GPU's instances */
static void occupancy(const struct fg_state *st, int gpu, uint32_t *mask, uint32_t *slices)
{
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    *mask = 0;
    *slices = 0;
    for (int g = 0; g < FG_MIG_MAX_GI; g++) {
        const struct fg_mig_gi *gi = &st->mig[gpu].gi[g];
        if (!gi->used)
            continue;
        *mask |= ((1u << gi->size) - 1) << gi->start;
        const struct fg_gi_profile *p = fg_mig_gi_by_id(t, gi->profile_id);
        *slices += p ? p->slices : 0;
    }
}

static uint32_t count_of(const struct fg_state *st, int gpu, uint32_t profile_id)
{
    uint32_t n = 0;
    for (int g = 0; g < FG_MIG_MAX_GI; g++)
        n += st->mig[gpu].gi[g].used && st->mig[gpu].gi[g].profile_id == profile_id;
    return n;
}

static int fits(uint32_t mask, uint32_t start, uint32_t size)
{
    uint32_t want = ((1u << size) - 1) << start;
    return start + size <= MEM_SLICES && !(mask & want);
}

/* The driver's GPU instance IDs by placement, as in the MIG user guide's examples (1g at slice s:
 * 7+s, two memory slices: 3+s/2, four: 1+s/4, eight: 0).  Nothing may rely on them. */
static uint32_t gi_id_for(uint32_t size, uint32_t start)
{
    switch (size) {
    case 8: return 0;
    case 4: return 1 + start / 4;
    case 2: return 3 + start / 2;
    default: return 7 + start;
    }
}

/* Placements of every profile of the table that still fit in `mask` (for the driver's choice). */
static unsigned feasible(const struct fg_mig_table *t, uint32_t mask)
{
    unsigned n = 0;
    for (uint32_t i = 0; i < t->nprof; i++)
        for (uint32_t k = 0; k < t->p[i].nplace; k++)
            n += (unsigned)fits(mask, t->p[i].starts[k], t->p[i].mem_slices);
    return n;
}

int fg_mig_gi_create(struct fg_state *st, int gpu, uint32_t profile_id, const uint32_t *start, uint32_t *gi_id)
{
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    if (!t || !fg_mig_enabled(st, gpu))
        return FG_MIG_NOT_SUPPORTED;
    const struct fg_gi_profile *p = fg_mig_gi_by_id(t, profile_id);
    if (!p)
        return FG_MIG_INVALID;
    uint32_t mask, slices;
    occupancy(st, gpu, &mask, &slices);
    if (count_of(st, gpu, profile_id) >= p->count || slices + p->slices > COMPUTE_SLICES)
        return FG_MIG_NO_RESOURCES;
    int chosen = -1;
    if (start) {
        for (uint32_t k = 0; k < p->nplace; k++)
            if (p->starts[k] == *start)
                chosen = (int)*start;
        if (chosen < 0)
            return FG_MIG_INVALID;
        if (!fits(mask, *start, p->mem_slices))
            return FG_MIG_NO_RESOURCES;
    } else {
        /* The driver's choice is not documented.  This one (the free placement that leaves the
         * most placements of all profiles possible, the lowest on a tie) gives every placement
         * of the MIG user guide's examples: 1g on an empty GPU at 6, 2g at 4, then 1g at 0, 1, ... */
        unsigned best = 0;
        for (uint32_t k = 0; k < p->nplace; k++) {
            uint32_t s = p->starts[k];
            if (!fits(mask, s, p->mem_slices))
                continue;
            unsigned left = feasible(t, mask | (((1u << p->mem_slices) - 1) << s));
            if (chosen < 0 || left > best) {
                chosen = (int)s;
                best = left;
            }
        }
        if (chosen < 0)
            return FG_MIG_NO_RESOURCES;
    }
    struct fg_mig_gi *slot = NULL;
    for (int g = 0; g < FG_MIG_MAX_GI && !slot; g++)
        if (!st->mig[gpu].gi[g].used)
            slot = &st->mig[gpu].gi[g];
    if (!slot)
        return FG_MIG_NO_RESOURCES;
    memset(slot, 0, sizeof(*slot));
    slot->id = gi_id_for(p->mem_slices, (uint32_t)chosen);
    slot->profile_id = p->id;
    slot->start = (uint32_t)chosen;
    slot->size = p->mem_slices;
    __atomic_store_n(&slot->used, 1, __ATOMIC_RELEASE);
    *gi_id = slot->id;
    return FG_MIG_OK;
}

int fg_mig_gi_destroy(struct fg_state *st, int gpu, uint32_t gi_id)
{
    if (!fg_mig_table_of(st, gpu) || !fg_mig_enabled(st, gpu))
        return FG_MIG_NOT_SUPPORTED;
    struct fg_mig_gi *gi = fg_mig_gi_get(st, gpu, gi_id);
    if (!gi)
        return FG_MIG_INVALID;
    for (int c = 0; c < FG_MIG_MAX_CI; c++)
        if (gi->ci[c].used)
            return FG_MIG_IN_USE; /* nvml.h: "processes ... or compute instances are active" */
    __atomic_store_n(&gi->used, 0, __ATOMIC_RELEASE);
    return FG_MIG_OK;
}

int fg_mig_gi_remaining(const struct fg_state *st, int gpu, uint32_t profile_id, uint32_t *count)
{
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    if (!t || !fg_mig_enabled(st, gpu))
        return FG_MIG_NOT_SUPPORTED;
    const struct fg_gi_profile *p = fg_mig_gi_by_id(t, profile_id);
    if (!p)
        return FG_MIG_INVALID;
    uint32_t mask, slices, n = 0, have = count_of(st, gpu, profile_id);
    occupancy(st, gpu, &mask, &slices);
    for (uint32_t k = 0; k < p->nplace; k++) {
        if (have + n >= p->count || slices + p->slices > COMPUTE_SLICES)
            break;
        if (fits(mask, p->starts[k], p->mem_slices)) {
            mask |= ((1u << p->mem_slices) - 1) << p->starts[k];
            slices += p->slices;
            n++;
        }
    }
    *count = n;
    return FG_MIG_OK;
}

/* 128 bits from the parent's UUID, the instance ids and the GPU's creation serial: a MIG UUID is
 * opaque ("Modern drivers assign opaque MIG UUIDs that carry no placement information", NVIDIA
 * k8s-device-plugin internal/rm/health.go) and a re-created instance gets a new one. */
static uint64_t fnv(const char *s, uint64_t h)
{
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ULL;
    }
    return h;
}

static void mig_uuid(const struct fg_state *st, int gpu, uint32_t gi, uint32_t ci, uint64_t serial, char *out,
                     size_t len)
{
    char key[160];
    snprintf(key, sizeof(key), "%s/%u/%u/%llu", st->cfg[gpu].uuid, gi, ci, (unsigned long long)serial);
    uint64_t a = fnv(key, 0xcbf29ce484222325ULL), b = fnv(key, 0x84222325cbf29ce4ULL ^ a);
    snprintf(out, len, "MIG-%08x-%04x-5%03x-%04x-%012llx", (unsigned)(a >> 32), (unsigned)(a >> 16) & 0xffff,
             (unsigned)a & 0xfff, 0x8000u | ((unsigned)(b >> 48) & 0x3fff),
             (unsigned long long)(b & 0xffffffffffffULL));
}

static void unit_clear(struct fg_state *st, int u)
{
    memset(&st->cfg[u], 0, sizeof(st->cfg[u]));
    memset(&st->ds[u], 0, sizeof(st->ds[u]));
    st->ds[u].cur_slot = FG_MAX_SLOTS;
    for (int s = 0; s < FG_MAX_SLOTS; s++)
        memset(&st->slots[s].dev[u], 0, sizeof(st->slots[s].dev[u]));
}

int fg_mig_ci_create(struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_profile, const uint32_t *start,
                     uint32_t *ci_id)
{
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    if (!t || !fg_mig_enabled(st, gpu))
        return FG_MIG_NOT_SUPPORTED;
    struct fg_mig_gi *gi = fg_mig_gi_get(st, gpu, gi_id);
    if (!gi)
        return FG_MIG_INVALID;
    const struct fg_gi_profile *gp = fg_mig_gi_by_id(t, gi->profile_id);
    struct fg_ci_profile cp;
    if (fg_mig_ci_profile(gp, ci_profile, &cp) != 0)
        return FG_MIG_NOT_SUPPORTED;
    uint32_t mask = 0, n = 0, used_slices = 0;
    for (int c = 0; c < FG_MIG_MAX_CI; c++)
        if (gi->ci[c].used) {
            mask |= ((1u << gi->ci[c].size) - 1) << gi->ci[c].start;
            used_slices += gi->ci[c].size;
            n += gi->ci[c].profile == ci_profile;
        }
    if (n >= cp.count || used_slices + cp.slices > gp->slices)
        return FG_MIG_NO_RESOURCES;
    int chosen = -1;
    for (uint32_t k = 0; k < cp.nplace && chosen < 0; k++) {
        uint32_t s = cp.starts[k], want = ((1u << cp.slices) - 1) << s;
        if (start && *start != s)
            continue;
        if (!(mask & want))
            chosen = (int)s;
        else if (start)
            return FG_MIG_NO_RESOURCES;
    }
    if (chosen < 0)
        return start ? FG_MIG_INVALID : FG_MIG_NO_RESOURCES;
    int unit = -1;
    for (int u = (int)st->h.ndev; u < FG_MAX_DEV && unit < 0; u++)
        if (st->unit[u].parent < 0)
            unit = u;
    struct fg_mig_ci *slot = NULL;
    for (int c = 0; c < FG_MIG_MAX_CI && !slot; c++)
        if (!gi->ci[c].used)
            slot = &gi->ci[c];
    if (unit < 0 || !slot)
        return FG_MIG_NO_RESOURCES; /* the simulator's own limit: FG_MAX_DEV units */
    uint32_t id = 0; /* the lowest free CI id (the guide's CIs 0, 1, 2 in creation order) */
    for (int again = 1; again;) {
        again = 0;
        for (int c = 0; c < FG_MIG_MAX_CI; c++)
            if (gi->ci[c].used && gi->ci[c].id == id) {
                id++;
                again = 1;
            }
    }
    unit_clear(st, unit);
    struct fg_devcfg *cfg = &st->cfg[unit];
    *cfg = st->cfg[gpu];
    uint64_t serial = ++st->mig[gpu].serial;
    mig_uuid(st, gpu, gi->id, id, serial, cfg->uuid, sizeof(cfg->uuid));
    /* nvmlDeviceGetName of a MIG device / the CUDA device name: "NVIDIA H200 MIG 3g.71gb" */
    char pname[61];
    snprintf(pname, sizeof(pname), "%s", st->cfg[gpu].name);
    snprintf(cfg->name, sizeof(cfg->name), "%s MIG %.30s", pname, cp.name);
    cfg->memory = gp->mem_mib << 20;
    cfg->reserved = 0;
    cfg->sm_count = cp.sm;
    cfg->mig_table = 0;
    cfg->mig_mode = 0;
    st->ds[unit].sim_time = fg_now();
    memset(slot, 0, sizeof(*slot));
    slot->id = id;
    slot->profile = ci_profile;
    slot->start = (uint32_t)chosen;
    slot->size = cp.slices;
    slot->unit = unit;
    slot->used = 1;
    st->unit[unit].gi = gi->id;
    st->unit[unit].ci = id;
    __atomic_store_n(&st->unit[unit].parent, gpu, __ATOMIC_RELEASE);
    *ci_id = id;
    return FG_MIG_OK;
}

int fg_mig_ci_destroy(struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_id)
{
    if (!fg_mig_table_of(st, gpu) || !fg_mig_enabled(st, gpu))
        return FG_MIG_NOT_SUPPORTED;
    struct fg_mig_ci *ci = fg_mig_ci_get(st, gpu, gi_id, ci_id);
    if (!ci)
        return FG_MIG_INVALID;
    fg_reap_in(st);
    if (unit_busy(st, ci->unit))
        return FG_MIG_IN_USE; /* nvml.h: "processes (e.g. CUDA application) are active" */
    int u = ci->unit;
    __atomic_store_n(&st->unit[u].parent, -1, __ATOMIC_RELEASE);
    unit_clear(st, u);
    memset(ci, 0, sizeof(*ci));
    return FG_MIG_OK;
}

int fg_mig_ci_remaining(const struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_profile, uint32_t *count)
{
    struct fg_mig_gi *gi = fg_mig_gi_get((struct fg_state *)st, gpu, gi_id);
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    if (!t || !gi)
        return FG_MIG_INVALID;
    struct fg_ci_profile cp;
    const struct fg_gi_profile *gp = fg_mig_gi_by_id(t, gi->profile_id);
    if (fg_mig_ci_profile(gp, ci_profile, &cp) != 0)
        return FG_MIG_NOT_SUPPORTED;
    uint32_t mask = 0, n = 0, have = 0, used = 0;
    for (int c = 0; c < FG_MIG_MAX_CI; c++)
        if (gi->ci[c].used) {
            mask |= ((1u << gi->ci[c].size) - 1) << gi->ci[c].start;
            used += gi->ci[c].size;
            have += gi->ci[c].profile == ci_profile;
        }
    for (uint32_t k = 0; k < cp.nplace; k++) {
        uint32_t want = ((1u << cp.slices) - 1) << cp.starts[k];
        if (have + n >= cp.count || used + cp.slices > gp->slices)
            break;
        if (!(mask & want)) {
            mask |= want;
            used += cp.slices;
            n++;
        }
    }
    *count = n;
    return FG_MIG_OK;
}

struct ord {
    uint32_t gi, ci;
    int unit;
};

static int ord_cmp(const void *a, const void *b)
{
    const struct ord *x = a, *y = b;
    if (x->gi != y->gi)
        return x->gi < y->gi ? -1 : 1;
    return x->ci < y->ci ? -1 : x->ci > y->ci;
}

int fg_mig_units(const struct fg_state *st, int gpu, int out[FG_MAX_DEV])
{
    struct ord o[FG_MAX_DEV];
    int n = 0;
    for (int u = (int)st->h.ndev; u < FG_MAX_DEV; u++)
        if (__atomic_load_n(&st->unit[u].parent, __ATOMIC_ACQUIRE) == gpu)
            o[n++] = (struct ord){st->unit[u].gi, st->unit[u].ci, u};
    qsort(o, (size_t)n, sizeof(o[0]), ord_cmp);
    for (int i = 0; i < n; i++)
        out[i] = o[i].unit;
    return n;
}
