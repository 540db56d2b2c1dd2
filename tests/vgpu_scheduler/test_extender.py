"""The extender over HTTP, driven by the kube-scheduler stand-in and the API stand-in."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from sim.kubeapi import KubeAPI, pod_object
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.support.http import post_ok
from tests.support.inventory import uuid
from tests.vgpu_scheduler.helpers import GiB, MiB, decision_of, gpu_node, running_scheduler, vgpu_pod
from vgpu import scheduling as sc
from vgpu_scheduler.config import SchedulerConfig


def events(api: KubeAPI, pod: str) -> list[str]:
    return [e["message"] for e in api.objects("events") if e["involvedObject"]["name"] == pod]


def bind_args(pod: dict[str, Any], node: str) -> dict[str, Any]:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": node}


def test_filter_wire_format_node_names(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("small", n=1, mem_gib=16))
    kubeapi.create("nodes", gpu_node("big", n=2, mem_gib=80))
    pod = kubeapi.create("pods", vgpu_pod("p", mem=30000, cores=30))
    with running_scheduler(kubeapi) as s:
        before = len(kubeapi.requests)
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["small", "big", "ghost"]})
        assert set(out) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
        assert out["NodeNames"] == ["big"] and out["Nodes"] is None and out["Error"] == ""
        # A node was found: kube-scheduler reads no failure reasons then (schedule_one.go).
        assert out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {}
        # No API round trip in filter: the choice is held in memory until bind.
        assert [r for r in kubeapi.requests[before:] if "watch=true" not in r[1]] == []
        assert decision_of(kubeapi, "p") is None
        assert post_ok(s.url + "/bind", bind_args(pod, "big")) == {"Error": ""}
        d = decision_of(kubeapi, "p")
        assert d is not None and d.node == "big"
        assert [(c.name, c.init, [(g.memory, g.cores) for g in c.gpus]) for c in d.containers] == [
            ("main", False, [(30000 * MiB, 30)])
        ]
        # bind: one write, the Binding, which carries the decision, bind-phase and bind-time as
        # annotations (kube-apiserver merges them into the pod with nodeName, conditioned on the
        # filter's resourceVersion)
        writes = [r for r in kubeapi.requests[before:] if r[0] != "GET"]  # the watches' are GETs
        assert [(m, path.rsplit("/", 1)[-1]) for m, path, _ in writes] == [("POST", "binding")]
        assert kubeapi.get("pods", "p")["spec"]["nodeName"] == "big"
        ann = kubeapi.get("pods", "p")["metadata"]["annotations"]
        assert ann[sc.BIND_PHASE_ANNOTATION] == sc.PHASE_ALLOCATING and int(ann[sc.BIND_TIME_ANNOTATION]) > 0
        # reasons when no node fits: per node, unknown nodes unresolvable
        pod2 = kubeapi.create("pods", vgpu_pod("q", gpu=2, mem=60000))
        out = post_ok(s.url + "/filter", {"Pod": pod2, "Nodes": None, "NodeNames": ["small", "big", "ghost"]})
        assert out["NodeNames"] == []
        assert out["FailedNodes"] == {
            "big": f"container main: 1/2 GPUs fit, 2 asked: {uuid('big', 0)}: 51920 MiB free < 60000 MiB asked"
        }
        assert out["FailedAndUnresolvableNodes"] == {
            "ghost": "node unknown to vgpu-scheduler",
            "small": "node has 1 GPU(s) < 2 asked by one container",
        }
        # 90000 MiB never fits an 80 GiB GPU, whatever is evicted: preemption cannot help
        pod3 = kubeapi.create("pods", vgpu_pod("r", mem=90000))
        out = post_ok(s.url + "/filter", {"Pod": pod3, "Nodes": None, "NodeNames": ["big"]})
        assert out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"]["big"].startswith(
            "never fits this node: container main: 0/2 GPUs fit, 1 asked: "
        )


def test_filter_with_full_nodes_answers_nodes(kubeapi: KubeAPI) -> None:
    """nodeCacheCapable: false — full Node objects in, a NodeList out; the given objects decide."""
    n1, n2 = gpu_node("a", n=1, mem_gib=8), gpu_node("b", n=1, mem_gib=80)
    pod = kubeapi.create("pods", vgpu_pod("p", mem=10000))
    uid = pod["metadata"]["uid"]
    with running_scheduler(kubeapi) as s:  # neither node exists in the API: the request carries them
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": {"items": [n1, n2]}, "NodeNames": None})
        assert out["NodeNames"] is None
        assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["b"]
        assert s.service.state.reservations[uid].decision.node == "b"
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": {"items": [n1]}, "NodeNames": None})
        assert out["Nodes"]["items"] == []
        assert "8192 MiB free < 10000 MiB asked" in out["FailedAndUnresolvableNodes"]["a"]
    with running_scheduler(kubeapi, SchedulerConfig(simulate_full_nodes=True)) as s:
        pod2 = kubeapi.create("pods", vgpu_pod("q", mem=10000))
        out = post_ok(s.url + "/filter", {"Pod": pod2, "Nodes": {"items": [n1, n2]}, "NodeNames": None})
        assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["b"]
        assert s.service.state.reservations == {}  # a simulation holds nothing


def test_pod_without_vgpu_passes_through(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("a"))
    pod = kubeapi.create("pods", pod_object("plain", [("c", {"cpu": "1"})]))
    with running_scheduler(kubeapi) as s:
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["a", "x"]})
        assert out["NodeNames"] == ["a", "x"] and not out["FailedNodes"]
        assert decision_of(kubeapi, "plain") is None


def test_bad_bodies_answer_error_with_200(kubeapi: KubeAPI) -> None:
    with running_scheduler(kubeapi) as s:
        out = post_ok(s.url + "/filter", {"NodeNames": ["a"]})
        assert out["Error"].startswith("bad ExtenderArgs")
        out = post_ok(s.url + "/bind", {"PodName": 3})
        assert out["Error"].startswith("bad ExtenderBindingArgs")
        with urllib.request.urlopen(s.url + "/healthz", timeout=5) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        with urllib.request.urlopen(s.url + "/readyz", timeout=5) as r:
            assert json.loads(r.read())["ready"] is True


def test_invalid_request_fails_every_node_with_the_reason(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("a"))
    pod = kubeapi.create("pods", vgpu_pod("p", annotations={sc.GPU_POLICY_ANNOTATION: "random"}))
    with running_scheduler(kubeapi) as s:
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["a"]})
        assert out["NodeNames"] == []
        assert "must be one of binpack, spread" in out["FailedAndUnresolvableNodes"]["a"]


def test_full_cycle_filter_prioritize_bind(kubeapi: KubeAPI) -> None:
    for n in ("n1", "n2", "n3"):
        kubeapi.create("nodes", gpu_node(n, n=2))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("p", mem=8192, cores=30))
        r = ks.schedule_one("default", "p")
        assert r.status == "Scheduled", r.message
        # filter answers one node: kube-scheduler does not prioritize a single feasible node
        assert r.calls == ["filter", "bind"]
        pod = kubeapi.get("pods", "p")
        ann = pod["metadata"]["annotations"]
        assert pod["spec"]["nodeName"] == r.node
        assert ann[sc.BIND_PHASE_ANNOTATION] == sc.PHASE_ALLOCATING
        assert int(ann[sc.BIND_TIME_ANNOTATION]) > 0
        d = sc.decode_decision(ann[sc.DECISION_ANNOTATION])
        assert d.node == r.node and d.containers[0].gpus[0].memory == 8192 * MiB
        # binpack (the default node policy): the next pod goes to the same node
        kubeapi.create("pods", vgpu_pod("q", mem=8192, cores=30))
        assert ks.schedule_one("default", "q").node == r.node
        # a pod with spread goes elsewhere
        kubeapi.create("pods", vgpu_pod("s", mem=8192, annotations={"hami.io/node-scheduler-policy": "spread"}))
        assert ks.schedule_one("default", "s").node != r.node


def test_unschedulable_pod_gets_event_with_reasons(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("big", mem=20000))
        r = ks.schedule_one("default", "big")
        assert r.status == "Unschedulable"
        [msg] = events(kubeapi, "big")
        assert msg.startswith("0/1 nodes are available:")
        assert f"{uuid('n1', 0)}: 16384 MiB free < 20000 MiB asked" in msg


def test_bind_without_decision_for_that_node_is_refused(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1"))
    kubeapi.create("nodes", gpu_node("n2"))
    pod = kubeapi.create("pods", vgpu_pod("p"))
    with running_scheduler(kubeapi) as s:
        out = post_ok(
            s.url + "/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"}
        )
        assert "no node" in out["Error"] and "filter again" in out["Error"]
        f = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["n1", "n2"]})
        other = ({"n1", "n2"} - set(f["NodeNames"])).pop()
        out = post_ok(
            s.url + "/bind",
            {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": other},
        )
        assert "not " + other in out["Error"]
        assert not kubeapi.get("pods", "p")["spec"].get("nodeName")
        out = post_ok(
            s.url + "/bind",
            {"PodName": "p", "PodNamespace": "default", "PodUID": "other-uid", "Node": f["NodeNames"][0]},
        )
        assert "another UID" in out["Error"]


def test_failed_binding_releases_the_decision(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, split=1))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("p"))
        kubeapi.fail_next("POST", r"/pods/p/binding$", 500)
        r = ks.schedule_one("default", "p")
        assert r.status == "Error" and "binding default/p" in r.message
        assert decision_of(kubeapi, "p") is None
        used = s.service.state.usage_copy().get("n1", {}).get(uuid("n1", 0))
        assert used is None or used.slots == 0
        # the only slot is free again: the retry schedules
        r = ks.schedule_one("default", "p")
        assert r.status == "Scheduled", r.message


def test_conflicting_write_is_retried_on_a_fresh_pod(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1"))
    pod = kubeapi.create("pods", vgpu_pod("p", mem=1024))
    with running_scheduler(kubeapi) as s:
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["n1"]})
        assert out["NodeNames"] == ["n1"], out
        kubeapi.patch("pods", "p", {"metadata": {"labels": {"changed": "yes"}}})  # the filter's copy is now stale
        before = len(kubeapi.requests)
        assert post_ok(s.url + "/bind", bind_args(pod, "n1")) == {"Error": ""}
    assert decision_of(kubeapi, "p") is not None
    assert kubeapi.get("pods", "p")["metadata"]["labels"] == {"changed": "yes"}
    assert kubeapi.get("pods", "p")["spec"]["nodeName"] == "n1"
    binds = [r for r in kubeapi.requests[before:] if r[0] == "POST" and r[1].endswith("/binding")]
    assert len(binds) == 2  # one 409 (the filter's resourceVersion), one success after a re-read


def test_ignorable_extender_down_and_timeouts(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1"))
    kubeapi.create("pods", vgpu_pod("p"))
    dead = "http://127.0.0.1:9"  # nothing listens
    ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(dead, ignorable=False, http_timeout_s=1)])
    r = ks.schedule_one("default", "p")
    assert r.status == "Error"
    ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(dead, ignorable=True, http_timeout_s=1)])
    r = ks.schedule_one("default", "p")
    assert r.status == "Scheduled" and r.node == "n1"  # skipped filter, default binder
    assert decision_of(kubeapi, "p") is None
    kubeapi.create("pods", vgpu_pod("slow"))
    with running_scheduler(kubeapi) as s:
        kubeapi.latency_s = 0.4  # each API call of the extender is slow; the caller gives up first
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url, http_timeout_s=0.3)])
        r = ks.schedule_one("default", "slow")
        kubeapi.latency_s = 0.0
        assert r.status == "Error" and "timed out" in r.message


def test_gpu_count_and_memory_percentage_over_http(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=4, mem_gib=40))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url, node_cache_capable=False)])
        kubeapi.create(
            "pods",
            pod_object(
                "multi",
                [("a", {"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50"}), ("b", {"nvidia.com/gpu": "1"})],
                init=[("setup", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"})],
                scheduler="vgpu-scheduler",
            ),
        )
        r = ks.schedule_one("default", "multi")
        assert r.status == "Scheduled", r.message
        d = decision_of(kubeapi, "multi")
        assert d is not None
        assert [(c.name, c.init, len(c.gpus)) for c in d.containers] == [
            ("setup", True, 1),
            ("a", False, 2),
            ("b", False, 1),
        ]
        assert {g.memory for g in d.containers[1].gpus} == {20 * GiB}
        assert d.containers[2].gpus[0].memory == 10 * GiB  # the 1/K slice of a 40 GiB GPU, K=4


def test_prioritize_scores_by_policy_and_decided_node_gets_10(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("empty", n=1, mem_gib=16))
    kubeapi.create("nodes", gpu_node("busy", n=1, mem_gib=16))
    kubeapi.create("nodes", gpu_node("tiny", n=1, mem_gib=1))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("first", mem=8000, annotations={sc.NODE_POLICY_ANNOTATION: "spread"}))
        first = ks.schedule_one("default", "first").node
        other = ({"empty", "busy"} - {first}).pop()
        args = {"Pod": vgpu_pod("probe", mem=4000), "Nodes": None, "NodeNames": [first, other, "tiny"]}
        pack = {h["Host"]: h["Score"] for h in post_ok(s.url + "/prioritize", args)}
        assert set(pack) == {first, other, "tiny"} and pack["tiny"] == 0
        assert 0 < pack[other] < pack[first] <= 10  # binpack: the used node scores higher
        args["Pod"] = vgpu_pod("probe", mem=4000, annotations={sc.NODE_POLICY_ANNOTATION: "spread"})
        spread = {h["Host"]: h["Score"] for h in post_ok(s.url + "/prioritize", args)}
        assert spread[other] > spread[first]
        decided = kubeapi.get("pods", "first")
        hp = post_ok(s.url + "/prioritize", {"Pod": decided, "Nodes": None, "NodeNames": [first, other]})
        assert {h["Host"]: h["Score"] for h in hp}[first] == 10
