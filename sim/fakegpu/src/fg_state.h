/* fakegpu: the shared state of the simulated node.
 *
 * One fixed-size file (FAKEGPU_STATE, default /tmp/fakegpu.state), mmapped by every process that
 * uses the fake libcuda.so.1 / libnvidia-ml.so.1 and by fakegpu-ctl.  Layout below; see
 * docs/developers/simulators.md.  All fields are changed only under the global lock (fg_lock/fg_unlock):
 * a process-local mutex plus an fcntl OFD write lock on byte FG_LOCK_GLOBAL of the file, which the
 * kernel releases when the holder dies.  A process owns its slot while it holds an OFD read lock
 * on byte FG_LOCK_SLOT0 + slot; a slot whose lock nobody holds belongs to a dead process and is
 * reclaimed (memory, contexts, queued kernels) by whoever notices first.
 */
#ifndef FG_STATE_H
#define FG_STATE_H

#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

#define FG_MAGIC 0x5550474b414546ULL /* "FAKGPU\0" little endian-ish */
#define FG_VERSION 2u

#define FG_MAX_GPU 8  /* GPUs of the configuration */
#define FG_MAX_DEV 16 /* simulation units: the GPUs, then MIG devices (fg_mig.h) at indices >= ndev */
#define FG_MAX_SLOTS 384 /* processes on the node at once (256 of one container, and the rest) */
#define FG_MASK_WORDS (FG_MAX_SLOTS / 64)
#define FG_MAX_SHARED 256 /* shared (exported/imported) allocations on the node */
#define FG_MAX_STREAMS 16 /* per process per device; 0 = legacy default, 1 = per-thread default */
#define FG_QENT 16        /* run-length entries per stream queue */
#define FG_RING 128       /* utilisation periods kept per process/device and per device */
#define FG_XID_RING 32

#define FG_LOCK_GLOBAL (1LL << 40)
#define FG_LOCK_SLOT0 ((1LL << 40) + 4096)

#define FG_SLOT_FREE 0u
#define FG_SLOT_LIVE 1u

#define FG_UUID_LEN 96
#define FG_NAME_LEN 96
#define FG_BUSID_LEN 32

struct fg_devcfg {
    char uuid[FG_UUID_LEN];       /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char name[FG_NAME_LEN];
    char pci_bus_id[FG_BUSID_LEN]; /* "00000000:65:00.0" */
    uint64_t memory;               /* bytes */
    uint64_t context_overhead;     /* bytes charged per context, shown by NVML, not by allocations */
    uint64_t reserved;             /* bytes NVML reports as reserved (memory v2) */
    int32_t numa_node;
    uint32_t pci_device_id;        /* e.g. 0x233010de */
    uint32_t sm_count;
    uint32_t cc_major, cc_minor;
    uint32_t minor_number;
    uint64_t memory_bandwidth;    /* bytes/s a kernel reads device memory at (HBM) */
    uint64_t host_link_bandwidth; /* bytes/s a kernel reads host memory at (PCIe, one direction) */
    uint32_t mig_table; /* MIG profile table (fg_mig.c) + 1; 0: no table (MIG reads disabled); FG_MIG_INCAPABLE */
    uint32_t mig_mode;  /* MIG mode at state creation */
};

struct fg_period {
    uint64_t idx;  /* period number: floor(t / period_ns) */
    uint64_t busy; /* ns of kernel execution inside the period */
};

struct fg_qent {
    uint64_t dur; /* ns per kernel */
    uint32_t n;   /* kernels with this duration, in launch order */
    uint32_t pad;
};

struct fg_stream {
    uint32_t in_use;
    uint32_t count;    /* pending kernels (queued + running) */
    uint32_t head;     /* first qent */
    uint32_t nent;     /* qents used */
    uint64_t progress; /* ns already executed of the head kernel */
    uint64_t pending_ns;
    struct fg_qent q[FG_QENT];
};

