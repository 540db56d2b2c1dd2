/* fakegpu libnvidia-ml: initialisation, device handles, identity, memory, error strings.
 * Names and struct versions are those nvidia-ml-py 13.x calls (reference cuda-interception.md §5,
 * compute-shares.md §1): nvmlInitWithFlags, *_v2 count/handle, GetPciInfo_v3, GetMemoryInfo(_v2). */
#include "fg_nvml.h"
#include "fg_mig.h"

#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#define DEV_MAGIC 0x4e564d4cu

static struct nvml_dev g_devs[FG_MAX_DEV];
static int g_refs;
static int g_vis[FG_MAX_DEV], g_nvis;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_atfork;

static void nvml_atfork_child(void)
{
    fg_atfork_child(); /* the state is re-opened lazily by the next call */
}

nvmlReturn_t fg_nvml_check(void)
{
    if (__atomic_load_n(&g_refs, __ATOMIC_ACQUIRE) <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!fg_g.st && fg_open(1) != 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    return NVML_SUCCESS;
}

nvmlDevice_t fg_nvml_handle(int idx)
{
    return &g_devs[idx];
}

/* A MIG device this process may use, of a GPU NVML shows it. */
int fg_nvml_mig_usable(int unit)
{
    struct fg_state *st = fg_g.st;
    if (!fg_unit_is_mig(st, unit))
        return 0;
    int gpu = fg_unit_root(st, unit);
    return g_devs[gpu].vis >= 0 && fg_mig_enabled(st, gpu) && fg_mig_visible(st, unit);
}

nvmlReturn_t fg_nvml_dev(nvmlDevice_t d, int dynamic, int *idx)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!d || d < &g_devs[0] || d >= &g_devs[FG_MAX_DEV] || d->magic != DEV_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fg_state *st = fg_g.st;
    if ((unsigned)d->index < st->h.ndev) {
        if (d->vis < 0)
            return NVML_ERROR_INVALID_ARGUMENT;
    } else if (!fg_nvml_mig_usable(d->index)) {
        /* a MIG device handle whose compute instance is gone: "the MIG device handle would remain
         * invalid and must be requested again" (nvml.h) */
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (dynamic && __atomic_load_n(&st->ds[fg_unit_root(st, d->index)].lost, __ATOMIC_RELAXED))
        return NVML_ERROR_GPU_IS_LOST;
    *idx = d->index;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&g_mu);
    if (!g_atfork) {
        pthread_atfork(NULL, NULL, nvml_atfork_child);
        g_atfork = 1;
    }
    if (fg_open(0) != 0) {
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    g_nvis = fg_visible_map(fg_g.st, g_vis);
    for (int i = 0; i < FG_MAX_DEV; i++) {
        g_devs[i].magic = DEV_MAGIC;
        g_devs[i].index = i;
        g_devs[i].vis = -1;
    }
    for (int v = 0; v < g_nvis; v++)
        g_devs[g_vis[v]].vis = v;
    __atomic_add_fetch(&g_refs, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

FG_API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

FG_API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (g_refs <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        __atomic_sub_fetch(&g_refs, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static nvmlReturn_t copy_str(char *dst, unsigned len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned int len)
{
    nvmlReturn_t rc = fg_nvml_check();
    return rc ? rc : copy_str(buf, len, fg_g.st->h.driver_version);
}

FG_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *buf, unsigned int len)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    char v[64];
    snprintf(v, sizeof(v), "%d.%s", fg_g.st->h.cuda_version / 1000, fg_g.st->h.driver_version);
    return copy_str(buf, len, v);
}

FG_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = fg_g.st->h.cuda_version;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    return nvmlSystemGetCudaDriverVersion(v);
}

FG_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)g_nvis;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *n)
{
    return nvmlDeviceGetCount_v2(n);
}

