/* fakegpu-ctl: create, inspect and disturb the simulated node.
 *
 *   fakegpu-ctl init [--force]      create the state from FAKEGPU_CONFIG (--force: recreate)
 *   fakegpu-ctl dump                the state as one JSON object
 *   fakegpu-ctl xid INDEX XID [GI CI]  inject an XID event on device INDEX (attributed to a MIG instance)
 *   fakegpu-ctl lost INDEX [0|1]    mark device INDEX lost (injects XID 79) or back
 *   fakegpu-ctl hold-lock SECONDS   take the state lock, print "locked", sleep (tests)
 *   fakegpu-ctl lock-wait           wait for the state lock, print CLOCK_MONOTONIC ns when taken
 *   fakegpu-ctl mig-mode INDEX 0|1  set the MIG mode (nvidia-smi -i INDEX -mig 0|1)
 *   fakegpu-ctl mig-create INDEX PROFILE[,PROFILE...] [START]
 *                                   GPU instances with their full compute instance (nvidia-smi mig
 *                                   -cgi PROFILE -C); PROFILE: name (3g.71gb) or ID (9); START: placement
 *   fakegpu-ctl mig-destroy INDEX GI|all   compute instances, then the GPU instance (-dci, -dgi)
 *   fakegpu-ctl high [--reset] [--watch BYTES]
 *                                   the devices' memory high-water marks (JSON); --reset: then
 *                                   restart them from the current usage; --watch: a new high
 *                                   above BYTES is recorded only after dead processes are reaped
 */
#include "fg_state.h"
#include "fg_mig.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(void)
{
    fputs("usage: fakegpu-ctl init [--force] | dump | xid INDEX XID [GI CI] | lost INDEX [0|1] | hold-lock SECONDS | "
          "lock-wait | high [--reset] [--watch BYTES] | mig-mode INDEX 0|1 | "
          "mig-create INDEX PROFILE[,PROFILE...] [START] | mig-destroy INDEX GI|all\n",
          stderr);
    exit(2);
}