struct fg_pdev { /* one process on one device */
    uint64_t mem_device;       /* cuMemAlloc*, pitch, arrays, VMM handles, pool reservations */
    uint64_t mem_managed_dev;  /* managed allocations resident on the device */
    uint64_t mem_managed_host; /* managed allocations that did not fit (host-resident) */
    uint32_t contexts;         /* each costs devcfg.context_overhead */
    uint32_t rr_stream;        /* stream that runs during this process's slice */
    uint64_t exec_ns;          /* ground truth: kernel time executed on the device */
    uint64_t launched, completed;
    struct fg_stream streams[FG_MAX_STREAMS];
    struct fg_period periods[FG_RING];
};

struct fg_slot {
    uint32_t state;
    int32_t pid;          /* in its own pid namespace */
    uint64_t pidns;       /* inode of /proc/self/ns/pid */
    uint64_t start_time;  /* /proc/self/stat field 22 (clock ticks after boot) */
    int32_t host_pid;     /* cached by a resolver in the initial pid namespace, 0 if unknown */
    uint32_t pad;
    uint64_t generation;  /* bumped at every registration */
    char comm[16];
    struct fg_pdev dev[FG_MAX_DEV];
};

struct fg_xid {
    uint64_t seq;
    uint64_t xid;
    uint64_t time_ns;
    uint32_t gi, ci; /* the MIG instance it is attributed to, 0xFFFFFFFF: none (the whole GPU) */
};

struct fg_devstate {
    uint32_t lost;
    uint32_t cur_slot; /* slot whose slice runs now, FG_MAX_SLOTS if none */
    uint64_t sim_time; /* CLOCK_MONOTONIC ns the simulation has advanced to */
    uint64_t slice_left;
    uint64_t busy_ns;  /* total executed kernel time */
    uint64_t xid_seq;  /* number of XIDs injected so far */
    struct fg_xid xids[FG_XID_RING];
    struct fg_period periods[FG_RING];
    /* High-water marks of the device's memory, updated under the lock at every change (the test
     * oracle of the memory limits: fakegpu-ctl high).  used_high: fg_dev_used (allocations +
     * managed resident + contexts); alloc_high: the same without the contexts. */
    uint64_t used_high;
    uint64_t alloc_high;
    /* A new high above this many bytes is recorded only after dead processes were reaped (a
     * probe per live process): the memory of a process that died and was not reaped yet is
     * gone on a real GPU.  0: never verified (fakegpu-ctl high --watch BYTES sets it). */
    uint64_t high_watch;
    /* fg_dev_used of this device, kept up to date under the lock at every change (charges,
     * frees, contexts, shared memory let go, reaped processes), so that a charge costs no scan
     * of every process; ctx_total: the contexts' part of it.  fakegpu-ctl high checks them
     * against a scan. */
    uint64_t used_total;
    uint64_t ctx_total;
};

/* A device allocation shared between processes (cuda_ipc.c): exported to a POSIX file
 * descriptor, a legacy IPC handle or a pool export.  Its bytes are backed by the file
 * <FAKEGPU_STATE>.mem/<index>.<generation>; its device memory counts once, in the mem_device of
 * charged_slot (one of the holders), and is freed when the last holder drops it. */
#define FG_SHARED_FREE 0u
#define FG_SHARED_LIVE 1u
#define FG_SHK_VMM 1u     /* cuMemCreate handle with a POSIX fd handle type */
#define FG_SHK_IPC 2u     /* cuMemAlloc allocation exported with cuIpcGetMemHandle */
#define FG_SHK_POOL 3u    /* an exportable memory pool (no bytes of its own) */
#define FG_SHK_POOLPTR 4u /* an allocation of an exportable pool (counted by the pool) */
struct fg_shared {
    uint32_t state;
    uint32_t kind;
    int32_t dev;
    int32_t charged_slot; /* -1: counted nowhere (pools, pool pointers) */
    uint64_t bytes;
    uint64_t generation;
    uint64_t ino, fsdev;  /* identity of the backing file */
    uint64_t holders[FG_MASK_WORDS];
};

