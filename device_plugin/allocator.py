"""Preferred allocation and Allocate's mapping of vGPU IDs to GPU slices.

Pure functions over a DeviceTable; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nodecore.devices import DeviceTable
from vgpu.schemas import AllocatedGPU


class AllocationError(ValueError):
    """A request kubelet must be told is invalid (gRPC INVALID_ARGUMENT)."""


def preferred(
    table: DeviceTable,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: str = "spread",
) -> list[str]:
    """Choose `size` IDs from `available`, keeping every must-include ID.

    Each further vGPU goes to a physical GPU this request does not use yet
    where possible; among those, `spread` takes the least-allocated GPU
    (allocated = its vGPUs not in `available`) and `binpack` the most
    allocated. Ties fall to the GPU's NVML index, then the lowest vGPU index.
    Unknown IDs in `available` are ignored.
    """
    chosen: list[str] = []
    seen: set[str] = set()
    for d in must_include:
        if d not in seen:
            chosen.append(d)
            seen.add(d)
    if size <= len(chosen):
        return chosen

    free: dict[str, list[str]] = {}
    for d in available:
        if d in seen:
            continue
        st = table.gpu_of(d)
        if st is None or not st.healthy:
            continue
        free.setdefault(st.info.uuid, []).append(d)
    avail_count = {u: len(ids) for u, ids in free.items()}
    for d in chosen:  # must-include IDs are "available" to this request too
        st = table.gpu_of(d)
        if st is not None:
            avail_count[st.info.uuid] = avail_count.get(st.info.uuid, 0) + 1
    taken: dict[str, int] = {}
    for d in chosen:
        st = table.gpu_of(d)
        if st is not None:
            taken[st.info.uuid] = taken.get(st.info.uuid, 0) + 1
    for ids in free.values():
        ids.sort(key=_vgpu_index)

    sign = -1 if policy == "binpack" else 1
    while len(chosen) < size:
        candidates = [u for u, ids in free.items() if ids]
        if not candidates:
            break

        def key(u: str) -> tuple[int, int, int]:
            allocated = len(table.gpus[u].ids) - avail_count.get(u, 0)
            return (taken.get(u, 0), sign * allocated, table.gpus[u].info.index)

        u = min(candidates, key=key)
        chosen.append(free[u].pop(0))
        taken[u] = taken.get(u, 0) + 1
    return chosen


def _vgpu_index(device_id: str) -> int:
    tail = device_id.rpartition("::")[2]
    return int(tail) if tail.isdigit() else 0


@dataclass(frozen=True)
class Slice:
    """A container's allocation: per physical GPU, in order of first appearance."""

    gpus: list[AllocatedGPU]

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.gpus]


def slice_for(table: DeviceTable, device_ids: Sequence[str]) -> Slice:
    """Map a container's vGPU IDs to per-GPU slices, merging IDs of one GPU.

    Raises AllocationError for an empty request, duplicate, unknown or
    unhealthy IDs, with a message naming them.
    """
    if not device_ids:
        raise AllocationError("empty device list")
    dups = sorted({d for d in device_ids if device_ids.count(d) > 1})
    if dups:
        raise AllocationError(f"duplicate device IDs: {', '.join(dups)}")
    unknown = [d for d in device_ids if table.gpu_of(d) is None]
    if unknown:
        raise AllocationError(f"unknown device IDs: {', '.join(_short(d) for d in unknown)}")
    unhealthy = [d for d in device_ids if not table.is_healthy(table.by_id[d])]
    if unhealthy:
        raise AllocationError(f"unhealthy device IDs: {', '.join(unhealthy)}")
    grouped: dict[str, list[str]] = {}
    for d in device_ids:
        grouped.setdefault(table.by_id[d], []).append(d)
    s = table.slicing
    gpus = []
    for uuid, ids in grouped.items():
        total = table.gpus[uuid].info.memory_total
        memory = s.memory_for(total, len(ids))
        gpus.append(
            AllocatedGPU(
                uuid=uuid,
                memory_limit=memory,
                core_percent=s.cores_for(len(ids)),
                vgpu_ids=list(ids),
                device_limit=s.device_share(memory),
            )
        )
    return Slice(gpus=gpus)


def _short(device_id: str) -> str:
    # IDs come from the kubelet, but keep error messages bounded anyway.
    return repr(device_id[:80])
