"""MIG devices of the node as NVML shows them (node core: both front ends, the monitor, vgpuctl).

`discover()` walks the GPUs the way NVIDIA's go-nvlib does (`pkg/nvlib/device/device.go`:
`IsMigCapable`/`IsMigEnabled` from `nvmlDeviceGetMigMode`, `VisitMigDevices` over
`nvmlDeviceGetMaxMigDeviceCount` and `nvmlDeviceGetMigDeviceHandleByIndex`, NOT_FOUND and
INVALID_ARGUMENT skipped) and names each MIG device's profile as go-nvlib's `GetProfile` does:
the GPU instance profile whose ID is the instance's, the compute instance profile whose ID is
the compute instance's, and the memory size in GB from the device's `memorySizeMB` and the GPU's
total (`getMigMemorySizeGB`): `1g.18gb`, `1c.3g.71gb`, `1g.18gb+me`.  NVIDIA's device plugin
derives its resource names and the single strategy's uniformity from exactly these.

`MigDevice.as_gpu()` is the MIG device as a `GPUInfo` (UUID `MIG-...`, the instance's memory, the
GPU's index, PCI bus and NUMA node), which is what the node core slices: a MIG device is a
device like a GPU to the allocation records, limits (keyed by UUID, contract 4) and the hook.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpu.nvml import GPUInfo

log = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20

# go-nvlib mig_profile.go NewMigProfile: GPU instance profile index -> (slices, attributes)
_GI_SLICES = {
    0: 1,
    1: 2,
    2: 3,
    3: 4,
    4: 7,
    5: 8,
    6: 6,
    7: 1,
    8: 2,
    9: 1,
    10: 1,
    11: 2,
    12: 4,
    13: 1,
    14: 2,
    15: 1,
    16: 2,
}
_GI_ATTR = {7: "+me", 8: "+me", 15: "+me.all", 16: "+me.all", 10: "+gfx", 11: "+gfx", 12: "+gfx", 13: "-me", 14: "-me"}
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6, 7: 1, 8: 7}
GI_PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT
CI_PROFILE_COUNT = 0x9


def memory_gb(total_bytes: int, mem_mib: int) -> int:
    """go-nvlib getMigMemorySizeGB: the instance's share of the GPU rounded up to eighths, times the
    GPU's memory in whole GB (rounded up), rounded half away from zero."""
    if total_bytes <= 0:
        return 0
    frac = math.ceil(mem_mib * MIB / total_bytes * 8) / 8
    total_gb = (total_bytes + GIB - 1) // GIB
    return math.floor(frac * total_gb + 0.5)


def profile_name(gi_index: int, ci_index: int, mem_mib: int, total_bytes: int) -> str:
    """go-nvlib MigProfileInfo.String(): `<g>g.<gb>gb[+attr]`, `<c>c.<g>g.<gb>gb` when c < g."""
    g = _GI_SLICES.get(gi_index, 0)
    c = _CI_SLICES.get(ci_index, 0)
    base = f"{g}g.{memory_gb(total_bytes, mem_mib)}gb{_GI_ATTR.get(gi_index, '')}"
    return base if c == g else f"{c}c.{base}"


def gi_profile_name(gi_index: int, mem_mib: int, total_bytes: int) -> str:
    """A GPU instance profile's name as go-nvlib writes it (`1g.35gb`, `1g.18gb+me`): the name of
    its MIG device with a compute instance spanning it."""
    return f"{_GI_SLICES.get(gi_index, 0)}g.{memory_gb(total_bytes, mem_mib)}gb{_GI_ATTR.get(gi_index, '')}"


def resource_suffix(profile: str) -> str:
    """NVIDIA's mixed strategy resource name part: `mig-` + the profile with `+` as `.`
    (k8s-device-plugin internal/rm/rm.go AddDefaultResourcesToConfig)."""
    return ("mig-" + profile).replace("+", ".")


@dataclass(frozen=True)
class MigDevice:
    uuid: str
    parent: GPUInfo
    mig_index: int  # nvmlDeviceGetMigDeviceHandleByIndex's index under the GPU
    gi: int
    ci: int
    profile: str  # go-nvlib's name: 1g.18gb, 1c.3g.71gb, ...
    gi_profile_id: int
    ci_profile_id: int
    memory: int  # bytes: the GPU instance's (attributes.memorySizeMB)
    sm_count: int
    gi_slices: int
    ci_slices: int
    placement: tuple[int, int] = (0, 0)  # (start, size) in memory slices

    @property
    def whole_instance(self) -> bool:
        """The compute instance spans its GPU instance (C == G): the profiles NVIDIA's mixed
        strategy offers."""
        return self.gi_slices == self.ci_slices

    def as_gpu(self) -> GPUInfo:
        p = self.parent
        return GPUInfo(
            index=p.index,
            uuid=self.uuid,
            name=f"{p.name} MIG {self.profile}",
            memory_total=self.memory,
            pci_bus_id=p.pci_bus_id,
            numa_node=p.numa_node,
            cc_major=p.cc_major,
            cc_minor=p.cc_minor,
            driver_version=p.driver_version,
            cuda_driver_version=p.cuda_driver_version,
            parent_uuid=p.uuid,
            mig_gi=self.gi,
            mig_ci=self.ci,
            mig_profile=self.profile,
            mig_index=self.mig_index,
        )


