/*
 * state.c — process state: is this process in a vGPU container (limits),
 * fail-closed reporting, region attach, device mapping by UUID, fork.
 *
 * Limits come from /run/vgpu/limits (mounted read-only by the hook).  Only
 * if that path does not exist may VGPU_LIMITS_FILE / VGPU_REGION_FILE name
 * other files (tests, use outside Kubernetes): the container's environment
 * can never override a mounted limits file.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "log.h"
#include "oversub.h"
#include "vgpu.h"

#define FIXED_LIMITS "/run/vgpu/limits"
#define FIXED_REGION "/run/vgpu/region"
/* Compile-time floor of the per-context reserve.  0: the monitor's
 * extra_bytes (NVML-observed usage beyond what the library counted) is the
 * primary mechanism; see vgpu_ctx_reserve(). */
#ifndef VGPU_DEFAULT_CONTEXT_RESERVE
#define VGPU_DEFAULT_CONTEXT_RESERVE 0ull
#endif

int vgpu_status_cache;
VGPU_TLS int vgpu_in_hook;

struct vgpu_track vgpu_t_ptr = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_vmm = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_map = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_arr = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_pool = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_exec = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_ipc = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_shr = VGPU_TRACK_INIT;
struct vgpu_track vgpu_t_defer = VGPU_TRACK_INIT;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vgpu_limits g_lim;
static char g_limits_path[4096];
static char g_region_path[4096];
static int g_region_private;
static char g_fail[560];
static int g_fail_logged;
static uint64_t g_reserve;

/* CUDA ordinal -> (limits index + 2); 0 unknown, 1 unlisted */
#define MAX_ORDINALS 256
static int g_devmap[MAX_ORDINALS];

static uint64_t parse_size(const char *s, int *ok)
{
    char *end;
    *ok = 0;
    if (*s < '0' || *s > '9') /* strtoull would accept "-1" as 2^64-1 */
        return 0;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return 0;
    unsigned long long mul = 1;
    if (*end == 'k' || *end == 'K')
        mul = 1ull << 10, end++;
    else if (*end == 'm' || *end == 'M')
        mul = 1ull << 20, end++;
    else if (*end == 'g' || *end == 'G')
        mul = 1ull << 30, end++;
    if (*end != '\0' || (mul > 1 && v > UINT64_MAX / mul))
        return 0;
    *ok = 1;
    return v * mul;
}

static void set_failed_locked(const char *fmt_path, const char *what)
{
    snprintf(g_fail, sizeof g_fail, "%.250s: %.250s", fmt_path, what);
    __atomic_store_n(&vgpu_status_cache, VGPU_ST_FAILED, __ATOMIC_RELEASE);
}

int vgpu_status_slow(void)
{
    pthread_mutex_lock(&g_mu);
    int st = __atomic_load_n(&vgpu_status_cache, __ATOMIC_ACQUIRE);
    if (st) {
        pthread_mutex_unlock(&g_mu);
        return st;
    }
    vgpu_log_init();
    char err[300];
    int rc = vgpu_limits_load(FIXED_LIMITS, &g_lim, err, sizeof err);
    if (rc == 0) {
        snprintf(g_limits_path, sizeof g_limits_path, "%s", FIXED_LIMITS);
        snprintf(g_region_path, sizeof g_region_path, "%s", FIXED_REGION);
    } else if (rc < 0) {
        snprintf(g_limits_path, sizeof g_limits_path, "%s", FIXED_LIMITS);
        set_failed_locked("limits file " FIXED_LIMITS, err);
        goto out;
    } else {
        /* no mounted limits: the environment may name files (never overriding a mount) */
        const char *lp = secure_getenv("VGPU_LIMITS_FILE");
        if (!lp || !*lp) {
            __atomic_store_n(&vgpu_status_cache, VGPU_ST_INACTIVE, __ATOMIC_RELEASE);
            goto out;
        }
        snprintf(g_limits_path, sizeof g_limits_path, "%s", lp);
        rc = vgpu_limits_load(lp, &g_lim, err, sizeof err);
        if (rc != 0) {
            char where[4200];
            snprintf(where, sizeof where, "limits file %s", lp);
            set_failed_locked(where, rc > 0 ? "does not exist" : err);
            goto out;
        }
        const char *rp = secure_getenv("VGPU_REGION_FILE");
        if (rp && *rp)
            snprintf(g_region_path, sizeof g_region_path, "%s", rp);
        else
            g_region_private = 1; /* per-process accounting only */
    }
    /* Per-context reserve: bytes charged once per process and device until
     * the monitor's extra_bytes (which measures it) is larger.  The container
     * environment is untrusted, so VGPU_CONTEXT_RESERVE can only make the
     * limit stricter: the effective reserve is max(compiled default, env). */
    g_reserve = VGPU_DEFAULT_CONTEXT_RESERVE;
    const char *rs = getenv("VGPU_CONTEXT_RESERVE");
    if (rs && *rs) {
        int ok;
        uint64_t v = parse_size(rs, &ok);
        if (ok && v > g_reserve)
            g_reserve = v;
        else if (!ok)
            VLOG(VGPU_LOG_WARN, "ignoring VGPU_CONTEXT_RESERVE=%.32s (want bytes with optional k/m/g)", rs);
    }
    VLOG(VGPU_LOG_INFO, "limits from %s: %u device(s), region %s, context reserve %llu", g_limits_path, g_lim.count,
         g_region_private ? "(private)" : g_region_path, (unsigned long long)g_reserve);
    __atomic_store_n(&vgpu_status_cache, VGPU_ST_ACTIVE, __ATOMIC_RELEASE);
out:
    st = __atomic_load_n(&vgpu_status_cache, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&g_mu);
    return st;
}

