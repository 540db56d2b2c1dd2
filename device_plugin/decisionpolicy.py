"""Which container an Allocate is for and what slice the scheduler decided for it (pure: the
pods come decoded, the API calls are device_plugin.decision's).

vgpu-scheduler records on each pod it places which GPUs every vGPU container gets and how
much of them (`vgpu.k8s.io/decision`), and sets `bind-phase=allocating` with the Binding.
The kubelet's Allocate carries only vGPU IDs, so the plugin finds the container it is serving:
among the pods on this node that are `allocating` with a decision for this node, oldest
bind-time first, the first whose next decided container (init containers first, spec order) is
not yet allocated and spans as many GPUs as IDs were asked.  kubelet allocates one pod's
containers in that order and admits pods one at a time, so the next unallocated container of
the oldest allocating pod is the one being asked for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from device_plugin import allocator
from device_plugin.allocator import Slice
from device_plugin.podschema import Pod, pod_list_decoder
from nodecore.devices import DeviceTable
from vgpu import scheduling
from vgpu.log import kv
from vgpu.scheduling import ContainerDecision, Decision
from vgpu.schemas import AllocatedGPU

log = logging.getLogger("device_plugin.decision")


class DecisionError(RuntimeError):
    """The pod has a decision for this node that cannot be honoured (gRPC FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class PendingPod:
    """A pod bound to this node whose decided containers are being allocated."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    bind_time: float
    decision: Decision
    allocated: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Claim:
    pod: PendingPod
    container: ContainerDecision
    slice: Slice


def _float(text: str | None, default: float) -> float:
    try:
        v = float(text) if text is not None else default
    except ValueError:
        return default
    return v if math.isfinite(v) else default


def pending(pod: Pod, node: str) -> PendingPod | None:
    """The pod as a PendingPod when it is allocating with a valid decision for `node`."""
    m = pod.metadata
    ann = m.annotations or {}
    if ann.get(scheduling.BIND_PHASE_ANNOTATION) != scheduling.PHASE_ALLOCATING:
        return None
    if m.deletionTimestamp is not None or pod.status.phase in ("Succeeded", "Failed"):
        return None
    text = ann.get(scheduling.DECISION_ANNOTATION)
    if text is None:
        return None
    try:
        d = scheduling.decode_decision(text)
        allocated = scheduling.decode_allocated(ann.get(scheduling.ALLOCATED_ANNOTATION))
    except scheduling.ContractError as e:
        # The annotation is the scheduler's (or an editor's); bounded in the log.
        log.warning(kv("ignoring pod with an invalid decision", pod=f"{m.namespace}/{m.name}", error=str(e)[:200]))
        return None
    if d.node != node:
        return None
    return PendingPod(
        namespace=m.namespace,
        name=m.name,
        uid=m.uid,
        resource_version=m.resourceVersion,
        bind_time=_float(ann.get(scheduling.BIND_TIME_ANNOTATION), d.time),
        decision=d,
        allocated=tuple(allocated),
    )


def pending_pods(body: bytes, node: str) -> list[PendingPod]:
    """Allocating pods with a decision for `node` in a PodList body, oldest bind first."""
    items = pod_list_decoder.decode(body).items or []
    out = [p for p in (pending(i, node) for i in items) if p is not None]
    out.sort(key=lambda p: (p.bind_time, p.decision.time, p.namespace, p.name))
    return out


def next_container(pod: PendingPod, served: set[str] | frozenset[str] = frozenset()) -> ContainerDecision | None:
    """The first decided container neither in `allocated` nor served by this process."""
    for c in pod.decision.containers:
        if c.name not in pod.allocated and c.name not in served:
            return c
    return None


def choose(
    pods: Sequence[PendingPod], size: int, served: dict[str, set[str]]
) -> tuple[PendingPod, ContainerDecision] | None:
    """The pod and container an Allocate of `size` IDs is for, or None."""
    for p in pods:
        c = next_container(p, served.get(p.uid, set()))
        if c is not None and len(c.gpus) == size:
            return p, c
    return None


def steer(
    table: DeviceTable,
    container: ContainerDecision,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: str,
) -> list[str]:
    """Preferred IDs: every must-include ID, then one free ID on each decided GPU not yet covered
    (lowest vGPU index); what is still missing is filled by the plugin's own policy."""
    out: list[str] = []
    for d in must_include:
        if d not in out:
            out.append(d)
    covered = {table.by_id.get(d) for d in out}
    free = [d for d in available if d not in out]
    for g in container.gpus:
        if len(out) >= size:
            break
        if g.uuid in covered:
            continue
        on_gpu = sorted((d for d in free if table.by_id.get(d) == g.uuid), key=allocator._vgpu_index)
        if on_gpu:
            out.append(on_gpu[0])
            covered.add(g.uuid)
    if len(out) < size:
        out = allocator.preferred(table, available, out, size, policy)
    return out


def decided_slice(table: DeviceTable, device_ids: Sequence[str], container: ContainerDecision) -> Slice:
    """The container's slice: kubelet's IDs mapped onto the decided GPUs, decided sizes.

    The IDs are validated as without a decision (AllocationError). Each ID on a decided GPU
    stays on it; the others take the remaining decided GPUs in order (kubelet may not follow
    the preferred allocation; its IDs are then only counters, the decision names the GPUs).
    DecisionError when a decided GPU is not on this node, unhealthy, listed twice, or smaller
    than the decision.
    """
    allocator.slice_for(table, device_ids)  # validation only
    if len(device_ids) != len(container.gpus):
        raise DecisionError(f"container {container.name}: {len(device_ids)} IDs for {len(container.gpus)} decided GPUs")
    check_decided(table, container)
    seen = {g.uuid for g in container.gpus}
    ids_for: dict[str, str] = {}
    rest: list[str] = []
    for d in device_ids:
        u = table.by_id[d]
        if u in seen and u not in ids_for:
            ids_for[u] = d
        else:
            rest.append(d)
    for g in container.gpus:
        if g.uuid not in ids_for:
            ids_for[g.uuid] = rest.pop(0)
    s = table.slicing
    return Slice(
        gpus=[
            AllocatedGPU(
                uuid=g.uuid,
                memory_limit=g.memory,
                core_percent=g.cores,
                vgpu_ids=[ids_for[g.uuid]],
                device_limit=s.device_share(g.memory),  # gpumem x 1/S may be on the GPU
            )
            for g in container.gpus
        ]
    )


def check_decided(table: DeviceTable, container: ContainerDecision) -> None:
    """DecisionError when a decided GPU is not on this node, listed twice, unhealthy, or smaller
    than the decision."""
    s = table.slicing
    seen: set[str] = set()
    for g in container.gpus:
        st = table.gpus.get(g.uuid)
        if st is None:
            raise DecisionError(f"container {container.name}: decided GPU {g.uuid} is not on this node")
        if g.uuid in seen:
            raise DecisionError(f"container {container.name}: GPU {g.uuid} decided twice")
        seen.add(g.uuid)
        if not table.is_healthy(g.uuid):
            raise DecisionError(f"container {container.name}: decided GPU {g.uuid} is unhealthy")
        cap_mem = math.floor(st.info.memory_total * s.memory_scaling)
        cap_cores = math.floor(100 * s.cores_scaling + 1e-9)
        if g.memory > cap_mem or g.cores > cap_cores:
            raise DecisionError(
                f"container {container.name}: decided {g.memory} B / {g.cores} % exceeds GPU {g.uuid}'s "
                f"{cap_mem} B / {cap_cores} %"
            )
