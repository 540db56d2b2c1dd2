"""`vgpuctl cluster`: the cluster's vGPU nodes, GPUs, allocated/free memory and cores, pods per GPU.

Everything comes from the API server (kubeconfig or in-cluster service account): the Nodes'
inventory annotations (what the device plugins offer), their usage annotations (every slice the
node handed out, with or without a decision) and the Pods' decision annotations (what
vgpu-scheduler gave each container, counted until the node publishes it). A GPU's usage is
vgpu.scheduling.node_usage of both, the arithmetic the scheduler uses: the same numbers. Every
slice is shown with the pod holding it (the device plugin names it from the kubelet's device
checkpoint); pods placed without a decision (another scheduler, or before vgpu-scheduler ran) are
flagged "(no decision)", slices that name no pod yet are listed as UNNAMED, and the slices of pods
that ended are not counted although their allocation records stay. `view()` is pure; `fetch()`
does the two list calls (Nodes first); `render()` formats the text table.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from vgpu import scheduling as sc

MiB = 1 << 20


class PodOnGPU(msgspec.Struct, kw_only=True):
    namespace: str  # "" with name UNNAMED: slices the node handed out that name no pod (yet)
    name: str
    containers: list[str]
    memory: int  # bytes (effective usage of this pod on this GPU)
    cores: int  # percent
    phase: str
    terminating: bool = False
    decided: bool = True  # False: placed without a vgpu-scheduler decision (another scheduler, n x 1/K)


# Slices the device plugin published without a pod's name: the moment between an Allocate and the
# kubelet's checkpoint write, or a node whose checkpoint cannot be read (device_plugin/usage.py).
UNNAMED = "(no pod named)"


class GPURow(msgspec.Struct, kw_only=True):
    uuid: str
    index: int
    model: str
    healthy: bool
    numa: int
    memory: int  # schedulable bytes
    memory_allocated: int
    memory_free: int
    cores: int
    cores_allocated: int
    cores_free: int
    slots: int
    slots_allocated: int
    pods: list[PodOnGPU] = msgspec.field(default_factory=list)


class NodeRow(msgspec.Struct, kw_only=True):
    name: str
    problem: str = ""  # why the node offers no GPUs to the scheduler ("" when it does)
    heartbeat_age_s: float | None = None
    split_count: int = 0
    allocatable: int = -1  # allocatable vGPU resource; -1 when not listed
    gpus: list[GPURow] = msgspec.field(default_factory=list)
    unknown_gpus: list[str] = msgspec.field(default_factory=list)  # decided UUIDs absent from the inventory


class ClusterView(msgspec.Struct, kw_only=True):
    time: float
    nodes: list[NodeRow]
    pending: int = 0  # pods with a decision, not yet bound


def view(
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    now: float,
    stale_after_s: float = sc.DEFAULT_STALE_AFTER_S,
    resource: str = sc.RESOURCE_GPU,
) -> ClusterView:
    """The cluster view from Node and Pod objects (as the API returns them). Only nodes with an
    inventory annotation, or holding decided pods, are listed."""
    rows, used = node_rows(nodes, now, stale_after_s, resource)
    gpu_rows = {(n.name, g.uuid): g for n in rows.values() for g in n.gpus}
    pods_of = PodIndex(pods)
    held, pending = held_decisions(pods, rows)
    for node in held.keys() | used.keys():
        slices = used.get(node, [])
        decided = held.get(node, {})
        _count_usage(rows[node], gpu_rows, slices, decided, pods_of)
        _list_holders(node, gpu_rows, slices, decided, pods_of)
    for gr in gpu_rows.values():
        gr.memory_free = max(0, gr.memory - gr.memory_allocated)
        gr.cores_free = max(0, gr.cores - gr.cores_allocated)
        gr.pods.sort(key=lambda p: (p.namespace, p.name))
    return ClusterView(time=now, nodes=[rows[k] for k in sorted(rows)], pending=pending)


def node_rows(
    nodes: list[dict[str, Any]], now: float, stale_after_s: float, resource: str
) -> tuple[dict[str, NodeRow], dict[str, list[sc.UsedSlice]]]:
    """A row per node with an inventory annotation, its GPUs with nothing allocated yet; and
    what each node published as handed out (its usage annotation)."""
    rows: dict[str, NodeRow] = {}
    used: dict[str, list[sc.UsedSlice]] = {}
    for n in sorted(nodes, key=lambda n: (n.get("metadata") or {}).get("name") or ""):
        meta = n.get("metadata") or {}
        name = meta.get("name") or ""
        annotations = meta.get("annotations") or {}
        text = annotations.get(sc.INVENTORY_ANNOTATION)
        if text is None:
            continue
        row = rows[name] = NodeRow(name=name, allocatable=sc.node_allocatable(n, resource))
        text_used = annotations.get(sc.USAGE_ANNOTATION)
        if text_used:
            try:
                used[name] = sc.decode_usage(text_used).slices
            except sc.ContractError as e:
                row.problem = f"invalid usage: {e}"
                continue
        try:
            inv = sc.decode_inventory(text)
        except sc.ContractError as e:
            row.problem = f"invalid inventory: {e}"
            continue
        row.split_count = inv.split_count
        row.heartbeat_age_s = round(now - inv.heartbeat, 1)
        row.problem = sc.offer_problem(inv, row.allocatable, now, stale_after_s)
        row.gpus = [_gpu_row(g) for g in sorted(inv.gpus, key=lambda g: g.index)]
    return rows, used


def _gpu_row(g: sc.InventoryGPU) -> GPURow:
    return GPURow(
        uuid=g.uuid,
        index=g.index,
        model=g.model,
        healthy=g.health,
        numa=g.numa,
        memory=g.memory_schedulable,
        memory_allocated=0,
        memory_free=g.memory_schedulable,
        cores=g.cores,
        cores_allocated=0,
        cores_free=g.cores,
        slots=g.split_count,
        slots_allocated=0,
    )


class PodIndex:
    """The Pods by UID, and what the usage arithmetic asks of them.  The Pods are listed after the
    Nodes (fetch): a pod a Node's usage names that the list lacks has been deleted since.  A
    mirror pod stands for the static pod whose UID the kubelet uses."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.by_uid: dict[str, dict[str, Any]] = {}
        for p in pods:
            self.by_uid[str((p.get("metadata") or {}).get("uid") or "")] = p
        for p in pods:
            mirror = ((p.get("metadata") or {}).get("annotations") or {}).get(sc.MIRROR_ANNOTATION)
            if mirror and mirror not in self.by_uid:
                self.by_uid[str(mirror)] = p
        self.inits = {uid: sc.blocking_inits(p) for uid, p in self.by_uid.items()}

    def holds(self, uid: str) -> bool:
        """Whether the pod still holds its slices (listed, not ended)."""
        p = self.by_uid.get(uid)
        return p is not None and (p.get("status") or {}).get("phase") not in sc.TERMINATED_PHASES