struct fg_header {
    uint64_t magic; /* written last, after the rest is initialised */
    uint32_t version;
    uint32_t size;
    uint32_t ndev;
    uint32_t queue_depth;     /* per stream, launches block beyond it */
    uint64_t timeslice_ns;    /* time-slice between processes on a device */
    uint64_t period_ns;       /* utilisation sample period */
    uint64_t util_window_ns;  /* window of nvmlDeviceGetUtilizationRates */
    int64_t real_minus_mono;  /* CLOCK_REALTIME - CLOCK_MONOTONIC at creation, ns */
    uint64_t created_ns;      /* CLOCK_REALTIME */
    uint64_t generation;
    char driver_version[32];  /* NVML system driver version, e.g. "580.65.06" */
    int32_t cuda_version;     /* cuDriverGetVersion, e.g. 13000 */
    uint32_t pad;
    uint64_t reaped_ns;       /* CLOCK_MONOTONIC ns of the last full reap (fg_reap_lazy) */
    uint64_t shared_generation;
};

/* MIG (fg_mig.h): per GPU its mode, GPU instances and their compute instances; per unit its place. */
#define FG_MIG_MAX_GI 8 /* at most 7 on every product */
#define FG_MIG_MAX_CI 8
#define FG_NO_INSTANCE 0xFFFFFFFFu
#define FG_MIG_INCAPABLE 255u /* mig_profiles = none: nvmlDeviceGetMigMode is NOT_SUPPORTED */

struct fg_mig_ci {
    uint32_t used;
    uint32_t id;      /* compute instance ID, unique in its GI */
    uint32_t profile; /* NVML_COMPUTE_INSTANCE_PROFILE_* (== the CI profile ID) */
    uint32_t start, size; /* placement in the GI's SM slices */
    int32_t unit;     /* state index of the MIG device */
};

struct fg_mig_gi {
    uint32_t used;
    uint32_t id;         /* GPU instance ID, unique on the GPU */
    uint32_t profile_id; /* GI profile ID (19 = 1g, ...) */
    uint32_t start, size; /* placement: memory slices */
    uint32_t pad;
    struct fg_mig_ci ci[FG_MIG_MAX_CI];
};

struct fg_mig {
    uint32_t mode, pending; /* NVML_DEVICE_MIG_DISABLE 0 / ENABLE 1 */
    uint64_t serial;        /* compute instances ever created: makes every MIG UUID new */
    struct fg_mig_gi gi[FG_MIG_MAX_GI];
};

struct fg_unit {
    int32_t parent; /* GPU index of a MIG device, -1: a GPU or unused */
    uint32_t gi, ci;
    uint32_t pad;
};

struct fg_state {
    struct fg_header h;
    struct fg_devcfg cfg[FG_MAX_DEV];
    struct fg_devstate ds[FG_MAX_DEV];
    /* live_map[s] is 1 while slots[s].state is FG_SLOT_LIVE (changed with it, under the lock):
     * scans read this page instead of one page per slot */
    uint8_t live_map[FG_MAX_SLOTS];
    struct fg_slot slots[FG_MAX_SLOTS];
    struct fg_shared shared[FG_MAX_SHARED];
    struct fg_mig mig[FG_MAX_GPU];
    struct fg_unit unit[FG_MAX_DEV];
};

/* Whole-node configuration (parsed from FAKEGPU_CONFIG). */
struct fg_config {
    uint32_t ndev;
    uint32_t queue_depth;
    uint64_t timeslice_ns;
    uint64_t period_ns;
    uint64_t util_window_ns;
    char driver_version[32];
    int32_t cuda_version;
    struct fg_devcfg dev[FG_MAX_GPU];
};

