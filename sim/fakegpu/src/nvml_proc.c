/* fakegpu libnvidia-ml: running processes and utilisation.
 *
 * Processes: every live process with a context on the device, with the pid as the caller sees it
 * (host pids from the host, fg_pid.c) and usedGpuMemory = its allocations + its contexts'
 * simulated overhead.  Utilisation: the kernel model credits executed time to periods of
 * period_ns; each finished period with non-zero use is one sample (timeStamp = the period's end,
 * CLOCK_REALTIME µs; smUtil = percent of the period).  lastSeenTimeStamp returns only newer
 * samples; none: NVML_ERROR_NOT_FOUND (nvml.h).  Samples of a process that is gone are gone.
 */
#include "fg_mig.h"
#include "fg_nvml.h"

#include <pthread.h>
#include <string.h>

typedef struct { /* nvmlProcessInfo_v1_t, 16 B */
    unsigned pid;
    unsigned long long usedGpuMemory;
} fg_proc_v1;

typedef struct { /* nvmlProcessInfo_t (v2), used by _v2 and _v3, 24 B */
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} fg_proc_v2;

typedef struct { /* nvmlProcessUtilizationSample_t, 32 B */
    unsigned pid;
    unsigned long long timeStamp;
    unsigned smUtil, memUtil, encUtil, decUtil;
} fg_util_sample;

typedef struct { /* nvmlProcessUtilizationInfo_v1_t, 40 B */
    unsigned long long timeStamp;
    unsigned pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} fg_util_info;

typedef struct { /* nvmlProcessesUtilizationInfo_v1_t, 24 B */
    unsigned version, processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    fg_util_info *procUtilArray;
} fg_utils_info;

_Static_assert(sizeof(fg_proc_v1) == 16, "v1 size");
_Static_assert(sizeof(fg_proc_v2) == 24, "v2 size");
_Static_assert(sizeof(fg_util_sample) == 32, "sample size");
_Static_assert(sizeof(fg_util_info) == 40, "util info size");
_Static_assert(sizeof(fg_utils_info) == 24, "utils info size");

struct row {
    unsigned pid;
    uint64_t mem;
    unsigned gi, ci;
};

#define MAX_ROWS (FG_MAX_SLOTS * 8)

/* The processes of a GPU, a MIG device, or in MIG mode of all the GPU's MIG devices ("In MIG mode,
 * if device handle is provided, the API returns aggregate information ... Per-instance
 * information can be queried by using specific MIG device handles", nvml.h), each with its GPU
 * and compute instance IDs (0xFFFFFFFF outside MIG). */
static nvmlReturn_t collect(nvmlDevice_t d, struct row *rows, unsigned *n)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    /* lock-free (fg_live.c) */
    struct fg_state *st = fg_g.st;
    uint64_t live[FG_MASK_WORDS];
    fg_live_mask(st, live);
    int units[FG_MAX_DEV], nu = 1;
    units[0] = i;
    if (!fg_unit_is_mig(st, i) && fg_mig_enabled(st, i))
        nu = fg_mig_units(st, i, units);
    *n = 0;
    for (int k = 0; k < nu; k++) {
        int u = units[k], mig = fg_unit_is_mig(st, u);
        for (int s = 0; s < FG_MAX_SLOTS && *n < MAX_ROWS; s++) {
            if (!fg_mask_has(live, s) || st->slots[s].dev[u].contexts == 0)
                continue;
            int pid = fg_visible_pid(st, s);
            if (pid <= 0)
                continue;
            rows[*n].pid = (unsigned)pid;
            rows[*n].mem = fg_pdev_used(st, s, u);
            rows[*n].gi = mig ? st->unit[u].gi : NVML_NO_INSTANCE;
            rows[*n].ci = mig ? st->unit[u].ci : NVML_NO_INSTANCE;
            (*n)++;
        }
    }
    return NVML_SUCCESS;
}

/* nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently supported",
 * "On MIG-enabled GPUs, querying process utilization is not currently supported" -- for the GPU
 * and for its MIG devices (nvidia-smi shows N/A). */
