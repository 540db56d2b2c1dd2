"""A stand-in for kube-scheduler towards HTTP extenders (NOT kube-scheduler).

Modelled from kube-scheduler v1.36 (openshift/kubernetes, pkg/scheduler; cited beside each
behaviour) and checked against what the real one sent (tests/data/real-traces/extender/,
tests/vgpu_scheduler/test_kubescheduler_traces.py). One `schedule_one` is one scheduling cycle and,
when it places the pod, its binding cycle:

- the snapshot: Nodes, and the pods bound to them that are not Succeeded/Failed (scheduler.go
  builds the pod informer with `status.phase!=Succeeded,status.phase!=Failed`), terminating ones
  included; the Pod as the informer keeps it (no kind/apiVersion, no managedFields);
- in-tree filters, reduced to what GPU scheduling meets: NodeUnschedulable, TaintToleration
  (a NotReady node counts as tainted `node.kubernetes.io/not-ready:NoSchedule`, as the node
  lifecycle controller taints it) and NodeResourcesFit (noderesources/fit.go fitsRequest: pods,
  cpu, memory, every extended resource except those an extender lists with
  `ignoredByScheduler: true`; UnschedulableAndUnresolvable when the request exceeds allocatable),
  with the pods nominated to the node of equal or higher priority added
  (RunFilterPluginsWithNominatedPods); the nominated node is tried first (evaluateNominatedNode);
- only numFeasibleNodesToFind feasible nodes are looked for, from a start index that moves on
  by the nodes processed each cycle (schedule_one.go findNodesThatPassFilters,
  numFeasibleNodesToFind: percentageOfNodesToScore, adaptive when 0, at least 100 nodes);
- extenders that are interested (a managed resource in any container's requests or limits,
  extender.go IsInterested), ignorable ones last, each given the nodes left by the previous:
  `NodeNames` when nodeCacheCapable, else `Nodes` (the other null); a returned node not in the
  input is an error; FailedAndUnresolvableNodes win over FailedNodes (findNodesThatPassExtenders);
- one feasible node: no prioritize call (schedulePod "When only one node after predicate, just
  use it"); more: prioritize, Score x weight x 10 added, the highest wins (the real one breaks
  ties at random, this one takes the first);
- when no node is left: PostFilter, DefaultPreemption (defaultpreemption/default_preemption.go,
  preemption/preemption.go): eligibility (preemptionPolicy Never, a terminating victim on the
  nominated node), candidate nodes = those whose status is Unschedulable, a dry run per node
  with the in-tree filters only (SelectVictimsOnNode: remove every lower-priority pod, reprieve
  the most important first; "No preemption victims found for incoming pod", "expected at least
  one victim pod on node"), then each interested extender with a preemptVerb
  (callExtenders/ProcessPreemption: NodeNameToMetaVictims when nodeCacheCapable, else
  NodeNameToVictims; the answer's UIDs must be pods of that node, every node needs a victim),
  the best candidate (pickOneNodeForPreemption's default order), the victims deleted with a
  `Preempted by pod <uid> on node <node>` event and the pod's nominatedNodeName set;
- the FailedScheduling message as FitError.Error() writes it ("0/N nodes are available: ..."
  plus the PostFilter message; DynamicResources adds "no new claims to deallocate"), set as the
  PodScheduled=False condition and, truncated and run through Go's fmt.Sprintf as the format
  (`%` starts a verb: "20%!c(MISSING)ompute"), as the FailedScheduling event's note;
- bind: the first interested binder extender (extendersBinding; an ignorable one's error moves
  on), else the default binder (a Binding).

HTTP as Go's client sends it (the traces): `POST <urlPrefix>/<verb>`, headers Host, User-Agent
`Go-http-client/1.1`, Content-Length, Content-Type `application/json`, Accept-Encoding `gzip`;
a non-200 answer or an answer that does not decode is the extender's error (extender.go send).
Not modelled: the scheduling queue (backoff, retries: a test calls schedule_one again), scores
of in-tree plugins, PodDisruptionBudgets, affinity, volumes, DRA.
"""

from __future__ import annotations

import calendar
import gzip
import http.client
import json
import random
import re
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]

