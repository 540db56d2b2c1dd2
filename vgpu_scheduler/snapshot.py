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
from collections.abc import Callable
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
    mig: sc.MigGPU | None = None  # a GPU that creates MIG instances per container (vgpu_scheduler/mig.py)


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: tuple[GPU, ...] = ()
    problem: str = ""  # why the node offers no GPUs ("" when it offers its gpus)
    heartbeat: float = 0.0
    totals: tuple[int, int, int] = (0, 0, 0)  # schedulable memory, cores, slots of all its GPUs


# Memory bytes, compute percent and vGPU slots held of one GPU (scalars only, out of the cyclic GC).
Use = sc.GPUUse


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
    resource_version: str = ""
    inventory_key: int = 0  # hash of the inventory text it was parsed from (0: none)


def node_info(node: dict[str, Any], resource: str = sc.RESOURCE_GPU) -> NodeInfo:
    """What the scheduler keeps of a Node object (a dict, as the API returns it)."""
    meta = node.get("metadata") or {}
    alloc = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    return _node_info(
        str(meta.get("name") or ""),
        str(meta.get("resourceVersion") or ""),
        meta.get("annotations") or {},
        alloc if alloc is None else str(alloc),
        dict(meta.get("labels") or {}),
        None,
    )


def _node_info(
    name: str,
    rv: str,
    annotations: dict[str, str],
    alloc_text: str | None,
    labels: dict[str, str],
    prev: NodeInfo | None,
) -> NodeInfo:
    text = annotations.get(sc.INVENTORY_ANNOTATION)
    key = hash(text) if text is not None else 0
    inv: sc.NodeInventory | None = None
    err = ""
    gpus: tuple[GPU, ...] = ()
    if prev is not None and key and prev.inventory_key == key and prev.inventory is not None:
        # The inventory text is what it was (only the heartbeat makes it change): not decoded again.
        inv, gpus = prev.inventory, prev.gpus
    elif text is None:
        err = "no vGPU inventory (device plugin not running?)"
    else:
        try:
            inv = sc.decode_inventory(text)
        except sc.ContractError as e:
            err = f"invalid inventory: {e}"
        if inv is not None:
            gpus = tuple(
                GPU(
                    g.uuid,
                    g.index,
                    g.model,
                    g.numa,
                    g.memory_schedulable,
                    g.cores,
                    g.split_count,
                    g.health,
                    None if isinstance(g.mig, msgspec.UnsetType) else g.mig,
                )
                for g in sorted(inv.gpus, key=lambda g: g.index)
            )
    alloc = sc.allocatable_count(alloc_text)
    used: sc.NodeUsage | None = None
    text_used = annotations.get(sc.USAGE_ANNOTATION)
    if text_used:
        try:
            used = sc.decode_usage(text_used)
        except sc.ContractError as e:
            # Unreadable: the slices it would name are unknown; the node offers nothing rather
            # than over-committing what it may hold.
            err = err or f"invalid usage: {e}"
            inv, gpus = None, ()
    if prev is not None and prev.gpus is gpus:
        totals, shape = prev.totals, prev.shape
    else:
        totals = (sum(g.memory for g in gpus), sum(g.cores for g in gpus), sum(g.slots for g in gpus))
        shape = (totals, tuple((g.memory, g.cores, g.slots, _mig_shape(g.mig)) for g in gpus))
    return NodeInfo(name, inv, err, alloc, labels, gpus, totals, used, shape, rv, key if inv is not None else 0)


def _mig_shape(m: sc.MigGPU | None) -> object:
    """What of a MIG GPU makes the instances a pod gets (its profiles, not what is free)."""
    if m is None:
        return None
    return (
        m.compute_slices,
        tuple((p.name, p.id, p.memory, p.slices, p.memory_slices, p.placements) for p in m.profiles),
    )


