/* fakegpu libnvidia-ml: the MIG API (nvml.h "Multi Instance GPU Management").
 *
 * The state lives in fg_mig.c; here the ABI: the profile, placement and instance structs of
 * nvml.h (sizes checked below), opaque GPU/compute instance handles, MIG device handles (the
 * nvmlDevice_t of a compute instance: its simulation unit, nvml_core.c), and the answers nvml.h
 * documents: NOT_SUPPORTED where MIG is off or the profile is not on the product, INVALID_ARGUMENT
 * for unknown profiles, placements and stale handles, INSUFFICIENT_RESOURCES when an instance
 * does not fit, IN_USE to destroy an instance with processes or compute instances.
 * Reads of the MIG layout take the state lock: none of these calls is on a monitor's hot path.
 */
#include "fg_mig.h"
#include "fg_nvml.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define GI_MAGIC 0x4d494749u
#define CI_MAGIC 0x4d494743u
#define MAX_GI_ID 16
#define MAX_CI_ID FG_MIG_MAX_CI
#define NAME_V2 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */

struct nvml_gi {
    uint32_t magic;
    int gpu;
    uint32_t id;
};

struct nvml_ci {
    uint32_t magic;
    int gpu;
    uint32_t gi, ci;
};

typedef struct {
    struct nvml_gi *handle;
} fg_gi_t; /* nvmlGpuInstance_t */

typedef struct {
    struct nvml_ci *handle;
} fg_ci_t; /* nvmlComputeInstance_t */

typedef struct {
    unsigned start, size;
} fg_placement; /* nvmlGpuInstancePlacement_t, nvmlComputeInstancePlacement_t */

typedef struct {
    unsigned id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount,
        encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} fg_gi_info_v1;

typedef struct {
    unsigned version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount,
        decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[NAME_V2];
} fg_gi_info_v2;

typedef struct {
    unsigned version, id, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount, encoderCount,
        jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[NAME_V2];
    unsigned capabilities;
} fg_gi_info_v3;

typedef struct {
    nvmlDevice_t device;
    unsigned id, profileId;
    fg_placement placement;
} fg_gi_instance_info;

typedef struct {
    unsigned id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} fg_ci_info_v1;

typedef struct {
    unsigned version, id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[NAME_V2];
} fg_ci_info_v2;

typedef struct {
    unsigned version, id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[NAME_V2];
    unsigned capabilities;
} fg_ci_info_v3;

typedef struct {
    nvmlDevice_t device;
    fg_gi_t gpuInstance;
    unsigned id, profileId;
    fg_placement placement;
} fg_ci_instance_info;

typedef struct { /* nvmlDeviceAttributes_t */
    unsigned multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount, gpuInstanceSliceCount, computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} fg_attributes;

_Static_assert(sizeof(fg_gi_info_v1) == 48, "nvmlGpuInstanceProfileInfo_t");
_Static_assert(sizeof(fg_gi_info_v2) == 152, "nvmlGpuInstanceProfileInfo_v2_t");
_Static_assert(sizeof(fg_gi_info_v3) == 152, "nvmlGpuInstanceProfileInfo_v3_t");
_Static_assert(sizeof(fg_gi_instance_info) == 24, "nvmlGpuInstanceInfo_t");
_Static_assert(sizeof(fg_ci_info_v1) == 36, "nvmlComputeInstanceProfileInfo_t");
_Static_assert(sizeof(fg_ci_info_v2) == 136, "nvmlComputeInstanceProfileInfo_v2_t");
_Static_assert(sizeof(fg_ci_info_v3) == 140, "nvmlComputeInstanceProfileInfo_v3_t");
_Static_assert(sizeof(fg_ci_instance_info) == 32, "nvmlComputeInstanceInfo_t");
_Static_assert(sizeof(fg_attributes) == 40, "nvmlDeviceAttributes_t");

/* NVML_STRUCT_VERSION(name, v): sizeof | v << 24 */
#define GI_INFO_V2 (unsigned)(sizeof(fg_gi_info_v2) | (2u << 24))
#define GI_INFO_V3 (unsigned)(sizeof(fg_gi_info_v3) | (3u << 24))
#define CI_INFO_V2 (unsigned)(sizeof(fg_ci_info_v2) | (2u << 24))
#define CI_INFO_V3 (unsigned)(sizeof(fg_ci_info_v3) | (3u << 24))

static struct nvml_gi g_gih[FG_MAX_GPU][MAX_GI_ID];
static struct nvml_ci g_cih[FG_MAX_GPU][MAX_GI_ID][MAX_CI_ID];

