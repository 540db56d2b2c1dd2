/* fakegpu: the device configuration file (FAKEGPU_CONFIG).
 *
 * Format (see docs/developers/simulators.md): "key = value" lines; '#' starts a comment; keys before the first
 * "[device]" line are node-wide, each "[device]" starts a new device whose keys default to the
 * built-in device of that index.  No [device] section: the two default devices.
 */
#include "fg_state.h"
#include "fg_mig.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void default_device(struct fg_devcfg *d, unsigned i)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->uuid, sizeof(d->uuid), "GPU-fa6e0000-0000-4000-8000-%012x", 0x100u + i);
    snprintf(d->name, sizeof(d->name), "NVIDIA Fake GPU");
    snprintf(d->pci_bus_id, sizeof(d->pci_bus_id), "00000000:%02X:00.0", 0x10u + i);
    d->memory = 16ULL << 30;
    d->context_overhead = 300ULL << 20;
    d->reserved = 0;
    d->numa_node = 0;
    d->pci_device_id = 0x233010deu;
    d->sm_count = 132;
    d->cc_major = 9;
    d->cc_minor = 0;
    d->minor_number = i;
    /* An H200: HBM3e at 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet, "GPU Memory Bandwidth
     * 4.8TB/s"), host memory over PCIe Gen5 x16 at 64 GB/s per direction (the datasheet's
     * "PCIe Gen5: 128GB/s" both ways; PCI-SIG PCIe 5.0: 32 GT/s per lane, 16 lanes). */
    d->memory_bandwidth = 4800000000000ULL;
    d->host_link_bandwidth = 64000000000ULL;
}

void fg_config_defaults(struct fg_config *c)
{
    memset(c, 0, sizeof(*c));
    c->ndev = 2;
    c->queue_depth = 1000;
    c->timeslice_ns = 2000000;    /* 2 ms */
    c->period_ns = 100000000;     /* 100 ms */
    c->util_window_ns = 1000000000; /* 1 s */
    snprintf(c->driver_version, sizeof(c->driver_version), "580.65.06");
    c->cuda_version = 13000;
    for (unsigned i = 0; i < FG_MAX_GPU; i++)
        default_device(&c->dev[i], i);
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

static int parse_u64(const char *v, uint64_t *out)
{
    char *end;
    errno = 0;
    if (*v == '-' || *v == '\0')
        return -1;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || *end != '\0')
        return -1;
    *out = x;
    return 0;
}

static int parse_i64(const char *v, int64_t *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 0);
    if (errno || *end != '\0' || *v == '\0')
        return -1;
    *out = x;
    return 0;
}

int fg_parse_busid(const char *s, unsigned *domain, unsigned *bus, unsigned *dev, unsigned *fn)
{
    unsigned a, b, c, d;
    int n = 0;
    if (sscanf(s, "%x:%x:%x.%x%n", &a, &b, &c, &d, &n) == 4 && s[n] == '\0') {
        *domain = a, *bus = b, *dev = c, *fn = d;
        return 0;
    }
    n = 0;
    if (sscanf(s, "%x:%x.%x%n", &b, &c, &d, &n) == 3 && s[n] == '\0') {
        *domain = 0, *bus = b, *dev = c, *fn = d;
        return 0;
    }
    return -1;
}

int fg_uuid_bytes(const char *uuid, unsigned char out[16])
{
    const char *p = uuid;
    if (strncmp(p, "GPU-", 4) == 0 || strncmp(p, "MIG-", 4) == 0)
        p += 4;
    unsigned n = 0;
    for (; *p && n < 32; p++) {
        if (*p == '-')
            continue;
        if (!isxdigit((unsigned char)*p))
            return -1;
        int v = isdigit((unsigned char)*p) ? *p - '0' : (tolower((unsigned char)*p) - 'a' + 10);
        if (n % 2 == 0)
            out[n / 2] = (unsigned char)(v << 4);
        else
            out[n / 2] |= (unsigned char)v;
        n++;
    }
    return (n == 32 && *p == '\0') ? 0 : -1;
}

static int set_str(char *dst, size_t len, const char *v)
{
    if (strlen(v) >= len)
        return -1;
    snprintf(dst, len, "%s", v);
    return 0;
}

static int known(const char *k, const char *const *keys)
{
    for (; *keys; keys++)
        if (!strcmp(k, *keys))
            return 1;
    return 0;
}

static const char *const DEVICE_KEYS[] = {"uuid", "name", "pci_bus_id", "numa_node", "memory", "context_overhead",
                                          "reserved", "pci_device_id", "sm_count", "cc_major", "cc_minor",
                                          "minor_number", "memory_bandwidth", "host_link_bandwidth", "mig_profiles",
                                          "mig_mode", NULL};
static const char *const NODE_KEYS[] = {"driver_version", "queue_depth", "timeslice_us", "sample_period_ms",
                                        "util_window_ms", "cuda_version", "gpus", NULL};