# The chart's managed resources: name -> ignoredByScheduler (packaging/helm/.../scheduler-configmap.yaml).
CHART_MANAGED = {
    "nvidia.com/gpu": False,
    "nvidia.com/gpumem": True,
    "nvidia.com/gpumem-percentage": True,
    "nvidia.com/gpucores": True,
    "vgpu.k8s.io/gpumem-total": False,
    "vgpu.k8s.io/gpucores-total": False,
}


@dataclass
class ExtenderConfig:
    url_prefix: str
    filter_verb: str = "filter"
    prioritize_verb: str = "prioritize"
    bind_verb: str = "bind"
    preempt_verb: str = "preempt"
    weight: int = 1
    node_cache_capable: bool = True
    ignorable: bool = False
    http_timeout_s: float = 5.0  # extender.go DefaultExtenderTimeout
    managed_resources: dict[str, bool] = field(default_factory=lambda: dict(CHART_MANAGED))
    tls_insecure: bool = True


@dataclass
class Result:
    status: str  # Scheduled | Unschedulable | Error
    node: str = ""
    message: str = ""
    failed: dict[str, str] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # extender verbs called, in order
    nominated: str = ""  # nominatedNodeName set by preemption
    victims: list[str] = field(default_factory=list)  # names of the pods preempted


@dataclass
class Sent:
    """One HTTP request to an extender, as sent."""

    verb: str
    request_line: str
    headers: list[tuple[str, str]]
    body: Any


class ExtenderError(Exception):
    pass


# ----- quantities (resource.Quantity, as far as node and pod resources use them) -----
_Q = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?)$")
_SUFFIX = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def quantity(v: Any) -> Fraction:
    m = _Q.match(str(v).strip())
    if not m:
        raise ValueError(f"not a quantity: {v!r}")
    num = Fraction(m.group(1))
    if m.group(2):
        return num * Fraction(10) ** int(m.group(2)[1:])
    return num * _SUFFIX[m.group(3) or ""]


