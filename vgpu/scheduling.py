"""Scheduling contract between vgpu-scheduler and the device plugin (docs/design.md, "Scheduler").

The device plugin publishes its node's GPUs as the Node annotation `vgpu.k8s.io/node-inventory`
(`NodeInventory`, version 2); the scheduler records, per pod, which GPUs each container gets and
how much of them (`Decision`, pod annotation `vgpu.k8s.io/decision`), written at filter time and
before the Binding. The device plugin honours the decision in Allocate and reports its progress in
`bind-phase` and `allocated`. The device plugin also publishes what it has handed out
(`NodeUsage`, Node annotation `vgpu.k8s.io/node-usage`: one entry per vGPU slot in use, tagged
with the pod UID and container that hold it), so slices that no decision names (pods placed by
another scheduler, or before vgpu-scheduler ran) are counted too, and a pod's slices stop counting
when the pod ends although its allocation records stay (the kubelet may replay them). A GPU's
usage is its published slices of pods that hold them plus the decided containers not yet among
them, per pod by the effective-request rule (`node_usage`, `pod_usage`): the scheduler and
`vgpuctl cluster` both compute it so, from the API objects alone.

Node-level totals (`RESOURCE_NODE_MEM`, `RESOURCE_NODE_CORES`) make GPU memory and compute
resources kube-scheduler itself counts, so a pod blocked by them reaches preemption: the device
plugin advertises the node's totals in the Node's status, the webhook adds the container's totals
(`node_level_requests`) to its requests (docs/developers/scheduler.md, "Preemption").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Annotated, Any, Protocol, TypeVar

import msgspec

from vgpu import quantity

# Resources (names as HAMi users know them).
RESOURCE_GPU = "nvidia.com/gpu"  # count of distinct physical GPUs the container spans
RESOURCE_MEM = "nvidia.com/gpumem"  # MiB per GPU
RESOURCE_MEM_PERCENT = "nvidia.com/gpumem-percentage"  # percent of each GPU's memory (exclusive with gpumem)
RESOURCE_CORES = "nvidia.com/gpucores"  # percent of each GPU's compute
VGPU_RESOURCES = (RESOURCE_GPU, RESOURCE_MEM, RESOURCE_MEM_PERCENT, RESOURCE_CORES)
# Node-level totals kube-scheduler's NodeResourcesFit counts (extended resources: whole numbers):
# on the Node, the sum over its GPUs; on a container, its per-GPU ask times its GPU count.
RESOURCE_NODE_MEM = "vgpu.k8s.io/gpumem-total"  # MiB
RESOURCE_NODE_CORES = "vgpu.k8s.io/gpucores-total"  # percent of one GPU's compute, summed
NODE_LEVEL_RESOURCES = (RESOURCE_NODE_MEM, RESOURCE_NODE_CORES)

# Node annotation (device plugin → scheduler).
INVENTORY_ANNOTATION = "vgpu.k8s.io/node-inventory"
INVENTORY_VERSION = 2
# Version 3 is version 2 with GPUs that create MIG instances on demand (`InventoryGPU.mig`); the
# plugin writes 3 only then, so a scheduler that knows only 2 offers none of such a node's GPUs
# rather than vGPU slices of a GPU in MIG mode (which CUDA cannot use whole).
INVENTORY_VERSION_MIG = 3
INVENTORY_VERSIONS = (INVENTORY_VERSION, INVENTORY_VERSION_MIG)
DEFAULT_HEARTBEAT_S = 30.0  # the plugin refreshes `heartbeat` this often
DEFAULT_STALE_AFTER_S = 120.0  # the scheduler offers no GPUs of a node whose heartbeat is older

# Node annotation (device plugin → scheduler, vgpuctl cluster): the slices the node handed out.
USAGE_ANNOTATION = "vgpu.k8s.io/node-usage"
USAGE_VERSION = 1

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
# "true": the pod's containers get a MIG instance each, created for them (dynamic MIG,
# docs/operators/mig.md); only GPUs that create instances on demand take the pod.
MIG_ANNOTATION = "vgpu.k8s.io/mig"
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

MIG_MEMORY_SLICES = 8  # "one eighth of the total GPU memory resources" (MIG user guide, "Terminology")
Bytes = Annotated[int, msgspec.Meta(ge=0)]
Percent = Annotated[int, msgspec.Meta(ge=0, le=10_000)]
Uuid = Annotated[str, msgspec.Meta(min_length=1, max_length=95, pattern=r"^[A-Za-z0-9-]+$")]


class MigProfile(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A GPU instance profile of a GPU in MIG mode (NVML nvmlGpuInstanceProfileInfo_t and
    nvmlDeviceGetGpuInstancePossiblePlacements_v2): its name as go-nvlib writes it (`1g.35gb`),
    NVML's profile ID, the instance's memory, its compute slices (the `1g`), the memory slices it
    takes, every start it may be placed at, and the starts free now."""

    name: str
    id: Annotated[int, msgspec.Meta(ge=0)]
    memory: Bytes
    slices: Annotated[int, msgspec.Meta(ge=1)]
    memory_slices: Annotated[int, msgspec.Meta(ge=1, le=MIG_MEMORY_SLICES)]
    placements: tuple[Annotated[int, msgspec.Meta(ge=0, lt=MIG_MEMORY_SLICES)], ...]
    free: tuple[int, ...] = ()