const struct vgpu_limits *vgpu_limits(void) { return &g_lim; }
uint64_t vgpu_ctx_reserve(void) { return g_reserve; }

CUresult vgpu_fail_closed(const char *where)
{
    if (!__atomic_exchange_n(&g_fail_logged, 1, __ATOMIC_RELAXED))
        VLOG(VGPU_LOG_ERROR, "%s: refusing GPU use (fail closed): %s", where, g_fail);
    return CUDA_ERROR_NOT_PERMITTED;
}

int vgpu_ensure_mapped(void)
{
    if (LIKELY(vgpu_rgn_mapped()))
        return 0;
    if (vgpu_status() != VGPU_ST_ACTIVE)
        return -1;
    char err[300];
    if (vgpu_rgn_map(g_region_private ? NULL : g_region_path, strcmp(g_region_path, FIXED_REGION) != 0, &g_lim, err, sizeof err) == 0)
        return 0;
    pthread_mutex_lock(&g_mu);
    char where[4200];
    snprintf(where, sizeof where, "region %s", g_region_private ? "(private)" : g_region_path);
    set_failed_locked(where, err);
    pthread_mutex_unlock(&g_mu);
    return -1;
}

int vgpu_ensure_joined(void)
{
    if (LIKELY(vgpu_rgn_slot() >= 0))
        return 0;
    if (vgpu_ensure_mapped() != 0)
        return -1;
    char err[300];
    if (vgpu_rgn_join(err, sizeof err) == 0)
        return 0;
    pthread_mutex_lock(&g_mu);
    char where[4200];
    snprintf(where, sizeof where, "region %s", g_region_private ? "(private)" : g_region_path);
    set_failed_locked(where, err);
    pthread_mutex_unlock(&g_mu);
    return -1;
}

void vgpu_format_uuid(const CUuuid *u, char out[VGPU_UUID_LEN])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, VGPU_UUID_LEN, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static int limits_index_of(const char *uuid)
{
    for (unsigned i = 0; i < g_lim.count; i++)
        if (strcasecmp(g_lim.dev[i].uuid, uuid) == 0)
            return (int)i;
    return -1;
}

/* The 16 bytes of a limits line's UUID ("GPU-..." or a MIG device's "MIG-..."), -1 if it has
 * another form. */
static int uuid_bytes(const char *s, unsigned char out[16])
{
    if (strncmp(s, "GPU-", 4) != 0 && strncmp(s, "MIG-", 4) != 0)
        return -1;
    unsigned n = 0;
    for (s += 4; *s; s++) {
        if (*s == '-')
            continue;
        int v = (*s >= '0' && *s <= '9') ? *s - '0' : (*s | 0x20) >= 'a' && (*s | 0x20) <= 'f' ? (*s | 0x20) - 'a' + 10 : -1;
        if (v < 0 || n >= 32)
            return -1;
        out[n / 2] = (unsigned char)(n % 2 ? (out[n / 2] | v) : (v << 4));
        n++;
    }
    return n == 32 ? 0 : -1;
}

/* Contract 4: a CUDA device's limits line is the one whose UUID has the device's 16 bytes.  A MIG
 * device's are its MIG UUID's: cuDeviceGetUuid_v2 "If the device is in MIG mode, returns its MIG
 * UUID which uniquely identifies the subscribed MIG compute instance" (cuda.h); the bytes alone
 * do not say GPU or MIG, so both prefixes are compared by their bytes. */
static int limits_index_of_bytes(const unsigned char b[16])
{
    for (unsigned i = 0; i < g_lim.count; i++) {
        unsigned char u[16];
        if (uuid_bytes(g_lim.dev[i].uuid, u) == 0 && memcmp(u, b, 16) == 0)
            return (int)i;
    }
    return -1;
}

