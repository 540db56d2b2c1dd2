/* fakegpu-ctl: create, inspect and disturb the simulated node.
 *
 *   fakegpu-ctl init [--force]      create the state from FAKEGPU_CONFIG (--force: recreate)
 *   fakegpu-ctl dump                the state as one JSON object
 *   fakegpu-ctl xid INDEX XID       inject an XID event on device INDEX
 *   fakegpu-ctl lost INDEX [0|1]    mark device INDEX lost (injects XID 79) or back
 *   fakegpu-ctl hold-lock SECONDS   take the state lock, print "locked", sleep (tests)
 *   fakegpu-ctl lock-wait           wait for the state lock, print CLOCK_MONOTONIC ns when taken
 *   fakegpu-ctl high [--reset] [--watch BYTES]
 *                                   the devices' memory high-water marks (JSON); --reset: then
 *                                   restart them from the current usage; --watch: a new high
 *                                   above BYTES is recorded only after dead processes are reaped
 */
#include "fg_state.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(void)
{
    fputs("usage: fakegpu-ctl init [--force] | dump | xid INDEX XID | lost INDEX [0|1] | hold-lock SECONDS | "
          "lock-wait | high [--reset] [--watch BYTES]\n",
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
               "\"busy_ns\":%llu,\"xid_count\":%llu,\"used_high\":%llu,\"alloc_high\":%llu}",
               (unsigned long long)c->memory, (unsigned long long)fg_dev_used(st, (int)d),
               (unsigned long long)c->context_overhead, c->numa_node, st->ds[d].lost ? "true" : "false",
               (unsigned long long)st->ds[d].busy_ns, (unsigned long long)st->ds[d].xid_seq,
               (unsigned long long)st->ds[d].used_high, (unsigned long long)st->ds[d].alloc_high);
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
        for (unsigned d = 0; d < st->h.ndev; d++) {
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
    if (!strcmp(cmd, "xid") && argc == 4) {
        int d = (int)num(argv[2], 0, (long)st->h.ndev - 1);
        long xid = num(argv[3], 0, 0x7fffffff);
        fg_lock();
        struct fg_devstate *ds = &st->ds[d];
        uint64_t seq = ++ds->xid_seq;
        ds->xids[seq % FG_XID_RING] = (struct fg_xid){seq, (uint64_t)xid, fg_now()};
        fg_unlock();
        return 0;
    }
    if (!strcmp(cmd, "lost") && (argc == 3 || argc == 4)) {
        int d = (int)num(argv[2], 0, (long)st->h.ndev - 1);
        int lost = argc == 4 ? (int)num(argv[3], 0, 1) : 1;
        fg_lock();
        struct fg_devstate *ds = &st->ds[d];
        if (lost && !ds->lost) {
            uint64_t seq = ++ds->xid_seq; /* Xid 79: GPU has fallen off the bus */
            ds->xids[seq % FG_XID_RING] = (struct fg_xid){seq, 79, fg_now()};
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
