"""Scheduling contract between vgpu-scheduler and the device plugin (docs/design.md, "Scheduler").

The device plugin publishes its node's GPUs as the Node annotation `vgpu.k8s.io/node-inventory`
(`NodeInventory`, version 2); the scheduler records, per pod, which GPUs each container gets and
how much of them (`Decision`, pod annotation `vgpu.k8s.io/decision`), written at filter time and
before the Binding. The device plugin honours the decision in Allocate and reports its progress in
`bind-phase` and `allocated`. The pods' decision annotations are the single source of truth of
the cluster's vGPU usage: the scheduler rebuilds all of its accounting from them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from vgpu import quantity

# Resources (names as HAMi users know them).
RESOURCE_GPU = "nvidia.com/gpu"  # count of distinct physical GPUs the container spans
RESOURCE_MEM = "nvidia.com/gpumem"  # MiB per GPU
RESOURCE_MEM_PERCENT = "nvidia.com/gpumem-percentage"  # percent of each GPU's memory (exclusive with gpumem)
RESOURCE_CORES = "nvidia.com/gpucores"  # percent of each GPU's compute
VGPU_RESOURCES = (RESOURCE_GPU, RESOURCE_MEM, RESOURCE_MEM_PERCENT, RESOURCE_CORES)

# Node annotation (device plugin → scheduler).
INVENTORY_ANNOTATION = "vgpu.k8s.io/node-inventory"
INVENTORY_VERSION = 2
DEFAULT_HEARTBEAT_S = 30.0  # the plugin refreshes `heartbeat` this often
DEFAULT_STALE_AFTER_S = 120.0  # the scheduler offers no GPUs of a node whose heartbeat is older

# Pod annotations (scheduler ↔ device plugin).
DECISION_ANNOTATION = "vgpu.k8s.io/decision"
DECISION_VERSION = 1
BIND_PHASE_ANNOTATION = "vgpu.k8s.io/bind-phase"
BIND_TIME_ANNOTATION = "vgpu.k8s.io/bind-time"
ALLOCATED_ANNOTATION = "vgpu.k8s.io/allocated"
PHASE_ALLOCATING = "allocating"
PHASE_SUCCESS = "success"
PHASE_FAILED = "failed"
BIND_PHASES = (PHASE_ALLOCATING, PHASE_SUCCESS, PHASE_FAILED)

# User-facing pod annotations (validated by the webhook) and HAMi's spellings accepted as aliases.
NODE_POLICY_ANNOTATION = "vgpu.k8s.io/node-scheduler-policy"
GPU_POLICY_ANNOTATION = "vgpu.k8s.io/gpu-scheduler-policy"
USE_GPUTYPE_ANNOTATION = "vgpu.k8s.io/use-gputype"
NOUSE_GPUTYPE_ANNOTATION = "vgpu.k8s.io/nouse-gputype"
USE_GPUUUID_ANNOTATION = "vgpu.k8s.io/use-gpuuuid"
NOUSE_GPUUUID_ANNOTATION = "vgpu.k8s.io/nouse-gpuuuid"
NUMA_BIND_ANNOTATION = "vgpu.k8s.io/numa-bind"
ANNOTATION_ALIASES: dict[str, tuple[str, ...]] = {
    NODE_POLICY_ANNOTATION: ("hami.io/node-scheduler-policy",),
    GPU_POLICY_ANNOTATION: ("hami.io/gpu-scheduler-policy",),
    USE_GPUTYPE_ANNOTATION: ("nvidia.com/use-gputype",),
    NOUSE_GPUTYPE_ANNOTATION: ("nvidia.com/nouse-gputype",),
    USE_GPUUUID_ANNOTATION: ("nvidia.com/use-gpuuuid",),
    NOUSE_GPUUUID_ANNOTATION: ("nvidia.com/nouse-gpuuuid",),
    NUMA_BIND_ANNOTATION: ("nvidia.com/numa-bind",),
}
POLICY_BINPACK = "binpack"
POLICY_SPREAD = "spread"
POLICIES = (POLICY_BINPACK, POLICY_SPREAD)

Bytes = Annotated[int, msgspec.Meta(ge=0)]
Percent = Annotated[int, msgspec.Meta(ge=0, le=10_000)]
Uuid = Annotated[str, msgspec.Meta(min_length=1, max_length=95, pattern=r"^[A-Za-z0-9-]+$")]


class InventoryGPU(msgspec.Struct, kw_only=True):
    """One physical GPU of a node, as the device plugin offers it."""

    uuid: Uuid
    index: Annotated[int, msgspec.Meta(ge=0)]
    model: str
    memory: Bytes  # physical
    memory_schedulable: Bytes  # memory * memory_scaling
    cores: Percent  # 100 * cores_scaling
    split_count: Annotated[int, msgspec.Meta(ge=1)]  # vGPU slots (containers) this GPU takes
    numa: int = -1  # -1: unknown
    health: bool = True


class NodeInventory(msgspec.Struct, kw_only=True):
    """`vgpu.k8s.io/node-inventory` on the Node (version 2)."""

    version: int = INVENTORY_VERSION
    resource: str = RESOURCE_GPU
    split_count: Annotated[int, msgspec.Meta(ge=1)]
    memory_scaling: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cores_scaling: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    heartbeat: float  # unix seconds, refreshed every inventory_heartbeat_s
    gpus: list[InventoryGPU] = msgspec.field(default_factory=list)


# Decisions are trees of scalars (no reference cycles possible): gc=False keeps thousands of them
# out of the cyclic GC's full collections in the scheduler.
class GPUAssignment(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """One GPU given to a container: its UUID, the memory limit in bytes and the compute share in percent."""

    uuid: Uuid
    memory: Bytes
    cores: Percent


class ContainerDecision(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    init: bool = False
    gpus: list[GPUAssignment]


class Decision(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """`vgpu.k8s.io/decision` on the Pod: one entry per vGPU container, init containers first (spec order)."""

    version: int = DECISION_VERSION
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    time: float
    containers: list[ContainerDecision]


class ContractError(ValueError):
    """An annotation that is not a valid document of this contract."""


_encoder = msgspec.json.Encoder()
_inventory_decoder = msgspec.json.Decoder(NodeInventory)
_decision_decoder = msgspec.json.Decoder(Decision)
_allocated_decoder = msgspec.json.Decoder(list[str])


def encode(obj: msgspec.Struct | list[str]) -> str:
    """Compact JSON text for an annotation value."""
    return _encoder.encode(obj).decode()


def decode_inventory(text: str | bytes) -> NodeInventory:
    """Parse a node-inventory annotation; ContractError when it is not a version-2 inventory."""
    try:
        inv = _inventory_decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ContractError(f"{INVENTORY_ANNOTATION}: {e}") from None
    if inv.version != INVENTORY_VERSION:
        raise ContractError(f"{INVENTORY_ANNOTATION}: version {inv.version}, expected {INVENTORY_VERSION}")
    return inv


def decode_decision(text: str | bytes) -> Decision:
    """Parse a decision annotation; ContractError when invalid or of another version."""
    try:
        d = _decision_decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ContractError(f"{DECISION_ANNOTATION}: {e}") from None
    if d.version != DECISION_VERSION:
        raise ContractError(f"{DECISION_ANNOTATION}: version {d.version}, expected {DECISION_VERSION}")
    return d


def decode_allocated(text: str | bytes | None) -> list[str]:
    """Parse the `allocated` annotation (JSON list of container names); absent means none."""
    if text is None or text == "":
        return []
    try:
        return _allocated_decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ContractError(f"{ALLOCATED_ANNOTATION}: {e}") from None


def annotation(annotations: dict[str, str] | None, key: str) -> str | None:
    """A user-facing annotation by its name or one of its HAMi aliases (ours wins)."""
    if not annotations:
        return None
    if key in annotations:
        return annotations[key]
    for alias in ANNOTATION_ALIASES.get(key, ()):
        if alias in annotations:
            return annotations[alias]
    return None


# --- usage (pure; shared by vgpuctl cluster, and the scheduler's accounting may delegate here) ---
TERMINATED_PHASES = ("Succeeded", "Failed")


class GPUUse(msgspec.Struct, kw_only=True):
    """What pods hold of one GPU: memory bytes, compute percent, vGPU slots (containers)."""

    memory: int = 0
    cores: int = 0
    slots: int = 0


def decision_usage(d: Decision) -> dict[str, GPUUse]:
    """One pod's effective usage per GPU UUID, from its decision alone.

    Per dimension (memory, cores, slots) the larger of any single init container's and the sum of
    the app containers': init containers run one at a time before the app containers (the
    Kubernetes effective-request rule), and the kubelet reuses their devices for the app containers.
    """
    apps: dict[str, GPUUse] = {}
    inits: dict[str, GPUUse] = {}
    for c in d.containers:
        for g in c.gpus:
            if c.init:
                u = inits.setdefault(g.uuid, GPUUse())
                u.memory, u.cores, u.slots = max(u.memory, g.memory), max(u.cores, g.cores), max(u.slots, 1)
            else:
                a = apps.setdefault(g.uuid, GPUUse())
                a.memory, a.cores, a.slots = a.memory + g.memory, a.cores + g.cores, a.slots + 1
    out: dict[str, GPUUse] = {}
    for uuid in apps.keys() | inits.keys():
        a, i = apps.get(uuid, GPUUse()), inits.get(uuid, GPUUse())
        out[uuid] = GPUUse(memory=max(a.memory, i.memory), cores=max(a.cores, i.cores), slots=max(a.slots, i.slots))
    return out


def holding_node(d: Decision | None, phase: str, bound_node: str) -> str:
    """The node on which a pod's decision holds GPUs, or "" when it holds none.

    Succeeded/Failed pods release; terminating pods keep (their processes may still hold GPU
    memory); a pod bound to another node than its decision's never used the decided GPUs.
    """
    if d is None or phase in TERMINATED_PHASES:
        return ""
    if bound_node and bound_node != d.node:
        return ""
    return d.node


# --- whether a node offers its GPUs (pure; the scheduler's filter and vgpuctl cluster) ----------


def node_allocatable(node: dict[str, Any], resource: str = RESOURCE_GPU) -> int:
    """The Node's allocatable vGPU count: -1 when it does not list the resource, 0 when unparsable."""
    text = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    if text is None:
        return -1
    try:
        # A Quantity as the API server writes it: 1000 slots read "1k" (vgpu/quantity.py).
        return quantity.whole(text)
    except quantity.QuantityError:
        return 0


def offer_problem(inv: NodeInventory, allocatable: int, now: float, stale_after_s: float) -> str:
    """Why a node with a valid inventory offers no GPUs now, "" when it offers them: its device
    plugin deregistered (allocatable 0) or stopped refreshing the inventory (heartbeat too old)."""
    if allocatable == 0:
        return "device plugin not registered (allocatable vGPU resource is 0)"
    age = now - inv.heartbeat
    if age > stale_after_s:
        return f"inventory stale (heartbeat {age:.0f} s old > {stale_after_s:.0f} s)"
    return ""