def held_decisions(
    pods: list[dict[str, Any]], rows: dict[str, NodeRow]
) -> tuple[dict[str, dict[str, sc.Decision]], int]:
    """({node: {pod uid: decision}} of the decisions that hold GPUs, and how many of those pods
    are not bound yet); a node they name without an inventory gets a row saying so."""
    held: dict[str, dict[str, sc.Decision]] = {}
    pending = 0
    for p in pods:
        meta = p.get("metadata") or {}
        text = (meta.get("annotations") or {}).get(sc.DECISION_ANNOTATION)
        if not text:
            continue
        try:
            d = sc.decode_decision(text)
        except sc.ContractError:
            continue
        phase = (p.get("status") or {}).get("phase") or ""
        bound = (p.get("spec") or {}).get("nodeName") or ""
        node = sc.holding_node(d, phase, bound)
        if not node:
            continue
        if not bound:
            pending += 1  # decided, reserved by the scheduler, not bound yet
        held.setdefault(node, {})[str(meta.get("uid") or "")] = d
        rows.setdefault(node, NodeRow(name=node, problem="no vGPU inventory"))
    return held, pending


def _count_usage(
    row: NodeRow,
    gpu_rows: dict[tuple[str, str], GPURow],
    slices: list[sc.UsedSlice],
    decided: dict[str, sc.Decision],
    pods: PodIndex,
) -> None:
    """Each GPU's allocated memory, cores and slots: vgpu.scheduling.node_usage, the scheduler's
    arithmetic; GPUs the usage names that the inventory lacks are listed as unknown."""
    for uuid, use in sorted(sc.node_usage(slices, decided, pods.holds, pods.inits).items()):
        found = gpu_rows.get((row.name, uuid))
        if found is None:
            if uuid not in row.unknown_gpus:
                row.unknown_gpus.append(uuid)
            continue
        found.memory_allocated += use.memory
        found.cores_allocated += use.cores
        found.slots_allocated += use.slots