/* A GPU (not a MIG device) handle: 0 with *gpu set, else the NVML error. */
static nvmlReturn_t gpu_of(nvmlDevice_t d, int *gpu)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 1, &i);
    if (rc)
        return rc;
    if (fg_unit_is_mig(fg_g.st, i))
        return NVML_ERROR_NOT_SUPPORTED;
    *gpu = i;
    return NVML_SUCCESS;
}

/* A MIG device handle: 0 with *unit set; a GPU handle: NOT_SUPPORTED ("not supported by the device"). */
static nvmlReturn_t mig_of(nvmlDevice_t d, int *unit)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!fg_unit_is_mig(fg_g.st, i))
        return NVML_ERROR_NOT_SUPPORTED;
    *unit = i;
    return NVML_SUCCESS;
}

static int privileged(void)
{
    /* "Requires privileged user" (nvml.h): root, which has every nvidia-capability */
    return geteuid() == 0;
}

static fg_gi_t gi_handle(int gpu, uint32_t id)
{
    struct nvml_gi *h = &g_gih[gpu][id % MAX_GI_ID];
    h->magic = GI_MAGIC;
    h->gpu = gpu;
    h->id = id;
    return (fg_gi_t){h};
}

static fg_ci_t ci_handle(int gpu, uint32_t gi, uint32_t ci)
{
    struct nvml_ci *h = &g_cih[gpu][gi % MAX_GI_ID][ci % MAX_CI_ID];
    h->magic = CI_MAGIC;
    h->gpu = gpu;
    h->gi = gi;
    h->ci = ci;
    return (fg_ci_t){h};
}

/* With the lock held: the GI of a handle, NULL if the handle is bad or the instance gone. */
static struct fg_mig_gi *gi_of(fg_gi_t g)
{
    struct nvml_gi *h = g.handle;
    const struct nvml_gi *lo = &g_gih[0][0], *hi = lo + sizeof(g_gih) / sizeof(g_gih[0][0]);
    if (!h || h < lo || h >= hi || h->magic != GI_MAGIC)
        return NULL;
    return fg_mig_gi_get(fg_g.st, h->gpu, h->id);
}

static struct fg_mig_ci *ci_of(fg_ci_t c)
{
    struct nvml_ci *h = c.handle;
    const struct nvml_ci *lo = &g_cih[0][0][0], *hi = lo + sizeof(g_cih) / sizeof(g_cih[0][0][0]);
    if (!h || h < lo || h >= hi || h->magic != CI_MAGIC)
        return NULL;
    return fg_mig_ci_get(fg_g.st, h->gpu, h->gi, h->ci);
}

/* --- mode and MIG devices ------------------------------------------------------------------ */

FG_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *cur, unsigned int *pending)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!cur || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (fg_g.st->cfg[gpu].mig_table == FG_MIG_INCAPABLE)
        return NVML_ERROR_NOT_SUPPORTED; /* "If device doesn't support MIG mode" */
    /* a GPU without a profile table reads as a MIG-capable GPU with MIG disabled */
    *cur = __atomic_load_n(&fg_g.st->mig[gpu].mode, __ATOMIC_ACQUIRE);
    *pending = __atomic_load_n(&fg_g.st->mig[gpu].pending, __ATOMIC_ACQUIRE);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t d, unsigned int mode, nvmlReturn_t *activation)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!activation || mode > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!privileged())
        return NVML_ERROR_NO_PERMISSION;
    int act = 0;
    fg_lock();
    rc = fg_mig_set_mode(fg_g.st, gpu, mode, &act);
    fg_unlock();
    *activation = act;
    return rc;
}

/* nvml.h: "Returns zero if MIG is not supported or enabled"; else the most MIG devices the GPU can
 * hold: 7 (the guide's "Max Number of Instances"). */
