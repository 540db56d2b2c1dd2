/* fakegpu libnvidia-ml: event sets.  XIDs are injected into the shared state by fakegpu-ctl
 * (`xid INDEX XID`, and XID 79 "fallen off the bus" by `lost INDEX`); a set registered for
 * nvmlEventTypeXidCriticalError on a device receives the XIDs injected after registration. */
#include "fg_mig.h"
#include "fg_nvml.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SET_MAGIC 0x45565345u

struct nvml_evset {
    uint32_t magic;
    uint64_t mask[FG_MAX_DEV];
    uint64_t cursor[FG_MAX_DEV]; /* last xid sequence delivered/skipped */
};

typedef struct { /* nvmlEventData_t */
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} fg_event_data;

static pthread_mutex_t g_emu = PTHREAD_MUTEX_INITIALIZER;

FG_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvml_evset *s = calloc(1, sizeof(*s));
    if (!s)
        return NVML_ERROR_MEMORY;
    s->magic = SET_MAGIC;
    *out = s;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t s)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!s || s->magic != SET_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    s->magic = 0;
    free(s);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    if (!types)
        return NVML_ERROR_INVALID_ARGUMENT;
    *types = NVML_EVENTS_SUPPORTED;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t s)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    if (!s || s->magic != SET_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~NVML_EVENTS_SUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    /* nvml.h: "This API does not currently support per-instance event reporting using MIG device
     * handles"; a GPU's set gets its MIG instances' events with their GI and CI ids. */
    if (fg_unit_is_mig(fg_g.st, i))
        return NVML_ERROR_NOT_SUPPORTED;
    uint64_t seq = __atomic_load_n(&fg_g.st->ds[i].xid_seq, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&g_emu);
    if (!(s->mask[i] & NVML_EVENT_XID))
        s->cursor[i] = seq;
    s->mask[i] |= types;
    pthread_mutex_unlock(&g_emu);
    return NVML_SUCCESS;
}

/* Delivers the oldest pending event of the registered devices. */
static int poll_once(struct nvml_evset *s, fg_event_data *out, int full)
{
    struct fg_state *st = fg_g.st;
    int got = 0;
    pthread_mutex_lock(&g_emu);
    if (fg_lock_timed(FG_READ_TIMEOUT_NS) != 0) { /* try again at the next poll */
        pthread_mutex_unlock(&g_emu);
        return 0;
    }
    for (;;) {
        int best = -1;
        uint64_t best_seq = 0, best_time = 0;
        for (unsigned i = 0; i < st->h.ndev; i++) {
            if (!(s->mask[i] & NVML_EVENT_XID))
                continue;
            struct fg_devstate *ds = &st->ds[i];
            if (ds->xid_seq <= s->cursor[i])
                continue;
            uint64_t seq = s->cursor[i] + 1;
            if (ds->xid_seq - seq >= FG_XID_RING) /* overwritten: skip to the oldest kept */
                seq = ds->xid_seq - FG_XID_RING + 1;
            const struct fg_xid *x = &ds->xids[seq % FG_XID_RING];
            if (x->seq != seq) { /* torn entry: skip it */
                s->cursor[i] = seq;
                continue;
            }
            if (best < 0 || x->time_ns < best_time) {
                best = (int)i;
                best_seq = seq;
                best_time = x->time_ns;
            }
        }
        if (best < 0)
            break;
        const struct fg_xid *x = &st->ds[best].xids[best_seq % FG_XID_RING];
        s->cursor[best] = best_seq;
        out->device = fg_nvml_handle(best);
        out->eventType = NVML_EVENT_XID;
        out->eventData = x->xid;
        if (full) {
            out->gpuInstanceId = x->gi;
            out->computeInstanceId = x->ci;
        }
        got = 1;
        break;
    }
    fg_unlock();
    pthread_mutex_unlock(&g_emu);
    return got;
}

static nvmlReturn_t wait(nvmlEventSet_t s, fg_event_data *data, unsigned timeout_ms, int full)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!s || s->magic != SET_MAGIC || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = fg_now() + (uint64_t)timeout_ms * 1000000ULL;
    for (;;) {
        if (poll_once(s, data, full))
            return NVML_SUCCESS;
        uint64_t now = fg_now();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        uint64_t nap = deadline - now < 5000000ULL ? deadline - now : 5000000ULL;
        struct timespec ts = {0, (long)nap};
        nanosleep(&ts, NULL);
    }
}

FG_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t s, fg_event_data *data, unsigned int timeout_ms)
{
    return wait(s, data, timeout_ms, 1);
}

/* v1 nvmlEventData_t has no instance ids: only the first three fields are written. */
FG_API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t s, fg_event_data *data, unsigned int timeout_ms)
{
    return wait(s, data, timeout_ms, 0);
}