static int mig_no_utilization(int i)
{
    struct fg_state *st = fg_g.st;
    return fg_unit_is_mig(st, i) || fg_mig_enabled(st, i);
}

static nvmlReturn_t procs(nvmlDevice_t d, unsigned *count, void *infos, int v1)
{
    struct row rows[MAX_ROWS];
    unsigned n;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = collect(d, rows, &n);
    if (rc)
        return rc;
    if (*count < n || (!infos && n > 0)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++) {
        if (v1) {
            fg_proc_v1 *p = &((fg_proc_v1 *)infos)[k];
            memset(p, 0, sizeof(*p));
            p->pid = rows[k].pid;
            p->usedGpuMemory = rows[k].mem;
        } else {
            fg_proc_v2 *p = &((fg_proc_v2 *)infos)[k];
            memset(p, 0, sizeof(*p));
            p->pid = rows[k].pid;
            p->usedGpuMemory = rows[k].mem;
            p->gpuInstanceId = rows[k].gi;
            p->computeInstanceId = rows[k].ci;
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count, fg_proc_v2 *infos)
{
    return procs(d, count, infos, 0);
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *count, fg_proc_v2 *infos)
{
    return procs(d, count, infos, 0);
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *count, fg_proc_v1 *infos)
{
    return procs(d, count, infos, 1);
}

static nvmlReturn_t no_procs(nvmlDevice_t d, unsigned *count)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned *count, void *infos)
{
    (void)infos;
    return no_procs(d, count);
}

FG_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count, void *infos)
{
    (void)infos;
    return no_procs(d, count);
}

/* The older versions the real library still exports (nvml.h's "backwards compatibility" block):
 * v1 fills nvmlProcessInfo_v1_t, v2 nvmlProcessInfo_v2_t; with no graphics or MPS process on the
 * simulated GPU every version answers an empty list. */
FG_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned *count, void *infos)
{
    (void)infos;
    return no_procs(d, count);
}

FG_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned *count, void *infos)
{
    (void)infos;
    return no_procs(d, count);
}

FG_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *count, void *infos)
{
    (void)infos;
    return no_procs(d, count);
}

FG_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t d, unsigned *count, void *infos)
{
    (void)infos;
    return no_procs(d, count);
}

/* --- utilisation ------------------------------------------------------------------------ */

#define MAX_SAMPLES (FG_MAX_SLOTS * FG_RING)

struct sample {
    unsigned pid;
    uint64_t ts;
    unsigned sm;
};

static struct sample g_buf[MAX_SAMPLES];
static pthread_mutex_t g_bmu = PTHREAD_MUTEX_INITIALIZER;

/* Fills g_buf (caller holds g_bmu) with the samples newer than last: *n of them; *nlive: the
 * processes that can produce a new sample any time (a sample period may end between pynvml's
 * sizing call and its second call, so the sizing answer leaves room for one more each). */
