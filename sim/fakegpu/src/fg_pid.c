/* fakegpu: process identity across pid namespaces.
 *
 * A process records (pid in its own namespace, inode of its pid namespace, start time).  NVML
 * reports the pid as the caller sees it: the recorded pid when both share a namespace, otherwise
 * the /proc entry of the caller's namespace whose NSpid ends with the recorded pid and whose pid
 * namespace and start time match (the real driver reports host pids the same way, being outside
 * every namespace).  A resolver in the initial pid namespace caches the host pid in the slot, so
 * callers inside containers see host pids as with the real driver.
 */
#include "fg_state.h"

#include <ctype.h>
#include <pthread.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static uint64_t g_self_ns;
static void cache_reset(void);

void fg_pid_cache_reset(void)
{
    g_self_ns = 0;
    cache_reset();
}

uint64_t fg_self_pidns(void)
{
    if (!g_self_ns) {
        struct stat sb;
        if (stat("/proc/self/ns/pid", &sb) == 0)
            g_self_ns = (uint64_t)sb.st_ino;
    }
    return g_self_ns;
}

uint64_t fg_proc_start_time(int pid)
{
    char path[64], buf[1024];
    if (pid > 0)
        snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    else
        snprintf(path, sizeof(path), "/proc/self/stat");
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
    if (!p)
        return 0;
    p++;
    /* after ')': field 3 (state) ... field 22 (starttime) */
    for (int field = 3; field < 22; field++) {
        p = strchr(p + 1, ' ');
        if (!p)
            return 0;
    }
    return strtoull(p + 1, NULL, 10);
}

static uint64_t ns_of(int pid)
{
    char path[64];
    struct stat sb;
    snprintf(path, sizeof(path), "/proc/%d/ns/pid", pid);
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

/* Last NSpid entry of /proc/<pid>/status and the number of entries. */
static int innermost_pid(int pid, int *levels)
{
    char path[64], line[512];
    snprintf(path, sizeof(path), "/proc/%d/status", pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    int last = 0;
    *levels = 0;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "NSpid:", 6) != 0)
            continue;
        char *p = line + 6, *end;
        for (;;) {
            long v = strtol(p, &end, 10);
            if (end == p)
                break;
            last = (int)v;
            (*levels)++;
            p = end;
        }
        break;
    }
    fclose(f);
    return last;
}

/* Per-slot cache of a resolution, keyed by the process's identity (pid namespace, pid in it,
 * start time): a slot is only asked about while its process lives (readers filter dead slots),
 * and a live process keeps its host pid, so a hit needs no /proc access at all.  A failed
 * resolution (the process is in no namespace visible from here) is retried at most every
 * FG_PID_RETRY_NS instead of scanning /proc on every call. */
#define FG_PID_RETRY_NS 1000000000ULL
static struct {
    uint64_t pidns, start_time, retry_at;
    int32_t nspid;
    int pid; /* 0: not found (retry after retry_at) */
} g_cache[FG_MAX_SLOTS];
static pthread_mutex_t g_cache_mu = PTHREAD_MUTEX_INITIALIZER;

static int resolve(const struct fg_slot *sl)
{
    int found = 0;
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!isdigit((unsigned char)de->d_name[0]))
            continue;
        int pid = atoi(de->d_name), levels = 0;
        if (innermost_pid(pid, &levels) != sl->pid || levels < 2)
            continue;
        if (ns_of(pid) != sl->pidns || fg_proc_start_time(pid) != sl->start_time)
            continue;
        found = pid;
        break;
    }
    closedir(d);
    return found;
}

int fg_visible_pid(struct fg_state *st, int slot)
{
    struct fg_slot *sl = &st->slots[slot];
    uint64_t self = fg_self_pidns();
    uint64_t pidns = sl->pidns, start = sl->start_time, gen = sl->generation;
    int32_t nspid = sl->pid;
    if (pidns == self)
        return nspid;
    pthread_mutex_lock(&g_cache_mu);
    int hit = g_cache[slot].pidns == pidns && g_cache[slot].nspid == nspid && g_cache[slot].start_time == start;
    int pid = g_cache[slot].pid;
    uint64_t retry_at = g_cache[slot].retry_at;
    pthread_mutex_unlock(&g_cache_mu);
    if (!hit || (pid == 0 && fg_now() >= retry_at)) {
        pid = resolve(sl);
        pthread_mutex_lock(&g_cache_mu);
        g_cache[slot].pidns = pidns;
        g_cache[slot].nspid = nspid;
        g_cache[slot].start_time = start;
        g_cache[slot].pid = pid;
        g_cache[slot].retry_at = fg_now() + FG_PID_RETRY_NS;
        pthread_mutex_unlock(&g_cache_mu);
    }
    if (pid > 0) {
        /* Readers write this without the state lock: only into the registration they resolved
         * (same generation) and only once (0 -> pid). */
        int32_t zero = 0;
        if (self == FG_PIDNS_INIT && __atomic_load_n(&sl->host_pid, __ATOMIC_RELAXED) == 0 &&
            __atomic_load_n(&sl->generation, __ATOMIC_ACQUIRE) == gen)
            __atomic_compare_exchange_n(&sl->host_pid, &zero, (int32_t)pid, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        return pid;
    }
    /* Not visible from here (the caller is in another container): report the host pid when a
     * host-side caller has resolved it, as the real driver does. */
    return __atomic_load_n(&sl->host_pid, __ATOMIC_RELAXED);
}

static void cache_reset(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_cache_mu = fresh;
    memset(g_cache, 0, sizeof(g_cache));
}