static long num(const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 0);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "fakegpu-ctl: invalid number `%s`\n", s);
        exit(2);
    }
    return v;
}

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void dump(void)
{
    int locked;
    struct fg_state *st = fg_read_begin(&locked);
    fg_reap_in(st);
    uint64_t now = fg_now();
    fg_sim_advance_all(st, now);
    printf("{\"version\":%u,\"snapshot\":%s,\"now_ns\":%llu,\"queue_depth\":%u,\"timeslice_ns\":%llu,\"period_ns\":%llu,", st->h.version,
           locked ? "false" : "true", (unsigned long long)now, st->h.queue_depth, (unsigned long long)st->h.timeslice_ns,
           (unsigned long long)st->h.period_ns);
    printf("\"devices\":[");
    for (unsigned d = 0; d < st->h.ndev; d++) {
        const struct fg_devcfg *c = &st->cfg[d];
        printf("%s{\"index\":%u,\"uuid\":", d ? "," : "", d);
        json_str(c->uuid);
        printf(",\"name\":");
        json_str(c->name);
        printf(",\"pci_bus_id\":");
        json_str(c->pci_bus_id);
        printf(",\"memory\":%llu,\"used\":%llu,\"context_overhead\":%llu,\"numa_node\":%d,\"lost\":%s,"
               "\"busy_ns\":%llu,\"xid_count\":%llu,\"minor_number\":%u,\"used_high\":%llu,\"alloc_high\":%llu}",
               (unsigned long long)c->memory, (unsigned long long)fg_dev_used(st, (int)d),
               (unsigned long long)c->context_overhead, c->numa_node, st->ds[d].lost ? "true" : "false",
               (unsigned long long)st->ds[d].busy_ns, (unsigned long long)st->ds[d].xid_seq, c->minor_number,
               (unsigned long long)st->ds[d].used_high, (unsigned long long)st->ds[d].alloc_high);
    }
    printf("],\"mig\":[");
    for (unsigned d = 0; d < st->h.ndev; d++) {
        const struct fg_mig_table *t = fg_mig_table_of(st, (int)d);
        printf("%s{\"index\":%u,\"profiles\":", d ? "," : "", d);
        if (t)
            json_str(t->key);
        else
            printf("null");
        printf(",\"mode\":%u,\"pending\":%u,\"gpu_instances\":[", st->mig[d].mode, st->mig[d].pending);
        int gfirst = 1;
        for (int g = 0; g < FG_MIG_MAX_GI; g++) {
            const struct fg_mig_gi *gi = &st->mig[d].gi[g];
            if (!gi->used)
                continue;
            const struct fg_gi_profile *p = fg_mig_gi_by_id(t, gi->profile_id);
            printf("%s{\"id\":%u,\"profile_id\":%u,\"profile\":", gfirst ? "" : ",", gi->id, gi->profile_id);
            json_str(p ? p->name : "");
            printf(",\"start\":%u,\"size\":%u,\"memory\":%llu,\"compute_instances\":[", gi->start, gi->size,
                   (unsigned long long)(p ? p->mem_mib << 20 : 0));
            gfirst = 0;
            int cfirst = 1;
            for (int c = 0; c < FG_MIG_MAX_CI; c++) {
                const struct fg_mig_ci *ci = &gi->ci[c];
                if (!ci->used)
                    continue;
                const struct fg_devcfg *u = &st->cfg[ci->unit];
                printf("%s{\"id\":%u,\"profile\":%u,\"start\":%u,\"size\":%u,\"unit\":%d,\"uuid\":", cfirst ? "" : ",",
                       ci->id, ci->profile, ci->start, ci->size, ci->unit);
                json_str(u->uuid);
                printf(",\"name\":");
                json_str(u->name);
                printf(",\"sm_count\":%u,\"used\":%llu,\"busy_ns\":%llu}", u->sm_count,
                       (unsigned long long)fg_dev_used(st, ci->unit), (unsigned long long)st->ds[ci->unit].busy_ns);
                cfirst = 0;
            }
            printf("]}");
        }
        printf("]}");
    }
    printf("],\"processes\":[");
    int first = 1;
    for (int s = 0; s < FG_MAX_SLOTS; s++) {
        const struct fg_slot *sl = &st->slots[s];
        if (sl->state != FG_SLOT_LIVE)
            continue;
        printf("%s{\"slot\":%d,\"pid\":%d,\"host_pid\":%d,\"pidns\":%llu,\"start_time\":%llu,\"comm\":", first ? "" : ",",
               s, sl->pid, fg_visible_pid(st, s), (unsigned long long)sl->pidns, (unsigned long long)sl->start_time);
        json_str(sl->comm);
        printf(",\"devices\":[");
        first = 0;
        int dfirst = 1;
        for (unsigned d = 0; d < FG_MAX_DEV; d++) {
            if (!fg_unit_live(st, (int)d))
                continue;
            const struct fg_pdev *p = &sl->dev[d];
            if (!p->contexts && !p->mem_device && !p->mem_managed_dev && !p->mem_managed_host && !p->exec_ns &&
                !p->launched)
                continue;
            printf("%s{\"index\":%u,\"uuid\":", dfirst ? "" : ",", d);
            json_str(st->cfg[d].uuid);
            printf(",\"used\":%llu,\"allocated\":%llu,\"managed_device\":%llu,\"managed_host\":%llu,\"contexts\":%u,"
                   "\"exec_ns\":%llu,\"launched\":%llu,\"completed\":%llu,\"queued\":%u}",
                   (unsigned long long)fg_pdev_used(st, s, (int)d), (unsigned long long)p->mem_device,
                   (unsigned long long)p->mem_managed_dev, (unsigned long long)p->mem_managed_host, p->contexts,
                   (unsigned long long)p->exec_ns, (unsigned long long)p->launched,
                   (unsigned long long)p->completed, fg_sim_pending(st, s, (int)d, -1));
            dfirst = 0;
        }
        printf("]}");
    }
    printf("],\"shared\":[");
    first = 1;
    for (int i = 0; i < FG_MAX_SHARED; i++) {
        const struct fg_shared *e = &st->shared[i];
        if (e->state != FG_SHARED_LIVE)
            continue;
        printf("%s{\"index\":%d,\"kind\":%u,\"device\":%d,\"bytes\":%llu,\"charged_slot\":%d,\"holders\":[", first ? "" : ",", i,
               e->kind, e->dev, (unsigned long long)e->bytes, e->charged_slot);
        first = 0;
        int hfirst = 1;
        for (int s = 0; s < FG_MAX_SLOTS; s++)
            if (fg_mask_has(e->holders, s)) {
                printf("%s%d", hfirst ? "" : ",", s);
                hfirst = 0;
            }
        printf("]}");
    }
    printf("]}\n");
    fg_read_end(locked);
}

static const char *mig_error(int rc)
{
    switch (rc) {
    case FG_MIG_INVALID: return "Invalid Argument";
    case FG_MIG_NOT_SUPPORTED: return "Not Supported";
    case FG_MIG_IN_USE: return "In use by another client";
    case FG_MIG_NO_RESOURCES: return "Insufficient Resources";
    default: return "Unknown Error";
    }
}

