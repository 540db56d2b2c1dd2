/*
 * vlimits.c — the limits file parser.  The file is trusted (written by the
 * hook from the allocation record, mounted read-only), but it is still parsed
 * strictly: anything unexpected is an error, and an error is fatal for the
 * process (fail closed), never "run unlimited".
 *
 * Version 2 (written by every current writer):
 *     <uuid> <memory_limit> <core_percent> <oversubscribe 0|1> <device_limit>
 * device_limit is the physical share: what may be resident on the device.
 * It is at most memory_limit, and equal to it without oversubscription.
 * Version 1 (four fields) is still read when no line oversubscribes: the
 * physical share is then the limit itself, exactly what version 1 meant.  A
 * version-1 line with oversubscription does not say how much of the slice
 * may be device-resident, and guessing could take VRAM neighbours were
 * promised, so it is an error (fail closed).
 */
#include "vlimits.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sysio.h"

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

/* split a line into at most `max` fields; returns the count (max+1 if more) */
static int split(char *line, char **f, int max)
{
    int n = 0;
    char *p = line;
    for (;;) {
        while (*p && is_space(*p))
            p++;
        if (!*p)
            return n;
        if (n == max)
            return max + 1;
        f[n++] = p;
        while (*p && !is_space(*p))
            p++;
        if (*p)
            *p++ = '\0';
    }
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    if (!*s || strlen(s) > 20)
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        unsigned d = (unsigned)(*s - '0');
        if (v > (max - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

static int valid_uuid(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n >= VGPU_UUID_LEN)
        return 0;
    for (; *s; s++) {
        char c = *s;
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-'))
            return 0;
    }
    return 1;
}

int vgpu_limits_parse(const char *buf, size_t len, struct vgpu_limits *out, char *err, size_t errlen)
{
    char text[VGPU_LIMITS_MAX_BYTES + 1];
    memset(out, 0, sizeof *out);
    if (len > VGPU_LIMITS_MAX_BYTES) {
        snprintf(err, errlen, "file larger than %d bytes", VGPU_LIMITS_MAX_BYTES);
        return -1;
    }
    if (memchr(buf, '\0', len)) {
        snprintf(err, errlen, "NUL byte in file");
        return -1;
    }
    memcpy(text, buf, len);
    text[len] = '\0';
    int seen_header = 0, lineno = 0, version = 0;
    char *save = NULL;
    char *line = text;
    while (line) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        lineno++;
        char *cur = line;
        line = nl ? nl + 1 : NULL;
        if (cur[0] == '#')
            continue;
        char *f[6];
        int n = split(cur, f, 5);
        if (n == 0)
            continue;
        if (!seen_header) {
            if (n != 2 || strcmp(f[0], "vgpu-limits") != 0) {
                snprintf(err, errlen, "line %d: missing 'vgpu-limits <version>' header", lineno);
                return -1;
            }
            if (strcmp(f[1], "1") != 0 && strcmp(f[1], "2") != 0) {
                snprintf(err, errlen, "line %d: unknown limits version '%.16s'", lineno, f[1]);
                return -1;
            }
            version = f[1][0] - '0';
            seen_header = 1;
            continue;
        }
        uint64_t mem, pct, devlim = 0;
        int want = version == 1 ? 4 : 5;
        if (n != want || !valid_uuid(f[0]) || parse_u64(f[1], UINT64_MAX, &mem) || parse_u64(f[2], 10000, &pct) ||
            (strcmp(f[3], "0") != 0 && strcmp(f[3], "1") != 0) ||
            (version == 2 && parse_u64(f[4], UINT64_MAX, &devlim))) {
            snprintf(err, errlen, "line %d: malformed device line (want '<uuid> <bytes> <percent> <0|1>%s')", lineno,
                     version == 1 ? "" : " <device bytes>");
            return -1;
        }
        int over = f[3][0] == '1';
        if (version == 1) {
            if (over) {
                snprintf(err, errlen,
                         "line %d: version 1 limits with oversubscription do not carry the physical share "
                         "(recreate the container: its writer predates 'vgpu-limits 2')",
                         lineno);
                return -1;
            }
            devlim = mem;
        } else if (devlim > mem || (!over && devlim != mem)) {
            snprintf(err, errlen,
                     "line %d: device bytes must be at most the limit, and equal to it without oversubscription",
                     lineno);
            return -1;
        }
        if (out->count >= VGPU_MAX_DEVICES) {
            snprintf(err, errlen, "line %d: more than %u devices", lineno, VGPU_MAX_DEVICES);
            return -1;
        }
        for (unsigned i = 0; i < out->count; i++) {
            if (strcasecmp(out->dev[i].uuid, f[0]) == 0) {
                snprintf(err, errlen, "line %d: duplicate device %.40s", lineno, f[0]);
                return -1;
            }
        }
        struct vgpu_limit *d = &out->dev[out->count++];
        snprintf(d->uuid, sizeof d->uuid, "%s", f[0]);
        d->memory_limit = mem;
        d->device_limit = devlim;
        d->core_percent = (uint32_t)pct;
        d->oversubscribe = over;
    }
    (void)save;
    if (!seen_header) {
        snprintf(err, errlen, "empty file (no 'vgpu-limits <version>' header)");
        return -1;
    }
    return 0;
}

int vgpu_limits_load(const char *path, struct vgpu_limits *out, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT)
            return 1;
        snprintf(err, errlen, "cannot open: %s", strerror(errno));
        return -1;
    }
    struct stat st;
    if (vgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(err, errlen, "not a regular file");
        return -1;
    }
    char buf[VGPU_LIMITS_MAX_BYTES + 1];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, sizeof buf - len);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            close(fd);
            snprintf(err, errlen, "cannot read: %s", strerror(e));
            return -1;
        }
        if (r == 0)
            break;
        len += (size_t)r;
        if (len == sizeof buf)
            break;
    }
    close(fd);
    return vgpu_limits_parse(buf, len, out, err, errlen);
}