FG_API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = fg_mig_table_of(fg_g.st, gpu) && fg_mig_enabled(fg_g.st, gpu) ? 7 : 0;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig)
{
    int i;
    nvmlReturn_t rc = fg_nvml_dev(d, 0, &i);
    if (rc)
        return rc;
    if (!is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = fg_unit_is_mig(fg_g.st, i) ? 1 : 0;
    return NVML_SUCCESS;
}

/* MIG device indices: the MIG devices this process may use, by GI id then CI id (nvidia-smi -L
 * numbers the MIG devices of a GPU so); an index past them: NOT_FOUND (go-nvlib skips it). */
FG_API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *out)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc == NVML_ERROR_NOT_SUPPORTED ? NVML_ERROR_INVALID_ARGUMENT : rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!fg_mig_enabled(fg_g.st, gpu))
        return NVML_ERROR_NOT_FOUND;
    int units[FG_MAX_DEV], n = fg_mig_units(fg_g.st, gpu, units);
    unsigned k = 0;
    for (int j = 0; j < n; j++) {
        if (!fg_nvml_mig_usable(units[j]))
            continue;
        if (k++ == index) {
            *out = fg_nvml_handle(units[j]);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

FG_API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *out)
{
    int unit;
    nvmlReturn_t rc = mig_of(mig, &unit);
    if (rc)
        return rc == NVML_ERROR_NOT_SUPPORTED ? NVML_ERROR_INVALID_ARGUMENT : rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = fg_nvml_handle(fg_unit_root(fg_g.st, unit));
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id)
{
    int unit;
    nvmlReturn_t rc = mig_of(d, &unit);
    if (rc)
        return rc;
    if (!id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = fg_g.st->unit[unit].gi;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t d, unsigned int *id)
{
    int unit;
    nvmlReturn_t rc = mig_of(d, &unit);
    if (rc)
        return rc;
    if (!id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = fg_g.st->unit[unit].ci;
    return NVML_SUCCESS;
}

/* nvml.h: "This API currently only supports MIG device handles." */
FG_API nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t d, fg_attributes *a)
{
    int unit;
    nvmlReturn_t rc = mig_of(d, &unit);
    if (rc)
        return rc;
    if (!a)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fg_state *st = fg_g.st;
    fg_lock();
    int gpu = fg_unit_root(st, unit);
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    struct fg_mig_gi *gi = fg_mig_gi_get(st, gpu, st->unit[unit].gi);
    struct fg_mig_ci *ci = fg_mig_ci_get(st, gpu, st->unit[unit].gi, st->unit[unit].ci);
    const struct fg_gi_profile *p = gi ? fg_mig_gi_by_id(t, gi->profile_id) : NULL;
    if (!p || !ci) {
        fg_unlock();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    memset(a, 0, sizeof(*a));
    a->multiprocessorCount = st->cfg[unit].sm_count;
    a->sharedCopyEngineCount = p->ce;
    a->sharedDecoderCount = p->dec;
    a->sharedEncoderCount = p->enc;
    a->sharedJpegCount = p->jpeg;
    a->sharedOfaCount = p->ofa;
    a->gpuInstanceSliceCount = p->slices;
    a->computeInstanceSliceCount = ci->size;
    a->memorySizeMB = p->mem_mib;
    fg_unlock();
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t d, fg_attributes *a)
{
    return nvmlDeviceGetAttributes_v2(d, a);
}

/* --- GPU instance profiles ----------------------------------------------------------------- */

/* The profile `index` of a GPU in MIG mode.  nvml.h: INVALID_ARGUMENT past the profiles NVML knows
 * (callers enumerate "until the API returns NVML_ERROR_INVALID_ARGUMENT"), NOT_SUPPORTED when MIG
 * is off or the product has no such profile (go-nvlib skips both). */
static nvmlReturn_t gi_profile(nvmlDevice_t d, int by_id, unsigned key, const struct fg_gi_profile **out)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!by_id && key >= FG_MIG_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fg_mig_table *t = fg_mig_table_of(fg_g.st, gpu);
    if (!t || !fg_mig_enabled(fg_g.st, gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    *out = by_id ? fg_mig_gi_by_id(t, key) : fg_mig_gi_by_index(t, key);
    if (!*out)
        return by_id ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static void profile_name(char *dst, const char *name)
{
    snprintf(dst, NAME_V2, "MIG %s", name); /* as nvidia-smi mig -lgip prints it */
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t d, unsigned int profile, fg_gi_info_v1 *info)
{
    const struct fg_gi_profile *p;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = gi_profile(d, 0, profile, &p);
    if (rc)
        return rc;
    *info = (fg_gi_info_v1){p->id, 0, p->slices, p->count, p->sm, p->ce, p->dec, p->enc, p->jpeg, p->ofa, p->mem_mib};
    return NVML_SUCCESS;
}

static nvmlReturn_t gi_info_versioned(nvmlDevice_t d, int by_id, unsigned key, void *out)
{
    const struct fg_gi_profile *p;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned version = *(unsigned *)out;
    if (version != GI_INFO_V2 && version != GI_INFO_V3)
        return NVML_ERROR_INVALID_ARGUMENT; /* "info->version are invalid" */
    nvmlReturn_t rc = gi_profile(d, by_id, key, &p);
    if (rc)
        return rc;
    if (version == GI_INFO_V2) {
        fg_gi_info_v2 *i = out;
        memset(i, 0, sizeof(*i));
        *i = (fg_gi_info_v2){version, p->id, 0, p->slices, p->count, p->sm, p->ce, p->dec, p->enc, p->jpeg, p->ofa,
                             p->mem_mib, {0}};
        profile_name(i->name, p->name);
    } else {
        fg_gi_info_v3 *i = out;
        memset(i, 0, sizeof(*i));
        *i = (fg_gi_info_v3){version, p->id, p->slices, p->count, p->sm, p->ce, p->dec, p->enc, p->jpeg, p->ofa,
                             p->mem_mib, {0}, 0};
        profile_name(i->name, p->name);
    }
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t d, unsigned int profile, void *info)
{
    return gi_info_versioned(d, 0, profile, info);
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t d, unsigned int profile_id, void *info)
{
    return gi_info_versioned(d, 1, profile_id, info);
}

/* "returns all the possible placements for the given profile regardless of whether MIG is enabled" */
FG_API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t d, unsigned int profile_id,
                                                                  fg_placement *placements, unsigned int *count)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fg_mig_table *t = fg_mig_table_of(fg_g.st, gpu);
    if (!t)
        return NVML_ERROR_NOT_SUPPORTED;
    const struct fg_gi_profile *p = fg_mig_gi_by_id(t, profile_id);
    if (!p)
        return NVML_ERROR_NOT_SUPPORTED;
    if (placements) {
        if (*count < p->nplace) {
            *count = p->nplace;
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (uint32_t k = 0; k < p->nplace; k++)
            placements[k] = (fg_placement){p->starts[k], p->mem_slices};
    }
    *count = p->nplace;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t d, unsigned int profile_id,
                                                              unsigned int *count)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t n = 0;
    fg_lock();
    rc = fg_mig_gi_remaining(fg_g.st, gpu, profile_id, &n);
    fg_unlock();
    if (rc == NVML_SUCCESS)
        *count = n;
    return rc;
}

/* --- GPU instances ------------------------------------------------------------------------- */

static nvmlReturn_t gi_create(nvmlDevice_t d, unsigned profile_id, const fg_placement *pl, fg_gi_t *out)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!privileged())
        return NVML_ERROR_NO_PERMISSION;
    uint32_t id, start = pl ? pl->start : 0;
    fg_lock();
    if (pl) {
        const struct fg_gi_profile *p = fg_mig_gi_by_id(fg_mig_table_of(fg_g.st, gpu), profile_id);
        if (p && pl->size != p->mem_slices) {
            fg_unlock();
            return NVML_ERROR_INVALID_ARGUMENT;
        }
    }
    rc = fg_mig_gi_create(fg_g.st, gpu, profile_id, pl ? &start : NULL, &id);
    fg_unlock();
    if (rc == NVML_SUCCESS)
        *out = gi_handle(gpu, id);
    return rc;
}

FG_API nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t d, unsigned int profile_id, fg_gi_t *out)
{
    return gi_create(d, profile_id, NULL, out);
}