int vgpu_dev_index(CUdevice dev)
{
    if (dev < 0)
        return -2;
    int cached = dev < MAX_ORDINALS ? __atomic_load_n(&g_devmap[dev], __ATOMIC_RELAXED) : 0;
    if (LIKELY(cached))
        return cached - 2;
    CUuuid u;
    if (REAL(cuDeviceGetUuid_v2)) {
        if (REAL(cuDeviceGetUuid_v2)(&u, dev) != CUDA_SUCCESS)
            return -2;
    } else if (!REAL(cuDeviceGetUuid) || REAL(cuDeviceGetUuid)(&u, dev) != CUDA_SUCCESS) {
        return -2; /* a driver before 11.4: no MIG UUIDs */
    }
    char s[VGPU_UUID_LEN];
    vgpu_format_uuid(&u, s);
    int idx = limits_index_of_bytes((const unsigned char *)u.bytes);
    if (idx < 0)
        VLOG(VGPU_LOG_WARN, "CUDA device %d (%s) has no limits line: its allocations are refused", dev, s);
    if (dev < MAX_ORDINALS)
        __atomic_store_n(&g_devmap[dev], idx + 2, __ATOMIC_RELAXED);
    return idx;
}

/* NVML handles are stable pointers; a small cache maps them to limits lines */
#define MAX_NVML 64
static struct {
    nvmlDevice_t h;
    int idx;
} g_nvml[MAX_NVML];
static int g_nvml_n;
static pthread_mutex_t g_nvml_mu = PTHREAD_MUTEX_INITIALIZER;

int vgpu_nvml_index(nvmlDevice_t h)
{
    pthread_mutex_lock(&g_nvml_mu);
    for (int i = 0; i < g_nvml_n; i++) {
        if (g_nvml[i].h == h) {
            int idx = g_nvml[i].idx;
            pthread_mutex_unlock(&g_nvml_mu);
            return idx;
        }
    }
    pthread_mutex_unlock(&g_nvml_mu);
    if (!REAL(nvmlDeviceGetUUID))
        return -2;
    char s[VGPU_UUID_LEN];
    if (REAL(nvmlDeviceGetUUID)(h, s, sizeof s) != NVML_SUCCESS)
        return -2;
    s[VGPU_UUID_LEN - 1] = '\0';
    int idx = limits_index_of(s);
    pthread_mutex_lock(&g_nvml_mu);
    if (g_nvml_n < MAX_NVML) {
        g_nvml[g_nvml_n].h = h;
        g_nvml[g_nvml_n].idx = idx;
        g_nvml_n++;
    }
    pthread_mutex_unlock(&g_nvml_mu);
    return idx;
}

/* ------------------------------------------------------------------ fork */

static void at_prepare(void)
{
    pthread_mutex_lock(&g_mu);
    vgpu_rgn_atfork_prepare();
    vgpu_track_lock(&vgpu_t_ptr);
    vgpu_track_lock(&vgpu_t_vmm);
    vgpu_track_lock(&vgpu_t_map);
    vgpu_track_lock(&vgpu_t_arr);
    vgpu_track_lock(&vgpu_t_pool);
    vgpu_track_lock(&vgpu_t_exec);
    vgpu_track_lock(&vgpu_t_ipc);
    vgpu_track_lock(&vgpu_t_shr);
    vgpu_track_lock(&vgpu_t_defer);
}

static void at_parent(void)
{
    vgpu_track_unlock(&vgpu_t_defer);
    vgpu_track_unlock(&vgpu_t_shr);
    vgpu_track_unlock(&vgpu_t_ipc);
    vgpu_track_unlock(&vgpu_t_exec);
    vgpu_track_unlock(&vgpu_t_pool);
    vgpu_track_unlock(&vgpu_t_arr);
    vgpu_track_unlock(&vgpu_t_map);
    vgpu_track_unlock(&vgpu_t_vmm);
    vgpu_track_unlock(&vgpu_t_ptr);
    vgpu_rgn_atfork_parent();
    pthread_mutex_unlock(&g_mu);
}

/* The child owns no GPU memory and no slot: forget both.  Nothing here runs
 * unless the parent had used CUDA (closing its region descriptor). */
static void at_child(void)
{
    vgpu_track_reset_child(&vgpu_t_ptr);
    vgpu_track_reset_child(&vgpu_t_vmm);
    vgpu_track_reset_child(&vgpu_t_map);
    vgpu_track_reset_child(&vgpu_t_arr);
    vgpu_track_reset_child(&vgpu_t_pool);
    vgpu_track_reset_child(&vgpu_t_exec);
    vgpu_track_reset_child(&vgpu_t_ipc);
    vgpu_track_reset_child(&vgpu_t_shr);
    vgpu_track_reset_child(&vgpu_t_defer);
    vgpu_os_atfork_child();
    vgpu_hooks_atfork_child();
    vgpu_rgn_atfork_child();
    pthread_mutex_init(&g_mu, NULL);
    pthread_mutex_init(&g_nvml_mu, NULL);
    vgpu_in_hook = 0;
}

__attribute__((constructor)) static void vgpu_ctor(void)
{
    /* the only work at load time: no file is touched until CUDA/NVML is used */
    pthread_atfork(at_prepare, at_parent, at_child);
}