static nvmlReturn_t gather(nvmlDevice_t d, unsigned long long last, unsigned *n, unsigned *nlive)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    if (mig_no_utilization(i))
        return NVML_ERROR_NOT_SUPPORTED;
    /* lock-free (fg_live.c): only periods the simulation has settled are reported, so a
     * sample is never a partial period (lastSeenTimeStamp would hide its final value) */
    uint64_t live[FG_MASK_WORDS], settled;
    fg_live_mask(fg_g.st, live);
    int snap;
    struct fg_state *st = fg_sim_view(i, &settled, &snap);
    *n = 0;
    *nlive = 0;
    uint64_t P = st->h.period_ns;
    uint64_t done = settled / P; /* periods < done are finished */
    uint64_t lo = done >= FG_RING - 1 ? done - (FG_RING - 1) : 0;
    /* period j's sample has timeStamp ((j + 1) * P + real_minus_mono) / 1000 µs: skip those <= last */
    int64_t last_mono = (int64_t)(last > (unsigned long long)INT64_MAX / 2000 ? INT64_MAX / 2 : (int64_t)last * 1000) -
                        st->h.real_minus_mono;
    if (last_mono > 0 && (uint64_t)last_mono / P >= 1 && (uint64_t)last_mono / P - 1 > lo)
        lo = (uint64_t)last_mono / P - 1; /* still checked exactly below */
    for (int s = 0; s < FG_MAX_SLOTS; s++) {
        if (!fg_mask_has(live, s))
            continue;
        const struct fg_pdev *p = &st->slots[s].dev[i];
        if (p->contexts)
            (*nlive)++;
        int pid = -1;
        /* only the periods newer than last: index the ring directly (j -> j % FG_RING) */
        for (uint64_t j = lo; j < done; j++) {
            uint64_t busy;
            if (!fg_period_read(&p->periods[j % FG_RING], j, &busy) || busy == 0)
                continue;
            int64_t ts = fg_ts_us(st, (j + 1) * P);
            if (ts <= 0 || (unsigned long long)ts <= last)
                continue;
            if (pid < 0)
                pid = fg_visible_pid(st, s);
            if (pid <= 0)
                break;
            unsigned sm = (unsigned)((busy * 100 + P / 2) / P);
            g_buf[*n] = (struct sample){(unsigned)pid, (uint64_t)ts, sm > 100 ? 100 : sm};
            (*n)++;
        }
    }
    if (snap)
        fg_snapshot_end();
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, fg_util_sample *out, unsigned *count,
                                                    unsigned long long last)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n, nlive;
    pthread_mutex_lock(&g_bmu);
    nvmlReturn_t rc = gather(d, last, &n, &nlive);
    if (rc == NVML_SUCCESS) {
        if (n == 0) {
            rc = NVML_ERROR_NOT_FOUND;
        } else if (!out) {
            *count = n + nlive;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else if (*count < n) {
            *count = n;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            for (unsigned k = 0; k < n; k++)
                out[k] = (fg_util_sample){g_buf[k].pid, g_buf[k].ts, g_buf[k].sm, 0, 0, 0};
            *count = n;
        }
    }
    pthread_mutex_unlock(&g_bmu);
    return rc;
}

#define UTILS_INFO_V1 (unsigned)(sizeof(fg_utils_info) | (1u << 24))

FG_API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t d, fg_utils_info *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != UTILS_INFO_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned n, nlive;
    pthread_mutex_lock(&g_bmu);
    nvmlReturn_t rc = gather(d, info->lastSeenTimeStamp, &n, &nlive);
    if (rc == NVML_SUCCESS) {
        if (n == 0) {
            rc = NVML_ERROR_NOT_FOUND;
        } else if (!info->procUtilArray) {
            info->processSamplesCount = n + nlive;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else if (info->processSamplesCount < n) {
            info->processSamplesCount = n;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            for (unsigned k = 0; k < n; k++)
                info->procUtilArray[k] = (fg_util_info){g_buf[k].ts, g_buf[k].pid, g_buf[k].sm, 0, 0, 0, 0, 0};
            info->processSamplesCount = n;
        }
    }
    pthread_mutex_unlock(&g_bmu);
    return rc;
}

typedef struct {
    unsigned gpu, memory;
} fg_utilization;

/* gpu: percent of the last util_window_ns (whole finished periods) in which a kernel ran. */
FG_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, fg_utilization *u)
{
    int i;
    if (!u)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    if (mig_no_utilization(i))
        return NVML_ERROR_NOT_SUPPORTED;
    uint64_t settled; /* lock-free (fg_live.c) */
    int snap;
    struct fg_state *st = fg_sim_view(i, &settled, &snap);
    uint64_t P = st->h.period_ns, done = settled / P;
    uint64_t k = st->h.util_window_ns / P;
    if (k < 1)
        k = 1;
    if (k > FG_RING - 1)
        k = FG_RING - 1;
    uint64_t busy = 0;
    for (uint64_t j = done - k; j < done; j++) {
        uint64_t b;
        if (fg_period_read(&st->ds[i].periods[j % FG_RING], j, &b))
            busy += b;
    }
    if (snap)
        fg_snapshot_end();
    uint64_t pct = (busy * 100 + k * P / 2) / (k * P);
    u->gpu = (unsigned)(pct > 100 ? 100 : pct);
    u->memory = 0;
    return NVML_SUCCESS;
}
