"""Creating and destroying MIG instances through NVML (dynamic MIG, device_plugin/dynmig.py).

The calls are NVIDIA's for what `nvidia-smi mig -cgi <profile>:<start> -C` and `nvidia-smi mig
-dci`/`-dgi` do (NVML API reference, "Multi Instance GPU Management"):
`nvmlDeviceGetGpuInstanceProfileInfo` (each profile index up to NVML_GPU_INSTANCE_PROFILE_COUNT;
NOT_SUPPORTED for the profiles a GPU lacks) and `nvmlDeviceGetGpuInstancePossiblePlacements_v2`
(every placement of a profile, whether free or not), `nvmlDeviceGetGpuInstances` per profile and
`nvmlGpuInstanceGetInfo` (ID, profile, placement) for the existing instances,
`nvmlDeviceCreateGpuInstanceWithPlacement` (INSUFFICIENT_RESOURCES when the placement is taken),
`nvmlGpuInstanceCreateComputeInstance` with the compute instance profile spanning the instance
(`-C`: "create the default compute instance"), `nvmlComputeInstanceDestroy` then
`nvmlGpuInstanceDestroy` (which is IN_USE while compute instances or processes remain). The MIG
device of the new instances is found as go-nvlib finds MIG devices (nodecore/mig.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from nodecore import mig as node_mig
from vgpu.nvml import GPUInfo

MIB = 1 << 20
MAX_PLACEMENTS = 8
MAX_INSTANCES = 16


class MigOpError(RuntimeError):
    """An instance could not be created or destroyed; `taken`: its placement is not free."""

    def __init__(self, msg: str, taken: bool = False) -> None:
        super().__init__(msg)
        self.taken = taken


@dataclass(frozen=True)
class GIProfile:
    index: int
    id: int
    name: str  # go-nvlib's
    memory: int  # bytes
    slices: int  # compute slices
    count: int  # instances at most
    placements: tuple[tuple[int, int], ...]  # (start, memory slices)
    remaining: int  # nvmlDeviceGetGpuInstanceRemainingCapacity now


@dataclass(frozen=True)
class GIInfo:
    id: int
    profile_id: int
    start: int
    size: int


def _pynvml() -> Any:
    import pynvml

    return pynvml


def profiles(handle: Any, total_bytes: int) -> list[GIProfile]:
    """The GPU's GPU instance profiles with their placements (a GPU in MIG mode)."""
    n = _pynvml()
    out: list[GIProfile] = []
    for i in range(node_mig.GI_PROFILE_COUNT):
        try:
            info = n.nvmlDeviceGetGpuInstanceProfileInfo(handle, i, version=1)
        except (n.NVMLError_NotSupported, n.NVMLError_InvalidArgument):
            continue
        arr = (n.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
        count = ctypes.c_uint(MAX_PLACEMENTS)
        n.nvmlDeviceGetGpuInstancePossiblePlacements(handle, int(info.id), arr, ctypes.byref(count))
        try:
            remaining = int(n.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, int(info.id)))
        except n.NVMLError:
            remaining = 0
        out.append(
            GIProfile(
                index=i,
                id=int(info.id),
                name=node_mig.gi_profile_name(i, int(info.memorySizeMB), total_bytes),
                memory=int(info.memorySizeMB) * MIB,
                slices=int(info.sliceCount),
                count=int(info.instanceCount),
                placements=tuple((int(arr[k].start), int(arr[k].size)) for k in range(count.value)),
                remaining=remaining,
            )
        )
    return out


def _instances_of(handle: Any, profile_id: int) -> list[Any]:
    n = _pynvml()
    arr = (n.c_nvmlGpuInstance_t * MAX_INSTANCES)()
    count = ctypes.c_uint(MAX_INSTANCES)
    try:
        n.nvmlDeviceGetGpuInstances(handle, profile_id, arr, ctypes.byref(count))
    except (n.NVMLError_NotSupported, n.NVMLError_InvalidArgument):
        return []
    return [arr[k] for k in range(count.value)]


def gpu_instances(handle: Any, profile_ids: list[int]) -> list[GIInfo]:
    """Every GPU instance of the GPU (those without a compute instance too)."""
    n = _pynvml()
    out = []
    for pid in profile_ids:
        for gi in _instances_of(handle, pid):
            info = n.nvmlGpuInstanceGetInfo(gi)
            out.append(GIInfo(int(info.id), int(info.profileId), int(info.placement.start), int(info.placement.size)))
    return sorted(out, key=lambda g: g.start)


