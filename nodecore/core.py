"""The node core: what both front ends of a GPU node share (docs/design.md, contract 6).

Slices reach a node through the kubelet device plugin (`vgpu-device-plugin`, this package) or
through the kubelet DRA plugin (`vgpu-dra-plugin`, dra_plugin/). Both are front ends over
one core, never a copy of it:

| | module |
| --- | --- |
| inventory: the GPUs with every attribute either front end publishes | vgpu.nvml (`GPUInfo`, `inventory`) |
| slicing: the 1/K share, the capacities (limits) | nodecore.devices (`Slicing`) |
| health: XID events, lost GPUs, recovery | nodecore.devices (`DeviceTable`), nodecore.health |
| allocation records (contract 1) | nodecore.records (`RecordStore`) |
| limits, region, per-container and per-claim files | vgpu.limits, vgpu.region, vgpu.paths, vgpu.schemas |
| node configuration | vgpu.config (`NodeConfig`) |

In the node configuration, `[device_plugin]` holds the node's slicing (split count, scalings),
kubelet dir and node name, read by both front ends; `[dra]` the DRA front end's own settings.

`NodeCore` bundles the first four for one daemon; a front end adds its protocol (device plugin
v1beta1 and its node annotations; DRA v1, ResourceSlices and CDI specs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nodecore.devices import DeviceTable, Slicing
from nodecore.health import HealthMonitor
from nodecore.records import RecordStore
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths


class NodeCore:
    """The node's GPUs, their slicing and health, and its allocation records."""

    def __init__(
        self,
        gpus: Sequence[GPUInfo],
        slicing: Slicing,
        paths: Paths,
        *,
        health_recovery_s: float,
        nvml_health: bool = True,
        on_health_change: Callable[[], None] | None = None,
        plain_ids: bool = False,
    ) -> None:
        self.paths = paths
        self.table = DeviceTable(gpus, slicing, plain_ids=plain_ids)
        self.health = HealthMonitor(self.table, health_recovery_s, on_change=on_health_change) if nvml_health else None

    @property
    def slicing(self) -> Slicing:
        return self.table.slicing

    @property
    def gpus(self) -> list[GPUInfo]:
        """Every GPU of the node, in NVML index order."""
        return [st.info for st in self.table.gpus.values()]

    def healthy_gpus(self) -> list[GPUInfo]:
        return [st.info for st in self.table.gpus.values() if self.table.is_healthy(st.info.uuid)]

    def is_healthy(self, uuid: str) -> bool:
        return self.table.is_healthy(uuid)

    def health_of(self, uuid: str) -> tuple[bool, str]:
        """(healthy, why not) of one GPU; an unknown GPU is unhealthy."""
        st = self.table.gpus.get(uuid)
        if st is None:
            return False, "unknown GPU"
        return self.table.is_healthy(uuid), st.reason

    def records(self, resource_name: str, *, durable: bool = True) -> RecordStore:
        """The allocation records of one front end (its resource name)."""
        return RecordStore(self.paths, resource_name, durable=durable)

    def start(self) -> None:
        if self.health is not None:
            self.health.start()

    def stop(self) -> None:
        if self.health is not None:
            self.health.stop()
        self.table.kick()
