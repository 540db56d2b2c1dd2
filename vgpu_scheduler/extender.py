"""The kube-scheduler extender verbs: filter, prioritize, bind, preempt (wire types and their logic).

Wire format: kube-scheduler's extender/v1 types have no json tags, so the keys are the Go field
names (k8s.io/kube-scheduler/extender/v1/types.go: ExtenderArgs{Pod, Nodes, NodeNames},
ExtenderFilterResult{Nodes, NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error},
HostPriorityList [{Host, Score}], ExtenderBindingArgs{PodName, PodNamespace, PodUID, Node},
ExtenderBindingResult{Error}, ExtenderPreemptionArgs{Pod, NodeNameToVictims,
NodeNameToMetaVictims}, ExtenderPreemptionResult{NodeNameToMetaVictims}); errors travel as HTTP
200 with `Error` where the type has one.

No node lock and no API call in filter: filter decides under the state's short in-memory lock and
holds its choice there (a reservation: every later filter sees those GPUs taken). Bind re-checks
that it still fits and creates the Binding with the decision, `bind-phase` and `bind-time` as its
annotations: kube-apiserver merges them into the pod in the same update that sets nodeName,
conditioned on the pod's UID and the resourceVersion the filter decided on. One write per pod,
and a pod is never bound without its decision nor decided without being bound. A reservation
whose bind never comes stops counting after `reservation_ttl_s`. Nothing waits for the kubelet's
Allocate (docs/developers/scheduler.md, "Concurrency without a node lock").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from vgpu import scheduling as sc
from vgpu_scheduler import fit, requests, snapshot, victims
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import APIFailure, Conflict, Kube, NotFound
from vgpu_scheduler.state import ClusterState

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class ExtenderArgs(msgspec.Struct):
    Pod: Obj
    Nodes: Obj | None = None
    # Kept as raw JSON: decoding thousands of names and hashing them into a set costs more than
    # the filter's whole search; NameSet answers "was this node sent?" on the bytes, and the
    # list is decoded only when every node is needed (no node fits, prioritize).
    NodeNames: msgspec.Raw = msgspec.Raw(b"null")

    def node_names(self) -> list[str]:
        return _names.decode(self.NodeNames) or []


_names = msgspec.json.Decoder(list[str] | None)


class NameSet:
    """Membership in a JSON array of node names without decoding it. Node names are DNS
    subdomains ([a-z0-9.-]), written by JSON encoders without escapes, so `"name"` (quotes
    included) occurs in the array's bytes iff the name is one of its strings; an array with any
    escape is decoded instead."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.decoded: set[str] | None = set(_names.decode(raw) or []) if b"\\" in raw else None

    def __contains__(self, name: object) -> bool:
        if self.decoded is not None:
            return name in self.decoded
        return isinstance(name, str) and b'"' + name.encode() + b'"' in self.raw


def readable(text: str) -> str:
    """A reason as kube-scheduler's event will show it. kube-scheduler passes the whole failure
    message (an extender's FailedNodes reasons, its Error, a bind Error) as the *format* of the
    FailedScheduling event (pkg/scheduler/schedule_one.go handleSchedulingFailure:
    `Eventf(pod, nil, Warning, "FailedScheduling", "Scheduling", msg)`, no arguments;
    client-go tools/events/event_recorder.go eventf: `fmt.Sprintf(note, args...)`), so a `%`
    starts a Go verb: "20% compute" would read "20%!c(MISSING)ompute". Our own reasons say
    "percent"; a `%` from elsewhere (a user's value, a URL in an API error) becomes the fullwidth
    percent sign, which reads the same in the event and in the PodScheduled condition."""
    return text.replace("%", "\uff05") if "%" in text else text


def _readable_all(d: dict[str, str] | None) -> dict[str, str] | None:
    if not d or not any("%" in v for v in d.values()):
        return d
    return {k: readable(v) for k, v in d.items()}


class ExtenderFilterResult(msgspec.Struct):
    Nodes: Obj | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] | None = None
    FailedAndUnresolvableNodes: dict[str, str] | None = None
    Error: str = ""

    def __post_init__(self) -> None:
        self.FailedNodes = _readable_all(self.FailedNodes)
        self.FailedAndUnresolvableNodes = _readable_all(self.FailedAndUnresolvableNodes)
        self.Error = readable(self.Error)


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

    def __post_init__(self) -> None:
        self.Error = readable(self.Error)  # a bind error reaches the event too


class MetaPod(msgspec.Struct):
    UID: str


class MetaVictims(msgspec.Struct):
    Pods: list[MetaPod] | None = None
    NumPDBViolations: int = 0


class Victims(msgspec.Struct):
    Pods: list[Obj] | None = None
    NumPDBViolations: int = 0