def _full_ci_profile(gi: Any, slices: int) -> int:
    """The compute instance profile ID spanning a GPU instance of `slices` compute slices."""
    n = _pynvml()
    for j in range(node_mig.CI_PROFILE_COUNT):
        try:
            info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, j, 0, version=1)
        except (n.NVMLError_NotSupported, n.NVMLError_InvalidArgument):
            continue
        if int(info.sliceCount) == slices:
            return int(info.id)
    raise MigOpError(f"no compute instance profile spans {slices} slices")


def _compute_instances(gi: Any) -> list[Any]:
    n = _pynvml()
    out: list[Any] = []
    for j in range(node_mig.CI_PROFILE_COUNT):
        try:
            info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, j, 0, version=1)
        except (n.NVMLError_NotSupported, n.NVMLError_InvalidArgument):
            continue
        arr = (n.c_nvmlComputeInstance_t * 8)()
        count = ctypes.c_uint(8)
        try:
            n.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), arr, ctypes.byref(count))
        except (n.NVMLError_NotSupported, n.NVMLError_InvalidArgument):
            continue
        out.extend(arr[k] for k in range(count.value))
    return out


def create(
    handle: Any, profile_id: int, start: int, size: int, slices: int, gi_id: int | None = None
) -> tuple[int, int]:
    """(GPU instance ID, compute instance ID) of a new instance of the profile at placement
    (`start`, `size` memory slices: one of its possible placements, as NVML wants it) with its
    spanning compute instance; with `gi_id`, that existing GPU instance gets the compute instance
    (an instance half made before a restart). MigOpError(taken=True) when the placement is taken."""
    n = _pynvml()
    if gi_id is None:
        pl = n.c_nvmlGpuInstancePlacement_t()
        pl.start, pl.size = start, size
        try:
            gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, ctypes.byref(pl))
        except n.NVMLError_InsufficientResources:
            raise MigOpError(f"placement {start} of profile {profile_id} is not free", taken=True) from None
        except n.NVMLError as e:
            raise MigOpError(f"cannot create GPU instance of profile {profile_id} at {start}: {e}") from None
    else:
        gi = n.nvmlDeviceGetGpuInstanceById(handle, gi_id)
    gid = int(n.nvmlGpuInstanceGetInfo(gi).id)
    cis = _compute_instances(gi)
    if cis:
        return gid, int(n.nvmlComputeInstanceGetInfo(cis[0]).id)
    try:
        ci = n.nvmlGpuInstanceCreateComputeInstance(gi, _full_ci_profile(gi, slices))
    except n.NVMLError as e:
        raise MigOpError(f"cannot create the compute instance of GPU instance {gid}: {e}") from None
    return gid, int(n.nvmlComputeInstanceGetInfo(ci).id)


def destroy(handle: Any, gi_id: int) -> bool:
    """Destroy a GPU instance and its compute instances; False when it does not exist. MigOpError
    when NVML refuses (IN_USE: processes on it)."""
    n = _pynvml()
    try:
        gi = n.nvmlDeviceGetGpuInstanceById(handle, gi_id)
    except (n.NVMLError_NotFound, n.NVMLError_InvalidArgument):
        return False
    try:
        for ci in _compute_instances(gi):
            n.nvmlComputeInstanceDestroy(ci)
        n.nvmlGpuInstanceDestroy(gi)
    except n.NVMLError as e:
        raise MigOpError(f"cannot destroy GPU instance {gi_id}: {e}") from None
    return True


def processes(handle: Any, gi_id: int) -> int:
    """How many compute processes run on the GPU instance (the GPU's process list: each entry
    names its GPU and compute instance, nvmlProcessInfo_t gpuInstanceId)."""
    n = _pynvml()
    try:
        procs = n.nvmlDeviceGetComputeRunningProcesses(handle)
    except n.NVMLError:
        return 0
    return sum(1 for p in procs if int(getattr(p, "gpuInstanceId", 0xFFFFFFFF)) == gi_id)


def device_of(handle: Any, parent: GPUInfo, gi_id: int, ci_id: int) -> GPUInfo | None:
    """The MIG device of the instance, as the node core slices it (nodecore/mig.py as_gpu)."""
    n = _pynvml()
    for d in node_mig.mig_devices(n, handle, parent):
        if (d.gi, d.ci) == (gi_id, ci_id):
            return d.as_gpu()
    return None


def devices(handle: Any, parent: GPUInfo) -> list[GPUInfo]:
    """The GPU's MIG devices (nodecore/mig.py), as GPUInfo."""
    return [d.as_gpu() for d in node_mig.mig_devices(_pynvml(), handle, parent)]
