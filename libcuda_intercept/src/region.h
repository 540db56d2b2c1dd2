/* region.h — attaching to the shared accounting region, slots, check-and-charge. */
#ifndef VGPU_REGION_INTERNAL_H
#define VGPU_REGION_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../include/vgpu_region.h"
#include "vlimits.h"

enum { VGPU_KIND_DEVICE = 0, VGPU_KIND_HOST = 1 };

/* Open (path) or create a private memfd region (path NULL), map it, validate
 * the header (an empty/all-zero file is initialised), and copy the limits
 * into the device table.  create: make the file if missing (a region named
 * by VGPU_REGION_FILE; the mounted /run/vgpu/region must exist).
 * Returns 0 or -1 with a reason in err. */
int vgpu_rgn_map(const char *path, int create, const struct vgpu_limits *lim, char *err, size_t errlen);
int vgpu_rgn_mapped(void);
/* Take a slot (reclaiming dead ones).  Requires a mapped region. */
int vgpu_rgn_join(char *err, size_t errlen);
int vgpu_rgn_slot(void);

/* Atomically check usage(dev) + n (+ this slot's first context reserve) <=
 * limit and, for a device charge, device-resident usage + n <= dev_limit, and
 * charge n to this process's slot (device_bytes or host_bytes by kind).
 * 0 ok, VGPU_OVER_SLICE or VGPU_OVER_SHARE (device charges only). */
enum { VGPU_OVER_SLICE = -1, VGPU_OVER_SHARE = -2 };
int vgpu_rgn_charge(unsigned dev, uint64_t n, uint64_t limit, uint64_t dev_limit, uint64_t reserve, int kind);
/* Lower this process's charge (lock-free). */
void vgpu_rgn_uncharge(unsigned dev, uint64_t n, int kind);
/* Move n bytes of this slot's charge from device-resident to host-backed. */
void vgpu_rgn_to_host(unsigned dev, uint64_t n);

struct vgpu_usage {
    uint64_t device;  /* device_bytes summed */
    uint64_t host;    /* host_bytes summed */
    uint64_t extra;   /* sum of max(extra_bytes, ctx_reserve) */
};
/* Container usage of a device (no lock; a consistent-enough view). */
void vgpu_rgn_usage(unsigned dev, struct vgpu_usage *u);
/* Reclaim slots whose owner died (takes the lock).  Returns the number freed. */
int vgpu_rgn_reclaim(void);

/* The ledger of device memory shared between processes of the container
 * (vgpu_region.h: shared[]).  A reference is (index + 1) | generation << 32;
 * 0 means none.  This process holds an entry from the call that returns its
 * reference until vgpu_rgn_share_drop (or its death).
 *  - vgpu_rgn_share: n bytes this slot charged become a new entry (0: the
 *    ledger is full and the charge stays with the slot).
 *  - vgpu_rgn_share_charge: a new entry of n bytes, checked against limit as
 *    a charge: 0 ok (*ref), -1 over the limit or full.
 *  - vgpu_rgn_share_find_key / _find_fd: hold the entry whose legacy IPC
 *    handle hash is key / whose export descriptor is the same open file as fd.
 *  - _add_key / _add_fd: what importers will look for (fd: a descriptor this
 *    process keeps open until it drops the entry). */
uint64_t vgpu_rgn_share(unsigned dev, uint64_t n);
int vgpu_rgn_share_charge(unsigned dev, uint64_t n, uint64_t limit, uint64_t dev_limit, uint64_t *ref);
uint64_t vgpu_rgn_share_find_key(uint64_t key);
uint64_t vgpu_rgn_share_find_fd(int fd);
void vgpu_rgn_share_add_key(uint64_t ref, uint64_t key);
int vgpu_rgn_share_add_fd(uint64_t ref, int fd);
void vgpu_rgn_share_drop(uint64_t ref);

/* fork handlers */
void vgpu_rgn_atfork_prepare(void);
void vgpu_rgn_atfork_parent(void);
void vgpu_rgn_atfork_child(void);

static inline uint64_t vgpu_sat_add(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

#endif
