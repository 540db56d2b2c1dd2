"""The vGPU model: K virtual devices per physical GPU, their slices and health.

Part of the node core both front ends share (nodecore/core.py): `Slicing` is the
node's slicing (the 1/K share is a vGPU of the device plugin and the default share of a DRA
claim; the capacities are what the scheduler sees of a GPU on either path), `DeviceTable` the
GPUs and their health.

vGPU IDs are `<GPU-UUID>::<i>` (i in 0..K-1), the form NVIDIA's time-slicing
replicas use; the physical UUID is everything before the last `::`.
A vGPU of a GPU with M bytes gets floor(S*M/K) bytes (S = memory scaling) and
100*C/K percent of compute (C = cores scaling). With S > 1 only floor(slice / S) of a slice may be
resident on the GPU (its physical share, `device_share`): the K shares of a GPU never add up to
more than M, so no container's VRAM is taken by a neighbour's oversubscription; the rest of the
slice lives in host memory (docs/developers/intercept.md, "Virtual device memory").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from vgpu.nvml import GPUInfo

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
ID_SEP = "::"
MAX_ID_LEN = 63  # kubelet's limit on Device.ID


def vgpu_id(uuid: str, i: int) -> str:
    return f"{uuid}{ID_SEP}{i}"


def parse_vgpu_id(device_id: str) -> tuple[str, int] | None:
    """(uuid, index) of a vGPU ID, or None when it is not of our form."""
    uuid, sep, idx = device_id.rpartition(ID_SEP)
    if not sep or not uuid or not idx.isdigit() or len(idx) > 6:
        return None
    return uuid, int(idx)


@dataclass(frozen=True)
class Slicing:
    split_count: int
    memory_scaling: float = 1.0
    cores_scaling: float = 1.0

    def memory_capacity(self, total: int) -> int:
        """What the scheduler may hand out of a GPU of `total` bytes: floor(S*M)."""
        return math.floor(total * self.memory_scaling)

    @property
    def cores_capacity(self) -> int:
        """The compute of a GPU in percent: floor(100*C)."""
        return math.floor(100 * self.cores_scaling + 1e-9)

    def memory_per_vgpu(self, total: int) -> int:
        return math.floor(self.memory_scaling * total / self.split_count)

    def memory_for(self, total: int, n: int) -> int:
        """Memory of n vGPUs of one GPU merged into one slice: the sum of their slices."""
        return n * self.memory_per_vgpu(total)

    def device_share(self, memory: int) -> int:
        """The physical share of a slice of `memory` bytes: what may be resident on the GPU,
        floor(memory / S) with S > 1 (K slices of floor(S*M/K) then hold at most M together),
        the slice itself otherwise."""
        if self.memory_scaling <= 1.0:
            return memory
        return min(memory, math.floor(memory / self.memory_scaling))

    def cores_for(self, n: int) -> int:
        """Compute share in percent of n vGPUs of one GPU: floor(n * 100 * C / K)."""
        return math.floor(n * 100 * self.cores_scaling / self.split_count + 1e-9)

    @property
    def oversubscribe(self) -> bool:
        return self.memory_scaling > 1.0


@dataclass
class GPUState:
    info: GPUInfo
    healthy: bool = True
    reason: str = ""
    last_bad: float = 0.0  # monotonic time of the last bad event
    ids: list[str] = field(default_factory=list)


class DeviceTable:
    """The node's GPUs and their vGPUs; thread-safe; watchers wait for changes.

    `version` increases on every health change; ListAndWatch streams wait on
    `wait_change(version)` and send a new list when it moves.
    """

    def __init__(self, gpus: Iterable[GPUInfo], slicing: Slicing, *, plain_ids: bool = False) -> None:
        """plain_ids: with split count 1 a device's ID is its UUID, as NVIDIA's plugin names a
        device it offers whole (the MIG strategies single and mixed, device_plugin/mig.py)."""
        self.slicing = slicing
        self._cond = threading.Condition()
        self._version = 0
        self.gpus: dict[str, GPUState] = {}
        self.by_id: dict[str, str] = {}
        plain = plain_ids and slicing.split_count == 1
        for g in gpus:
            ids = [g.uuid] if plain else [vgpu_id(g.uuid, i) for i in range(slicing.split_count)]
            st = GPUState(info=g, ids=ids)
            self.gpus[g.uuid] = st
            for vid in st.ids:
                self.by_id[vid] = g.uuid

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def all_ids(self) -> list[str]:
        return list(self.by_id)

    def gpu_of(self, device_id: str) -> GPUState | None:
        uuid = self.by_id.get(device_id)
        return self.gpus.get(uuid) if uuid is not None else None

    def snapshot(self) -> tuple[int, list[tuple[str, str, int | None]]]:
        """(version, [(id, health, numa)...]) consistent with each other."""
        with self._cond:
            out: list[tuple[str, str, int | None]] = []
            for st in self.gpus.values():
                h = HEALTHY if st.healthy else UNHEALTHY
                out.extend((vid, h, st.info.numa_node) for vid in st.ids)
            return self._version, out

    def is_healthy(self, uuid: str) -> bool:
        with self._cond:
            st = self.gpus.get(uuid)
            return bool(st and st.healthy)

    def mark_unhealthy(self, uuid: str, reason: str, now: float | None = None) -> bool:
        """Mark a GPU unhealthy; returns True when its health changed."""
        with self._cond:
            st = self.gpus.get(uuid)
            if st is None:
                return False
            st.last_bad = time.monotonic() if now is None else now
            st.reason = reason
            if not st.healthy:
                return False
            st.healthy = False
            self._version += 1
            self._cond.notify_all()
            return True

    def mark_healthy(self, uuid: str) -> bool:
        with self._cond:
            st = self.gpus.get(uuid)
            if st is None or st.healthy:
                return False
            st.healthy = True
            st.reason = ""
            self._version += 1
            self._cond.notify_all()
            return True

    def wait_change(self, version: int, timeout: float, stop: threading.Event | None = None) -> int:
        """Block until the version differs from `version`, `stop` is set (and
        `kick()` called) or the timeout passes; returns the current version."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version or (stop is not None and stop.is_set()), timeout)
            return self._version

    def kick(self) -> None:
        """Wake every waiter (used on shutdown)."""
        with self._cond:
            self._cond.notify_all()
