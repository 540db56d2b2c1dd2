"""Dynamic MIG in the filter (pure): which instance a container gets on a GPU that creates MIG
instances on demand (inventory version 3, `vgpu.scheduling.MigGPU`).

A container asking M MiB and C percent of compute gets the **smallest profile that holds it**:
of the GPU's profiles named `<g>g.<m>gb` (the variants with or without media engines, `+me`,
`-me`, `+gfx`, are made for particular uses and are never chosen), those with at least M MiB and
at least C percent of the GPU's compute (g of its compute slices: 1g of 7 is 14 percent, 7g is
100), the one with the least memory, then the fewest compute slices, then the fewest memory
slices. On an H200 (MIG user guide, H200 table: 1g.18gb 16 GiB, 1g.35gb and 2g.35gb 32.5 GiB,
3g.71gb and 4g.71gb 70 GiB, 7g.141gb 140 GiB) 20 GiB gets 1g.35gb. A GPU where that profile has no
free placement does not take the container (a larger profile would waste what the pod did not ask
for; another GPU or node may have room), so every GPU of one kind gives a container the same
instance, which the filter's index relies on (all nodes of a shape give a pod the same slices).

A placement is free when none of its memory slices is taken by an instance the node published
(created for a pod or by the administrator) or by a decision or a published slice of a pod that
holds it (`GPUUse.mig`). Memory slices alone decide: with the placements NVIDIA's profiles have
(MIG user guide, `nvidia-smi mig -lgipp`: {0..6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8),
instances on disjoint memory slices never use more than the GPU's 7 compute slices (every set of
disjoint placements was counted: 7 at most), and each profile may have as many instances as it
has placements (the guide's instance counts), but for the media-engine variants, never chosen.

Of the free placements the filter takes the one that leaves the most placements of all profiles
possible (the lowest start on a tie), the rule the simulator uses for the driver's own choice
(sim/fakegpu/src/fg_mig.c), which gives the placements of the MIG user guide's examples.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from vgpu import scheduling as sc

MiB = 1 << 20
_PLAIN = re.compile(r"^\d+g\.\d+gb$")


@dataclass(frozen=True, slots=True)
class Pick:
    profile: sc.MigProfile
    start: int
    cores: int  # the instance's compute in percent of the GPU

    def assignment(self) -> sc.MigAssignment:
        p = self.profile
        return sc.MigAssignment(profile=p.name, id=p.id, start=self.start, size=p.memory_slices, slices=p.slices)


def cores_of(p: sc.MigProfile, gpu: sc.MigGPU) -> int:
    """The instance's compute in percent of the GPU's (g of its compute slices), 100 for all."""
    n = max(gpu.compute_slices, 1)
    return 100 if p.slices >= n else 100 * p.slices // n


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


@functools.lru_cache(maxsize=4096)
def smallest(gpu: sc.MigGPU, mem: int, cores: int) -> sc.MigProfile | None:
    """The smallest profile holding `mem` bytes and `cores` percent, None when none does."""
    fitting = [p for p in gpu.profiles if _PLAIN.match(p.name) and p.memory >= mem and cores_of(p, gpu) >= cores]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.memory, p.slices, p.memory_slices, p.id))


@functools.lru_cache(maxsize=4096)
def published_taken(gpu: sc.MigGPU) -> int:
    """The memory slices (bit i: slice i) the node's instances take."""
    out = 0
    for i in gpu.instances:
        out |= _mask(i.start, i.size)
    return out


def _left(gpu: sc.MigGPU, taken: int) -> int:
    """Placements of every choosable profile still free in `taken`."""
    n = 0
    for p in gpu.profiles:
        if _PLAIN.match(p.name):
            n += sum(1 for s in p.placements if not taken & _mask(s, p.memory_slices))
    return n


def place(gpu: sc.MigGPU, p: sc.MigProfile, taken: int) -> int | None:
    """The start to create `p` at given the taken memory slices, None when no placement is free."""
    best: tuple[int, int] | None = None
    for s in sorted(p.placements):
        m = _mask(s, p.memory_slices)
        if s + p.memory_slices > sc.MIG_MEMORY_SLICES or taken & m:
            continue
        left = _left(gpu, taken | m)
        if best is None or left > best[0]:
            best = (left, s)
    return None if best is None else best[1]


def taken_slices(gpu: sc.MigGPU, lanes: int) -> int:
    """The memory slices taken: the node's instances and what pods hold (`GPUUse.mig`)."""
    return published_taken(gpu) | sc.mig_taken(lanes)


def fit(gpu: sc.MigGPU, uuid: str, lanes: int, mem: int, cores: int) -> Pick | str:
    """The instance a container asking `mem` bytes and `cores` percent gets on this GPU, or why
    none (the reason, for the filter's failure message)."""
    p = smallest(gpu, mem, cores)
    if p is None:
        return f"{uuid}: no MIG profile holds {mem // MiB} MiB and {cores} percent compute"
    taken = taken_slices(gpu, lanes)
    start = place(gpu, p, taken)
    if start is None:
        used = ",".join(str(i) for i in range(sc.MIG_MEMORY_SLICES) if taken >> i & 1) or "none"
        return f"{uuid}: no free placement for MIG {p.name} (memory slices taken: {used})"
    return Pick(p, start, cores_of(p, gpu))
