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
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static uint64_t g_self_ns;

void fg_pid_cache_reset(void)
{
    g_self_ns = 0;
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

/* Per-slot cache of a resolution: valid while the slot's generation is the same and the
 * resolved process still has the recorded start time. */
static struct {
    uint64_t generation;
    int pid;
} g_cache[FG_MAX_SLOTS];

int fg_visible_pid(struct fg_state *st, int slot)
{
    struct fg_slot *sl = &st->slots[slot];
    uint64_t self = fg_self_pidns();
    if (sl->pidns == self)
        return sl->pid;
    if (g_cache[slot].generation == sl->generation && g_cache[slot].pid > 0 &&
        fg_proc_start_time(g_cache[slot].pid) == sl->start_time)
        return g_cache[slot].pid;
    int found = 0;
    DIR *d = opendir("/proc");
    if (d) {
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
    }
    if (found) {
        g_cache[slot].generation = sl->generation;
        g_cache[slot].pid = found;
        if (self == FG_PIDNS_INIT)
            sl->host_pid = found;
        return found;
    }
    /* Not visible from here (the caller is in another container): report the host pid when a
     * host-side caller has resolved it, as the real driver does. */
    return sl->host_pid;
}