# ----- what the watches and lists bring, decoded into the fields kept (msgspec skips the rest) ----
class _ObjMeta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    annotations: dict[str, str] | None = None
    deletionTimestamp: str | None = None


class _Container(msgspec.Struct):
    name: str = ""
    restartPolicy: str | None = None


class _PodSpec(msgspec.Struct):
    nodeName: str = ""
    priority: int | None = None
    initContainers: list[_Container] | None = None


class _PodStatus(msgspec.Struct):
    phase: str = ""
    startTime: str | None = None


class _Pod(msgspec.Struct):
    metadata: _ObjMeta = msgspec.field(default_factory=_ObjMeta)
    spec: _PodSpec = msgspec.field(default_factory=_PodSpec)
    status: _PodStatus = msgspec.field(default_factory=_PodStatus)


class _NodeStatus(msgspec.Struct):
    allocatable: dict[str, str] | None = None


class _Node(msgspec.Struct):
    metadata: _ObjMeta = msgspec.field(default_factory=_ObjMeta)
    status: _NodeStatus = msgspec.field(default_factory=_NodeStatus)


class _ListMeta(msgspec.Struct):
    resourceVersion: str = ""


class _PodList(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[_Pod] | None = None


class _NodeList(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[_Node] | None = None


_pod_dec = msgspec.json.Decoder(_Pod)
_node_dec = msgspec.json.Decoder(_Node)
_pod_list_dec = msgspec.json.Decoder(_PodList)
_node_list_dec = msgspec.json.Decoder(_NodeList)


class DecodeError(ValueError):
    """A Pod or Node (or list) that is not one."""


def _rec_of(p: _Pod) -> PodRec:
    m, spec, st = p.metadata, p.spec, p.status
    ann = m.annotations or {}
    text = ann.get(sc.DECISION_ANNOTATION)
    dec: sc.Decision | None = None
    if text:
        try:
            dec = sc.decode_decision(text)
        except sc.ContractError as e:
            log.warning("pod %s/%s: ignoring its decision: %s", m.namespace, m.name, e)
    return PodRec(
        uid=m.uid or f"{m.namespace}/{m.name}",
        namespace=m.namespace,
        name=m.name,
        node=spec.nodeName,
        phase=st.phase,
        deleting=bool(m.deletionTimestamp),
        decision=dec,
        resource_version=m.resourceVersion,
        priority=spec.priority or 0,
        start=st.startTime or "",
        inits=tuple(c.name for c in spec.initContainers or () if c.restartPolicy != "Always"),
        mirror=ann.get(sc.MIRROR_ANNOTATION) or "",
    )


def decode_pod(data: bytes) -> PodRec:
    """A Pod's JSON (a watch event's object) into what the scheduler keeps of it."""
    try:
        return _rec_of(_pod_dec.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"not a Pod: {e}") from None


def decode_pod_list(data: bytes) -> tuple[list[PodRec], str]:
    """A PodList's JSON into (records, the list's resourceVersion); no Pod is kept whole."""
    try:
        doc = _pod_list_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"not a PodList: {e}") from None
    return [_rec_of(p) for p in doc.items or ()], doc.metadata.resourceVersion


def _info_of(n: _Node, resource: str, prev: NodeInfo | None) -> NodeInfo:
    m = n.metadata
    alloc = (n.status.allocatable or {}).get(resource)
    return _node_info(m.name, m.resourceVersion, m.annotations or {}, alloc, {}, prev)


def decode_node(data: bytes, resource: str, kept: Callable[[str], NodeInfo | None] | None = None) -> NodeInfo:
    """A Node's JSON into what the scheduler keeps of it; `kept(name)`: the record kept for that
    node, whose inventory is reused when its text is unchanged (only decoded when it changed)."""
    try:
        n = _node_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"not a Node: {e}") from None
    return _info_of(n, resource, kept(n.metadata.name) if kept is not None else None)


