/* vlimits.h — parser for the per-container limits file (docs/design.md, contract 2). */
#ifndef VGPU_VLIMITS_H
#define VGPU_VLIMITS_H

#include <stddef.h>
#include <stdint.h>

#include "../include/vgpu_region.h"

#define VGPU_LIMITS_MAX_BYTES 8192

struct vgpu_limit {
    char uuid[VGPU_UUID_LEN];
    uint64_t memory_limit; /* the slice: device-resident + host-resident bytes */
    uint64_t device_limit; /* the physical share: device-resident bytes (<= memory_limit) */
    uint32_t core_percent;
    int oversubscribe;
};

struct vgpu_limits {
    unsigned count;
    struct vgpu_limit dev[VGPU_MAX_DEVICES];
};

/* Parse `len` bytes.  Returns 0, or -1 with a one-line reason in err. */
int vgpu_limits_parse(const char *buf, size_t len, struct vgpu_limits *out, char *err, size_t errlen);

/* Read and parse a file (regular file, at most VGPU_LIMITS_MAX_BYTES).
 * Returns 0; 1 if the file does not exist (ENOENT); -1 with err on any other problem. */
int vgpu_limits_load(const char *path, struct vgpu_limits *out, char *err, size_t errlen);

#endif