/* fg_config.c */
void fg_config_defaults(struct fg_config *c);
/* Parses path (NULL: defaults only). Returns 0, or -1 with a message in err. */
int fg_config_load(const char *path, struct fg_config *c, char *err, size_t errlen);
int fg_parse_busid(const char *s, unsigned *domain, unsigned *bus, unsigned *dev, unsigned *fn);
int fg_uuid_bytes(const char *uuid, unsigned char out[16]);

/* fg_state.c */
struct fg_handle {
    struct fg_state *st;
    int fd;
    int slot; /* this process's slot, -1 if none */
};

extern struct fg_handle fg_g;

const char *fg_state_path(void);
/* Opens (creating from the config if the file is empty) and maps the state.  0 or -1 (message
 * printed on stderr unless quiet). */
int fg_open(int quiet);
/* Recreates the state from the config (fakegpu-ctl init --force). */
int fg_reset(void);
void fg_lock(void);
void fg_unlock(void);
/* Takes the lock if it is free at once: 0, or -1 (nothing held). */
int fg_lock_try(void);
/* Takes the lock within timeout_ns: 0, or -1 (nothing held) when it could not. */
int fg_lock_timed(uint64_t timeout_ns);
/* Readers (NVML, fakegpu-ctl dump): the live state, locked; or, when the lock cannot be had within
 * FG_READ_TIMEOUT_NS (its holder is stopped — a monitor SIGSTOPs processes — or starved), a
 * private snapshot of it, which the reader may advance and reap at will.  Pass *locked to
 * fg_read_end. */
#define FG_READ_TIMEOUT_NS 20000000ULL
struct fg_state *fg_read_begin(int *locked);
void fg_read_end(int locked);
/* A private copy of the state (NULL if out of memory); fg_snapshot_end releases it. */
struct fg_state *fg_snapshot_begin(void);
/* The last private copy as it is (NULL if none); fg_snapshot_end releases it. */
struct fg_state *fg_snapshot_last(void);
void fg_snapshot_end(void);
/* Reads this process's identity (pid namespace, start time, name) for fg_register: call it
 * before taking the lock.  Registers this process in a slot (holding its liveness lock): call
 * with the lock held. */
void fg_identify(void);
int fg_register(void);
/* Reclaims the slots of dead processes.  Call with the lock held (or on a snapshot). */
void fg_reap(void);
void fg_reap_in(struct fg_state *st);
/* Reaps at most every FG_REAP_NS (node-wide): a slot probe is a syscall per live process, so a
 * burst of processes starting together must not probe on every charge.  Charges that do not fit
 * reap fully before they fail. */
#define FG_REAP_NS 10000000ULL
void fg_reap_lazy(void);
/* Records the device's high-water marks (call after a change, with the lock held). */
void fg_note_high(struct fg_state *st, int dev);
int fg_slot_alive(int slot);
uint64_t fg_now(void); /* CLOCK_MONOTONIC ns */
uint64_t fg_dev_used(const struct fg_state *st, int dev); /* a MIG device: its GPU instance's */
int fg_unit_live(const struct fg_state *st, int dev);       /* a GPU or an existing MIG device */
uint64_t fg_dev_used(const struct fg_state *st, int dev); /* the running total (O(1)) */
uint64_t fg_dev_used_scan(const struct fg_state *st, int dev); /* the same, summed over the slots */
uint64_t fg_pdev_used(const struct fg_state *st, int slot, int dev);
void fg_release_slot(struct fg_state *st, int slot);
void fg_atfork_child(void);

/* fg_live.c: lock-free reads for NVML (no lock waits, no snapshot copies).  Every field a reader
 * uses is one aligned word written by a single store, so a reader sees each value whole (a
 * momentary answer, as from the real driver).  fg_live_mask: the slots of live processes (a bitmap), their
 * liveness probed at most every FG_LIVE_SWEEP_NS (a slot found dead is left out and reaped when
 * the lock is free).  fg_sim_settled: advances the device to now if the lock is free at once and
 * returns the time up to which its simulation is final (periods before it are complete). */
