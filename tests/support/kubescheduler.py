"""A stand-in for kube-scheduler's side of the extender protocol (NOT kube-scheduler).

It models what kube-scheduler does towards HTTP extenders (kubernetes/kubernetes
pkg/scheduler/extender.go and schedule_one.go, see docs/scheduler.md): for one pod,
in-tree filtering reduced to "Node Ready and schedulable", then each interested extender's
filter in order (ignorable ones last; `NodeNames` when nodeCacheCapable, else full `Nodes`;
a result node not in the input is an error; FailedAndUnresolvableNodes win over FailedNodes),
then prioritize (errors ignored; Score x weight x 100/10 added), the highest score wins (ties:
first listed), then the binding extender's bind or, without one, the default binder (a
Binding). HTTP errors, non-200 answers, timeouts and `Error` fail the cycle unless the
extender is ignorable (filter skipped; bind falls back to the default binder). An
unschedulable pod gets a FailedScheduling Event with kube-scheduler's "0/N nodes are
available: ..." message. It talks to the API through the kubernetes client.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


@dataclass
class ExtenderConfig:
    url_prefix: str
    filter_verb: str = "filter"
    prioritize_verb: str = "prioritize"
    bind_verb: str = "bind"
    weight: int = 1
    node_cache_capable: bool = True
    ignorable: bool = False
    http_timeout_s: float = 5.0  # kube-scheduler's default httpTimeout
    managed_resources: list[str] = field(
        default_factory=lambda: [
            "nvidia.com/gpu",
            "nvidia.com/gpumem",
            "nvidia.com/gpumem-percentage",
            "nvidia.com/gpucores",
        ]
    )
    tls_insecure: bool = True


@dataclass
class Result:
    status: str  # Scheduled | Unschedulable | Error
    node: str = ""
    message: str = ""
    failed: dict[str, str] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # verbs called, in order


class ExtenderError(Exception):
    pass


def _extender_args(ext: ExtenderConfig, pod: Obj, nodes: list[Obj]) -> Obj:
    """ExtenderArgs as kube-scheduler sends them: node names only to a nodeCacheCapable extender,
    whole Node objects otherwise."""
    if ext.node_cache_capable:
        return {"Pod": pod, "Nodes": None, "NodeNames": [n["metadata"]["name"] for n in nodes]}
    return {"Pod": pod, "Nodes": {"kind": "NodeList", "apiVersion": "v1", "items": nodes}, "NodeNames": None}


def _post(ext: ExtenderConfig, verb: str, body: Any) -> Any:
    url = ext.url_prefix.rstrip("/") + "/" + verb
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    ctx = None
    if url.startswith("https:"):
        ctx = ssl.create_default_context()
        if ext.tls_insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, timeout=ext.http_timeout_s, context=ctx) as r:
            if r.status != 200:
                raise ExtenderError(f"{verb}: HTTP {r.status}")
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ExtenderError(f"{verb}: HTTP {e.code}") from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
        raise ExtenderError(f"{verb}: {e}") from None


def interested(ext: ExtenderConfig, pod: Obj) -> bool:
    if not ext.managed_resources:
        return True
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            if any(k in ext.managed_resources for k in res.get(part) or {}):
                return True
    return False


class KubeScheduler:
    def __init__(
        self, api_client: Any, extenders: list[ExtenderConfig], scheduler_name: str = "vgpu-scheduler"
    ) -> None:
        from kubernetes import client

        self.core: Any = client.CoreV1Api(api_client)  # dict bodies: the client sends them as they are
        # kube-scheduler moves ignorable extenders to the end of the list.
        self.extenders = [e for e in extenders if not e.ignorable] + [e for e in extenders if e.ignorable]
        self.scheduler_name = scheduler_name

    def _raw(self, fn: Any, *args: Any, **kw: Any) -> Obj:
        return json.loads(fn(*args, _preload_content=False, **kw).data)

    def _nodes(self) -> list[Obj]:
        out = []
        for n in self._raw(self.core.list_node).get("items") or []:
            if (n.get("spec") or {}).get("unschedulable"):
                continue
            conds = (n.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
                out.append(n)
        return out

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
            "source": {"component": self.scheduler_name},
        }
        self.core.create_namespaced_event(meta.get("namespace", "default"), body, _preload_content=False)

    def schedule_one(self, namespace: str, name: str) -> Result:
        pod = self._raw(self.core.read_namespaced_pod, name, namespace)
        res = Result("Error")
        nodes = self._nodes()
        total = len(nodes)
        feasible = nodes
        failed: dict[str, str] = {}
        for ext in self.extenders:
            if not ext.filter_verb or not interested(ext, pod) or not feasible:
                continue
            args = _extender_args(ext, pod, feasible)
            res.calls.append("filter")
            try:
                out = _post(ext, ext.filter_verb, args)
                if out.get("Error"):
                    raise ExtenderError(out["Error"])
            except ExtenderError as e:
                if ext.ignorable:
                    continue
                res.message = str(e)
                return res
            for n, why in (out.get("FailedNodes") or {}).items():
                failed[n] = why
            for n, why in (out.get("FailedAndUnresolvableNodes") or {}).items():
                failed[n] = why  # precedence: unresolvable
            if out.get("NodeNames") is not None and ext.node_cache_capable:
                kept = out["NodeNames"]
            else:
                kept = [n["metadata"]["name"] for n in ((out.get("Nodes") or {}).get("items") or [])]
            by_name = {n["metadata"]["name"]: n for n in feasible}
            for n in kept:
                if n not in by_name:
                    res.message = f"extender claims a filtered node {n!r} which is not found in the input node list"
                    return res
            feasible = [by_name[n] for n in kept]
        res.failed = failed
        if not feasible:
            parts = sorted(f"{why}" for why in failed.values()) or ["no node"]
            res.status = "Unschedulable"
            res.message = f"0/{total} nodes are available: {'; '.join(parts)}."
            self._event(pod, "FailedScheduling", res.message)
            return res
        scores = {n["metadata"]["name"]: 0 for n in feasible}
        for ext in self.extenders:
            if not ext.prioritize_verb or not interested(ext, pod):
                continue
            args = _extender_args(ext, pod, feasible)
            res.calls.append("prioritize")
            try:
                out = _post(ext, ext.prioritize_verb, args)
            except ExtenderError:
                continue  # prioritize errors are ignored
            for hp in out or []:
                if hp.get("Host") in scores:
                    scores[hp["Host"]] += int(hp.get("Score") or 0) * ext.weight * 10
        host = max(scores, key=lambda n: scores[n])  # first of the highest (dict order = input order)
        binder = next((e for e in self.extenders if e.bind_verb and interested(e, pod)), None)
        if binder is not None:
            res.calls.append("bind")
            try:
                meta = pod["metadata"]
                out = _post(
                    binder,
                    binder.bind_verb,
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
                if not binder.ignorable:
                    res.message = str(e)
                    return res
                binder = None
        if binder is None:
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name},
                "target": {"kind": "Node", "name": host},
            }
            self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False)
        res.status, res.node = "Scheduled", host
        return res

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