/* A lost GPU cannot be opened: "Unable to determine the device handle for GPU ...: GPU is lost" */
static nvmlReturn_t give_handle(int idx, nvmlDevice_t *out)
{
    if (__atomic_load_n(&fg_g.st->ds[idx].lost, __ATOMIC_RELAXED))
        return NVML_ERROR_GPU_IS_LOST;
    *out = &g_devs[idx];
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!out || i >= (unsigned)g_nvis)
        return NVML_ERROR_INVALID_ARGUMENT;
    return give_handle(g_vis[i], out);
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *out)
{
    return nvmlDeviceGetHandleByIndex_v2(i, out);
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!uuid || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int v = 0; v < g_nvis; v++)
        if (!strcmp(fg_g.st->cfg[g_vis[v]].uuid, uuid))
            return give_handle(g_vis[v], out);
    /* "The UUID of the target GPU or MIG instance" (nvml.h) */
    for (int u = (int)fg_g.st->h.ndev; u < FG_MAX_DEV; u++)
        if (fg_nvml_mig_usable(u) && !strcmp(fg_g.st->cfg[u].uuid, uuid)) {
            if (__atomic_load_n(&fg_g.st->ds[fg_unit_root(fg_g.st, u)].lost, __ATOMIC_RELAXED))
                return NVML_ERROR_GPU_IS_LOST;
            *out = &g_devs[u];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *busid, nvmlDevice_t *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    unsigned a[4], b[4];
    if (!busid || !out || fg_parse_busid(busid, &a[0], &a[1], &a[2], &a[3]) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int v = 0; v < g_nvis; v++) {
        if (fg_parse_busid(fg_g.st->cfg[g_vis[v]].pci_bus_id, &b[0], &b[1], &b[2], &b[3]) == 0 &&
            !memcmp(a, b, sizeof(a)))
            return give_handle(g_vis[v], out);
    }
    return NVML_ERROR_NOT_FOUND;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *busid, nvmlDevice_t *out)
{
    return nvmlDeviceGetHandleByPciBusId_v2(busid, out);
}

FG_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    return rc ? rc : copy_str(buf, len, fg_g.st->cfg[i].uuid);
}

FG_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned int len)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    return rc ? rc : copy_str(buf, len, fg_g.st->cfg[i].name);
}

FG_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *out)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (fg_unit_is_mig(fg_g.st, i)) {
        /* "indices that can be passed to nvmlDeviceGetMigDeviceHandleByIndex" (nvml.h) */
        int units[FG_MAX_DEV], n = fg_mig_units(fg_g.st, fg_unit_root(fg_g.st, i), units), k = 0;
        for (int j = 0; j < n; j++) {
            if (units[j] == i) {
                *out = (unsigned)k;
                return NVML_SUCCESS;
            }
            k += fg_nvml_mig_usable(units[j]);
        }
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *out = (unsigned)d->vis;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *out)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = fg_g.st->cfg[i].minor_number;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *out)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (fg_g.st->cfg[i].numa_node < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *out = (unsigned)fg_g.st->cfg[i].numa_node;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = (int)fg_g.st->cfg[i].cc_major;
    *minor = (int)fg_g.st->cfg[i].cc_minor;
    return NVML_SUCCESS;
}

/* nvmlPciInfo_t (v3): busIdLegacy[16], domain, bus, device, pciDeviceId, pciSubSystemId, busId[32] */
typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} fg_pci_info;
_Static_assert(sizeof(fg_pci_info) == 68, "nvmlPciInfo_t size");

FG_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, fg_pci_info *pci)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fg_devcfg *c = &fg_g.st->cfg[i];
    unsigned dom = 0, bus = 0, dv = 0, fn = 0;
    fg_parse_busid(c->pci_bus_id, &dom, &bus, &dv, &fn);
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.%X", dom & 0xffff, bus, dv, fn);
    snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.%X", dom, bus, dv, fn);
    pci->domain = dom;
    pci->bus = bus;
    pci->device = dv;
    pci->pciDeviceId = c->pci_device_id;
    pci->pciSubSystemId = 0x16c110de;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, fg_pci_info *pci)
{
    return nvmlDeviceGetPciInfo_v3(d, pci);
}

typedef struct {
    unsigned long long total, free, used;
} fg_memory;

