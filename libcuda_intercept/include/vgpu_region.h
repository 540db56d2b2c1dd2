/*
 * vgpu_region.h — the one definition of the per-container shared accounting
 * region (/run/vgpu/region inside a container,
 * /var/lib/vgpu/containers/<id>/region on the host).
 *
 * Readers: every process of the container (libvgpu.so) and the monitor
 * (Python, through vgpu/region.py, whose layout is checked against this
 * header by a compiled test).  The container can write any byte of this file:
 * the monitor validates every field it reads, and libvgpu.so re-checks
 * magic/version/size/counts before trusting the file.
 *
 * All integers are little-endian, naturally aligned, fixed width.  The layout
 * never changes without bumping VGPU_REGION_VERSION.
 *
 * Accounting rule (libvgpu.so): for device d, the container's usage is the sum
 * over ACTIVE slots of device_bytes + host_bytes + max(extra_bytes, ctx_reserve),
 * plus the bytes of every LIVE entry of shared[] on d (memory shared between
 * processes of the container: counted once, whoever holds it), at most
 * memory_limit; its device-resident usage, the same sum without host_bytes, at
 * most device_limit (the physical share).
 * A charge is checked and added under the region lock; a process lowers only
 * its own slot's counters, lock-free (atomic), after the driver freed memory.
 * devices[].used_device/used_host are informational totals, recomputed under
 * the lock at every charge and decremented atomically on frees.
 *
 * Locking: cross-process updates are serialised with an fcntl() record lock
 * (F_OFD_SETLKW) on byte VGPU_REGION_LOCK_BYTE of the file — released by the
 * kernel when a holder dies.  A process's slot is "owned" while that process
 * holds an OFD read lock on byte VGPU_REGION_SLOT_LOCK_BASE + slot index, so
 * liveness is a kernel question (F_OFD_GETLK), never a pid guess.
 */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <stdint.h>

#define VGPU_REGION_MAGIC      0x4e4f494745525056ULL /* "VPREGION" little-endian */
#define VGPU_REGION_VERSION    2u
#define VGPU_MAX_DEVICES       16u
#define VGPU_MAX_SLOTS         1024u
#define VGPU_UUID_LEN          96u   /* NUL-terminated, as NVML's buffer */

/* lock bytes: beyond the end of the data, so locks never overlap data reads */
#define VGPU_REGION_LOCK_BYTE       (1ull << 32)
#define VGPU_REGION_SLOT_LOCK_BASE  ((1ull << 32) + 4096ull)

/* slot states */
#define VGPU_SLOT_FREE   0u
#define VGPU_SLOT_ACTIVE 1u

/* per-device flags */
#define VGPU_DEV_OVERSUBSCRIBE 0x1u

/* the ledger of shared allocations */
#define VGPU_MAX_SHARED        256u
#define VGPU_SHARED_FREE       0u
#define VGPU_SHARED_LIVE       1u
#define VGPU_SHARED_KEYS       4u
#define VGPU_SHARED_FDS        4u

struct vgpu_region_device {
    char     uuid[VGPU_UUID_LEN];  /* GPU UUID ("GPU-...") this entry limits */
    uint64_t memory_limit;         /* bytes; the container's slice (device + host resident) */
    uint32_t core_percent;         /* compute share, 1..100 (may exceed 100 only by scaling) */
    uint32_t flags;                /* VGPU_DEV_* */
    uint64_t used_device;          /* sum over slots of device-resident bytes */
    uint64_t used_host;            /* sum over slots of host-backed (oversubscribed) bytes */
    uint64_t device_limit;         /* bytes; the physical share: device-resident bytes may not
                                      exceed it (a copy of the limits file, like memory_limit) */
    uint64_t reserved[3];
};

struct vgpu_slot_device {
    uint64_t device_bytes;   /* charged by the library, resident on the GPU */
    uint64_t host_bytes;     /* charged by the library, host-backed (managed fallback) */
    uint64_t extra_bytes;    /* written by the monitor: NVML-seen bytes beyond the above */
    uint64_t ctx_reserve;    /* set by the library at this process's first charge on the device:
                                the configured per-context reserve; the limit check counts
                                max(extra_bytes, ctx_reserve) for the slot */
};

struct vgpu_slot {
    uint32_t state;          /* VGPU_SLOT_* */
    int32_t  pid;            /* pid in the container's pid namespace */
    int32_t  host_pid;       /* pid on the host (NSpid first field), 0 if unknown */
    uint32_t reserved0;
    uint64_t start_time;     /* /proc/<pid>/stat field 22 (clock ticks since boot) */
    uint64_t reserved[4];
    struct vgpu_slot_device dev[VGPU_MAX_DEVICES];
};

/* Device memory shared between processes of the container (exported with
 * cuMemExportToShareableHandle or cuIpcGetMemHandle, imported by others): one
 * entry per allocation, counted once for the container while any slot in
 * holders[] holds it, freed with the last holder.  Written under the region
 * lock only. */
struct vgpu_shared {
    uint32_t state;          /* VGPU_SHARED_* */
    uint32_t dev;            /* limits index */
    uint64_t bytes;          /* device memory counted for the container */
    uint64_t generation;     /* bumped whenever the entry is (re)used */
    uint64_t keys[VGPU_SHARED_KEYS];      /* legacy IPC: hashes of the handles handed out, 0 unused */
    int32_t  export_pid[VGPU_SHARED_FDS]; /* a process (container pid) holding a descriptor of */
    int32_t  export_fd[VGPU_SHARED_FDS];  /* the export, for kcmp(KCMP_FILE); pid 0 unused */
    uint64_t holders[VGPU_MAX_SLOTS / 64]; /* bitmap of the slots holding it */
};

struct vgpu_region {
    uint64_t magic;          /* VGPU_REGION_MAGIC */
    uint32_t version;        /* VGPU_REGION_VERSION */
    uint32_t size;           /* sizeof(struct vgpu_region) */
    uint32_t num_devices;    /* valid entries in devices[], <= VGPU_MAX_DEVICES */
    uint32_t num_slots;      /* == VGPU_MAX_SLOTS */
    uint64_t created;        /* unix seconds, set by the hook */
    uint64_t generation;     /* bumped on every accounting change */
    uint32_t slot_hwm;       /* slots at index >= slot_hwm are FREE (library, under the lock) */
    uint32_t shared_hwm;     /* shared[] entries at index >= shared_hwm are FREE (idem) */
    uint64_t reserved[7];
    struct vgpu_region_device devices[VGPU_MAX_DEVICES];
    struct vgpu_slot slots[VGPU_MAX_SLOTS];
    struct vgpu_shared shared[VGPU_MAX_SHARED];
};

#endif /* VGPU_REGION_H */
