/* fakegpu libnvidia-ml: NVML types (ABI of nvml.h for the parts implemented) and shared helpers. */
#ifndef FG_NVML_H
#define FG_NVML_H

#include "fg_state.h"

#define FG_API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
typedef struct nvml_dev *nvmlDevice_t;
typedef struct nvml_evset *nvmlEventSet_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_EVENT_XID 0x8ULL
#define NVML_EVENTS_SUPPORTED 0x1fULL /* single/double bit ECC, pstate, XID, clock */
#define NVML_NO_INSTANCE 0xFFFFFFFFu

struct nvml_dev {
    uint32_t magic;
    int index; /* in the state */
    int vis;   /* NVML index (FAKEGPU_VISIBLE_DEVICES order), -1 if not visible */
};

/* An entry point the simulation does not implement (nvml_stubs.c, generated from
 * sim/fakegpu/nvml-entry-points.txt): exported, answers NVML_ERROR_NOT_SUPPORTED, as the real
 * library does for a feature the GPU lacks.  Weak, so the definition in nvml_*.c wins at link time
 * where there is one.  The arguments are never read: in the SysV x86-64 and AArch64 calling
 * conventions the caller owns them, so one body serves every signature returning nvmlReturn_t
 * (all of NVML but nvmlErrorString, which nvml_core.c defines). */
#define FG_NVML_STUB(name)                                                                         \
    FG_API __attribute__((weak)) nvmlReturn_t name(void);                                          \
    nvmlReturn_t name(void)                                                                        \
    {                                                                                              \
        return NVML_ERROR_NOT_SUPPORTED;                                                           \
    }

/* nvml_core.c */
nvmlReturn_t fg_nvml_check(void);
/* Validates a handle: 0 with *idx set, else an NVML error.  dynamic: fails on a lost GPU. */
nvmlReturn_t fg_nvml_dev(nvmlDevice_t d, int dynamic, int *idx);
nvmlDevice_t fg_nvml_handle(int idx);
int fg_nvml_mig_usable(int unit); /* a MIG device of a visible GPU this process may use */

#endif
