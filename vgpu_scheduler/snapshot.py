"""The cluster as the scheduler sees it (pure): what each node offers and what each pod uses.

- A node offers its inventory's healthy GPUs, or nothing (with the reason) when the inventory is
  missing, invalid or stale (heartbeat older than stale_after_s), or when its allocatable
  vGPU resource is 0 (the device plugin died or deregistered).
- A GPU's usage is what its node published as handed out (`vgpu.k8s.io/node-usage`: every
  slice of the device plugin's allocation records, with or without a decision) plus what the
  decisions of pods holding GPUs there name and the node has not published yet
  (vgpu.scheduling.node_usage). A pod's decision holds while it is not terminated:
  Succeeded/Failed pods release; terminating pods (deletionTimestamp set) keep their usage until
  they are gone, since their processes may still hold GPU memory.
- A pod's effective usage of one GPU is, per dimension (memory, cores, vGPU slots), the larger
  of any single init container's and the sum of its app containers' — init containers run one
  at a time before the app containers (Kubernetes' effective-request rule), and the kubelet's
  device manager reuses init containers' devices for the app containers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vgpu import scheduling as sc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GPU:
    uuid: str
    index: int
    model: str
    numa: int
    memory: int  # schedulable bytes
    cores: int  # percent (100 x cores_scaling)
    slots: int  # vGPU slots (split count)
    healthy: bool


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: tuple[GPU, ...] = ()
    problem: str = ""  # why the node offers no GPUs ("" when it offers its gpus)
    heartbeat: float = 0.0
    totals: tuple[int, int, int] = (0, 0, 0)  # schedulable memory, cores, slots of all its GPUs


class Use(msgspec.Struct, gc=False):
    """Memory bytes, compute percent and vGPU slots held of one GPU. Scalars only: kept out of the
    cyclic GC (there are tens of thousands of these; its full collections walk every tracked one)."""

    memory: int = 0
    cores: int = 0
    slots: int = 0

    def add(self, o: Use, sign: int = 1) -> None:
        self.memory += sign * o.memory
        self.cores += sign * o.cores
        self.slots += sign * o.slots


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the scheduler keeps of a Node object: the parsed inventory and its allocatable slots."""

    name: str
    inventory: sc.NodeInventory | None
    error: str  # why the inventory could not be used ("" when it parsed)
    allocatable: int  # allocatable vGPU resource; -1 when the Node does not list it
    labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[GPU, ...] = ()  # the inventory's GPUs, by index (built once per Node version)
    totals: tuple[int, int, int] = (0, 0, 0)
    # What the node published as handed out (None: nothing published, e.g. an older plugin).
    used: sc.NodeUsage | None = None
    # GPUs' sizes (and totals): nodes of one shape give a pod the same slices, so their order by
    # usage is their order by placement score (the filter's index, state.py).
    shape: tuple[object, ...] = ()


def node_info(node: dict[str, Any], resource: str = sc.RESOURCE_GPU) -> NodeInfo:
    meta = node.get("metadata") or {}
    name = meta.get("name") or ""
    text = (meta.get("annotations") or {}).get(sc.INVENTORY_ANNOTATION)
    inv: sc.NodeInventory | None = None
    err = ""
    if text is None:
        err = "no vGPU inventory (device plugin not running?)"
    else:
        try:
            inv = sc.decode_inventory(text)
        except sc.ContractError as e:
            err = f"invalid inventory: {e}"
    alloc = sc.node_allocatable(node, resource)
    used: sc.NodeUsage | None = None
    text_used = (meta.get("annotations") or {}).get(sc.USAGE_ANNOTATION)
    if text_used:
        try:
            used = sc.decode_usage(text_used)
        except sc.ContractError as e:
            # Unreadable: the slices it would name are unknown; the node offers nothing rather
            # than over-committing what it may hold.
            err = err or f"invalid usage: {e}"
            inv = None
    gpus: tuple[GPU, ...] = ()
    if inv is not None:
        gpus = tuple(
            GPU(g.uuid, g.index, g.model, g.numa, g.memory_schedulable, g.cores, g.split_count, g.health)
            for g in sorted(inv.gpus, key=lambda g: g.index)
        )
    totals = (sum(g.memory for g in gpus), sum(g.cores for g in gpus), sum(g.slots for g in gpus))
    shape = (totals, tuple((g.memory, g.cores, g.slots) for g in gpus))
    return NodeInfo(name, inv, err, alloc, dict(meta.get("labels") or {}), gpus, totals, used, shape)


