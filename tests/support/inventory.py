"""Node inventories (vgpu.scheduling.NodeInventory) as the device plugin publishes them, for the
scheduler, vgpuctl and benchmark tests."""

from __future__ import annotations

import time
from collections.abc import Sequence

from vgpu import scheduling as sc

GiB = 1 << 30


def uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i:04d}"


def inventory(
    node: str = "",
    n: int = 4,
    mem_gib: int = 80,
    split: int = 4,
    model: str = "NVIDIA A100-SXM4-80GB",
    numa: Sequence[int] | None = None,
    unhealthy: Sequence[int] = (),
    heartbeat: float | None = None,
    scaling: float = 1.0,
    uuids: Sequence[str] | None = None,
) -> sc.NodeInventory:
    """`n` GPUs of `node` (UUIDs `uuid(node, i)`, or `uuids`), each `mem_gib` GiB, `split` slots,
    on NUMA node numa[i] (-1 when None); GPUs whose index is in `unhealthy` are reported so;
    heartbeat now unless given."""
    ids = list(uuids) if uuids is not None else [uuid(node, i) for i in range(n)]
    gpus = [
        sc.InventoryGPU(
            uuid=u,
            index=i,
            model=model,
            memory=mem_gib * GiB,
            memory_schedulable=int(mem_gib * GiB * scaling),
            cores=100,
            split_count=split,
            numa=(numa[i] if numa else -1),
            health=i not in unhealthy,
        )
        for i, u in enumerate(ids)
    ]
    return sc.NodeInventory(
        split_count=split, memory_scaling=scaling, heartbeat=time.time() if heartbeat is None else heartbeat, gpus=gpus
    )
