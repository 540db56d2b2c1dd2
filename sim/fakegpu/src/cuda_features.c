/* fakegpu libcuda: entry points of the 580 driver for features the simulated GPU does not have,
 * answering as the real driver does for a device without them, and the driver's log callbacks.
 *
 * A framework resolves these names at start-up (PyTorch's c10 DriverAPI asks cudart for them with
 * cudaGetDriverEntryPoint).  A name the driver does not export leaves cudart's last error set to
 * cudaErrorSymbolNotFound, which the framework then reports at its next error check as if its own
 * work had failed: so the names are served, and the features refused:
 *  - multicast objects (CUDA 12.1): the device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0,
 *    so cuMulticastCreate and the rest are CUDA_ERROR_NOT_SUPPORTED (cuda.h);
 *  - green contexts and device resources (CUDA 12.4): not modelled, CUDA_ERROR_NOT_SUPPORTED
 *    (docs/developers/simulators.md, "What is simplified");
 *  - cuLogsRegisterCallback / cuLogsUnregisterCallback (CUDA 12.9): callbacks are kept and never
 *    called, since the simulated driver writes no log entries.
 */
#include "fg_cuda.h"

#include <stdlib.h>

static CUresult refused(void)
{
    CUresult rc = fg_check_init();
    return rc ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

FG_API CUresult cuMulticastCreate(void *mc, const void *prop)
{
    (void)mc;
    (void)prop;
    return refused();
}

FG_API CUresult cuMulticastAddDevice(unsigned long long mc, CUdevice dev)
{
    (void)mc;
    (void)dev;
    return refused();
}

FG_API CUresult cuMulticastBindMem(unsigned long long mc, size_t mcoff, unsigned long long mem, size_t memoff,
                                   size_t size, unsigned long long flags)
{
    (void)mc, (void)mcoff, (void)mem, (void)memoff, (void)size, (void)flags;
    return refused();
}

FG_API CUresult cuMulticastBindAddr(unsigned long long mc, size_t mcoff, CUdeviceptr ptr, size_t size,
                                    unsigned long long flags)
{
    (void)mc, (void)mcoff, (void)ptr, (void)size, (void)flags;
    return refused();
}

FG_API CUresult cuMulticastUnbind(unsigned long long mc, CUdevice dev, size_t off, size_t size)
{
    (void)mc, (void)dev, (void)off, (void)size;
    return refused();
}

FG_API CUresult cuMulticastGetGranularity(size_t *g, const void *prop, int option)
{
    (void)g, (void)prop, (void)option;
    return refused();
}

FG_API CUresult cuGreenCtxCreate(void **g, const void *desc, CUdevice dev, unsigned flags)
{
    (void)g, (void)desc, (void)dev, (void)flags;
    return refused();
}

FG_API CUresult cuGreenCtxDestroy(void *g)
{
    (void)g;
    return refused();
}

FG_API CUresult cuCtxFromGreenCtx(CUcontext *c, void *g)
{
    (void)c, (void)g;
    return refused();
}

FG_API CUresult cuGreenCtxStreamCreate(CUstream *s, void *g, unsigned flags, int prio)
{
    (void)s, (void)g, (void)flags, (void)prio;
    return refused();
}

FG_API CUresult cuDeviceGetDevResource(CUdevice dev, void *res, int type)
{
    (void)dev, (void)res, (void)type;
    return refused();
}

FG_API CUresult cuDevSmResourceSplitByCount(void *result, unsigned *n, const void *input, void *rem, unsigned flags,
                                            unsigned min_count)
{
    (void)result, (void)n, (void)input, (void)rem, (void)flags, (void)min_count;
    return refused();
}

FG_API CUresult cuDevResourceGenerateDesc(void **desc, void *res, unsigned n)
{
    (void)desc, (void)res, (void)n;
    return refused();
}

/* --- log callbacks: (callback, user data, CUlogsCallbackHandle *) ------------------------------- */

struct log_cb {
    void (*fn)(void *, int, char *, size_t);
    void *arg;
};

FG_API CUresult cuLogsRegisterCallback(void (*fn)(void *, int, char *, size_t), void *arg, void **handle)
{
    if (!fn || !handle)
        return CUDA_ERROR_INVALID_VALUE;
    struct log_cb *c = malloc(sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->fn = fn;
    c->arg = arg;
    *handle = c;
    return CUDA_SUCCESS;
}

FG_API CUresult cuLogsUnregisterCallback(void *handle)
{
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    free(handle);
    return CUDA_SUCCESS;
}
