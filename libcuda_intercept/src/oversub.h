/* oversub.h — virtual device memory (memory scaling S > 1): what a container
 * allocates beyond its physical share lives in host memory, reached by the GPU
 * through unified memory (docs/developers/intercept.md, "Virtual device memory").
 *
 * The rule: a container's device-resident bytes never exceed its physical
 * share (limits file: device_limit), so a neighbour is never refused memory
 * inside its own share; beyond it, up to the slice (memory_limit), a path that
 * can hold its bytes in host memory does, one that cannot is refused. */
#ifndef VGPU_OVERSUB_H
#define VGPU_OVERSUB_H

#include "vgpu.h"

/* Charge n bytes for an allocation on limits index idx (CUDA ordinal ord):
 * device-resident while the physical share has room; beyond it, with
 * host_ok and oversubscription on and a device that can reach managed memory
 * concurrently, host-resident.  `what` names the path in log lines.
 * 0 with *kind = VGPU_KIND_DEVICE or VGPU_KIND_HOST, or -1 (refused, logged;
 * the caller returns CUDA_ERROR_OUT_OF_MEMORY). */
int vgpu_os_charge(int idx, CUdevice ord, uint64_t n, int host_ok, const char *what, int *kind);

/* A stream-ordered allocation of n bytes the device cannot take (why: VGPU_OVER_SHARE, the
 * physical share is reached; 0, the driver had no memory; VGPU_OVER_SLICE: refused) in host
 * memory, recorded as host-backed in vgpu_t_ptr so that its cuMemFreeAsync frees it in stream
 * order.  CUDA_SUCCESS, or CUDA_ERROR_OUT_OF_MEMORY (logged). */
CUresult vgpu_os_async_host(int why, int idx, CUdevice ord, CUdeviceptr *dptr, size_t n, const char *what);

/* 1 if a device allocation that the driver refused for lack of memory may be
 * moved to host memory (oversubscription on, managed memory usable). */
int vgpu_os_can_host(int idx, CUdevice ord);

/* Host-resident managed memory for device ord: cuMemAllocManaged(flags), then
 * advised to prefer host memory and to be accessed by ord, so the driver maps
 * it for the device instead of migrating it into VRAM.  Refused (and freed)
 * if the preferred-location advice fails. */
CUresult vgpu_os_managed(CUdeviceptr *p, size_t n, unsigned flags, CUdevice ord);

/* cuMemAllocPitch_v2 in host memory: the driver's validation and a pitch of
 * the width rounded up to the device's texture (pitch) alignment, at least 512
 * bytes; *bytes = pitch * height. */
CUresult vgpu_os_pitch(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned elem, CUdevice ord,
                       uint64_t *bytes);

/* cuMemFreeAsync(_ptsz) of host-backed memory: freed once the work queued on
 * stream s before the call has finished (an event recorded on s); until then
 * it stays charged.  r is the pointer's record (already taken from
 * vgpu_t_ptr).  Returns what cuMemFreeAsync returns. */
CUresult vgpu_os_free_async(const struct vgpu_rec *r, CUstream s, int per_thread);

/* Free the deferred pointers whose stream work has finished (wait: all of
 * them, blocking).  Returns how many were freed.  Cheap when none pend. */
int vgpu_os_reap(int wait);

/* 1 if stream s is being captured into a graph (host fallback would escape
 * the graph), 0 otherwise or when the driver cannot tell. */
int vgpu_os_capturing(CUstream s, int per_thread);

/* cuMemCreate of a host-NUMA physical allocation (the NUMA node nearest to
 * device ord) with the caller's properties otherwise, where the driver
 * supports host-NUMA virtual memory management; CUDA_ERROR_NOT_SUPPORTED
 * where it does not. */
CUresult vgpu_os_create_host(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                             unsigned long long flags, CUdevice ord);

/* 1 if [p, p+n) overlaps host-backed memory this process allocated. */
int vgpu_os_overlaps_host(CUdeviceptr p, size_t n);

/* after fork, in the child */
void vgpu_os_atfork_child(void);

#endif
