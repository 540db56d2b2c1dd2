"""The kube-scheduler stand-in against what the real kube-scheduler v1.36.2 did (K2 traces).

Each recorded scenario is replayed: the same nodes and pods in the API stand-in, the stand-in
scheduling them through a recording extender that answers what the recording extender answered
(`response_sent`). The requests the stand-in sends must have the recorded shape (request line,
header names in order, Go field names in order, explicit nulls, node names, victims), in the
recorded order of verbs (preempt only after an in-tree filter failed, none after an extender's
rejection alone, no prioritize call for one feasible node), and the pods must end as recorded
(scenario-results.json: messages, preempted pods, events).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sim.kubeapi import KubeAPI, node_object, pod_object
from sim.kubescheduler import ExtenderConfig, KubeScheduler, Result
from tests.support import traces

Obj = dict[str, Any]
TRACES = {"a": "extender/requests-nodecache-true.json", "b": "extender/requests-nodecache-false.json"}
RESULTS = traces.load_json("extender/scenario-results.json")


class Recorder:
    """An HTTP extender answering the recorded `response_sent` of each verb, in turn."""

    def __init__(self, answers: dict[str, list[Any]]) -> None:
        self.answers = {v: list(a) for v, a in answers.items()}
        self.got: list[Obj] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n))
                verb = self.path.rsplit("/", 1)[-1]
                rec.got.append(
                    {
                        "verb": verb,
                        "request_line": self.requestline,
                        "headers": [[k, v] for k, v in self.headers.items()],
                        "body": body,
                    }
                )
                queue = rec.answers.get(verb) or [{}]
                answer = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/extender"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def recorded(kind: str, scenario: str) -> list[Obj]:
    return [r for r in traces.load_json(TRACES[kind]) if r["scenario"] == f"{scenario}-{kind}"]


@contextmanager
def setup(
    kind: str, scenario: str, nodes: tuple[str, ...] = ("node-1", "node-2")
) -> Iterator[tuple[KubeAPI, Recorder]]:
    rec = recorded(kind, scenario)
    answers: dict[str, list[Any]] = {}
    for r in rec:
        answers.setdefault(r["verb"], []).append(r["response_sent"])
    with KubeAPI() as api:
        for n in nodes:
            api.create("nodes", node_object(n, gpus=2))
        r = Recorder(answers)
        try:
            yield api, r
        finally:
            r.close()


def gpu_pod(name: str, kind: str, prio: int = 0, cores: bool = False, labels: Obj | None = None) -> Obj:
    lim = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3k"}
    if cores:
        lim["nvidia.com/gpucores"] = "30"
    p = pod_object(name, [("main", lim)], scheduler=f"vgpu-scheduler-{kind}")
    p["spec"]["priority"] = prio
    p["spec"]["tolerations"] = [{"operator": "Exists"}]
    if prio:
        p["spec"]["priorityClassName"] = "high"
    if labels:
        p["metadata"]["labels"] = labels
    return p


def low_pod(api: KubeAPI, name: str, node: str, gpus: str = "1", start: str = "2026-12-02T07:27:51Z") -> Obj:
    p = pod_object(name, [("main", {"nvidia.com/gpu": gpus} if gpus else {})], scheduler="default-scheduler")
    p["metadata"]["labels"] = {"role": "low"}
    p["spec"].update({"nodeName": node, "priority": 100, "priorityClassName": "low"})
    p["status"] = {"phase": "Running", "startTime": start}
    return api.create("pods", p)


def scheduler(api: KubeAPI, rec: Recorder, kind: str, **kw: Any) -> KubeScheduler:
    ext = ExtenderConfig(rec.url, preempt_verb="preempt", node_cache_capable=kind == "a", http_timeout_s=30, **kw)
    ext.managed_resources = kw.get("managed_resources") or {
        "nvidia.com/gpu": False,
        "nvidia.com/gpumem": True,
        "nvidia.com/gpucores": True,
    }
    return KubeScheduler(api.api_client(), [ext], scheduler_name=f"vgpu-scheduler-{kind}")


def same_shape(ours: Obj, real: Obj) -> None:
    """Our request has the recorded one's shape: request line, header names (in order) and the
    values Go sets, body keys in Go field order, nulls where the recording has them."""
    assert ours["verb"] == real["verb"]
    assert ours["request_line"] == real["request_line"]
    assert [h[0] for h in ours["headers"]] == [h[0] for h in real["headers"]]
    mine, theirs = dict(ours["headers"]), dict(real["headers"])
    for h in ("User-Agent", "Content-Type", "Accept-Encoding"):
        assert mine[h] == theirs[h], h
    assert int(mine["Content-Length"]) > 0
    ob, rb = ours["body"], real["body"]
    assert list(ob) == list(rb)
    for k in rb:
        assert (ob[k] is None) == (rb[k] is None), k
    if "Pod" in rb:
        assert list(ob["Pod"]) == list(rb["Pod"]) == ["metadata", "spec", "status"]  # no kind/apiVersion
        assert "managedFields" not in ob["Pod"]["metadata"]
    if rb.get("NodeNames") is not None:
        # The feasible list's order comes from parallel filter goroutines (schedule_one.go
        # findNodesThatPassFilters): compare as sets.
        assert sorted(ob["NodeNames"]) == sorted(rb["NodeNames"])
    if rb.get("Nodes") is not None:
        assert list(ob["Nodes"]) == list(rb["Nodes"]) == ["metadata", "items"]
        names = sorted(n["metadata"]["name"] for n in rb["Nodes"]["items"])
        assert sorted(n["metadata"]["name"] for n in ob["Nodes"]["items"]) == names
        for n in ob["Nodes"]["items"]:
            assert list(n) == ["metadata", "spec", "status"]
    for key in ("NodeNameToMetaVictims", "NodeNameToVictims"):
        if rb.get(key) is not None:
            assert sorted(ob[key]) == sorted(rb[key])
            for node, v in rb[key].items():
                assert list(ob[key][node]) == list(v) == ["Pods", "NumPDBViolations"]
                assert len(ob[key][node]["Pods"]) == len(v["Pods"])
                if key == "NodeNameToMetaVictims":
                    assert [list(p) for p in ob[key][node]["Pods"]] == [["UID"]]
                else:
                    assert [p["metadata"]["name"] for p in ob[key][node]["Pods"]] == [
                        p["metadata"]["name"] for p in v["Pods"]
                    ]


def check(kind: str, scenario: str, rec: Recorder, results: list[Result]) -> None:
    real = recorded(kind, scenario)
    verbs = [v for r in results for v in r.calls]
    assert [g["verb"] for g in rec.got] == verbs
    assert verbs == [r["verb"] for r in real[: len(verbs)]], (verbs, [r["verb"] for r in real])
    for ours, theirs in zip(rec.got, real, strict=False):
        same_shape(ours, theirs)


def failed_message(kind: str, scenario: str) -> str:
    return next(e["message"] for e in RESULTS[f"{scenario}-{kind}"]["events"] if e["reason"] == "FailedScheduling")


def norm(msg: str) -> str:
    """The order of a preemption error list is the order the parallel dry run met the nodes."""
    head, sep, tail = msg.partition("preemption: [")
    return head + sep + ", ".join(sorted(tail.rstrip("]").split(", "))) + "]" if sep else msg


@pytest.mark.parametrize("kind", ["a", "b"])
def test_basic_filter_prioritize_bind_and_no_call_without_managed_resources(kind: str) -> None:
    with setup(kind, "basic") as (api, rec):
        api.create("pods", gpu_pod("basic", kind, cores=True))
        r = scheduler(api, rec, kind).schedule_one("default", "basic")
        assert (r.status, r.node) == ("Scheduled", RESULTS[f"basic-{kind}"]["nodeName"])
        check(kind, "basic", rec, [r])
        api.create("pods", pod_object("nogpu", [("main", {})], scheduler=f"vgpu-scheduler-{kind}"))
        n = scheduler(api, rec, kind).schedule_one("default", "nogpu")
        # "Pods that request no managed resource never reach the extender"
        assert n.status == "Scheduled" and n.calls == []


@pytest.mark.parametrize("kind", ["a", "b"])
@pytest.mark.parametrize("scenario", ["failed", "unresolvable"])
def test_extender_rejection_alone_preempts_nobody(kind: str, scenario: str) -> None:
    with setup(kind, scenario) as (api, rec):
        api.create("pods", gpu_pod(scenario, kind, labels={"ext-filter": scenario}))
        ks = scheduler(api, rec, kind)
        results = [ks.schedule_one("default", scenario) for _ in range(2)]
        check(kind, scenario, rec, results)
        assert [r.status for r in results] == ["Unschedulable"] * 2
        assert results[0].message == failed_message(kind, scenario)


@pytest.mark.parametrize("kind", ["a", "b"])
def test_high_priority_blocked_by_the_extender_alone_gets_expected_at_least_one_victim(kind: str) -> None:
    with setup(kind, "high-block-if-low") as (api, rec):
        low_pod(api, "low-1", "node-1", gpus="")
        low_pod(api, "nogpu", "node-2", gpus="")
        api.create("pods", gpu_pod("high", kind, prio=1000, labels={"ext-filter": "block-if-low"}))
        r = scheduler(api, rec, kind).schedule_one("default", "high")
        check(kind, "high-block-if-low", rec, [r])
        assert "preempt" not in r.calls and r.victims == []
        assert norm(r.message) == norm(failed_message(kind, "high-block-if-low"))
        assert {p["metadata"]["name"] for p in api.objects("pods")} >= {"low-1"}  # low-1_still_exists


@pytest.mark.parametrize("kind", ["a", "b"])
def test_unresolvable_high_priority_pod_preempts_nobody(kind: str) -> None:
    with setup(kind, "high-unresolvable") as (api, rec):
        low_pod(api, "low-1", "node-1")
        api.create("pods", gpu_pod("high", kind, prio=1000, labels={"ext-filter": "unresolvable"}))
        r = scheduler(api, rec, kind).schedule_one("default", "high")
        check(kind, "high-unresolvable", rec, [r])
        assert r.message == failed_message(kind, "high-unresolvable") and r.victims == []


@pytest.mark.parametrize("kind", ["a", "b"])
def test_preempt_verb_after_an_in_tree_filter_failed(kind: str) -> None:
    with setup(kind, "preempt", nodes=("node-1",)) as (api, rec):
        low_pod(api, "low-1", "node-1", start="2026-12-02T07:27:50Z")
        low2 = low_pod(api, "low-2", "node-1", start="2026-12-02T07:27:51Z")
        # The recording extender's answer names the recorded victim's UID: ours has another.
        real_uid = recorded(kind, "preempt")[0]["response_sent"]["NodeNameToMetaVictims"]["node-1"]["Pods"][0]["UID"]
        for v in rec.answers["preempt"]:
            v["NodeNameToMetaVictims"]["node-1"]["Pods"][0]["UID"] = low2["metadata"]["uid"]
        high = api.create("pods", gpu_pod("preempt", kind, prio=1000, cores=True))
        ks = scheduler(api, rec, kind)
        first = ks.schedule_one("default", "preempt")
        assert first.calls == ["preempt"] and first.victims == ["low-2"] and first.nominated == "node-1"
        assert first.message == failed_message(kind, "preempt")  # "0/1 nodes are available: 1 Insufficient ..."
        pod = api.get("pods", "preempt")
        assert pod["status"]["nominatedNodeName"] == "node-1"
        assert [p["metadata"]["name"] for p in api.objects("pods") if p["metadata"]["name"].startswith("low")] == [
            "low-1"
        ]  # low_pods_left
        ev = [e for e in api.objects("events") if e["reason"] == "Preempted"]
        recorded_ev = next(e for e in RESULTS[f"preempt-{kind}"]["low_events"]["low-2"] if e["reason"] == "Preempted")
        assert [e["message"] for e in ev] == [
            recorded_ev["message"].replace("53363fb2-96bc-43be-91a2-5af026411ff7", high["metadata"]["uid"])
        ]
        second = ks.schedule_one("default", "preempt")
        assert second.status == "Scheduled" and second.node == RESULTS[f"preempt-{kind}"]["nodeName"]
        check(kind, "preempt", rec, [first, second])
        got = rec.got[0]["body"]
        if kind == "a":
            assert got["NodeNameToMetaVictims"]["node-1"]["Pods"] == [{"UID": low2["metadata"]["uid"]}]
        else:
            sent = got["NodeNameToVictims"]["node-1"]["Pods"]
            assert [p["metadata"]["uid"] for p in sent] == [low2["metadata"]["uid"]]
        assert real_uid  # the recording named one victim too


@pytest.mark.parametrize("kind", ["a", "b"])
def test_filter_and_bind_errors(kind: str) -> None:
    with setup(kind, "filter-error", nodes=("node-1",)) as (api, rec):
        api.create("pods", gpu_pod("fe", kind, labels={"ext-filter": "error"}))
        r = scheduler(api, rec, kind).schedule_one("default", "fe")
        check(kind, "filter-error", rec, [r])
        assert r.status == "Error" and r.message == failed_message(kind, "filter-error")
    with setup(kind, "bind-error", nodes=("node-1",)) as (api, rec):
        api.create("pods", gpu_pod("be", kind))
        r = scheduler(api, rec, kind).schedule_one("default", "be")
        check(kind, "bind-error", rec, [r])
        assert r.status == "Error" and r.message == failed_message(kind, "bind-error")
        assert not api.get("pods", "be")["spec"].get("nodeName")


def test_gpu_counted_or_ignored_by_the_scheduler() -> None:
    """gpu100-a: nvidia.com/gpu counted, 100 > allocatable 2: unresolvable in-tree, no extender
    call; gpu100-c: all managed resources ignoredByScheduler, filter and bind are called."""
    with setup("a", "gpu100", nodes=("node-1",)) as (api, rec):
        p = pod_object("gpu100", [("main", {"nvidia.com/gpu": "100"})], scheduler="vgpu-scheduler-a")
        api.create("pods", p)
        r = scheduler(api, rec, "a").schedule_one("default", "gpu100")
        assert r.calls == [] and r.message == RESULTS["gpu100-a"]["conditions"][0]["message"]
    real = traces.load_json("extender/requests-nodecache-true-gpu-ignoredByScheduler.json")
    answers: dict[str, list[Any]] = {}
    for x in real:
        answers.setdefault(x["verb"], []).append(x["response_sent"])
    with KubeAPI() as api:
        api.create("nodes", node_object("node-1", gpus=2))
        rec = Recorder(answers)
        try:
            p = pod_object("gpu100", [("main", {"nvidia.com/gpu": "100"})], scheduler="vgpu-scheduler-c")
            api.create("pods", p)
            ext = ExtenderConfig(rec.url, node_cache_capable=True, http_timeout_s=30)
            ext.managed_resources = {"nvidia.com/gpu": True, "nvidia.com/gpumem": True, "nvidia.com/gpucores": True}
            r = KubeScheduler(api.api_client(), [ext], scheduler_name="vgpu-scheduler-c").schedule_one(
                "default", "gpu100"
            )
            assert r.status == "Scheduled" and r.calls == ["filter", "bind"] == [x["verb"] for x in real]
            for ours, theirs in zip(rec.got, real, strict=True):
                same_shape(ours, theirs)
        finally:
            rec.close()
