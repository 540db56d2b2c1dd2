"""Scheduler decisions in Allocate (contract: vgpu/scheduling.py, docs/developers/device-plugin.md).

vgpu-scheduler records on each pod it places which GPUs every vGPU container gets and how
much of them (`vgpu.k8s.io/decision`), and sets `bind-phase=allocating` with the Binding.
The kubelet's Allocate carries only vGPU IDs, so the plugin finds the container it is serving:
among the pods on this node (API list, field selector spec.nodeName) that are `allocating` with
a decision for this node, oldest bind-time first, the first whose next decided container (init
containers first, spec order) is not yet allocated and spans as many GPUs as IDs were asked.
kubelet allocates one pod's containers in that order and admits pods one at a time, so the
next unallocated container of the oldest allocating pod is the one being asked for.

`Decisions.preferred()` steers GetPreferredAllocation to IDs on the decided GPUs;
`Decisions.claim()` maps the IDs to the decided GPUs with the decided bytes and percent;
after the record is written `Decisions.confirm()` appends the container to
`vgpu.k8s.io/allocated` (and sets `bind-phase=success` once all are) by a merge patch carrying
the pod's resourceVersion, retried on 409. No decision → None (the caller keeps n x 1/K).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from device_plugin import allocator
from device_plugin.allocator import Slice
from nodecore.devices import DeviceTable
from vgpu import scheduling
from vgpu.log import kv
from vgpu.scheduling import ContainerDecision, Decision
from vgpu.schemas import AllocatedGPU

log = logging.getLogger(__name__)

API_TIMEOUT_S = 5.0  # per API call; Allocate blocks the kubelet's pod admission meanwhile
PATCH_ATTEMPTS = 8
MODES = ("auto", "required", "off")
MERGE_PATCH = "application/merge-patch+json"  # RFC 7386; a metadata.resourceVersion in it is a precondition


class DecisionError(RuntimeError):
    """The pod has a decision for this node that cannot be honoured (gRPC FAILED_PRECONDITION)."""


class ApiUnavailable(RuntimeError):
    """The API server could not be asked, and the mode is `required` (gRPC UNAVAILABLE)."""


# --- the parts of a Pod this module reads (unknown fields are ignored) -----------------
class _Meta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    annotations: dict[str, str] | None = None
    deletionTimestamp: str | None = None


class _Status(msgspec.Struct):
    phase: str = ""


class _Pod(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    status: _Status = msgspec.field(default_factory=_Status)


class _PodList(msgspec.Struct):
    items: list[_Pod] | None = None


_pod_decoder = msgspec.json.Decoder(_Pod)
_list_decoder = msgspec.json.Decoder(_PodList)


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


def pending(pod: _Pod, node: str) -> PendingPod | None:
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
    items = _list_decoder.decode(body).items or []
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
    return Slice(
        gpus=[
            AllocatedGPU(uuid=g.uuid, memory_limit=g.memory, core_percent=g.cores, vgpu_ids=[ids_for[g.uuid]])
            for g in container.gpus
        ]
    )


def _api_error(e: Exception) -> str:
    status = getattr(e, "status", None)
    reason = getattr(e, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


class Decisions:
    """Finds and completes decisions through the API server; thread-safe.

    `api_factory` returns a kubernetes CoreV1Api (or None when no API server is configured);
    it is called once, at first use.
    """

    def __init__(
        self,
        table: DeviceTable,
        node: str,
        mode: str = "auto",
        policy: str = "spread",
        api_factory: Callable[[], Any | None] | None = None,
        timeout: float = API_TIMEOUT_S,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"decisions mode {mode!r}: one of {', '.join(MODES)}")
        self.table = table
        self.node = node
        self.mode = mode
        self.policy = policy
        self.timeout = timeout
        self._factory = api_factory
        self._api: Any | None = None
        self._api_loaded = False
        self._lock = threading.Lock()  # one claim at a time: two Allocates never take one container
        self._served: dict[str, set[str]] = {}  # pod uid → containers this process allocated
        self._warned = False

    # --- API ---------------------------------------------------------------------------
    def _client(self) -> Any | None:
        if not self._api_loaded:
            self._api_loaded = True
            if self._factory is None:
                from device_plugin.inventory import load_client

                self._factory = load_client
            try:
                self._api = self._factory()
            except Exception as e:
                log.warning(kv("kubernetes client unavailable", error=e))
                self._api = None
        return self._api

    def _list(self) -> list[PendingPod] | None:
        """Pending pods of this node; None when the API cannot be asked (warned once per outage)."""
        api = self._client()
        if api is None:
            if self.mode == "required":
                raise ApiUnavailable("no Kubernetes API server configured; decisions are required")
            return None
        try:
            resp = api.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node}", _request_timeout=self.timeout, _preload_content=False
            )
            pods = pending_pods(resp.data, self.node)
        except Exception as e:  # ApiException, connection errors, a body that is not a PodList
            if self.mode == "required":
                raise ApiUnavailable(f"cannot list the pods of node {self.node}: {_api_error(e)}") from None
            if not self._warned:
                log.warning(
                    kv(
                        "cannot look up scheduler decisions; containers get n x 1/K slices",
                        node=self.node,
                        error=_api_error(e),
                    )
                )
                self._warned = True
            return None
        if self._warned:
            log.warning(kv("scheduler decisions reachable again", node=self.node))
            self._warned = False
        live = {p.uid for p in pods}
        for uid in [u for u in self._served if u not in live]:
            del self._served[uid]  # done (success/failed) or gone
        return pods

    # --- RPC helpers -------------------------------------------------------------------
    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str] | None:
        """IDs on the decided GPUs of the container a request of `size` is for; None without one."""
        if self.mode == "off":
            return None
        with self._lock:
            try:
                pods = self._list()
            except ApiUnavailable:
                return None  # Allocate will refuse; the preference does not matter
            if not pods:
                return None
            found = choose(pods, size, self._served)
        if found is None:
            return None
        return steer(self.table, found[1], available, must_include, size, self.policy)

    def claim(self, device_ids: Sequence[str]) -> Claim | None:
        """The decision for this Allocate, marked served; None: none applies (n x 1/K).

        Raises ApiUnavailable (mode `required`), DecisionError (then `bind-phase=failed` is
        set on the pod), AllocationError (invalid IDs).
        """
        if self.mode == "off":
            return None
        with self._lock:
            pods = self._list()
            if not pods:
                return None
            found = choose(pods, len(device_ids), self._served)
            if found is None:
                log.warning(
                    kv(
                        "pods with decisions are allocating here, none waits for a container of this size; "
                        "n x 1/K slice",
                        devices=len(device_ids),
                        pods=",".join(p.key for p in pods[:8]),
                    )
                )
                return None
            pod, container = found
            try:
                sl = decided_slice(self.table, device_ids, container)
            except DecisionError as e:
                self._fail(pod, str(e))
                raise
            self._served.setdefault(pod.uid, set()).add(container.name)
        return Claim(pod=pod, container=container, slice=sl)

    def release(self, claim: Claim) -> None:
        """Forget a claim whose record could not be written: the kubelet's retry gets it again."""
        with self._lock:
            self._served.get(claim.pod.uid, set()).discard(claim.container.name)

    def confirm(self, claim: Claim) -> bool:
        """Append the container to `allocated` (and `bind-phase=success` when all are); True when written."""
        api = self._client()
        if api is None:
            return False
        pod = claim.pod
        rv = pod.resource_version
        allocated = list(pod.allocated)
        decision = pod.decision
        for _attempt in range(PATCH_ATTEMPTS):
            if claim.container.name not in allocated:
                allocated.append(claim.container.name)
            with self._lock:
                served = set(self._served.get(pod.uid, ()))
            allocated += [c.name for c in decision.containers if c.name in served and c.name not in allocated]
            ann = {scheduling.ALLOCATED_ANNOTATION: scheduling.encode(allocated)}
            if all(c.name in allocated for c in decision.containers):
                ann[scheduling.BIND_PHASE_ANNOTATION] = scheduling.PHASE_SUCCESS
            body = {"metadata": {"resourceVersion": rv, "annotations": ann}}
            try:
                api.patch_namespaced_pod(
                    pod.name, pod.namespace, body, _request_timeout=self.timeout, _content_type=MERGE_PATCH
                )
                log.info(
                    kv(
                        "decision honoured",
                        pod=pod.key,
                        container=claim.container.name,
                        phase=ann.get(scheduling.BIND_PHASE_ANNOTATION, scheduling.PHASE_ALLOCATING),
                    )
                )
                return True
            except Exception as e:
                if getattr(e, "status", None) != 409:
                    log.warning(kv("cannot mark the decision allocated", pod=pod.key, error=_api_error(e)))
                    return False
            fresh = self._get(pod)  # 409: someone else wrote the pod; read it and merge again
            if fresh is None:
                return False
            rv, allocated, decision = fresh
        log.warning(kv("cannot mark the decision allocated", pod=pod.key, error="conflicts persisted"))
        return False

    def _get(self, pod: PendingPod) -> tuple[str, list[str], Decision] | None:
        api = self._client()
        try:
            resp = api.read_namespaced_pod(  # type: ignore[union-attr]
                pod.name, pod.namespace, _request_timeout=self.timeout, _preload_content=False
            )
            cur = _pod_decoder.decode(resp.data)
        except Exception as e:
            log.warning(kv("cannot re-read pod", pod=pod.key, error=_api_error(e)))
            return None
        if cur.metadata.uid != pod.uid:
            return None  # replaced by a pod of the same name
        ann = cur.metadata.annotations or {}
        try:
            decision = scheduling.decode_decision(ann.get(scheduling.DECISION_ANNOTATION, ""))
            allocated = scheduling.decode_allocated(ann.get(scheduling.ALLOCATED_ANNOTATION))
        except scheduling.ContractError:
            return None
        return cur.metadata.resourceVersion, allocated, decision

    def _fail(self, pod: PendingPod, reason: str) -> None:
        """`bind-phase=failed` on a pod whose decision this node cannot honour (best effort)."""
        log.error(kv("decision cannot be honoured", pod=pod.key, reason=reason))
        api = self._client()
        if api is None:
            return
        body = {"metadata": {"annotations": {scheduling.BIND_PHASE_ANNOTATION: scheduling.PHASE_FAILED}}}
        try:
            api.patch_namespaced_pod(
                pod.name, pod.namespace, body, _request_timeout=self.timeout, _content_type=MERGE_PATCH
            )
        except Exception as e:
            log.warning(kv("cannot mark the decision failed", pod=pod.key, error=_api_error(e)))