@dataclass
class MigLayout:
    """Every GPU, whether it is in MIG mode (None: not MIG-capable), and the MIG devices."""

    gpus: list[GPUInfo]
    mode: dict[str, int | None] = field(default_factory=dict)  # GPU uuid -> current MIG mode
    devices: list[MigDevice] = field(default_factory=list)
    pending: dict[str, int | None] = field(default_factory=dict)  # GPU uuid -> pending MIG mode

    def enabled(self, uuid: str) -> bool:
        return self.mode.get(uuid) == 1

    def of(self, uuid: str) -> list[MigDevice]:
        return [d for d in self.devices if d.parent.uuid == uuid]

    def devices_as_gpus(self) -> list[GPUInfo]:
        """The node's devices for a front end that publishes what CUDA can use: each GPU not in
        MIG mode, and the MIG devices of those in it (a GPU in MIG mode is not a CUDA device)."""
        out: list[GPUInfo] = []
        for g in self.gpus:
            out.extend([d.as_gpu() for d in self.of(g.uuid)] if self.enabled(g.uuid) else [g])
        return out


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def mig_modes(pynvml: Any, handle: Any) -> tuple[int | None, int | None]:
    """(current, pending) MIG mode; None when the GPU does not support MIG (NOT_SUPPORTED, go-nvlib
    IsMigCapable) or the library has no MIG entry points."""
    try:
        cur, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None, None
    return int(cur), int(pending)


def mig_mode(pynvml: Any, handle: Any) -> int | None:
    return mig_modes(pynvml, handle)[0]


def _profile_of(pynvml: Any, parent: Any, gi: Any, gi_profile_id: int, ci_profile_id: int) -> tuple[int, int] | None:
    """(GI profile index, CI profile index) whose IDs are the instances' (go-nvlib GetProfile)."""
    for i in range(GI_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, i, version=1)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        if int(info.id) != gi_profile_id:
            continue
        for j in range(CI_PROFILE_COUNT):
            try:
                cinfo = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, j, 0, version=1)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                continue
            if int(cinfo.id) == ci_profile_id:
                return i, j
    return None


def mig_devices(pynvml: Any, handle: Any, parent: GPUInfo) -> list[MigDevice]:
    """The MIG devices of one GPU in MIG mode (go-nvlib VisitMigDevices + GetProfile)."""
    out: list[MigDevice] = []
    total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    count = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    for j in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            continue
        uuid = _text(pynvml.nvmlDeviceGetUUID(mig))
        gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
        ci_id = int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
        attrs = pynvml.nvmlDeviceGetAttributes_v2(mig)
        gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        gi_info = pynvml.nvmlGpuInstanceGetInfo(gi)
        ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        ci_info = pynvml.nvmlComputeInstanceGetInfo(ci)
        idx = _profile_of(pynvml, handle, gi, int(gi_info.profileId), int(ci_info.profileId))
        if idx is None:
            raise RuntimeError(f"MIG device {uuid}: no matching profile IDs found")  # go-nvlib's error
        mem_mib = int(attrs.memorySizeMB)
        out.append(
            MigDevice(
                uuid=uuid,
                parent=parent,
                mig_index=j,
                gi=gi_id,
                ci=ci_id,
                profile=profile_name(idx[0], idx[1], mem_mib, total),
                gi_profile_id=int(gi_info.profileId),
                ci_profile_id=int(ci_info.profileId),
                memory=mem_mib * MIB,
                sm_count=int(attrs.multiprocessorCount),
                gi_slices=int(attrs.gpuInstanceSliceCount),
                ci_slices=int(attrs.computeInstanceSliceCount),
                placement=(int(gi_info.placement.start), int(gi_info.placement.size)),
            )
        )
    return out


def discover(gpus: Sequence[GPUInfo], handle_of: Callable[[GPUInfo], Any] | None = None) -> MigLayout:
    """The MIG layout of the node's GPUs (NVML initialised)."""
    import pynvml

    layout = MigLayout(gpus=list(gpus))
    for g in gpus:
        h = handle_of(g) if handle_of else pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
        mode, pending = mig_modes(pynvml, h)
        layout.mode[g.uuid] = mode
        layout.pending[g.uuid] = pending
        if mode == 1:
            layout.devices.extend(mig_devices(pynvml, h, g))
    return layout