static int device_key(struct fg_devcfg *d, const char *k, const char *v)
{
    if (!known(k, DEVICE_KEYS))
        return -2;
    uint64_t u;
    int64_t i;
    unsigned a, b, c, e;
    unsigned char ub[16];
    if (!strcmp(k, "uuid"))
        return (fg_uuid_bytes(v, ub) == 0 && !strncmp(v, "GPU-", 4)) ? set_str(d->uuid, sizeof(d->uuid), v) : -1;
    if (!strcmp(k, "name"))
        return set_str(d->name, sizeof(d->name), v);
    if (!strcmp(k, "pci_bus_id")) {
        if (fg_parse_busid(v, &a, &b, &c, &e) != 0 || b > 0xff || c > 0x1f || e > 7)
            return -1;
        snprintf(d->pci_bus_id, sizeof(d->pci_bus_id), "%08X:%02X:%02X.%X", a, b, c, e);
        return 0;
    }
    if (!strcmp(k, "mig_profiles")) { /* the product's MIG profile table (fg_mig.c); none: not MIG-capable */
        int t = fg_mig_table_key(v);
        return t < 0 ? -1 : (d->mig_table = t == 0 ? FG_MIG_INCAPABLE : (uint32_t)t, 0);
    }
    if (!strcmp(k, "numa_node"))
        return (parse_i64(v, &i) == 0 && i >= -1 && i < 1024) ? (d->numa_node = (int32_t)i, 0) : -1;
    if (parse_u64(v, &u) != 0)
        return -1;
    if (!strcmp(k, "memory"))
        return u >= (1ULL << 20) ? (d->memory = u, 0) : -1;
    if (!strcmp(k, "context_overhead"))
        return (d->context_overhead = u, 0);
    if (!strcmp(k, "reserved"))
        return (d->reserved = u, 0);
    if (!strcmp(k, "memory_bandwidth"))
        return u > 0 ? (d->memory_bandwidth = u, 0) : -1;
    if (!strcmp(k, "host_link_bandwidth"))
        return u > 0 ? (d->host_link_bandwidth = u, 0) : -1;
    if (u > 0xffffffffULL)
        return -1;
    if (!strcmp(k, "pci_device_id"))
        return (d->pci_device_id = (uint32_t)u, 0);
    if (!strcmp(k, "sm_count"))
        return (d->sm_count = (uint32_t)u, 0);
    if (!strcmp(k, "cc_major"))
        return (d->cc_major = (uint32_t)u, 0);
    if (!strcmp(k, "cc_minor"))
        return (d->cc_minor = (uint32_t)u, 0);
    if (!strcmp(k, "minor_number"))
        return (d->minor_number = (uint32_t)u, 0);
    if (!strcmp(k, "mig_mode"))
        return u <= 1 ? (d->mig_mode = (uint32_t)u, 0) : -1;
    return -2;
}

static int global_key(struct fg_config *c, const char *k, const char *v)
{
    uint64_t u;
    if (!known(k, NODE_KEYS))
        return -2;
    if (!strcmp(k, "driver_version"))
        return set_str(c->driver_version, sizeof(c->driver_version), v);
    if (parse_u64(v, &u) != 0)
        return -1;
    if (!strcmp(k, "queue_depth"))
        return (u >= 1 && u <= 1000000) ? (c->queue_depth = (uint32_t)u, 0) : -1;
    if (!strcmp(k, "timeslice_us"))
        return (u >= 10 && u <= 10000000) ? (c->timeslice_ns = u * 1000, 0) : -1;
    if (!strcmp(k, "sample_period_ms"))
        return (u >= 10 && u <= 10000) ? (c->period_ns = u * 1000000, 0) : -1;
    if (!strcmp(k, "util_window_ms"))
        return (u >= 10 && u <= 60000) ? (c->util_window_ns = u * 1000000, 0) : -1;
    if (!strcmp(k, "cuda_version"))
        return (u >= 2000 && u <= 99999) ? (c->cuda_version = (int32_t)u, 0) : -1;
    if (!strcmp(k, "gpus"))
        return (u >= 1 && u <= FG_MAX_GPU) ? (c->ndev = (uint32_t)u, 0) : -1;
    return -2;
}

int fg_config_load(const char *path, struct fg_config *c, char *err, size_t errlen)
{
    fg_config_defaults(c);
    if (!path || !*path)
        return 0;
    FILE *f = fopen(path, "re");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    char line[512];
    int lineno = 0, dev = -1;
    int rc = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *s = trim(line);
        if (!*s)
            continue;
        if (!strcmp(s, "[device]")) {
            if (++dev >= FG_MAX_GPU) {
                snprintf(err, errlen, "%s:%d: more than %d devices", path, lineno, FG_MAX_GPU);
                rc = -1;
                break;
            }
            c->ndev = (uint32_t)dev + 1;
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "%s:%d: expected key = value", path, lineno);
            rc = -1;
            break;
        }
        *eq = '\0';
        char *k = trim(s), *v = trim(eq + 1);
        int r = dev < 0 ? global_key(c, k, v) : device_key(&c->dev[dev], k, v);
        if (r != 0) {
            snprintf(err, errlen, "%s:%d: %s key `%s`", path, lineno, r == -2 ? "unknown" : "invalid value for", k);
            rc = -1;
            break;
        }
    }
    fclose(f);
    if (rc == 0) {
        for (unsigned i = 0; i < c->ndev; i++)
            for (unsigned j = 0; j < i; j++)
                if (!strcmp(c->dev[i].uuid, c->dev[j].uuid)) {
                    snprintf(err, errlen, "%s: devices %u and %u have the same uuid", path, j, i);
                    return -1;
                }
    }
    return rc;
}