FG_API nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t d, unsigned int profile_id,
                                                             const fg_placement *placement, fg_gi_t *out)
{
    if (!placement)
        return NVML_ERROR_INVALID_ARGUMENT;
    return gi_create(d, profile_id, placement, out);
}

FG_API nvmlReturn_t nvmlGpuInstanceDestroy(fg_gi_t g)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!privileged())
        return NVML_ERROR_NO_PERMISSION;
    fg_lock();
    struct fg_mig_gi *gi = gi_of(g);
    rc = gi ? (nvmlReturn_t)fg_mig_gi_destroy(fg_g.st, g.handle->gpu, gi->id) : NVML_ERROR_INVALID_ARGUMENT;
    fg_unlock();
    return rc;
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t d, unsigned int profile_id, fg_gi_t *out,
                                              unsigned int *count)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!count || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fg_state *st = fg_g.st;
    const struct fg_mig_table *t = fg_mig_table_of(st, gpu);
    if (!t || !fg_mig_enabled(st, gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    if (!fg_mig_gi_by_id(t, profile_id))
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    fg_lock();
    for (int g = 0; g < FG_MIG_MAX_GI; g++)
        if (st->mig[gpu].gi[g].used && st->mig[gpu].gi[g].profile_id == profile_id)
            out[n++] = gi_handle(gpu, st->mig[gpu].gi[g].id);
    fg_unlock();
    *count = n;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t d, unsigned int id, fg_gi_t *out)
{
    int gpu;
    nvmlReturn_t rc = gpu_of(d, &gpu);
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!fg_mig_table_of(fg_g.st, gpu) || !fg_mig_enabled(fg_g.st, gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    fg_lock();
    int found = fg_mig_gi_get(fg_g.st, gpu, id) != NULL;
    fg_unlock();
    if (!found)
        return NVML_ERROR_NOT_FOUND;
    *out = gi_handle(gpu, id);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetInfo(fg_gi_t g, fg_gi_instance_info *info)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    fg_lock();
    struct fg_mig_gi *gi = gi_of(g);
    if (gi)
        *info = (fg_gi_instance_info){fg_nvml_handle(g.handle->gpu), gi->id, gi->profile_id, {gi->start, gi->size}};
    fg_unlock();
    return gi ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* --- compute instance profiles ------------------------------------------------------------- */

/* With the lock held. */
static nvmlReturn_t ci_profile(fg_gi_t g, unsigned index, struct fg_ci_profile *cp, struct fg_mig_gi **gip)
{
    struct fg_mig_gi *gi = gi_of(g);
    if (!gi)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= FG_MIG_CI_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fg_gi_profile *p = fg_mig_gi_by_id(fg_mig_table_of(fg_g.st, g.handle->gpu), gi->profile_id);
    if (fg_mig_ci_profile(p, index, cp) != 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (gip)
        *gip = gi;
    return NVML_SUCCESS;
}

static const struct fg_gi_profile *gi_profile_of(fg_gi_t g)
{
    struct fg_mig_gi *gi = gi_of(g);
    return gi ? fg_mig_gi_by_id(fg_mig_table_of(fg_g.st, g.handle->gpu), gi->profile_id) : NULL;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(fg_gi_t g, unsigned int profile,
                                                                 unsigned int eng_profile, fg_ci_info_v1 *info)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!info || eng_profile != 0) /* NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED only */
        return info ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    struct fg_ci_profile cp;
    fg_lock();
    rc = ci_profile(g, profile, &cp, NULL);
    const struct fg_gi_profile *p = gi_profile_of(g);
    if (rc == NVML_SUCCESS && p)
        *info = (fg_ci_info_v1){cp.index, cp.slices, cp.count, cp.sm, p->ce, p->dec, p->enc, p->jpeg, p->ofa};
    fg_unlock();
    return rc;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(fg_gi_t g, unsigned int profile,
                                                                  unsigned int eng_profile, void *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned version = *(unsigned *)out;
    if (version != CI_INFO_V2 && version != CI_INFO_V3)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (eng_profile != 0)
        return NVML_ERROR_NOT_SUPPORTED;
    struct fg_ci_profile cp;
    fg_lock();
    rc = ci_profile(g, profile, &cp, NULL);
    const struct fg_gi_profile *p = gi_profile_of(g);
    if (rc == NVML_SUCCESS && p) {
        /* v2 and v3 differ only by v3's trailing capabilities (0: no graphics) */
        fg_ci_info_v3 i;
        memset(&i, 0, sizeof(i));
        i.version = version;
        i.id = cp.index;
        i.sliceCount = cp.slices;
        i.instanceCount = cp.count;
        i.multiprocessorCount = cp.sm;
        i.sharedCopyEngineCount = p->ce;
        i.sharedDecoderCount = p->dec;
        i.sharedEncoderCount = p->enc;
        i.sharedJpegCount = p->jpeg;
        i.sharedOfaCount = p->ofa;
        snprintf(i.name, sizeof(i.name), "MIG %s", cp.name);
        memcpy(out, &i, version == CI_INFO_V2 ? sizeof(fg_ci_info_v2) : sizeof(fg_ci_info_v3));
    }
    fg_unlock();
    return rc;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetComputeInstancePossiblePlacements(fg_gi_t g, unsigned int profile_id,
                                                                        fg_placement *placements, unsigned int *count)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fg_ci_profile cp;
    fg_lock();
    rc = ci_profile(g, profile_id, &cp, NULL);
    fg_unlock();
    if (rc)
        return rc;
    if (placements) {
        if (*count < cp.nplace) {
            *count = cp.nplace;
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (uint32_t k = 0; k < cp.nplace; k++)
            placements[k] = (fg_placement){cp.starts[k], cp.slices};
    }
    *count = cp.nplace;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(fg_gi_t g, unsigned int profile_id,
                                                                       unsigned int *count)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t n = 0;
    fg_lock();
    struct fg_mig_gi *gi = gi_of(g);
    rc = gi ? (nvmlReturn_t)fg_mig_ci_remaining(fg_g.st, g.handle->gpu, gi->id, profile_id, &n)
            : NVML_ERROR_INVALID_ARGUMENT;
    fg_unlock();
    if (rc == NVML_SUCCESS)
        *count = n;
    return rc;
}

/* --- compute instances --------------------------------------------------------------------- */

static nvmlReturn_t ci_create(fg_gi_t g, unsigned profile_id, const fg_placement *pl, fg_ci_t *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!privileged())
        return NVML_ERROR_NO_PERMISSION;
    uint32_t id, start = pl ? pl->start : 0;
    fg_lock();
    struct fg_mig_gi *gi = gi_of(g);
    struct fg_ci_profile cp;
    if (!gi) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (pl && (ci_profile(g, profile_id, &cp, NULL) != NVML_SUCCESS || pl->size != cp.slices)) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        uint32_t gi_id = gi->id;
        rc = fg_mig_ci_create(fg_g.st, g.handle->gpu, gi_id, profile_id, pl ? &start : NULL, &id);
        if (rc == NVML_SUCCESS)
            *out = ci_handle(g.handle->gpu, gi_id, id);
    }
    fg_unlock();
    return rc;
}

FG_API nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(fg_gi_t g, unsigned int profile_id, fg_ci_t *out)
{
    return ci_create(g, profile_id, NULL, out);
}

FG_API nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(fg_gi_t g, unsigned int profile_id,
                                                                      const fg_placement *placement, fg_ci_t *out)
{
    if (!placement)
        return NVML_ERROR_INVALID_ARGUMENT;
    return ci_create(g, profile_id, placement, out);
}

FG_API nvmlReturn_t nvmlComputeInstanceDestroy(fg_ci_t c)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!privileged())
        return NVML_ERROR_NO_PERMISSION;
    fg_lock();
    struct fg_mig_ci *ci = ci_of(c);
    rc = ci ? (nvmlReturn_t)fg_mig_ci_destroy(fg_g.st, c.handle->gpu, c.handle->gi, ci->id)
            : NVML_ERROR_INVALID_ARGUMENT;
    fg_unlock();
    return rc;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(fg_gi_t g, unsigned int profile_id, fg_ci_t *out,
                                                       unsigned int *count)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!out || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fg_ci_profile cp;
    unsigned n = 0;
    fg_lock();
    struct fg_mig_gi *gi = NULL;
    rc = ci_profile(g, profile_id, &cp, &gi);
    for (int c = 0; rc == NVML_SUCCESS && c < FG_MIG_MAX_CI; c++)
        if (gi->ci[c].used && gi->ci[c].profile == profile_id)
            out[n++] = ci_handle(g.handle->gpu, gi->id, gi->ci[c].id);
    fg_unlock();
    if (rc == NVML_SUCCESS)
        *count = n;
    return rc;
}

FG_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(fg_gi_t g, unsigned int id, fg_ci_t *out)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    fg_lock();
    struct fg_mig_gi *gi = gi_of(g);
    int found = gi && fg_mig_ci_get(fg_g.st, g.handle->gpu, gi->id, id);
    if (found)
        *out = ci_handle(g.handle->gpu, gi->id, id);
    fg_unlock();
    return !gi ? NVML_ERROR_INVALID_ARGUMENT : found ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t ci_info(fg_ci_t c, fg_ci_instance_info *info, int v2)
{
    nvmlReturn_t rc = fg_nvml_check();
    if (rc)
        return rc;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    fg_lock();
    struct fg_mig_ci *ci = ci_of(c);
    if (ci) {
        fg_ci_instance_info i = {fg_nvml_handle(c.handle->gpu), gi_handle(c.handle->gpu, c.handle->gi), ci->id,
                                 ci->profile, {ci->start, ci->size}};
        /* the v1 struct ends before the placement */
        memcpy(info, &i, v2 ? sizeof(i) : offsetof(fg_ci_instance_info, placement));
    }
    fg_unlock();
    return ci ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

FG_API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(fg_ci_t c, fg_ci_instance_info *info)
{
    return ci_info(c, info, 1);
}

FG_API nvmlReturn_t nvmlComputeInstanceGetInfo(fg_ci_t c, fg_ci_instance_info *info)
{
    return ci_info(c, info, 0);
}
