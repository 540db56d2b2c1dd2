/* fakegpu libcuda: entry points that frameworks resolve when they start, whose model lives in
 * another part of the simulator.  PyTorch looks up cuMemExportToShareableHandle and
 * cuMemImportFromShareableHandle through cudaGetDriverEntryPoint at start-up and refuses to use the
 * GPU when a name is missing (c10/cuda DriverAPI), though it calls them only to share memory
 * between processes.  The definitions here are weak: where the simulator's model of shareable
 * handles is linked in, its definitions replace these; otherwise sharing is refused with
 * CUDA_ERROR_NOT_SUPPORTED, what the real driver answers for a handle type it does not support.
 */
#include "fg_cuda.h"

#define FG_WEAK __attribute__((weak)) FG_API

FG_WEAK CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                              unsigned long long flags)
{
    (void)out;
    (void)h;
    (void)type;
    (void)flags;
    CUresult rc = fg_check_init();
    return rc ? rc : CUDA_ERROR_NOT_SUPPORTED;
}

FG_WEAK CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *handle, int type)
{
    (void)h;
    (void)handle;
    (void)type;
    CUresult rc = fg_check_init();
    return rc ? rc : CUDA_ERROR_NOT_SUPPORTED;
}