#define FG_LIVE_SWEEP_NS 200000000ULL
void fg_live_mask(struct fg_state *st, uint64_t mask[FG_MASK_WORDS]);
static inline int fg_mask_has(const uint64_t *mask, int s)
{
    return (int)((mask[s / 64] >> (s % 64)) & 1u);
}
uint64_t fg_sim_settled(struct fg_state *st, int dev);
/* The state to read device dev's utilisation from, *settled set: the live state, advanced if the
 * lock is free at once; or, when the simulation has not moved for FG_STALE_NS and the lock is
 * taken (its holder is stopped or starved) while kernels are pending, a private snapshot advanced
 * to now: copied at most once per FG_SNAP_MIN_NS, the last copy advanced further in between
 * (*snap = 1: call fg_snapshot_end when done). */
#define FG_STALE_NS 20000000ULL
#define FG_SNAP_MIN_NS 250000000ULL
struct fg_state *fg_sim_view(int dev, uint64_t *settled, int *snap);
void fg_live_reset(void); /* atfork child */
/* Reads period idx from its ring entry e: 1 with *busy set, 0 if e holds another period. */
int fg_period_read(const struct fg_period *e, uint64_t idx, uint64_t *busy);

/* fg_sim.c: the kernel model.  All with the lock held. */
void fg_sim_advance(struct fg_state *st, int dev, uint64_t now);
void fg_sim_advance_all(struct fg_state *st, uint64_t now);
/* Queues n kernels of dur ns on (slot, dev, stream).  Returns 0, or 1 if the queue is full. */
int fg_sim_enqueue(struct fg_state *st, int slot, int dev, int stream, uint64_t dur);
void fg_sim_drop(struct fg_state *st, int slot, int dev, int stream); /* discard a stream's queue */
uint64_t fg_sim_pending_ns(const struct fg_state *st, int slot, int dev, int stream); /* stream -1: all */
uint32_t fg_sim_pending(const struct fg_state *st, int slot, int dev, int stream);
int64_t fg_ts_us(const struct fg_state *st, uint64_t mono_ns);

/* fg_shared.c: allocations shared between processes (with the lock held; live = 0 on a
 * snapshot: no files touched).  fg_shared_new returns the index or -1 (table full). */
int fg_shared_path(int idx, uint64_t gen, char *buf, size_t len);
int fg_shared_new(struct fg_state *st, uint32_t kind, int dev, uint64_t bytes, int charged_slot, int holder);
void fg_shared_hold(struct fg_state *st, int idx, int slot);
int fg_shared_find(const struct fg_state *st, int idx, uint64_t gen); /* idx if live with gen, else -1 */
int fg_shared_find_file(const struct fg_state *st, uint64_t ino, uint64_t fsdev);
/* slot lets go of entry idx: its charge moves to another holder, or the entry is freed */
void fg_shared_drop(struct fg_state *st, int idx, int slot, int live);
void fg_shared_release_slot(struct fg_state *st, int slot, int live);

/* fg_visible.c: FAKEGPU_VISIBLE_DEVICES -> state indices of GPUs; returns the count.  A MIG UUID
 * makes its parent GPU visible. */
int fg_visible_map(const struct fg_state *st, int map[FG_MAX_DEV]);
/* Whether this process may use MIG device `unit` (its GI and CI capabilities, fg_visible.c). */
int fg_mig_visible(const struct fg_state *st, int unit);
const char *fg_env(const char *name); /* getenv, else the driver file (fg_visible.c) */

/* fg_pid.c: pid namespaces. */
#define FG_PIDNS_INIT 0xEFFFFFFCULL /* PROC_PID_INIT_INO: the initial pid namespace */
uint64_t fg_self_pidns(void);
uint64_t fg_proc_start_time(int pid); /* 0 if unknown */
/* The pid of slot s as seen by the caller, 0 if it is not visible to the caller. */
int fg_visible_pid(struct fg_state *st, int slot);
void fg_pid_cache_reset(void);

#endif
