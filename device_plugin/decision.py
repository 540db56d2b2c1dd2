"""Scheduler decisions in Allocate, through the API server (contract: vgpu/scheduling.py,
docs/developers/device-plugin.md; which container and which slice: device_plugin.decisionpolicy).

The pods on this node come from one API list (field selector spec.nodeName).
`Decisions.preferred()` steers GetPreferredAllocation to IDs on the decided GPUs;
`Decisions.claim()` maps the IDs to the decided GPUs with the decided bytes and percent;
after the record is written `Decisions.confirm()` appends the container to
`vgpu.k8s.io/allocated` (and sets `bind-phase=success` once all are) by a merge patch carrying
the pod's resourceVersion, retried on 409. No decision → None (the caller keeps n x 1/K).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from device_plugin.decisionpolicy import Claim, DecisionError, PendingPod, choose, decided_slice, pending_pods, steer
from device_plugin.podschema import pod_decoder
from nodecore.devices import DeviceTable
from vgpu import scheduling
from vgpu.log import kv
from vgpu.scheduling import Decision

log = logging.getLogger(__name__)

API_TIMEOUT_S = 5.0  # per API call; Allocate blocks the kubelet's pod admission meanwhile
PATCH_ATTEMPTS = 8
MODES = ("auto", "required", "off")
MERGE_PATCH = "application/merge-patch+json"  # RFC 7386; a metadata.resourceVersion in it is a precondition


class ApiUnavailable(RuntimeError):
    """The API server could not be asked, and the mode is `required` (gRPC UNAVAILABLE)."""


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
            cur = pod_decoder.decode(resp.data)
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