static int mig_mode(struct fg_state *st, int d, unsigned mode)
{
    int act = 0;
    fg_lock();
    int rc = fg_mig_set_mode(st, d, mode, &act);
    fg_unlock();
    if (rc) {
        fprintf(stderr, "fakegpu-ctl: unable to set MIG mode of GPU %d: %s\n", d, mig_error(rc));
        return 1;
    }
    if (act)
        printf("pending: %s\n", mig_error(act));
    return 0;
}

static int mig_create(struct fg_state *st, int d, const char *list, const char *start_s)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", list);
    uint32_t start = start_s ? (uint32_t)num(start_s, 0, 7) : 0;
    int rc = 0;
    fg_lock();
    const struct fg_mig_table *t = fg_mig_table_of(st, d);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && rc == 0; tok = strtok_r(NULL, ",", &save)) {
        const struct fg_gi_profile *p = NULL;
        for (uint32_t i = 0; t && i < t->nprof && !p; i++) {
            char id[16];
            snprintf(id, sizeof(id), "%u", t->p[i].id);
            if (!strcmp(tok, t->p[i].name) || !strcmp(tok, id))
                p = &t->p[i];
        }
        if (!p) {
            fprintf(stderr, "fakegpu-ctl: GPU %d has no MIG profile `%s`\n", d, tok);
            rc = FG_MIG_INVALID;
            break;
        }
        uint32_t gi_id, ci_id;
        rc = fg_mig_gi_create(st, d, p->id, start_s ? &start : NULL, &gi_id);
        if (rc == 0) {
            struct fg_ci_profile cp;
            uint32_t ci_index = 0;
            for (uint32_t k = 0; k < FG_MIG_CI_PROFILE_COUNT; k++)
                if (fg_mig_ci_profile(p, k, &cp) == 0 && cp.slices == p->slices)
                    ci_index = k;
            rc = fg_mig_ci_create(st, d, gi_id, ci_index, NULL, &ci_id);
            if (rc) {
                fg_mig_gi_destroy(st, d, gi_id);
            } else {
                const struct fg_mig_ci *ci = fg_mig_ci_get(st, d, gi_id, ci_id);
                printf("{\"gpu\":%d,\"gi\":%u,\"ci\":%u,\"profile\":", d, gi_id, ci_id);
                json_str(p->name);
                printf(",\"unit\":%d,\"uuid\":", ci->unit);
                json_str(st->cfg[ci->unit].uuid);
                printf(",\"start\":%u,\"size\":%u}\n", fg_mig_gi_get(st, d, gi_id)->start, p->mem_slices);
            }
        }
        if (rc)
            fprintf(stderr, "fakegpu-ctl: unable to create a GPU instance on GPU %d using profile %s: %s\n", d, tok,
                    mig_error(rc));
    }
    fg_unlock();
    return rc ? 1 : 0;
}

static int mig_destroy(struct fg_state *st, int d, const char *which)
{
    int all = !strcmp(which, "all");
    uint32_t want = all ? 0 : (uint32_t)num(which, 0, 14);
    int rc = 0, found = 0;
    fg_lock();
    for (int g = 0; g < FG_MIG_MAX_GI && rc == 0; g++) {
        struct fg_mig_gi *gi = &st->mig[d].gi[g];
        if (!gi->used || (!all && gi->id != want))
            continue;
        found = 1;
        uint32_t id = gi->id;
        for (int c = 0; c < FG_MIG_MAX_CI && rc == 0; c++)
            if (gi->ci[c].used)
                rc = fg_mig_ci_destroy(st, d, id, gi->ci[c].id);
        if (rc == 0)
            rc = fg_mig_gi_destroy(st, d, id);
        if (rc)
            fprintf(stderr, "fakegpu-ctl: unable to destroy GPU instance %u on GPU %d: %s\n", id, d, mig_error(rc));
    }
    fg_unlock();
    if (!found && !all) {
        fprintf(stderr, "fakegpu-ctl: GPU %d has no GPU instance %u\n", d, want);
        return 1;
    }
    return rc ? 1 : 0;
}