def decode_node_list(data: bytes, resource: str) -> tuple[list[NodeInfo], str]:
    try:
        doc = _node_list_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"not a NodeList: {e}") from None
    return [_info_of(n, resource, None) for n in doc.items or ()], doc.metadata.resourceVersion


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
    inits: tuple[str, ...] = ()  # init containers that are not restartable (vgpu.scheduling.pod_usage)
    mirror: str = ""  # a mirror pod: the UID the kubelet knows its static pod by (sc.MIRROR_ANNOTATION)

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
        inits=sc.blocking_inits(pod),
        mirror=str((meta.get("annotations") or {}).get(sc.MIRROR_ANNOTATION) or ""),
    )


def _int(v: Any) -> int:
    try:
        return int(v) if v is not None else 0
    except (TypeError, ValueError):
        return 0


def decision_usage(d: sc.Decision, allocated: frozenset[str] | set[str] = frozenset()) -> dict[str, Use]:
    """A decision's effective usage per GPU UUID: max(any init container, sum of app containers),
    less the containers the node already published (`allocated`). The rule lives once, in
    vgpu.scheduling (vgpuctl cluster reads the same)."""
    return sc.decision_usage(d, allocated)


def counts(p: PodRec) -> str:
    """The node a pod's decision holds GPUs on, or "" when it holds none (vgpu.scheduling.holding_node:
    terminated pods release, terminating ones keep, a pod bound elsewhere never used the GPUs)."""
    return sc.holding_node(p.decision, p.phase, p.node)


Usage = dict[str, dict[str, Use]]  # node -> GPU UUID -> used


def usage_of(
    pods: list[PodRec],
    nodes: list[NodeInfo] | None = None,
    reserved: dict[str, sc.Decision] | None = None,
    unknown_holds: Callable[[str, str], bool] | None = None,
) -> Usage:
    """Usage recomputed from scratch (what the incremental accounting must always equal): per node,
    vgpu.scheduling.node_usage of its published slices and of the decisions holding GPUs there
    (a reservation, `reserved`: pod UID -> decision, stands for the pod's decision).

    A pod's published slices hold while it is not Succeeded/Failed (`pods`, by UID or, for a mirror
    pod, by its static pod's UID); for a pod UID none of `pods` has, `unknown_holds(node, uid)`
    answers (the state: its pod watch has not reached the node's version yet; default: no)."""
    by_uid: dict[str, PodRec] = {p.uid: p for p in pods}
    for p in pods:
        if p.mirror and p.mirror not in by_uid:
            by_uid[p.mirror] = p
    held: dict[str, dict[str, sc.Decision]] = {}
    for p in pods:
        d = (reserved or {}).get(p.uid)
        if d is not None:
            node = d.node if p.phase not in sc.TERMINATED_PHASES and p.node in ("", d.node) else ""
        else:
            node, d = counts(p), p.decision
        if node and d is not None:
            held.setdefault(node, {})[p.uid] = d
    inits = {uid: p.inits for uid, p in by_uid.items()}
    slices = {n.name: n.used.slices for n in nodes or [] if n.used is not None}
    usage: Usage = {}
    for node in held.keys() | slices.keys():

        def holds(uid: str, node: str = node) -> bool:
            p = by_uid.get(uid)
            if p is not None:
                return p.phase not in sc.TERMINATED_PHASES
            return unknown_holds(node, uid) if unknown_holds is not None else False

        usage[node] = sc.node_usage(slices.get(node, []), held.get(node, {}), holds, inits)
    return usage


def drift_bytes(a: Usage, b: Usage) -> int:
    """Sum over GPUs of |memory difference| between two usages (0 when they agree)."""
    total = 0
    for node in a.keys() | b.keys():
        x, y = a.get(node, {}), b.get(node, {})
        for uuid in x.keys() | y.keys():
            total += abs(x.get(uuid, Use()).memory - y.get(uuid, Use()).memory)
    return total