def node_view(info: NodeInfo, now: float, stale_after_s: float) -> NodeView:
    """The GPUs a node offers now (pure)."""
    inv = info.inventory
    if inv is None:
        return NodeView(info.name, problem=info.error)
    problem = sc.offer_problem(inv, info.allocatable, now, stale_after_s)
    if problem:
        return NodeView(info.name, problem=problem)
    gpus = info.gpus
    if not gpus:
        return NodeView(info.name, problem="inventory lists no GPUs", heartbeat=inv.heartbeat)
    return NodeView(info.name, gpus, heartbeat=inv.heartbeat, totals=info.totals)


class PodRec(msgspec.Struct, frozen=True, gc=False):
    """What the scheduler keeps of a Pod: identity, phase, its decision, and what preemption ranks
    victims by (spec.priority, status.startTime)."""

    uid: str
    namespace: str
    name: str
    node: str  # spec.nodeName ("" while unbound)
    phase: str
    deleting: bool
    decision: sc.Decision | None
    resource_version: str = ""
    priority: int = 0  # spec.priority (admission sets it from the PriorityClass); absent: 0
    start: str = ""  # status.startTime (RFC 3339, sorts as text); "" while not started

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_rec(pod: dict[str, Any]) -> PodRec:
    meta = pod.get("metadata") or {}
    text = (meta.get("annotations") or {}).get(sc.DECISION_ANNOTATION)
    dec: sc.Decision | None = None
    if text:
        try:
            dec = sc.decode_decision(text)
        except sc.ContractError as e:
            log.warning("pod %s/%s: ignoring its decision: %s", meta.get("namespace"), meta.get("name"), e)
    return PodRec(
        uid=meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}",
        namespace=meta.get("namespace") or "",
        name=meta.get("name") or "",
        node=(pod.get("spec") or {}).get("nodeName") or "",
        phase=(pod.get("status") or {}).get("phase") or "",
        deleting=bool(meta.get("deletionTimestamp")),
        decision=dec,
        resource_version=meta.get("resourceVersion") or "",
        priority=_int((pod.get("spec") or {}).get("priority")),
        start=str((pod.get("status") or {}).get("startTime") or ""),
    )


def _int(v: Any) -> int:
    try:
        return int(v) if v is not None else 0
    except (TypeError, ValueError):
        return 0


def decision_usage(d: sc.Decision, allocated: frozenset[str] | set[str] = frozenset()) -> dict[str, Use]:
    """A decision's effective usage per GPU UUID: max(any init container, sum of app containers),
    less the containers the node already published (`allocated`).

    The rule lives once, in vgpu.scheduling.decision_usage (vgpuctl cluster reads the same)."""
    return {uuid: Use(u.memory, u.cores, u.slots) for uuid, u in sc.decision_usage(d, allocated).items()}


def counts(p: PodRec) -> str:
    """The node a pod's decision holds GPUs on, or "" when it holds none (vgpu.scheduling.holding_node:
    terminated pods release, terminating ones keep, a pod bound elsewhere never used the GPUs)."""
    return sc.holding_node(p.decision, p.phase, p.node)


Usage = dict[str, dict[str, Use]]  # node -> GPU UUID -> used


def usage_of(
    pods: list[PodRec], nodes: list[NodeInfo] | None = None, reserved: dict[str, sc.Decision] | None = None
) -> Usage:
    """Usage recomputed from scratch (what the incremental accounting must always equal): per node,
    vgpu.scheduling.node_usage of its published slices and of the decisions holding GPUs there
    (a reservation, `reserved`: pod UID -> decision, stands for the pod's decision)."""
    live = {p.uid: p.phase not in sc.TERMINATED_PHASES for p in pods}
    held: dict[str, dict[str, sc.Decision]] = {}
    for p in pods:
        d = (reserved or {}).get(p.uid)
        if d is not None:
            node = d.node if p.phase not in sc.TERMINATED_PHASES and p.node in ("", d.node) else ""
        else:
            node, d = counts(p), p.decision
        if node and d is not None:
            held.setdefault(node, {})[p.uid] = d
    slices = {n.name: n.used.slices for n in nodes or [] if n.used is not None}
    usage: Usage = {}
    for node in held.keys() | slices.keys():
        per = sc.node_usage(slices.get(node, []), held.get(node, {}), live)
        usage[node] = {uuid: Use(u.memory, u.cores, u.slots) for uuid, u in per.items()}
    return usage


def drift_bytes(a: Usage, b: Usage) -> int:
    """Sum over GPUs of |memory difference| between two usages (0 when they agree)."""
    total = 0
    for node in a.keys() | b.keys():
        x, y = a.get(node, {}), b.get(node, {})
        for uuid in x.keys() | y.keys():
            total += abs(x.get(uuid, Use()).memory - y.get(uuid, Use()).memory)
    return total
