/*
 * hooks_launch.c — the kernel-launch path: forwarded with no lock, no
 * syscall, no allocation, no TLS and no atomic read-modify-write: one load of
 * the real pointer and a tail call.  Compute shares are the monitor's job.
 * The wrappers exist so that every acquisition path provably reaches the
 * library (and as the hook point should one ever be needed).
 */
#include "vgpu.h"

/* The fast path is one load, one test and a tail jump; resolving the driver
 * on first use lives in a separate cold function so the hot one needs no
 * stack frame. */
#define FWD(name, params, args)                              \
    static __attribute__((noinline, cold)) CUresult name##_first params \
    {                                                        \
        vgpu_resolve_cuda();                                 \
        CUresult(*f) params = REAL(name);                    \
        return f ? f args : CUDA_ERROR_NOT_FOUND;            \
    }                                                        \
    VGPU_EXPORT CUresult name params                         \
    {                                                        \
        CUresult(*f) params = REAL(name);                    \
        if (LIKELY(f))                                       \
            return f args;                                   \
        return name##_first args;                            \
    }

#define LK_PARAMS                                                                                            \
    (CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, \
     CUstream s, void **kp, void **ex)
#define LK_ARGS (fn, gx, gy, gz, bx, by, bz, sh, s, kp, ex)
#define CK_PARAMS                                                                                            \
    (CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, \
     CUstream s, void **kp)
#define CK_ARGS (fn, gx, gy, gz, bx, by, bz, sh, s, kp)

FWD(cuLaunchKernel, LK_PARAMS, LK_ARGS)
FWD(cuLaunchKernel_ptsz, LK_PARAMS, LK_ARGS)
FWD(cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction fn, void **kp, void **ex), (c, fn, kp, ex))
FWD(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *c, CUfunction fn, void **kp, void **ex), (c, fn, kp, ex))
FWD(cuLaunchCooperativeKernel, CK_PARAMS, CK_ARGS)
FWD(cuLaunchCooperativeKernel_ptsz, CK_PARAMS, CK_ARGS)
/* cuGraphLaunch / _ptsz: hooks_graph.c (graphs with memory nodes allocate when launched) */
