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


# The H200's GPU instance profiles (MIG user guide, "H200 MIG Profiles" and `nvidia-smi mig -lgipp`;
# the simulator's table, sim/fakegpu/src/fg_mig.c): name, NVML profile ID, MiB, compute slices,
# memory slices, starts.  The device plugin publishes the same from the simulated H200
# (tests/device_plugin/test_mig_dynamic.py checks it).
H200_PROFILES = (
    ("1g.18gb", 19, 16384, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    ("1g.18gb+me", 20, 16384, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    ("1g.35gb", 15, 33280, 1, 2, (0, 2, 4, 6)),
    ("2g.35gb", 14, 33280, 2, 2, (0, 2, 4)),
    ("3g.71gb", 9, 71680, 3, 4, (0, 4)),
    ("4g.71gb", 5, 71680, 4, 4, (0,)),
    ("7g.141gb", 0, 143360, 7, 8, (0,)),
)


def h200_mig(instances: Sequence[tuple[str, int]] = (), pods: Sequence[str] = ()) -> sc.MigGPU:
    """An H200 in MIG mode that creates instances on demand, with `instances` ((profile, start))
    existing, created for `pods` (by position; "" or missing: not for a pod)."""
    sizes = {p[0]: p[4] for p in H200_PROFILES}
    return sc.MigGPU(
        profiles=tuple(
            sc.MigProfile(name=n, id=i, memory=mib << 20, slices=c, memory_slices=m, placements=pl)
            for n, i, mib, c, m, pl in H200_PROFILES
        ),
        instances=tuple(
            sc.MigInstance(profile=p, start=s, size=sizes[p], pod=pods[k] if k < len(pods) else "")
            for k, (p, s) in enumerate(instances)
        ),
    )


def mig_inventory(
    node: str = "", n: int = 1, split: int = 7, instances: Sequence[tuple[str, int]] = ()
) -> sc.NodeInventory:
    """A node of `n` H200s in MIG mode creating instances on demand (inventory version 3)."""
    inv = inventory(node, n=n, mem_gib=0, split=split, model="NVIDIA H200")
    for g in inv.gpus:
        g.memory = g.memory_schedulable = 143771 << 20
        g.mig = h200_mig(instances)
    inv.version = sc.INVENTORY_VERSION_MIG
    return inv