typedef struct {
    unsigned version;
    unsigned long long total, reserved, free, used;
} fg_memory_v2;
_Static_assert(sizeof(fg_memory_v2) == 40, "nvmlMemory_v2_t size");
#define NVML_MEMORY_V2 (unsigned)(sizeof(fg_memory_v2) | (2u << 24)) /* 0x02000028 */

static nvmlReturn_t memory(nvmlDevice_t d, uint64_t *total, uint64_t *reserved, uint64_t *used)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    /* lock-free (fg_live.c): a momentary answer, never a wait on another process */
    struct fg_state *st = fg_g.st;
    uint64_t live[FG_MASK_WORDS], u = 0;
    fg_live_mask(st, live);
    /* a MIG device: its GPU instance's memory; a GPU in MIG mode: the aggregate of its instances
     * ("In MIG mode, if device handle is provided, the API returns aggregate information", nvml.h) */
    int gpu = fg_unit_root(st, i), mig = fg_unit_is_mig(st, i);
    for (int d = 0; d < FG_MAX_DEV; d++) {
        if (d != i && !(fg_unit_is_mig(st, d) && st->unit[d].parent == gpu &&
                        (!mig || st->unit[d].gi == st->unit[i].gi)))
            continue;
        for (int s = 0; s < FG_MAX_SLOTS; s++)
            if (fg_mask_has(live, s))
                u += fg_pdev_used(st, s, d);
    }
    *used = u;
    *total = st->cfg[i].memory;
    *reserved = st->cfg[i].reserved;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, fg_memory *m)
{
    uint64_t total, reserved, used;
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = memory(d, &total, &reserved, &used);
    if (rc)
        return rc;
    /* v1 counts the reserved memory as used */
    m->total = total;
    m->used = used + reserved < total ? used + reserved : total;
    m->free = total - m->used;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, fg_memory_v2 *m)
{
    uint64_t total, reserved, used;
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = memory(d, &total, &reserved, &used);
    if (rc)
        return rc;
    m->total = total;
    m->reserved = reserved < total ? reserved : total;
    m->used = used < total - m->reserved ? used : total - m->reserved;
    m->free = total - m->reserved - m->used;
    return NVML_SUCCESS;
}

static const struct {
    int code;
    const char *text;
} g_errors[] = {
    {NVML_SUCCESS, "Success"},
    {NVML_ERROR_UNINITIALIZED, "Uninitialized"},
    {NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument"},
    {NVML_ERROR_NOT_SUPPORTED, "Not Supported"},
    {NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"},
    {NVML_ERROR_ALREADY_INITIALIZED, "Already Initialized"},
    {NVML_ERROR_NOT_FOUND, "Not Found"},
    {NVML_ERROR_INSUFFICIENT_SIZE, "Insufficient Size"},
    {NVML_ERROR_INSUFFICIENT_POWER, "Insufficient External Power"},
    {NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"},
    {NVML_ERROR_TIMEOUT, "Timeout"},
    {NVML_ERROR_IRQ_ISSUE, "Interrupt Request Issue"},
    {NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"},
    {NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found"},
    {NVML_ERROR_CORRUPTED_INFOROM, "Corrupted infoROM"},
    {NVML_ERROR_GPU_IS_LOST, "GPU is lost"},
    {NVML_ERROR_RESET_REQUIRED, "GPU requires restart"},
    {NVML_ERROR_OPERATING_SYSTEM, "The operating system has blocked the request."},
    {NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch."},
    {NVML_ERROR_IN_USE, "In use by another client"},
    {NVML_ERROR_MEMORY, "Insufficient Memory"},
    {NVML_ERROR_NO_DATA, "No data"},
    {NVML_ERROR_INSUFFICIENT_RESOURCES, "Insufficient Resources"},
    {NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "Argument version mismatch"},
    {NVML_ERROR_UNKNOWN, "Unknown Error"},
};

FG_API const char *nvmlErrorString(nvmlReturn_t r)
{
    for (size_t i = 0; i < sizeof(g_errors) / sizeof(g_errors[0]); i++)
        if (g_errors[i].code == r)
            return g_errors[i].text;
    return "Unknown Error";
}