def _amount(name: str, v: Any) -> int:
    """Milli-units for cpu (fit.go compares MilliCPU), whole units (rounded up) otherwise."""
    q = quantity(v)
    if name == "cpu":
        q *= 1000
    return -(-q.numerator // q.denominator)


# ----- pod requests (component-helpers/resource PodRequests) -----
def _container_requests(c: Obj) -> dict[str, int]:
    res = c.get("resources") or {}
    # The API server defaults requests from limits (pkg/apis/core/v1/defaults.go); the stand-in
    # API does not, so limits stand in for absent requests.
    merged = dict(res.get("limits") or {})
    merged.update(res.get("requests") or {})
    return {k: _amount(k, v) for k, v in merged.items()}


def pod_requests(pod: Obj) -> dict[str, int]:
    """max(sum of app containers, each init container) per resource."""
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for k, v in _container_requests(c).items():
            total[k] = total.get(k, 0) + v
    for c in spec.get("initContainers") or []:
        for k, v in _container_requests(c).items():
            total[k] = max(total.get(k, 0), v)
    return total


def priority(pod: Obj) -> int:
    return int((pod.get("spec") or {}).get("priority") or 0)  # corev1helpers.PodPriority


def _start(pod: Obj) -> float:
    t = (pod.get("status") or {}).get("startTime")
    if not t:
        return time.time()  # util.GetPodStartTime: not started yet counts as now
    return float(calendar.timegm(time.strptime(t.replace("Z", "")[:19], "%Y-%m-%dT%H:%M:%S")))


def more_important(a: Obj, b: Obj) -> bool:
    """util.MoreImportantPod."""
    if priority(a) != priority(b):
        return priority(a) > priority(b)
    return _start(a) < _start(b)


def interested(ext: ExtenderConfig, pod: Obj) -> bool:
    """extender.go IsInterested: a managed resource in any container's requests or limits."""
    if not ext.managed_resources:
        return True
    spec = pod.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            if any(k in ext.managed_resources for k in res.get(part) or {}):
                return True
    return False


# ----- statuses (framework Status codes) -----
UNSCHEDULABLE, UNRESOLVABLE, ERROR = "Unschedulable", "UnschedulableAndUnresolvable", "Error"


@dataclass
class Status:
    code: str
    reasons: list[str]


@dataclass
class NodeInfo:
    node: Obj
    pods: list[Obj]
    allocatable: dict[str, int]
    requested: dict[str, int]

    @property
    def name(self) -> str:
        return str(self.node["metadata"]["name"])


def _informer_copy(obj: Obj) -> Obj:
    """A Pod or Node as kube-scheduler's informer cache holds it and Go's encoding/json writes it:
    no TypeMeta (objects from an informer have none), no managedFields on pods (the scheduler's
    informers strip them, the traces' Pods have none), and metadata, spec, status always present,
    in that order (struct fields: `omitempty` does not omit a struct)."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {"metadata": meta, "spec": obj.get("spec") or {}, "status": obj.get("status") or {}}


# ----- events as kube-scheduler records them -----
NOTE_LENGTH_LIMIT = 1024  # pkg/apis/core/validation/events.go NoteLengthLimit


def truncate_message(message: str) -> str:
    """schedule_one.go truncateMessage: at most NoteLengthLimit bytes, cut (mid-rune if it falls
    there: Go slices bytes; the JSON encoder then writes U+FFFD) and ended with " ..."."""
    b = message.encode()
    if len(b) <= NOTE_LENGTH_LIMIT:
        return message
    return (b[: NOTE_LENGTH_LIMIT - 4] + b" ...").decode(errors="replace")


def _parsenum(s: bytes, start: int, end: int) -> tuple[int, bool, int]:
    """fmt/print.go parsenum: (number, whether there was one, index after it)."""
    if start >= end:
        return 0, False, end
    num, isnum, i = 0, False, start
    while i < end and 0x30 <= s[i] <= 0x39:
        if num > 1_000_000 or num < -1_000_000:  # tooLarge: "crazy long number"
            return 0, False, end
        num = num * 10 + s[i] - 0x30
        isnum = True
        i += 1
    return num, isnum, i


def _arg_number(s: bytes, i: int, good: bool) -> tuple[int, bool, bool]:
    """fmt/print.go argNumber with no operands: (index after, found, goodArgNum). Any `[n]` is
    out of range, so it makes the verb a BADINDEX."""
    if len(s) <= i or s[i] != 0x5B:  # '['
        return i, False, good
    rest = s[i:]
    wid, ok = 1, False  # parseArgNumber
    if len(rest) >= 3:
        for j in range(1, len(rest)):
            if rest[j] == 0x5D:  # ']'
                _n, isnum, newi = _parsenum(rest, 1, j)
                wid, ok = j + 1, isnum and newi == j
                break
    return i + wid, ok, False


def go_sprintf(fmt: str) -> str:
    """Go's fmt.Sprintf(fmt) with no operands (fmt/print.go doPrintf, go1.26), which is what
    kube-scheduler's event recorder does to a failure message: `%%` is `%`; any other verb,
    after flags, argument index, width and precision, has no operand: `%!<verb>(MISSING)` (flags
    dropped), `%!<verb>(BADINDEX)` after an `[n]`, `%!(BADWIDTH)` / `%!(BADPREC)` for `*`, and
    `%!(NOVERB)` when the text ends first. "20% compute" reads "20%!c(MISSING)ompute"."""
    s = fmt.encode()
    end, i = len(s), 0
    out = bytearray()
    while i < end:
        last = i
        while i < end and s[i] != 0x25:  # '%'
            i += 1
        out += s[last:i]
        if i >= end:
            break
        i += 1
        while i < end and s[i] in b"#0+- ":  # flags
            i += 1
        good = True
        i, after_index, good = _arg_number(s, i, good)
        if i < end and s[i] == 0x2A:  # '*' width: no operand
            i += 1
            out += b"%!(BADWIDTH)"
            after_index = False
        else:
            _w, present, i = _parsenum(s, i, end)
            if after_index and present:  # "%[3]2d"
                good = False
        if i + 1 < end and s[i] == 0x2E:  # '.' precision
            i += 1
            if after_index:  # "%[3].2d"
                good = False
            i, after_index, good = _arg_number(s, i, good)
            if i < end and s[i] == 0x2A:
                i += 1
                out += b"%!(BADPREC)"
                after_index = False
            else:
                _p, _present, i = _parsenum(s, i, end)
        if not after_index:
            i, after_index, good = _arg_number(s, i, good)
        if i >= end:
            out += b"%!(NOVERB)"
            break
        size = 1  # utf8.DecodeRuneInString
        while size < 4 and i + size < end and (s[i + size] & 0xC0) == 0x80 and s[i] >= 0xC0:
            size += 1
        verb = s[i : i + size]
        i += size
        if verb == b"%":
            out += b"%"
        elif not good:
            out += b"%!" + verb + b"(BADINDEX)"
        else:
            out += b"%!" + verb + b"(MISSING)"
    return out.decode(errors="replace")


class KubeScheduler:
    def __init__(
        self,
        api_client: Any,
        extenders: list[ExtenderConfig],
        scheduler_name: str = "vgpu-scheduler",
        percentage_of_nodes_to_score: int = 0,
        seed: int = 0,
    ) -> None:
        from kubernetes import client

        self.core: Any = client.CoreV1Api(api_client)  # dict bodies: the client sends them as they are
        # scheduler.go: ignorable extenders go to the end; ignoredByScheduler resources of every
        # extender are skipped by NodeResourcesFit.
        self.extenders = [e for e in extenders if not e.ignorable] + [e for e in extenders if e.ignorable]
        self.ignored = {r for e in extenders for r, ign in e.managed_resources.items() if ign}
        self.scheduler_name = scheduler_name
        self.percentage = percentage_of_nodes_to_score
        self.next_start = 0
        self.rng = random.Random(seed)
        self.sent: list[Sent] = []

    # ----- API -----
    def _raw(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return json.loads(fn(*args, _preload_content=False, **kw).data)

    def _snapshot(self) -> tuple[list[NodeInfo], list[Obj]]:
        nodes = self._raw(self.core.list_node).get("items") or []
        pods = [
            _informer_copy(p)
            for p in self._raw(self.core.list_pod_for_all_namespaces).get("items") or []
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        infos = []
        for n in nodes:
            name = n["metadata"]["name"]
            on = [p for p in pods if (p.get("spec") or {}).get("nodeName") == name]
            alloc = {k: _amount(k, v) for k, v in ((n.get("status") or {}).get("allocatable") or {}).items()}
            req: dict[str, int] = {}
            for p in on:
                for k, v in pod_requests(p).items():
                    req[k] = req.get(k, 0) + v
            infos.append(NodeInfo(_informer_copy(n), on, alloc, req))
        return infos, pods

    def _event(self, pod: Obj, reason: str, message: str, etype: str = "Warning") -> None:
        meta = pod["metadata"]
        body: Obj = {
            "metadata": {"generateName": meta["name"] + ".", "namespace": meta.get("namespace", "default")},
            "involvedObject": {
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": etype,
            "reportingComponent": self.scheduler_name,
            "source": {},
        }
        self.core.create_namespaced_event(meta.get("namespace", "default"), body, _preload_content=False)

    def _patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        self.core.patch_namespaced_pod_status(
            meta["name"], meta.get("namespace", "default"), {"status": status}, _preload_content=False
        )

    # ----- HTTP to extenders (extender.go send) -----
    def _post(self, ext: ExtenderConfig, verb: str, body: Any) -> Any:
        url = urllib.parse.urlsplit(ext.url_prefix.rstrip("/") + "/" + verb)
        data = json.dumps(body, separators=(",", ":")).encode()
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            ctx = ssl.create_default_context()
            if ext.tls_insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            conn = http.client.HTTPSConnection(url.hostname or "", url.port, timeout=ext.http_timeout_s, context=ctx)
        else:
            conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=ext.http_timeout_s)
        headers = [
            ("Host", url.netloc),
            ("User-Agent", "Go-http-client/1.1"),
            ("Content-Length", str(len(data))),
            ("Content-Type", "application/json"),
            ("Accept-Encoding", "gzip"),
        ]
        self.sent.append(Sent(verb, f"POST {url.path} HTTP/1.1", headers, body))
        try:
            conn.putrequest("POST", url.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            conn.endheaders(data)
            r = conn.getresponse()
            raw = r.read()
            if r.getheader("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            if r.status != 200:
                raise ExtenderError(f"failed {verb} with extender at URL {ext.url_prefix}/{verb}, code {r.status}")
            return json.loads(raw)
        except (OSError, ValueError, http.client.HTTPException) as e:
            raise ExtenderError(f"{verb}: {e}") from None
        finally:
            conn.close()

    # ----- in-tree filters -----
    def _tolerated(self, pod: Obj, key: str, value: str, effect: str) -> bool:
        for t in (pod.get("spec") or {}).get("tolerations") or []:
            if t.get("effect") and t.get("effect") != effect:
                continue
            if t.get("operator") == "Exists" and (not t.get("key") or t.get("key") == key):
                return True
            if t.get("key") == key and t.get("value", "") == value:
                return True
        return False

    def _filter(
        self, pod: Obj, ni: NodeInfo, nominated: list[Obj], extra_removed: frozenset[str] | set[str] = frozenset()
    ) -> Status:
        node = ni.node
        spec = node.get("spec") or {}
        if spec.get("unschedulable") and not self._tolerated(pod, "node.kubernetes.io/unschedulable", "", "NoSchedule"):
            return Status(UNRESOLVABLE, ["node(s) were unschedulable"])
        taints = list(spec.get("taints") or [])
        conds = (node.get("status") or {}).get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
            taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
        for t in taints:
            if t.get("effect") in ("NoSchedule", "NoExecute") and not self._tolerated(
                pod, t["key"], t.get("value", ""), t["effect"]
            ):
                return Status(UNRESOLVABLE, [f"node(s) had untolerated taint {{{t['key']}: {t.get('value', '')}}}"])
        # NodeResourcesFit, with the nominated pods of >= priority added.
        uid = pod["metadata"].get("uid")
        req = dict(ni.requested)
        count = len([p for p in ni.pods if p["metadata"].get("uid") not in extra_removed])
        for p in ni.pods:
            if p["metadata"].get("uid") in extra_removed:
                for k, v in pod_requests(p).items():
                    req[k] = req.get(k, 0) - v
        for p in nominated:
            if p["metadata"].get("uid") != uid and priority(p) >= priority(pod):
                count += 1
                for k, v in pod_requests(p).items():
                    req[k] = req.get(k, 0) + v
        reasons: list[str] = []
        unresolvable = False
        if count + 1 > ni.allocatable.get("pods", 110):
            reasons.append("Too many pods")
        for k, v in pod_requests(pod).items():
            if v == 0 or k in self.ignored:
                continue
            have = ni.allocatable.get(k, 0)
            if v > have - req.get(k, 0):
                reasons.append(f"Insufficient {k}")
                unresolvable = unresolvable or v > have
        if reasons:
            return Status(UNRESOLVABLE if unresolvable else UNSCHEDULABLE, reasons)
        return Status("Success", [])

    def _num_to_find(self, n: int) -> int:
        """schedule_one.go numFeasibleNodesToFind."""
        if n < 100:
            return n
        pct = self.percentage or max(50 - n // 125, 5)
        return max(n * pct // 100, 100)

    # ----- extenders -----
    def _args(self, ext: ExtenderConfig, pod: Obj, nodes: list[NodeInfo]) -> Obj:
        if ext.node_cache_capable:
            return {"Pod": pod, "Nodes": None, "NodeNames": [ni.name for ni in nodes]}
        return {"Pod": pod, "Nodes": {"metadata": {}, "items": [ni.node for ni in nodes]}, "NodeNames": None}

    def _extender_filter(
        self, pod: Obj, feasible: list[NodeInfo], statuses: dict[str, Status], res: Result
    ) -> list[NodeInfo]:
        for ext in self.extenders:
            if not feasible:
                break
            if not ext.filter_verb or not interested(ext, pod):
                continue
            res.calls.append("filter")
            try:
                out = self._post(ext, ext.filter_verb, self._args(ext, pod, feasible))
                if out.get("Error"):
                    raise ExtenderError(out["Error"])
            except ExtenderError:
                if ext.ignorable:
                    continue
                raise
            unres = out.get("FailedAndUnresolvableNodes") or {}
            for n, why in unres.items():
                statuses[n] = Status(UNRESOLVABLE, [why])
            for n, why in (out.get("FailedNodes") or {}).items():
                if n not in unres:
                    statuses[n] = Status(UNSCHEDULABLE, [why])
            by_name = {ni.name: ni for ni in feasible}
            if ext.node_cache_capable and out.get("NodeNames") is not None:
                kept = out["NodeNames"]
                for n in kept:
                    if n not in by_name:
                        raise ExtenderError(
                            f"extender {ext.url_prefix!r} claims a filtered node {n!r} which is not found "
                            "in the input node list"
                        )
                feasible = [by_name[n] for n in kept]
            elif out.get("Nodes") is not None:
                names = [n["metadata"]["name"] for n in out["Nodes"].get("items") or []]
                feasible = [by_name[n] for n in names if n in by_name]
            else:
                feasible = []
        return feasible

    def _find(
        self, pod: Obj, infos: list[NodeInfo], pods: list[Obj], res: Result
    ) -> tuple[list[NodeInfo], dict[str, Status]]:
        nominated = [
            p for p in pods if (p.get("status") or {}).get("nominatedNodeName") and not p["spec"].get("nodeName")
        ]

        def nominated_on(n: str) -> list[Obj]:
            return [p for p in nominated if p["status"]["nominatedNodeName"] == n]

        statuses: dict[str, Status] = {}
        nnn = (pod.get("status") or {}).get("nominatedNodeName")
        if nnn:
            ni = next((x for x in infos if x.name == nnn), None)
            if ni is not None and self._filter(pod, ni, nominated_on(nnn)).code == "Success":
                feasible = self._extender_filter(pod, [ni], {}, res)
                if feasible:
                    return feasible, statuses
        if not infos:
            return [], statuses
        want = self._num_to_find(len(infos))
        feasible: list[NodeInfo] = []
        processed = 0
        for i in range(len(infos)):
            ni = infos[(self.next_start + i) % len(infos)]
            processed += 1
            st = self._filter(pod, ni, nominated_on(ni.name))
            if st.code == "Success":
                feasible.append(ni)
                if len(feasible) >= want:
                    break
            else:
                statuses[ni.name] = st
        self.next_start = (self.next_start + processed) % len(infos)
        return self._extender_filter(pod, feasible, statuses, res), statuses

    # ----- the cycle -----
    def schedule_one(self, namespace: str, name: str) -> Result:
        res = Result("Error")
        pod = _informer_copy(self._raw(self.core.read_namespaced_pod, name, namespace))
        if pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
            res.message = "pod is bound or being deleted (skipPodSchedule)"
            return res
        infos, pods = self._snapshot()
        try:
            feasible, statuses = self._find(pod, infos, pods, res)
        except ExtenderError as e:
            res.message = str(e)
            self._failed(pod, res.message)
            return res
        if not feasible:
            return self._unschedulable(pod, infos, pods, statuses, res)
        host = feasible[0].name
        if len(feasible) > 1:
            scores = {ni.name: 0 for ni in feasible}
            for ext in self.extenders:
                if not ext.prioritize_verb or not interested(ext, pod):
                    continue
                res.calls.append("prioritize")
                try:
                    out = self._post(ext, ext.prioritize_verb, self._args(ext, pod, feasible))
                except ExtenderError:
                    continue  # prioritizeNodes: an extender's prioritize error is ignored
                for hp in out or []:
                    if hp.get("Host") in scores:
                        scores[hp["Host"]] += int(hp.get("Score") or 0) * ext.weight * 10
            host = max(scores, key=lambda n: scores[n])
        return self._bind(pod, host, res)

    def _bind(self, pod: Obj, host: str, res: Result) -> Result:
        meta = pod["metadata"]
        bound = False
        for ext in self.extenders:
            if not ext.bind_verb or not interested(ext, pod):
                continue
            res.calls.append("bind")
            try:
                out = self._post(
                    ext,
                    ext.bind_verb,
                    {
                        "PodName": meta["name"],
                        "PodNamespace": meta.get("namespace", "default"),
                        "PodUID": meta.get("uid", ""),
                        "Node": host,
                    },
                )
                if out.get("Error"):
                    raise ExtenderError(out["Error"])
            except ExtenderError as e:
                if ext.ignorable:
                    continue
                res.message = str(e)
                self._failed(pod, res.message)
                return res
            bound = True
            break
        if not bound:
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": meta["name"], "namespace": meta.get("namespace"), "uid": meta.get("uid")},
                "target": {"kind": "Node", "name": host},
            }
            self.core.create_namespaced_pod_binding(
                meta["name"], meta.get("namespace", "default"), body, _preload_content=False
            )
        self._event(
            pod, "Scheduled", f"Successfully assigned {meta.get('namespace')}/{meta['name']} to {host}", "Normal"
        )
        res.status, res.node = "Scheduled", host
        return res

    def _failed(self, pod: Obj, message: str) -> None:
        """schedule_one.go handleSchedulingFailure: the event's note is the message, truncated,
        used as the *format* of `Eventf(pod, nil, Warning, "FailedScheduling", "Scheduling", msg)`
        (client-go tools/events/event_recorder.go eventf: `fmt.Sprintf(note, args...)`); the
        PodScheduled condition gets the message as it is. An events.k8s.io/v1 Event whose note
        is longer than NoteLengthLimit fails validation (ValidateEventCreate): no event then."""
        note = go_sprintf(truncate_message(message))
        if len(note.encode()) <= NOTE_LENGTH_LIMIT:
            self._event(pod, "FailedScheduling", note)
        cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        self._patch_status(pod, {"conditions": [cond]})

    def _unschedulable(
        self, pod: Obj, infos: list[NodeInfo], pods: list[Obj], statuses: dict[str, Status], res: Result
    ) -> Result:
        res.status = "Unschedulable"
        res.failed = {n: "; ".join(s.reasons) for n, s in statuses.items()}
        head = self._fit_error(len(infos), statuses)
        post = self._preempt(pod, infos, pods, statuses, res)
        res.message = head + (f" {post}" if post else "")
        self._failed(pod, res.message)
        return res

    @staticmethod
    def _fit_error(num_all: int, statuses: dict[str, Status], absent: str = "") -> str:
        """framework FitError.Error(): the reasons histogram, sorted as text."""
        counts: dict[str, int] = {}
        for st in statuses.values():
            for r in st.reasons:
                counts[r] = counts.get(r, 0) + 1
        if absent and len(statuses) < num_all:
            counts[absent] = counts.get(absent, 0) + num_all - len(statuses)
        msg = f"0/{num_all} nodes are available:"
        parts = sorted(f"{v} {k}" for k, v in counts.items())
        if parts:
            msg += f" {', '.join(parts)}."
        return msg

    # ----- PostFilter: DefaultPreemption -----
    def _preempt(
        self, pod: Obj, infos: list[NodeInfo], pods: list[Obj], statuses: dict[str, Status], res: Result
    ) -> str:
        """The PostFilter message (RunPostFilterPlugins joins the plugins' reasons)."""
        if (pod["spec"].get("preemptionPolicy") or "PreemptLowerPriority") == "Never":
            return "no new claims to deallocate, preemption: not eligible due to preemptionPolicy=Never."
        nnn = (pod.get("status") or {}).get("nominatedNodeName")
        if nnn:
            ni = next((x for x in infos if x.name == nnn), None)
            if ni is not None and statuses.get(nnn, Status(UNRESOLVABLE, [])).code != UNRESOLVABLE:
                for p in ni.pods:
                    if priority(p) < priority(pod) and p["metadata"].get("deletionTimestamp"):
                        return (
                            "no new claims to deallocate, preemption: "
                            "not eligible due to a terminating pod on the nominated node."
                        )
        potential = [ni for ni in infos if statuses.get(ni.name, Status(UNRESOLVABLE, [])).code == UNSCHEDULABLE]
        if not potential:
            # preemption.go Preempt: "Preemption is not helpful for scheduling" for every node.
            return "no new claims to deallocate, preemption: " + self._fit_error(
                len(infos), {}, "Preemption is not helpful for scheduling"
            )
        candidates: dict[str, list[Obj]] = {}
        dry: dict[str, Status] = {}
        errors: list[str] = []
        offset = self.rng.randrange(len(potential))
        for i in range(len(potential)):
            ni = potential[(offset + i) % len(potential)]
            victims, st = self._select_victims(pod, ni, pods)
            if st.code == "Success" and victims:
                candidates[ni.name] = victims
                continue
            if st.code == "Success":
                st = Status(ERROR, [f'expected at least one victim pod on node "{ni.name}"'])
            if st.code == ERROR:
                errors.append(st.reasons[0])
            dry[ni.name] = st
        if not candidates:
            if errors:
                return "preemption: " + (errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]")
            return "no new claims to deallocate, preemption: " + self._fit_error(
                len(infos), dry, "Preemption is not helpful for scheduling"
            )
        by_name = {ni.name: ni for ni in infos}
        for ext in self.extenders:
            if not ext.preempt_verb or not interested(ext, pod):
                continue
            res.calls.append("preempt")
            if ext.node_cache_capable:
                args = {
                    "Pod": pod,
                    "NodeNameToVictims": None,
                    "NodeNameToMetaVictims": {
                        n: {"Pods": [{"UID": v["metadata"]["uid"]} for v in vs], "NumPDBViolations": 0}
                        for n, vs in candidates.items()
                    },
                }
            else:
                args = {
                    "Pod": pod,
                    "NodeNameToVictims": {n: {"Pods": vs, "NumPDBViolations": 0} for n, vs in candidates.items()},
                    "NodeNameToMetaVictims": None,
                }
            try:
                out = self._post(ext, ext.preempt_verb, args)
                new: dict[str, list[Obj]] = {}
                for n, mv in (out.get("NodeNameToMetaVictims") or {}).items():
                    ni = by_name.get(n)
                    if ni is None:
                        raise ExtenderError(f'nodeinfo not found for node name "{n}"')
                    found = []
                    for mp in (mv or {}).get("Pods") or []:
                        p = next((x for x in ni.pods if x["metadata"].get("uid") == mp.get("UID")), None)
                        if p is None:  # extender.go convertPodUIDToPod
                            raise ExtenderError(
                                f"extender: {ext.url_prefix} claims to preempt pod (UID: {mp.get('UID')}) on node: "
                                f"{n}, but the pod is not found on that node"
                            )
                        found.append(p)
                    if not found:
                        if ext.ignorable:
                            continue
                        raise ExtenderError(f'expected at least one victim pod on node "{n}"')
                    new[n] = found
            except ExtenderError as e:
                if ext.ignorable:
                    continue
                return f"preemption: {e}"
            candidates = new
            if not candidates:
                break
        if not candidates:
            return "no new claims to deallocate, preemption: no candidate node for preemption"
        node = self._pick(candidates)
        victims = candidates[node]
        uid = pod["metadata"].get("uid")
        for v in victims:
            if v["metadata"].get("deletionTimestamp"):
                continue  # executor.go prepareCandidateAsync: already being deleted
            self._event(v, "Preempted", f"Preempted by pod {uid} on node {node}", "Normal")
            try:
                self.core.delete_namespaced_pod(
                    v["metadata"]["name"], v["metadata"]["namespace"], _preload_content=False
                )
            except Exception:
                pass
            res.victims.append(v["metadata"]["name"])
        self._patch_status(pod, {"nominatedNodeName": node})
        res.nominated = node
        return ""

    def _select_victims(self, pod: Obj, ni: NodeInfo, pods: list[Obj]) -> tuple[list[Obj], Status]:
        """default_preemption.go SelectVictimsOnNode (no PodDisruptionBudgets)."""
        nominated = [
            p
            for p in pods
            if (p.get("status") or {}).get("nominatedNodeName") == ni.name and not p["spec"].get("nodeName")
        ]
        potential = [p for p in ni.pods if priority(p) < priority(pod)]
        if not potential:
            return [], Status(UNRESOLVABLE, ["No preemption victims found for incoming pod"])
        removed = {p["metadata"]["uid"] for p in potential}
        st = self._filter(pod, ni, nominated, removed)
        if st.code != "Success":
            return [], st
        potential.sort(key=lambda p: (-priority(p), _start(p)))  # MoreImportantPod first
        victims = []
        for p in potential:
            removed.discard(p["metadata"]["uid"])
            if self._filter(pod, ni, nominated, removed).code != "Success":
                removed.add(p["metadata"]["uid"])
                victims.append(p)
        return victims, Status("Success", [])

    @staticmethod
    def _pick(candidates: dict[str, list[Obj]]) -> str:
        """preemption.go pickOneNodeForPreemption (default score functions, no PDBs)."""
        nodes = list(candidates)
        funcs = [
            lambda n: -priority(candidates[n][0]),
            lambda n: -sum(priority(p) + 2**31 for p in candidates[n]),
            lambda n: -len(candidates[n]),
            lambda n: min(_start(p) for p in candidates[n] if priority(p) == priority(candidates[n][0])),
        ]
        for f in funcs:
            best = max(f(n) for n in nodes)
            nodes = [n for n in nodes if f(n) == best]
            if len(nodes) == 1:
                break
        return nodes[0]

    def pending(self) -> list[Obj]:
        pods = self._raw(self.core.list_pod_for_all_namespaces).get("items") or []
        return [
            p
            for p in pods
            if not (p.get("spec") or {}).get("nodeName")
            and (p.get("spec") or {}).get("schedulerName") == self.scheduler_name
            and (p.get("status") or {}).get("phase", "Pending") == "Pending"
            and not p["metadata"].get("deletionTimestamp")
        ]
