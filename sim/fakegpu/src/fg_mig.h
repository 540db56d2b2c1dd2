/* fakegpu: MIG (Multi-Instance GPU) of the simulated node.
 *
 * Modelled from NVIDIA's documentation (docs/developers/simulators.md "MIG" cites each point):
 * the MIG user guide (supported profiles, placements as `nvidia-smi mig -lgipp` prints them,
 * instance IDs, CUDA enumeration, /dev/nvidia-caps and the mig-minors file) and nvml.h (the MIG
 * API and what it does not offer on MIG devices).
 *
 * A GPU of a MIG-capable product (config key `mig_profiles`) has a MIG mode (current, pending).
 * In MIG mode it is split into GPU instances (GIs: memory slices + SM slices at a placement) and
 * those into compute instances (CIs: SM slices of the GI).  Every CI is a MIG device: it becomes
 * a simulation unit of its own (an index >= ndev in the state's per-device arrays, with its own
 * devcfg: MIG UUID, name, the GI's memory, the CI's SMs), so memory, processes, kernels and
 * utilisation work on it as on a GPU.  The CIs of one GI share its memory (fg_dev_used).
 * All functions here run with the state lock held.
 */
#ifndef FG_MIG_H
#define FG_MIG_H

#include "fg_state.h"

/* NVML return codes the MIG operations answer (nvml.h values) */
#define FG_MIG_OK 0
#define FG_MIG_INVALID 2       /* NVML_ERROR_INVALID_ARGUMENT */
#define FG_MIG_NOT_SUPPORTED 3 /* NVML_ERROR_NOT_SUPPORTED */
#define FG_MIG_NOT_FOUND 6     /* NVML_ERROR_NOT_FOUND */
#define FG_MIG_IN_USE 19       /* NVML_ERROR_IN_USE */
#define FG_MIG_NO_RESOURCES 23 /* NVML_ERROR_INSUFFICIENT_RESOURCES */

#define FG_MIG_PROFILE_COUNT 0x12    /* NVML_GPU_INSTANCE_PROFILE_COUNT */
#define FG_MIG_CI_PROFILE_COUNT 0x9  /* NVML_COMPUTE_INSTANCE_PROFILE_COUNT */

/* A GPU instance profile: one row of `nvidia-smi mig -lgip` plus its `-lgipp` placements. */
struct fg_gi_profile {
    uint32_t index;      /* NVML_GPU_INSTANCE_PROFILE_* (what nvmlDeviceGetGpuInstanceProfileInfo takes) */
    uint32_t id;         /* profile ID (the -lgip "ID" column; what the create calls take) */
    uint32_t slices;     /* SM slices (sliceCount) */
    uint32_t mem_slices; /* memory slices: the placement size */
    uint32_t count;      /* instanceCount */
    uint32_t sm, ce, dec, enc, jpeg, ofa;
    uint64_t mem_mib;
    const char *name;    /* "1g.18gb", "1g.18gb+me" */
    uint32_t nplace;
    uint32_t starts[8];
};

struct fg_mig_table {
    const char *key; /* config value: a100-40gb, h100-80gb, h200-141gb */
    uint32_t nprof;
    struct fg_gi_profile p[8];
};

/* A compute instance profile of a GI profile (nvmlComputeInstanceProfileInfo_t). */
struct fg_ci_profile {
    uint32_t index; /* NVML_COMPUTE_INSTANCE_PROFILE_* == its id */
    uint32_t slices, count, sm;
    uint32_t nplace;
    uint32_t starts[8];
    char name[48]; /* "1c.3g.71gb" or "3g.71gb" */
};

/* config: table index + 1 for a key, 0 for "none", -1 unknown */
int fg_mig_table_key(const char *key);
const struct fg_mig_table *fg_mig_table_of(const struct fg_state *st, int gpu); /* NULL: not capable */
const struct fg_gi_profile *fg_mig_gi_by_index(const struct fg_mig_table *t, uint32_t index);
const struct fg_gi_profile *fg_mig_gi_by_id(const struct fg_mig_table *t, uint32_t id);
/* CI profile `index` of GI profile g: 0, or -1 when the GI profile has no such CI profile. */
int fg_mig_ci_profile(const struct fg_gi_profile *g, uint32_t index, struct fg_ci_profile *out);

int fg_mig_enabled(const struct fg_state *st, int gpu);
/* Sets the pending mode; it takes effect at once when no process uses the GPU (and, to disable,
 * no GPU instance exists), as on Hopper, where enabling needs no reset; else *activation is
 * IN_USE and it stays pending. */
int fg_mig_set_mode(struct fg_state *st, int gpu, unsigned mode, int *activation);

struct fg_mig_gi *fg_mig_gi_get(struct fg_state *st, int gpu, uint32_t gi_id);
struct fg_mig_ci *fg_mig_ci_get(struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_id);
/* start NULL: the driver's choice of placement */
int fg_mig_gi_create(struct fg_state *st, int gpu, uint32_t profile_id, const uint32_t *start, uint32_t *gi_id);
int fg_mig_gi_destroy(struct fg_state *st, int gpu, uint32_t gi_id);
int fg_mig_gi_remaining(const struct fg_state *st, int gpu, uint32_t profile_id, uint32_t *count);
int fg_mig_ci_create(struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_profile, const uint32_t *start,
                     uint32_t *ci_id);
int fg_mig_ci_destroy(struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_id);
int fg_mig_ci_remaining(const struct fg_state *st, int gpu, uint32_t gi_id, uint32_t ci_profile, uint32_t *count);

/* Units: the state index of a MIG device, its parent GPU (the index itself for a GPU) */
int fg_unit_is_mig(const struct fg_state *st, int unit);
int fg_unit_root(const struct fg_state *st, int unit);
/* The MIG devices of a GPU in MIG-device index order (GI id, then CI id); returns the count. */
int fg_mig_units(const struct fg_state *st, int gpu, int out[FG_MAX_DEV]);
/* /dev/nvidia-caps minor numbers (mig-minors): gpu<minor>/gi<g>/access, .../ci<c>/access */
unsigned fg_mig_cap_minor(unsigned gpu_minor, unsigned gi, int ci /* -1: the GI's */);

#endif