class ExtenderPreemptionArgs(msgspec.Struct):
    """What kube-scheduler sends (extender.go ProcessPreemption): NodeNameToMetaVictims (UIDs) to
    a nodeCacheCapable extender, NodeNameToVictims (whole Pods) otherwise; the other is null."""

    Pod: Obj
    NodeNameToVictims: dict[str, Victims | None] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims | None] | None = None


class ExtenderPreemptionResult(msgspec.Struct):
    """Always MetaVictims (extender.go: "Extender will always return NodeNameToMetaVictims")."""

    NodeNameToMetaVictims: dict[str, MetaVictims] = msgspec.field(default_factory=dict)


MAX_PRIORITY = 10


class PreemptError(Exception):
    """The preempt verb cannot answer (not serving): an HTTP error, which kube-scheduler reports."""


def _meta(pod: Obj) -> Obj:
    return pod.get("metadata") or {}


def _priority(pod: Obj) -> int:
    try:
        return int((pod.get("spec") or {}).get("priority") or 0)
    except (TypeError, ValueError):
        return 0


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
        names = [(_meta(n).get("name") or "") for n in items] if full else []
        if not requests.wants_vgpu(pod, self.cfg.resource_name):
            return self._result(full, items, names or args.node_names(), {}, {})
        try:
            reqs = requests.container_requests(pod, self.cfg.resource_name)
            opts = requests.pod_options(_meta(pod).get("annotations"), self.cfg.node_policy, self.cfg.gpu_policy)
        except requests.RequestError as e:
            why = f"invalid vGPU request: {e}"
            return self._result(full, items, [], {}, dict.fromkeys(names or args.node_names(), why))
        if not reqs:
            return self._result(full, items, names or args.node_names(), {}, {})
        why = self._serving()
        if why:
            return ExtenderFilterResult(Error=why)
        uid = _meta(pod).get("uid") or ""
        infos = [snapshot.node_info(n, self.cfg.resource_name) for n in items] if full else None
        reserve = not (full and self.cfg.simulate_full_nodes)
        st = self.state
        with st.lock:
            st.expire()
            usage = st.usage_without(uid)
            gens = None if full else st.gens_without(uid)
            best: fit.Placement | None = None
            failed: dict[str, str] = {}
            unres: dict[str, str] = {}
            if not full:
                # The index walk: stops at the first fitting node of each node shape.
                now = st.clock()
                best = fit.search(
                    st.ordered(opts.node_policy),
                    NameSet(bytes(args.NodeNames)),
                    lambda n: st.view(n, now),
                    usage,
                    st.summary,
                    reqs,
                    opts,
                    self.cfg,
                    st.memo,
                    gens,
                    st.epoch,
                    extra=st._contrib.get(uid, {}).keys(),
                )
            if best is None:
                # Every node fitted, for the reasons (or the nodes came in the request).
                names = names or args.node_names()
                choice = fit.choose(st.views(names, infos), usage, reqs, opts, self.cfg, st.memo, gens, st.epoch)
                best = choice.best
                if best is None:
                    failed = {n: f.reason for n, f in choice.failures.items() if not f.unresolvable}
                    unres = {n: f.reason for n, f in choice.failures.items() if f.unresolvable}
                    known = {v.name for v in st.views(names, infos)}
                    for n in names:
                        if n not in known:
                            unres[n] = "node unknown to vgpu-scheduler"
                    return self._result(full, items, [], failed, unres)
            if reserve:
                st.reserve(pod, sc.Decision(node=best.node, time=time.time(), containers=best.containers))
        log.debug("filter %s/%s: node %s", _meta(pod).get("namespace"), _meta(pod).get("name"), best.node)
        return self._result(full, items, [best.node], {}, {})

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
        """0..10 per node under the pod's node policy; the node of the pod's decision gets 10.

        kube-scheduler calls it only when more than one node passed the filters (schedule_one.go
        schedulePod: "When only one node after predicate, just use it"); filter returns one."""
        pod = args.Pod
        full = args.Nodes is not None
        items: list[Obj] = list((args.Nodes or {}).get("items") or []) if full else []
        names = [(_meta(n).get("name") or "") for n in items] if full else args.node_names()
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
            decided, _d = self.state.holding(uid)
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
        why = self._serving()
        if why:
            return ExtenderBindingResult(Error=why)
        if self.kube is None:
            return ExtenderBindingResult(Error="vgpu-scheduler: no API client")
        ns, name, node, uid = args.PodNamespace or "default", args.PodName, args.Node, args.PodUID
        decision, rv, err = self._decision_for(uid, node)
        if err:
            return ExtenderBindingResult(Error=err)
        if decision is None:
            # Not from this replica's filter: the pod's own annotation (a decision written earlier).
            try:
                pod = self.kube.get_pod(ns, name)
            except APIFailure as e:
                return ExtenderBindingResult(Error=f"vgpu-scheduler: reading pod {ns}/{name}: {e}")
            meta = _meta(pod)
            if uid and meta.get("uid") != uid:
                return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} has another UID now")
            uid = meta.get("uid") or ""
            if not requests.wants_vgpu(pod, self.cfg.resource_name):
                return self._bind(ns, name, uid, node, None, "")
            text = (meta.get("annotations") or {}).get(sc.DECISION_ANNOTATION)
            try:
                d = sc.decode_decision(text) if text else None
            except sc.ContractError as e:
                return ExtenderBindingResult(Error=f"vgpu-scheduler: {e}")
            if d is None or d.node != node:
                where = f"node {d.node}" if d is not None else "no node"
                return ExtenderBindingResult(
                    Error=f"vgpu-scheduler: pod {ns}/{name} has a vGPU decision for {where}, not {node}; filter again"
                )
            decision, rv = d, meta.get("resourceVersion") or ""
        return self._bind(ns, name, uid, node, decision, rv)

    def _decision_for(self, uid: str, node: str) -> tuple[sc.Decision | None, str, str]:
        """(decision, resourceVersion to write it on, error) from this replica's reservation; no
        decision and no error: the slow path asks the API."""
        if not uid:
            return None, "", ""
        st = self.state
        with st.lock:
            st.expire()
            res = st.reservations.get(uid)
            if res is None or res.decision.node != node:
                return None, "", ""
            if not res.counted:
                st.recount_reservation(uid)  # its bind came after it expired: checked below
            return res.decision, res.resource_version, ""

    def _still_fits(self, uid: str, d: sc.Decision) -> bool:
        """The decision fits next to everything else held now (memory, cores, slots per GPU). Call under lock."""
        view = self.state.view(d.node, self.state.clock())
        if view is None or view.problem:
            return False
        gpus = {g.uuid: g for g in view.gpus if g.healthy}
        used = self.state.node_usage_without(uid, d.node)
        for uuid, u in snapshot.decision_usage(d).items():
            g = gpus.get(uuid)
            cur = used.get(uuid, snapshot.Use())
            if g is None or cur.memory + u.memory > g.memory or cur.cores + u.cores > g.cores:
                return False
            if cur.slots + u.slots > g.slots:
                return False
        return True

    def _bind(
        self, ns: str, name: str, uid: str, node: str, decision: sc.Decision | None, rv: str
    ) -> ExtenderBindingResult:
        """One write: the Binding, carrying the decision, bind-phase and bind-time as annotations
        (kube-apiserver merges them into the pod with nodeName, conditioned on UID and the
        resourceVersion the filter decided on: Kube.bind). A pod without vGPU: a plain Binding."""
        assert self.kube is not None
        ann: dict[str, str] | None = None
        if decision is not None:
            ann = {
                sc.DECISION_ANNOTATION: sc.encode(decision),
                sc.BIND_PHASE_ANNOTATION: sc.PHASE_ALLOCATING,
                sc.BIND_TIME_ANNOTATION: str(int(time.time())),
            }
        for attempt in range(self.cfg.conflict_retries + 1):
            if not self.is_leader():
                # Checked again just before the write: serving may have ended meanwhile, and a
                # decision written now could race the next serving replica's (docs/developers/scheduler.md,
                # "Failover"). Nothing is written; kube-scheduler retries the pod.
                return ExtenderBindingResult(Error="vgpu-scheduler: not the leader")
            if decision is not None:
                with self.state.lock:
                    # Anything counted since the filter (a slice the node published, a late write
                    # of another replica) may have taken its GPUs: written only if it still fits.
                    if not self._still_fits(uid, decision):
                        self.state.release(uid)
                        return ExtenderBindingResult(
                            Error=f"vgpu-scheduler: the GPUs decided for {ns}/{name} on {node} are taken "
                            "now; filter again"
                        )
            try:
                self.kube.bind(ns, name, uid, node, ann, rv)
            except Conflict:
                # The pod changed since the filter saw it (labels, status, another writer): the
                # choice is still ours to write if the pod is the same one and still unbound.
                log.info("bind %s/%s: conflict (attempt %d): re-reading", ns, name, attempt + 1)
                try:
                    cur = self.kube.get_pod(ns, name)
                except APIFailure as e:
                    return ExtenderBindingResult(Error=f"vgpu-scheduler: re-reading pod {ns}/{name}: {e}")
                meta = _meta(cur)
                if uid and meta.get("uid") != uid:
                    self._forget(uid)
                    return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} has another UID now")
                bound = (cur.get("spec") or {}).get("nodeName")
                if bound:
                    mine = (
                        ann is None
                        or (meta.get("annotations") or {}).get(sc.DECISION_ANNOTATION) == ann[sc.DECISION_ANNOTATION]
                    )
                    if bound == node and mine:
                        return ExtenderBindingResult()  # a retried bind whose first try went through
                    self._forget(uid)
                    return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} is bound to {bound} already")
                if meta.get("deletionTimestamp"):
                    self._forget(uid)
                    return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} is being deleted")
                rv = meta.get("resourceVersion") or ""
                continue
            except NotFound:
                self._forget(uid)
                return ExtenderBindingResult(Error=f"vgpu-scheduler: pod {ns}/{name} not found")
            except APIFailure as e:
                bound = self._bound_to(ns, name)
                if bound == node:
                    return ExtenderBindingResult()  # the write landed, its answer did not
                if not bound:
                    self._forget(uid)  # nothing was written: its GPUs are free for the next filter
                return ExtenderBindingResult(Error=f"vgpu-scheduler: binding {ns}/{name} to {node}: {e}")
            log.info("bind %s/%s: node %s", ns, name, node)
            return ExtenderBindingResult()
        return ExtenderBindingResult(
            Error=f"vgpu-scheduler: pod {ns}/{name} kept changing ({self.cfg.conflict_retries} conflicts)"
        )

    def _forget(self, uid: str) -> None:
        if uid:
            with self.state.lock:
                self.state.release(uid)

    def _bound_to(self, ns: str, name: str) -> str:
        assert self.kube is not None
        try:
            return str((self.kube.get_pod(ns, name).get("spec") or {}).get("nodeName") or "")
        except APIFailure:
            return "?"

    # ----- preempt -----
    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        """For each candidate node, the victims whose eviction lets the pod fit on that node's
        GPUs (victims.select_victims); nodes where no eviction helps are left out.

        kube-scheduler calls this after its own dry run (preemption.go callExtenders): per node
        the lower-priority pods its in-tree filters need gone. Our answer may name other pods of
        that node, and fewer: convertToVictims (extender.go) accepts any pod it has on the node;
        only pods bound there with a lower priority than the preemptor are named. A node left out
        is no candidate; an empty victim list would fail the whole preemption ("expected at least
        one victim pod on node"), so none is sent. Victims are listed most important first, as
        pickOneNodeForPreemption expects. NumPDBViolations is kube-scheduler's own count for the
        node, passed through (the extender does not read PodDisruptionBudgets)."""
        why = self._serving()
        if why:
            raise PreemptError(why)
        pod = args.Pod
        out = ExtenderPreemptionResult()
        if not requests.wants_vgpu(pod, self.cfg.resource_name):
            return out
        try:
            reqs = requests.container_requests(pod, self.cfg.resource_name)
            opts = requests.pod_options(_meta(pod).get("annotations"), self.cfg.node_policy, self.cfg.gpu_policy)
        except requests.RequestError:
            return out
        if not reqs:
            return out
        proposed: dict[str, tuple[list[str], int]] = {}
        for node, mv in (args.NodeNameToMetaVictims or {}).items():
            metas = (mv.Pods or []) if mv is not None else []
            proposed[node] = ([p.UID for p in metas], mv.NumPDBViolations if mv is not None else 0)
        for node, v in (args.NodeNameToVictims or {}).items():
            uids = [str(_meta(p).get("uid") or "") for p in ((v.Pods or []) if v is not None else [])]
            proposed[node] = ([u for u in uids if u], v.NumPDBViolations if v else 0)
        uid = _meta(pod).get("uid") or ""
        prio = _priority(pod)
        st = self.state
        with st.lock:
            st.expire()
            usage = st.usage_without(uid)
            now = st.clock()
            for node, (asked, pdb) in proposed.items():
                view = st.view(node, now)
                if view is None:
                    continue
                held = st.holders(node)
                cands: list[victims.Holder] = []
                for huid, per in held.items():
                    rec = st.pods.get(huid)
                    if huid == uid or rec is None or rec.node != node or rec.priority >= prio:
                        continue
                    cands.append(victims.Holder(huid, rec.priority, rec.start, rec.deleting, per))
                keep = []
                for vuid in asked:
                    if vuid not in held:
                        rec = st.pods.get(vuid)
                        keep.append(
                            victims.Holder(vuid, rec.priority if rec else 0, rec.start if rec else "", False, {})
                        )
                chosen = victims.select_victims(view, usage.get(node, {}), cands, keep, reqs, opts, self.cfg)
                if chosen:
                    out.NodeNameToMetaVictims[node] = MetaVictims([MetaPod(h.uid) for h in chosen], pdb)
        log.info(
            "preempt %s/%s: %d of %d candidate node(s) helped by evictions",
            _meta(pod).get("namespace"),
            _meta(pod).get("name"),
            len(out.NodeNameToMetaVictims),
            len(proposed),
        )
        return out