class MigInstance(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A GPU instance that exists (any: created for a pod or by the administrator): its profile,
    placement (memory slices start..start+size-1), the UUID of its MIG device ("" without a compute
    instance) and the UID of the pod it was created for ("" when none: not ours)."""

    profile: str
    start: Annotated[int, msgspec.Meta(ge=0, lt=MIG_MEMORY_SLICES)]
    size: Annotated[int, msgspec.Meta(ge=1, le=MIG_MEMORY_SLICES)]
    uuid: str = ""
    pod: str = ""


class MigGPU(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A GPU in MIG mode whose instances the node creates on demand: its profiles and instances."""

    profiles: tuple[MigProfile, ...] = ()
    instances: tuple[MigInstance, ...] = ()
    compute_slices: int = 7  # the GPU's compute slices ("one seventh of the SMs", MIG user guide)


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
    # A GPU in MIG mode whose instances are created per container (inventory version 3): each
    # vGPU slot is then at most one instance; absent on every other GPU.
    mig: MigGPU | msgspec.UnsetType = msgspec.UNSET


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
class MigAssignment(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, gc=False):
    """A MIG instance to create for a container on the GPU it is given (dynamic MIG): the GPU
    instance profile (name, NVML ID), its placement in memory slices and its compute slices."""

    profile: str
    id: Annotated[int, msgspec.Meta(ge=0)]
    start: Annotated[int, msgspec.Meta(ge=0, lt=MIG_MEMORY_SLICES)]
    size: Annotated[int, msgspec.Meta(ge=1, le=MIG_MEMORY_SLICES)]
    slices: Annotated[int, msgspec.Meta(ge=1)] = 1


class GPUAssignment(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """One GPU given to a container: its UUID, the memory limit in bytes and the compute share in
    percent; with `mig`, the container gets that instance of the GPU, created for it (the memory
    and compute are then the instance's). A device plugin that does not know `mig` refuses the
    decision (unknown field) rather than giving the container the GPU itself."""

    uuid: Uuid
    memory: Bytes
    cores: Percent
    mig: MigAssignment | msgspec.UnsetType = msgspec.UNSET


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


class UsedSlice(msgspec.Struct, kw_only=True, gc=False):
    """One vGPU slot in use on the node: the GPU, the memory limit and compute share of the
    container holding it, and that container's pod UID and name when the device plugin knows them
    (from the kubelet's device checkpoint, or the decision it honoured); "" while it does not."""

    gpu: Uuid
    memory: Bytes
    cores: Percent
    pod: str = ""
    container: str = ""
    mig: MigAssignment | msgspec.UnsetType = msgspec.UNSET  # the instance created for it (dynamic MIG)


class NodeUsage(msgspec.Struct, kw_only=True):
    """`vgpu.k8s.io/node-usage` on the Node (version 1): what the device plugin's allocation
    records hold now, as of `time`: one slice per vGPU slot and record (a slot named by records of
    several pods is the newest pod's; the records of one pod that share a slot, an init container's
    and the app container's it was given to, are all listed: `pod_usage` counts them once)."""

    version: int = USAGE_VERSION
    time: float
    slices: list[UsedSlice] = msgspec.field(default_factory=list)


class ContractError(ValueError):
    """An annotation that is not a valid document of this contract."""


_encoder = msgspec.json.Encoder()
_inventory_decoder = msgspec.json.Decoder(NodeInventory)
_decision_decoder = msgspec.json.Decoder(Decision)
_allocated_decoder = msgspec.json.Decoder(list[str])
_usage_decoder = msgspec.json.Decoder(NodeUsage)


def encode(obj: msgspec.Struct | list[str]) -> str:
    """Compact JSON text for an annotation value."""
    return _encoder.encode(obj).decode()


class _Versioned(Protocol):
    version: int


_V = TypeVar("_V", bound=_Versioned)


def _decode_versioned(decoder: msgspec.json.Decoder[_V], text: str | bytes, annotation: str, version: int) -> _V:
    """Parse an annotation's document; ContractError when invalid or of another version."""
    try:
        doc = decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ContractError(f"{annotation}: {e}") from None
    if doc.version != version:
        raise ContractError(f"{annotation}: version {doc.version}, expected {version}")
    return doc


def decode_inventory(text: str | bytes) -> NodeInventory:
    """Parse a node-inventory annotation; ContractError when it is not a version-2 or -3 inventory."""
    try:
        doc = _inventory_decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ContractError(f"{INVENTORY_ANNOTATION}: {e}") from None
    if doc.version not in INVENTORY_VERSIONS:
        raise ContractError(f"{INVENTORY_ANNOTATION}: version {doc.version}, expected 2 or 3")
    return doc


def decode_decision(text: str | bytes) -> Decision:
    """Parse a decision annotation; ContractError when invalid or of another version."""
    return _decode_versioned(_decision_decoder, text, DECISION_ANNOTATION, DECISION_VERSION)


def decode_usage(text: str | bytes) -> NodeUsage:
    """Parse a node-usage annotation; ContractError when it is not a version-1 document."""
    return _decode_versioned(_usage_decoder, text, USAGE_ANNOTATION, USAGE_VERSION)


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
# A mirror pod (the API's copy of a kubelet's static pod) has its own UID; the kubelet's device
# manager knows the static pod by the UID the kubelet gave it, which the mirror pod carries in
# this annotation (kubelet pkg/kubelet/pod/mirror_client.go CreateMirrorPod: the config hash, which
# config/common.go applyDefaults sets to the static pod's UID).
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


# How many holders each memory slice of a GPU in MIG mode has, packed in one int (GPUUse.mig):
# 16 bits per slice, slice i at bits 16i..16i+15, so that holders add and subtract like the other
# dimensions (a slice is taken while its count is not 0).
MIG_LANE_BITS = 16
_LANE = (1 << MIG_LANE_BITS) - 1


def mig_lanes(start: int, size: int) -> int:
    """One holder of memory slices start..start+size-1."""
    return sum(1 << (MIG_LANE_BITS * i) for i in range(start, start + size))


def mig_taken(lanes: int) -> int:
    """The memory slices held (bit i: slice i) of packed holder counts."""
    out = 0
    for i in range(MIG_MEMORY_SLICES):
        if (lanes >> (MIG_LANE_BITS * i)) & _LANE:
            out |= 1 << i
    return out


def _mig_of(m: MigAssignment | msgspec.UnsetType) -> int:
    return 0 if isinstance(m, msgspec.UnsetType) else mig_lanes(m.start, m.size)


class GPUUse(msgspec.Struct, gc=False):
    """What pods hold of one GPU: memory bytes, compute percent, vGPU slots (containers) and, on a
    GPU whose MIG instances are created per container, the memory slices of those instances
    (`mig`: packed holder counts, mig_lanes). Scalars only: gc=False keeps the tens of thousands
    the scheduler holds out of the cyclic GC's walks."""

    memory: int = 0
    cores: int = 0
    slots: int = 0
    mig: int = 0

    def add(self, o: GPUUse, sign: int = 1) -> None:
        self.memory += sign * o.memory
        self.cores += sign * o.cores
        self.slots += sign * o.slots
        self.mig += sign * o.mig

    def copy(self) -> GPUUse:
        return GPUUse(self.memory, self.cores, self.slots, self.mig)


PerGPU = dict[str, GPUUse]  # GPU UUID -> use


def _effective(conts: Iterable[tuple[bool, PerGPU]]) -> PerGPU:
    """Per GPU and dimension (memory, cores, slots): the larger of any single init container's use
    and the sum of the app containers' (Kubernetes' effective-request rule). MIG instances are
    summed over all containers: one created for an init container lives as long as its pod."""
    apps: PerGPU = {}
    inits: PerGPU = {}
    for init, per in conts:
        for uuid, x in per.items():
            if init:
                u = inits.get(uuid)
                if u is None:
                    inits[uuid] = x.copy()
                else:
                    u.memory, u.cores, u.slots = max(u.memory, x.memory), max(u.cores, x.cores), max(u.slots, x.slots)
                    u.mig += x.mig
            else:
                a = apps.get(uuid)
                if a is None:
                    apps[uuid] = x.copy()
                else:
                    a.add(x)
    if not inits:
        return apps
    for uuid, i in inits.items():
        a = apps.get(uuid)
        if a is None:
            apps[uuid] = i
        else:
            a.memory, a.cores, a.slots = max(a.memory, i.memory), max(a.cores, i.cores), max(a.slots, i.slots)
            a.mig += i.mig
    return apps


def _decided(c: ContainerDecision) -> PerGPU:
    return {g.uuid: GPUUse(g.memory, g.cores, 1, _mig_of(g.mig)) for g in c.gpus}


def decision_usage(d: Decision, allocated: frozenset[str] | set[str] = frozenset()) -> PerGPU:
    """One pod's effective usage per GPU UUID from its decision alone, less the containers in
    `allocated` (those counted from what the node published): `pod_usage` with nothing published
    but their names."""
    return pod_usage({name: {} for name in allocated}, d)


def pod_usage(
    published: Mapping[str, PerGPU] | None, decision: Decision | None, inits: Collection[str] | None = None
) -> PerGPU:
    """One pod's effective usage per GPU UUID of one node.

    Each container holds what the node published for it (the slices of its allocation records,
    `published`: container -> GPU -> use) or, while it has none, what the pod's decision names.
    Per GPU and dimension the pod then holds the larger of any single init container's use and the
    sum of its app containers': init containers run one at a time before the app containers, and
    the kubelet gives their devices to the app containers (device manager manager.go `Allocate`,
    `devicesToReuse`), so an init container's slice and an app container's slice on one vGPU never
    run at once. Once any app container is published, an init container not published holds
    nothing of its own (the kubelet allocates a pod's containers in order at admission).

    `inits`: the names of the pod's init containers that are not restartable (a restartable one, a
    sidecar, runs beside the app containers and keeps its devices: manager.go Allocate,
    `IsRestartableInitContainer`), when the pod's spec is known. A container is an init container
    when `inits` or the decision says so; any other published container is an app container (a
    sum: the larger answer).
    """
    pub = published or {}
    conts: list[tuple[bool, PerGPU]] = []
    flags = {c.name: c.init for c in decision.containers} if decision is not None else {}
    known = inits or ()

    def is_init(name: str) -> bool:
        return flags.get(name, False) or name in known

    app_done = False
    for name, per in pub.items():
        init = is_init(name)
        app_done = app_done or not init
        if per:
            conts.append((init, per))
    if decision is not None:
        for c in decision.containers:
            if c.name in pub:
                continue
            init = is_init(c.name)
            if init and app_done:
                continue
            conts.append((init, _decided(c)))
    return _effective(conts)


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


def blocking_inits(pod: dict[str, Any]) -> tuple[str, ...]:
    """The names of a Pod's init containers that are not restartable (`restartPolicy: Always` makes
    a sidecar, pkg/api/v1/pod IsRestartableInitContainer)."""
    out = []
    for c in (pod.get("spec") or {}).get("initContainers") or ():
        if isinstance(c, dict) and c.get("restartPolicy") != "Always":
            out.append(str(c.get("name") or ""))
    return tuple(out)


# --- whether a node offers its GPUs (pure; the scheduler's filter and vgpuctl cluster) ----------


def node_allocatable(node: dict[str, Any], resource: str = RESOURCE_GPU) -> int:
    """The Node's allocatable vGPU count: -1 when it does not list the resource, 0 when unparsable."""
    text = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    return allocatable_count(None if text is None else str(text))


def allocatable_count(text: str | None) -> int:
    """An allocatable quantity's text as a count: -1 when absent, 0 when unparsable."""
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


# --- one truth for usage (pure; the scheduler and vgpuctl cluster) -------------------------------


def split_slices(slices: Iterable[UsedSlice]) -> tuple[PerGPU, dict[str, dict[str, PerGPU]]]:
    """(the slices no pod is named on, per GPU; pod UID -> container -> GPU -> use) of a node's
    published usage: a container's use of a GPU is the sum of its slices there (n x 1/K is n)."""
    base: PerGPU = {}
    pods: dict[str, dict[str, PerGPU]] = {}
    for s in slices:
        if s.pod:
            per = pods.setdefault(s.pod, {}).setdefault(s.container, {})
        else:
            per = base
        u = per.get(s.gpu)
        if u is None:
            per[s.gpu] = GPUUse(s.memory, s.cores, 1, _mig_of(s.mig))
        else:
            u.memory, u.cores, u.slots = u.memory + s.memory, u.cores + s.cores, u.slots + 1
            u.mig += _mig_of(s.mig)
    return base, pods


def node_usage(
    slices: Iterable[UsedSlice],
    decisions: Mapping[str, Decision],
    holds: Callable[[str], bool] | None = None,
    inits: Mapping[str, Collection[str]] | None = None,
) -> PerGPU:
    """Per GPU UUID of one node: every published slice no pod is named on, plus per pod its
    `pod_usage` of the slices published for it and of its decision if that holds GPUs here
    (`decisions`: uid -> decision). `holds(uid)`: whether a pod's published slices hold their
    GPUs (the scheduler: the pod exists and is not Succeeded/Failed, or is not known yet; None:
    all hold). `inits`: uid -> the pod's blocking init containers, for the pods whose spec is known."""
    base, pods = split_slices(slices)
    out = base
    for uid in pods.keys() | decisions.keys():
        pub = pods.get(uid)
        if pub is not None and holds is not None and not holds(uid):
            pub = None
        d = decisions.get(uid)
        if pub is None and d is None:
            continue
        for uuid, x in pod_usage(pub, d, (inits or {}).get(uid)).items():
            u = out.get(uuid)
            if u is None:
                out[uuid] = x
            else:
                u.add(x)
    return out


# --- node-level totals kube-scheduler counts (pure; device plugin and webhook) ------------------
MiB = 1 << 20


def node_capacity(inv: NodeInventory) -> dict[str, int]:
    """The Node's RESOURCE_NODE_MEM (MiB) and RESOURCE_NODE_CORES (percent) capacity: the sum over
    all its GPUs, healthy or not (a smaller capacity could make the kubelet reject running pods on
    its restart; the extender does not offer unhealthy GPUs anyway)."""
    return {
        RESOURCE_NODE_MEM: sum(g.memory_schedulable // MiB for g in inv.gpus),
        RESOURCE_NODE_CORES: sum(g.cores for g in inv.gpus),
    }


def node_level_requests(count: int, mem_mib: int | None, cores: int | None) -> dict[str, int]:
    """A container's node-level totals: per-GPU MiB and percent times its GPU count. What the
    webhook cannot know (no gpumem: the chosen GPU's 1/K slice; a percentage of a GPU not yet
    chosen) is left out: kube-scheduler then counts less than the extender, never more."""
    out: dict[str, int] = {}
    if count > 0 and mem_mib is not None and mem_mib > 0:
        out[RESOURCE_NODE_MEM] = count * mem_mib
    if count > 0 and cores is not None and cores > 0:
        out[RESOURCE_NODE_CORES] = count * cores
    return out


def canonical_quantity(n: int) -> str:
    """A whole number as the API server stores it (3000 -> "3k", 4096 -> "4096"; vgpu.quantity's
    port of resource.Quantity's canonical form), so a value the webhook wrote reads back unchanged
    (traces: quantities/quantities.json)."""
    if n < 0:
        raise ValueError("negative quantity")
    return quantity.canonical(quantity.parse(str(n)))


def _esc(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def node_level_patch(spec: dict[str, Any], wanted: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """JSONPatch operations that make each container's node-level totals (`wanted`: container name
    -> node_level_requests) its requests and limits, in `spec` (the pod spec as the earlier
    operations left it). Extended resources need requests == limits; values already right are
    left alone (a reviewed pod reviewed again gets no operation), values that are wrong or are not
    wanted (a user's own) are replaced or removed: kube-scheduler must count what the extender
    will place."""
    ops: list[dict[str, Any]] = []
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            want = wanted.get(str(c.get("name") or ""), {})
            res = c.get("resources")
            base = f"/spec/{key}/{i}/resources"
            if res is None:
                if want:
                    vals = {k: canonical_quantity(v) for k, v in want.items()}
                    ops.append({"op": "add", "path": base, "value": {"limits": vals, "requests": dict(vals)}})
                continue
            for part in ("limits", "requests"):
                cur = res.get(part)
                if cur is None:
                    if want:
                        vals = {k: canonical_quantity(v) for k, v in want.items()}
                        ops.append({"op": "add", "path": f"{base}/{part}", "value": vals})
                    continue
                for name in NODE_LEVEL_RESOURCES:
                    path = f"{base}/{part}/{_esc(name)}"
                    if name in want:
                        v = canonical_quantity(want[name])
                        if name not in cur:
                            ops.append({"op": "add", "path": path, "value": v})
                        elif str(cur[name]) != v:
                            ops.append({"op": "replace", "path": path, "value": v})
                    elif name in cur:
                        ops.append({"op": "remove", "path": path})
    return ops