static void high(int reset, long long watch)
{
    struct fg_state *st = fg_g.st;
    fg_lock();
    fg_reap();
    printf("{\"devices\":[");
    for (unsigned d = 0; d < st->h.ndev; d++) {
        struct fg_devstate *ds = &st->ds[d];
        printf("%s{\"index\":%u,\"used\":%llu,\"used_high\":%llu,\"alloc_high\":%llu}", d ? "," : "", d,
               (unsigned long long)fg_dev_used(st, (int)d), (unsigned long long)ds->used_high,
               (unsigned long long)ds->alloc_high);
        if (watch >= 0)
            ds->high_watch = (uint64_t)watch;
        if (reset) {
            ds->used_high = ds->alloc_high = 0;
            fg_note_high(st, (int)d);
        }
    }
    printf("]}\n");
    /* the running totals must be what the processes add up to */
    int bad = 0;
    for (unsigned d = 0; d < st->h.ndev; d++)
        if (fg_dev_used_scan(st, (int)d) != fg_dev_used(st, (int)d)) {
            fprintf(stderr, "fakegpu-ctl: device %u: running total %llu, processes %llu\n", d,
                    (unsigned long long)fg_dev_used(st, (int)d), (unsigned long long)fg_dev_used_scan(st, (int)d));
            bad = 1;
        }
    fg_unlock();
    if (bad)
        exit(3);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        usage();
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage();
    }
    if (fg_open(0) != 0)
        return 1;
    struct fg_state *st = fg_g.st;
    if (!strcmp(cmd, "init")) {
        if (argc == 3 && !strcmp(argv[2], "--force"))
            return fg_reset() == 0 ? 0 : 1;
        return argc == 2 ? 0 : (usage(), 2);
    }
    if (!strcmp(cmd, "dump") && argc == 2) {
        dump();
        return 0;
    }
    if (!strcmp(cmd, "xid") && (argc == 4 || argc == 6)) {
        int d = (int)num(argv[2], 0, (long)st->h.ndev - 1);
        long xid = num(argv[3], 0, 0x7fffffff);
        uint32_t gi = argc == 6 ? (uint32_t)num(argv[4], 0, 14) : FG_NO_INSTANCE;
        uint32_t ci = argc == 6 ? (uint32_t)num(argv[5], 0, 7) : FG_NO_INSTANCE;
        fg_lock();
        struct fg_devstate *ds = &st->ds[d];
        uint64_t seq = ++ds->xid_seq;
        ds->xids[seq % FG_XID_RING] = (struct fg_xid){seq, (uint64_t)xid, fg_now(), gi, ci};
        fg_unlock();
        return 0;
    }
    if (!strcmp(cmd, "mig-mode") && argc == 4)
        return mig_mode(st, (int)num(argv[2], 0, (long)st->h.ndev - 1), (unsigned)num(argv[3], 0, 1));
    if (!strcmp(cmd, "mig-create") && (argc == 4 || argc == 5))
        return mig_create(st, (int)num(argv[2], 0, (long)st->h.ndev - 1), argv[3], argc == 5 ? argv[4] : NULL);
    if (!strcmp(cmd, "mig-destroy") && argc == 4)
        return mig_destroy(st, (int)num(argv[2], 0, (long)st->h.ndev - 1), argv[3]);
    if (!strcmp(cmd, "lost") && (argc == 3 || argc == 4)) {
        int d = (int)num(argv[2], 0, (long)st->h.ndev - 1);
        int lost = argc == 4 ? (int)num(argv[3], 0, 1) : 1;
        fg_lock();
        struct fg_devstate *ds = &st->ds[d];
        if (lost && !ds->lost) {
            uint64_t seq = ++ds->xid_seq; /* Xid 79: GPU has fallen off the bus */
            ds->xids[seq % FG_XID_RING] = (struct fg_xid){seq, 79, fg_now(), FG_NO_INSTANCE, FG_NO_INSTANCE};
        }
        ds->lost = (uint32_t)lost;
        fg_unlock();
        return 0;
    }
    if (!strcmp(cmd, "hold-lock") && argc == 3) {
        long secs = num(argv[2], 0, 86400);
        fg_lock();
        printf("locked\n");
        fflush(stdout);
        sleep((unsigned)secs);
        fg_unlock();
        return 0;
    }
    if (!strcmp(cmd, "high")) {
        int reset = 0;
        long long watch = -1;
        for (int i = 2; i < argc; i++) {
            if (!strcmp(argv[i], "--reset"))
                reset = 1;
            else if (!strcmp(argv[i], "--watch") && i + 1 < argc)
                watch = num(argv[++i], 0, 0x7fffffffffffffffL);
            else
                usage();
        }
        high(reset, watch);
        return 0;
    }
    if (!strcmp(cmd, "lock-wait") && argc == 2) {
        printf("waiting\n");
        fflush(stdout);
        fg_lock();
        uint64_t t = fg_now();
        fg_unlock();
        printf("%llu\n", (unsigned long long)t);
        return 0;
    }
    usage();
    return 2;
}