def _list_holders(
    node: str,
    gpu_rows: dict[tuple[str, str], GPURow],
    slices: list[sc.UsedSlice],
    decided: dict[str, sc.Decision],
    pods: PodIndex,
) -> None:
    """Who holds what: each pod (its published slices and its decided containers not published
    yet, by the same rule), and the slices that name no pod."""
    base, pub = sc.split_slices(slices)
    for uid in sorted(pub.keys() | decided.keys()):
        mine = pub.get(uid) if pods.holds(uid) else None
        dec = decided.get(uid)
        if mine is None and dec is None:
            continue
        p = pods.by_uid.get(uid) or {}
        meta = p.get("metadata") or {}
        for uuid, u in sc.pod_usage(mine, dec, pods.inits.get(uid)).items():
            target = gpu_rows.get((node, uuid))
            if target is None:
                continue
            names = [c for c, per in (mine or {}).items() if uuid in per]
            for c in dec.containers if dec is not None else ():
                if c.name not in names and any(g.uuid == uuid for g in c.gpus):
                    names.append(c.name)
            target.pods.append(
                PodOnGPU(
                    namespace=meta.get("namespace") or "",
                    name=meta.get("name") or uid,
                    containers=names,
                    memory=u.memory,
                    cores=u.cores,
                    phase=(p.get("status") or {}).get("phase") or "",
                    terminating=bool(meta.get("deletionTimestamp")),
                    decided=sc.DECISION_ANNOTATION in (meta.get("annotations") or {}),
                )
            )
    for uuid, u in base.items():
        target = gpu_rows.get((node, uuid))
        if target is not None:
            target.pods.append(
                PodOnGPU(namespace="", name=UNNAMED, containers=[], memory=u.memory, cores=u.cores, phase="")
            )


def _mib(n: int) -> str:
    return f"{n // MiB}"


def render(v: ClusterView) -> str:
    if not v.nodes:
        return "no vGPU nodes (no Node has the vgpu.k8s.io/node-inventory annotation)\n"
    lines: list[str] = []
    for n in v.nodes:
        hb = "" if n.heartbeat_age_s is None else f", heartbeat {n.heartbeat_age_s:.0f}s ago"
        state = f"  NOT OFFERED: {n.problem}" if n.problem else ""
        lines.append(f"NODE {n.name} ({len(n.gpus)} GPUs, split {n.split_count}{hb}){state}")
        if n.gpus:
            lines.append(
                f"  {'GPU':<4} {'UUID':<42} {'MODEL':<22} {'MEM ALLOC/TOTAL MiB':<21} {'FREE MiB':<9} "
                f"{'CORES ALLOC/TOTAL':<18} {'SLOTS':<6} PODS"
            )
        for g in n.gpus:
            health = "" if g.healthy else " (unhealthy)"
            lines.append(
                f"  {g.index:<4} {g.uuid:<42.42} {g.model:<22.22} "
                f"{_mib(g.memory_allocated) + '/' + _mib(g.memory):<21} {_mib(g.memory_free):<9} "
                f"{f'{g.cores_allocated}/{g.cores}':<18} {f'{g.slots_allocated}/{g.slots}':<6} {len(g.pods)}{health}"
            )
            for p in g.pods:
                flag = (" terminating" if p.terminating else "") + ("" if p.decided else " (no decision)")
                who = f"{p.namespace}/{p.name} [{','.join(p.containers)}]" if p.namespace else p.name
                lines.append(f"       {who} {_mib(p.memory)} MiB {p.cores}% {p.phase or '-'}{flag}")
        for u in n.unknown_gpus:
            lines.append(f"  decided GPU {u} is not in the node's inventory")
    if v.pending:
        lines.append(f"{v.pending} decided pod(s) not bound yet (counted on their nodes)")
    return "\n".join(lines) + "\n"


class ClusterUnavailable(RuntimeError):
    pass


def load_api(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A kubernetes CoreV1Api by vgpu.kube's rule."""
    from vgpu import kube

    try:
        api = kube.load(kubeconfig or "", context)
    except kube.KubeConfigError as e:
        raise ClusterUnavailable(str(e)) from None
    if api is None:
        raise ClusterUnavailable("no kubeconfig ($KUBECONFIG, ~/.kube/config) and not running in a cluster")
    from kubernetes import client

    return client.CoreV1Api(api)


class _List(msgspec.Struct):
    items: list[dict[str, Any]] | None = None


def fetch(api: Any, timeout: float = 30.0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(nodes, pods) from the API server; ClusterUnavailable naming the call on any error."""
    out = []
    for what, call in (("nodes", api.list_node), ("pods", api.list_pod_for_all_namespaces)):
        try:
            resp = call(_request_timeout=timeout, _preload_content=False)
            out.append(msgspec.json.decode(resp.data, type=_List).items or [])
        except Exception as e:
            status = getattr(e, "status", None)
            why = f"HTTP {status} {getattr(e, 'reason', '')}".strip() if status else (str(e).splitlines() or [""])[0]
            raise ClusterUnavailable(f"cannot list {what}: {why[:200]}") from None
    return out[0], out[1]


def run(kubeconfig: str | None, context: str | None, as_json: bool, stale_after_s: float) -> tuple[int, str]:
    """(exit status, text to print) of `vgpuctl cluster`."""
    try:
        nodes, pods = fetch(load_api(kubeconfig, context))
    except ClusterUnavailable as e:
        return 1, f"vgpuctl: {e}\n"
    v = view(nodes, pods, time.time(), stale_after_s)
    if as_json:
        return 0, msgspec.json.format(msgspec.json.encode(v), indent=2).decode() + "\n"
    return 0, render(v)
