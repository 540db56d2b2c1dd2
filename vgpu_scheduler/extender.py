"""The kube-scheduler extender verbs: filter, prioritize, bind (wire types and their logic).

Wire format: kube-scheduler's extender/v1 types have no json tags, so the keys are the Go field
names (ExtenderArgs{Pod, Nodes, NodeNames}, ExtenderFilterResult{Nodes, NodeNames, FailedNodes,
FailedAndUnresolvableNodes, Error}, HostPriorityList [{Host, Score}], ExtenderBindingArgs{PodName,
PodNamespace, PodUID, Node}, ExtenderBindingResult{Error}); errors travel as HTTP 200 with `Error`.

No node lock: filter decides under the state's short in-memory lock (a provisional record makes
the GPUs taken for every later filter at once), then writes the decision with a merge patch
conditioned on the pod's resourceVersion; a 409 drops the reservation, re-reads the pod and
decides again. bind re-reads the pod, checks its decision names the node, sets bind-phase and
bind-time (conditional again) and creates the Binding; when the Binding fails the decision is
removed so its GPUs are free again. Nothing waits for the kubelet's Allocate (docs/scheduler.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from vgpu import scheduling as sc
from vgpu_scheduler import fit, requests, snapshot
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import APIFailure, Conflict, Kube, NotFound
from vgpu_scheduler.state import ClusterState

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class ExtenderArgs(msgspec.Struct):
    Pod: Obj
    Nodes: Obj | None = None
    NodeNames: list[str] | None = None


class ExtenderFilterResult(msgspec.Struct):
    Nodes: Obj | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] | None = None
    FailedAndUnresolvableNodes: dict[str, str] | None = None
    Error: str = ""


class HostPriority(msgspec.Struct):
    Host: str
    Score: int


class ExtenderBindingArgs(msgspec.Struct):
    PodName: str
    PodNamespace: str
    PodUID: str = ""
    Node: str = ""


class ExtenderBindingResult(msgspec.Struct):
    Error: str = ""


MAX_PRIORITY = 10


def _meta(pod: Obj) -> Obj:
    return pod.get("metadata") or {}


class Extender:
    """The verbs over a ClusterState; `is_leader` gates every write (only the leader decides)."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        state: ClusterState,
        kube: Kube | None,
        is_leader: Callable[[], bool] = lambda: True,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self.cfg, self.state, self.kube, self.is_leader = cfg, state, kube, is_leader
        self.ready_timeout_s = ready_timeout_s

    def _serving(self) -> str:
        if not self.is_leader():
            return "vgpu-scheduler: not the leader"
        if not self.state.ready.wait(self.ready_timeout_s):
            return "vgpu-scheduler: state not synced with the API yet"
        return ""

    # ----- filter -----
    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        pod = args.Pod
        full = args.Nodes is not None
        items: list[Obj] = list((args.Nodes or {}).get("items") or []) if full else []
        names = [(_meta(n).get("name") or "") for n in items] if full else list(args.NodeNames or [])
        if not requests.wants_vgpu(pod, self.cfg.resource_name):
            return self._result(full, items, names, {}, {})
        try:
            reqs = requests.container_requests(pod, self.cfg.resource_name)
            opts = requests.pod_options(_meta(pod).get("annotations"), self.cfg.node_policy, self.cfg.gpu_policy)
        except requests.RequestError as e:
            return self._result(full, items, [], {}, dict.fromkeys(names, f"invalid vGPU request: {e}"))
        if not reqs:
            return self._result(full, items, names, {}, {})
        why = self._serving()
        if why:
            return ExtenderFilterResult(Error=why)
        infos = [snapshot.node_info(n, self.cfg.resource_name) for n in items] if full else None
        write = not (full and self.cfg.simulate_full_nodes) and self.kube is not None
        for attempt in range(self.cfg.conflict_retries + 1):
            uid = _meta(pod).get("uid") or ""
            with self.state.lock:
                views = self.state.views(names, infos)
                usage = self.state.usage_without(uid)
                gens = None if full else self.state.gens_without(uid)
                choice = fit.choose(views, usage, reqs, opts, self.cfg, self.state.memo, gens, self.state.epoch)
                known = {v.name for v in views}
                failed = {n: f.reason for n, f in choice.failures.items() if not f.unresolvable}
                unres = {n: f.reason for n, f in choice.failures.items() if f.unresolvable}
                for n in names:
                    if n not in known:
                        unres[n] = "node unknown to vgpu-scheduler"
                best = choice.best
                if best is None:
                    return self._result(full, items, [], failed, unres)
                decision = sc.Decision(node=best.node, time=time.time(), containers=best.containers)
                if write:
                    old, old_key = self.state.reserve(pod, decision)
            if not write:
                return self._result(full, items, [best.node], failed, unres)
            assert self.kube is not None
            ns, name = _meta(pod).get("namespace") or "default", _meta(pod).get("name") or ""
            if not self.is_leader():
                # Checked again just before the write: serving may have ended while this filter
                # computed, and a decision written now could race the next serving replica's
                # (docs/scheduler.md, "Failover"). Nothing is written; kube-scheduler retries.
                self.state.rollback(uid, old, old_key)
                return ExtenderFilterResult(Error="vgpu-scheduler: not the leader")
            try:
                answer = self.kube.patch_pod_annotations(
                    ns,
                    name,
                    {
                        sc.DECISION_ANNOTATION: sc.encode(decision),
                        sc.BIND_PHASE_ANNOTATION: None,
                        sc.BIND_TIME_ANNOTATION: None,
                        sc.ALLOCATED_ANNOTATION: None,
                    },
                    _meta(pod).get("resourceVersion"),
                )
            except Conflict:
                self.state.rollback(uid, old, old_key)
                log.info("filter %s/%s: conflict on write (attempt %d): re-reading", ns, name, attempt + 1)
                try:
                    pod = self.kube.get_pod(ns, name)
                except APIFailure as e:
                    return ExtenderFilterResult(Error=f"vgpu-scheduler: re-reading pod {ns}/{name}: {e}")
                continue
            except NotFound:
                self.state.rollback(uid, old, old_key)
                return ExtenderFilterResult(Error=f"vgpu-scheduler: pod {ns}/{name} not found")
            except APIFailure as e:
                self.state.rollback(uid, old, old_key)
                return ExtenderFilterResult(Error=f"vgpu-scheduler: writing the decision of {ns}/{name}: {e}")
            self.state.apply_pod(answer)
            if not self.is_leader():
                # Serving ended while the write was in flight: it may have landed after the next
                # serving replica relisted, so it must not be bound. Withdraw it (conditional on
                # the version just written: nothing newer is undone) and let kube-scheduler retry
                # there. Had it landed while we still served, the next one's relist has it.
                self._withdraw(ns, name, answer)
                return ExtenderFilterResult(Error="vgpu-scheduler: not the leader (lost it while writing)")
            log.info("filter %s/%s: node %s", ns, name, best.node)
            return self._result(full, items, [best.node], failed, unres)
        return ExtenderFilterResult(Error=f"vgpu-scheduler: pod kept changing ({self.cfg.conflict_retries} conflicts)")

    @staticmethod
    def _result(
        full: bool, items: list[Obj], keep: list[str], failed: dict[str, str], unres: dict[str, str]
    ) -> ExtenderFilterResult:
        if full:
            wanted = set(keep)
            nodes: Obj | None = {
                "apiVersion": "v1",
                "kind": "NodeList",
                "metadata": {},
                "items": [n for n in items if _meta(n).get("name") in wanted],
            }
            return ExtenderFilterResult(Nodes=nodes, FailedNodes=failed, FailedAndUnresolvableNodes=unres)
        return ExtenderFilterResult(NodeNames=keep, FailedNodes=failed, FailedAndUnresolvableNodes=unres)

    # ----- prioritize -----
    def prioritize(self, args: ExtenderArgs) -> list[HostPriority]:
        """0..10 per node under the pod's node policy; the node of the pod's decision gets 10."""
        pod = args.Pod
        full = args.Nodes is not None
        items: list[Obj] = list((args.Nodes or {}).get("items") or []) if full else []
        names = [(_meta(n).get("name") or "") for n in items] if full else list(args.NodeNames or [])
        try:
            reqs = requests.container_requests(pod, self.cfg.resource_name)
            opts = requests.pod_options(_meta(pod).get("annotations"), self.cfg.node_policy, self.cfg.gpu_policy)
        except requests.RequestError:
            return [HostPriority(n, 0) for n in names]
        if not reqs:
            return [HostPriority(n, 0) for n in names]
        uid = _meta(pod).get("uid") or ""
        infos = [snapshot.node_info(n, self.cfg.resource_name) for n in items] if full else None
        with self.state.lock:
            rec = self.state.pods.get(uid)
            decided = rec.decision.node if rec is not None and rec.decision is not None else ""
            choice = fit.choose(self.state.views(names, infos), self.state.usage_without(uid), reqs, opts, self.cfg)
        out = []
        for n in names:
            if n == decided:
                out.append(HostPriority(n, MAX_PRIORITY))
            elif n in choice.placements:
                out.append(HostPriority(n, round(choice.placements[n].preference)))
            else:
                out.append(HostPriority(n, 0))
        return out

    # ----- bind -----
    def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        why = self._serving() if self.is_leader() else "vgpu-scheduler: not the leader"
        if why:
            return ExtenderBindingResult(Error=why)
        if self.kube is None:
            return ExtenderBindingResult(Error="vgpu-scheduler: no API client")
        ns, name, node = args.PodNamespace or "default", args.PodName, args.Node
        fast = self._bind_known(args)
        if fast is not None:
            return fast
        for _attempt in range(self.cfg.conflict_retries + 1):
            try:
                pod = self.kube.get_pod(ns, name)
            except APIFailure as e:
                return ExtenderBindingResult(Error=f"vgpu-scheduler: reading pod {ns}/{name}: {e}")
            meta = _meta(pod)
            if args.PodUID and meta.get("uid") != args.PodUID:
                return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} has another UID now")
            vgpu = requests.wants_vgpu(pod, self.cfg.resource_name)
            if vgpu:
                text = (meta.get("annotations") or {}).get(sc.DECISION_ANNOTATION)
                try:
                    d = sc.decode_decision(text) if text else None
                except sc.ContractError as e:
                    return ExtenderBindingResult(Error=f"vgpu-scheduler: {e}")
                if d is None or d.node != node:
                    where = f"node {d.node}" if d is not None else "no node"
                    return ExtenderBindingResult(
                        Error=f"vgpu-scheduler: pod {ns}/{name} has a vGPU decision for {where}, "
                        f"not {node}; filter again"
                    )
                try:
                    answer = self.kube.patch_pod_annotations(
                        ns,
                        name,
                        {sc.BIND_PHASE_ANNOTATION: sc.PHASE_ALLOCATING, sc.BIND_TIME_ANNOTATION: str(int(time.time()))},
                        meta.get("resourceVersion"),
                    )
                except Conflict:
                    continue
                except APIFailure as e:
                    return ExtenderBindingResult(Error=f"vgpu-scheduler: marking {ns}/{name} allocating: {e}")
                self.state.apply_pod(answer)
            try:
                self.kube.bind(ns, name, meta.get("uid") or "", node)
            except APIFailure as e:
                bound = self._bound_to(ns, name)
                if bound == node:
                    return ExtenderBindingResult()  # a retried bind whose first try went through
                if vgpu and not bound:
                    self._release(ns, name)
                return ExtenderBindingResult(Error=f"vgpu-scheduler: binding {ns}/{name} to {node}: {e}")
            log.info("bind %s/%s: node %s", ns, name, node)
            return ExtenderBindingResult()
        return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} kept changing")

    def _bind_known(self, args: ExtenderBindingArgs) -> ExtenderBindingResult | None:
        """Bind from the state's copy of the pod (no GET); None: take the slow path (re-read the pod)."""
        assert self.kube is not None
        ns, name, node = args.PodNamespace or "default", args.PodName, args.Node
        with self.state.lock:
            rec = self.state.pods.get(args.PodUID) if args.PodUID else None
            settled = rec is not None and self.state.is_settled(rec.uid)
        if rec is None or not settled or rec.decision is None or rec.decision.node != node or rec.node:
            return None
        if (rec.namespace, rec.name) != (ns, name) or not rec.resource_version:
            return None
        try:
            answer = self.kube.patch_pod_annotations(
                ns,
                name,
                {sc.BIND_PHASE_ANNOTATION: sc.PHASE_ALLOCATING, sc.BIND_TIME_ANNOTATION: str(int(time.time()))},
                rec.resource_version,
            )
        except APIFailure:
            return None  # changed since (409) or gone: the slow path re-reads and says why
        self.state.apply_pod(answer)
        try:
            self.kube.bind(ns, name, args.PodUID, node)
        except APIFailure as e:
            bound = self._bound_to(ns, name)
            if bound == node:
                return ExtenderBindingResult()
            if not bound:
                self._release(ns, name)
            return ExtenderBindingResult(Error=f"vgpu-scheduler: binding {ns}/{name} to {node}: {e}")
        log.info("bind %s/%s: node %s", ns, name, node)
        return ExtenderBindingResult()

    def _bound_to(self, ns: str, name: str) -> str:
        assert self.kube is not None
        try:
            return str((self.kube.get_pod(ns, name).get("spec") or {}).get("nodeName") or "")
        except APIFailure:
            return "?"

    def _withdraw(self, ns: str, name: str, written: Obj) -> None:
        """Remove a decision this replica wrote, iff the pod is still at the version written."""
        assert self.kube is not None
        try:
            answer = self.kube.patch_pod_annotations(
                ns, name, {sc.DECISION_ANNOTATION: None}, _meta(written).get("resourceVersion")
            )
            self.state.apply_pod(answer)
        except APIFailure as e:
            # Changed since (another replica decided again) or unreachable: a pod left Pending
            # with this decision only holds its GPUs (never more) until it is filtered again.
            log.info("withdrawing the decision of %s/%s: %s", ns, name, e)

    def _release(self, ns: str, name: str) -> None:
        """Remove the decision of a pod whose Binding failed: its GPUs are free for the next filter."""
        assert self.kube is not None
        try:
            answer = self.kube.patch_pod_annotations(
                ns,
                name,
                {sc.DECISION_ANNOTATION: None, sc.BIND_PHASE_ANNOTATION: None, sc.BIND_TIME_ANNOTATION: None},
                None,
            )
            self.state.apply_pod(answer)
        except APIFailure as e:
            log.warning("releasing the decision of %s/%s: %s", ns, name, e)
