"""Preemption that helps, and none that doesn't.

The extender's preempt verb (extender.go ProcessPreemption, preemption.go callExtenders) keeps, per
candidate node, only victims whose eviction lets the pod fit on that node's GPUs; a node where no
eviction helps is left out. kube-scheduler only preempts after one of its own filters failed: the
node-level totals (vgpu.k8s.io/gpumem-total, gpucores-total) on the Node and on the pod make GPU
memory one of them. Driven by the kube-scheduler stand-in (DefaultPreemption modelled on v1.36,
checked against the recorded traces in test_kubescheduler_traces.py).
"""

from __future__ import annotations

from typing import Any

from sim.kubeapi import KubeAPI
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.support.http import post_json
from tests.support.inventory import uuid
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import GiB, MiB, Running, decision_of, gpu_node, running_scheduler, vgpu_pod
from vgpu import scheduling as sc
from vgpu_scheduler import requests, victims
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.snapshot import GPU, NodeView, Use


def node(name: str, n: int, mem_gib: int, split: int) -> dict[str, Any]:
    """A GPU node as the device plugin leaves it: inventory, slots, and the node-level totals."""
    obj = gpu_node(name, n=n, mem_gib=mem_gib, split=split)
    for part in ("capacity", "allocatable"):
        obj["status"][part][sc.RESOURCE_NODE_MEM] = str(n * mem_gib * 1024)
        obj["status"][part][sc.RESOURCE_NODE_CORES] = str(n * 100)
    return obj


def pod(name: str, mem: int, prio: int, gpu_uuid: str = "", totals: bool = True, **kw: Any) -> dict[str, Any]:
    """A vGPU pod as the webhook leaves it (node-level totals added), with a priority."""
    ann = {sc.USE_GPUUUID_ANNOTATION: gpu_uuid} if gpu_uuid else {}
    p = vgpu_pod(name, mem=mem, cores=10, annotations=ann, **kw)
    if totals:
        p["spec"]["containers"][0]["resources"]["limits"][sc.RESOURCE_NODE_MEM] = str(mem)
        p["spec"]["containers"][0]["resources"]["limits"][sc.RESOURCE_NODE_CORES] = "10"
    p["spec"]["priority"] = prio
    return p


def place_low(api: KubeAPI, ks: KubeScheduler, name: str, mem: int, gpu_uuid: str, start: str) -> None:
    api.create("pods", pod(name, mem, 100, gpu_uuid))
    r = ks.schedule_one("default", name)
    assert r.status == "Scheduled", r.message
    api.patch("pods", name, {"status": {"phase": "Running", "startTime": start}})


def names(api: KubeAPI) -> list[str]:
    return sorted(p["metadata"]["name"] for p in api.objects("pods"))


def add_node(api: KubeAPI, s: Running, obj: dict[str, Any]) -> None:
    api.create("nodes", obj)
    wait_for(lambda: obj["metadata"]["name"] in s.service.state.nodes, what="the scheduler sees the node")


def fragmented(api: KubeAPI, ks: KubeScheduler, s: Running) -> None:
    """n1: GPU 0 holds a (8192, started 2nd) and b (8192, started last); GPU 1 holds c (12288,
    started first). 4096 MiB free on the node in all, 12288 MiB free on no GPU."""
    add_node(api, s, node("n1", n=2, mem_gib=16, split=4))
    place_low(api, ks, "c", 12288, uuid("n1", 1), "2026-12-02T07:00:00Z")
    place_low(api, ks, "a", 8192, uuid("n1", 0), "2026-12-02T07:01:00Z")
    place_low(api, ks, "b", 8192, uuid("n1", 0), "2026-12-02T07:02:00Z")


def test_a_pod_blocked_by_gpu_memory_evicts_exactly_the_victims_that_help(kubeapi: KubeAPI) -> None:
    """kube-scheduler's own dry run would evict b (the least important pod, enough for its
    node-level totals) but b's GPU would still lack 4096 MiB. The extender names c instead: its
    GPU then has 16384 MiB free. One eviction, the pod placed there, a and b untouched."""
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        fragmented(kubeapi, ks, s)
        kubeapi.create("pods", pod("high", 12288, 1000))
        first = ks.schedule_one("default", "high")
        assert first.calls == ["preempt"]  # in-tree NodeResourcesFit failed first: no filter call
        assert "Insufficient vgpu.k8s.io/gpumem-total" in first.message
        assert (first.victims, first.nominated) == (["c"], "n1")
        assert names(kubeapi) == ["a", "b", "high"]
        second = ks.schedule_one("default", "high")
        assert (second.status, second.node) == ("Scheduled", "n1"), second.message
        d = decision_of(kubeapi, "high")
        assert d is not None and [g.uuid for g in d.containers[0].gpus] == [uuid("n1", 1)]


def test_one_larger_pod_is_evicted_rather_than_two_smaller(kubeapi: KubeAPI) -> None:
    """Two 16 GiB GPUs split 4, every slot taken: GPU 0 holds 8192 (started first), 4096, 2048 and
    2048 MiB, GPU 1 four pods of 4096 MiB. A pod of 8192 MiB at a higher priority evicts exactly
    the 8192 MiB pod and runs on GPU 0 (a greedy walk from the least important pods evicted two
    of GPU 1)."""
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        add_node(kubeapi, s, node("n1", n=2, mem_gib=16, split=4))
        for i, mib in enumerate((8192, 4096, 2048, 2048)):
            place_low(kubeapi, ks, f"g0-{i}", mib, uuid("n1", 0), f"2026-12-02T07:0{i}:00Z")
        for i in range(4):
            place_low(kubeapi, ks, f"g1-{i}", 4096, uuid("n1", 1), f"2026-12-02T07:1{i}:00Z")
        kubeapi.create("pods", pod("high", 8192, 1000))
        first = ks.schedule_one("default", "high")
        assert first.calls == ["preempt"] and (first.victims, first.nominated) == (["g0-0"], "n1"), first.message
        second = ks.schedule_one("default", "high")
        assert (second.status, second.node) == ("Scheduled", "n1"), second.message
        d = decision_of(kubeapi, "high")
        assert d is not None and [g.uuid for g in d.containers[0].gpus] == [uuid("n1", 0)]
        assert names(kubeapi) == sorted(["g0-1", "g0-2", "g0-3", "g1-0", "g1-1", "g1-2", "g1-3", "high"])


def test_without_the_preempt_verb_kube_scheduler_evicts_a_pod_that_does_not_help(kubeapi: KubeAPI) -> None:
    """The same cluster with an extender configured without preemptVerb: kube-scheduler evicts b on
    its own, and the pod still does not fit."""
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url, preempt_verb="")])
        fragmented(kubeapi, ks, s)
        kubeapi.create("pods", pod("high", 12288, 1000))
        assert ks.schedule_one("default", "high").victims == ["b"]
        r = ks.schedule_one("default", "high")
        assert r.status == "Unschedulable" and "4096 MiB free < 12288 MiB asked" in r.message


def test_a_pod_no_gpu_could_hold_evicts_nobody(kubeapi: KubeAPI) -> None:
    """Every slot used, a higher-priority pod asking more memory than any GPU has: kube-scheduler's
    in-tree filters fail (slots, node totals), its dry run proposes victims, the extender drops
    the node: no candidate, nobody evicted, every time."""
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        add_node(kubeapi, s, node("n1", n=2, mem_gib=16, split=2))
        for i, g in enumerate((0, 0, 1, 1)):
            place_low(kubeapi, ks, f"low-{i}", 8192, uuid("n1", g), f"2026-12-02T07:0{i}:00Z")
        kubeapi.create("pods", pod("huge", 20000, 1000))
        for _ in range(3):
            r = ks.schedule_one("default", "huge")
            assert r.calls == ["preempt"] and r.victims == [] and r.nominated == ""
            assert r.message.endswith("preemption: no candidate node for preemption")
        assert names(kubeapi) == ["huge", "low-0", "low-1", "low-2", "low-3"]


def test_rejected_by_the_extender_alone_no_eviction(kubeapi: KubeAPI) -> None:
    """A pod without the node-level totals (created while the webhook was down) blocked by GPU
    memory: kube-scheduler's own filters pass, only the extender rejects: its dry run finds no
    victim it needs ("expected at least one victim pod on node"), nobody is evicted."""
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        fragmented(kubeapi, ks, s)
        kubeapi.create("pods", pod("high", 12288, 1000, totals=False))
        r = ks.schedule_one("default", "high")
        assert r.calls == ["filter"] and r.victims == []
        assert 'preemption: expected at least one victim pod on node "n1"' in r.message
        assert names(kubeapi) == ["a", "b", "c", "high"]


def test_preempt_wire_format_both_node_cache_modes(kubeapi: KubeAPI) -> None:
    """NodeNameToMetaVictims (nodeCacheCapable) or NodeNameToVictims (whole Pods) in, always
    NodeNameToMetaVictims out (ExtenderPreemptionResult), most important victim first; a node
    that no eviction helps is left out (an empty list would fail kube-scheduler's preemption)."""
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        fragmented(kubeapi, ks, s)
        add_node(kubeapi, s, node("n2", n=1, mem_gib=8, split=4))
        high = kubeapi.create("pods", pod("high", 12288, 1000))
        uid = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kubeapi.objects("pods")}
        meta = {
            "Pod": high,
            "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                "n1": {"Pods": [{"UID": uid["b"]}], "NumPDBViolations": 1},
                "n2": {"Pods": [{"UID": "whatever"}], "NumPDBViolations": 0},  # 8 GiB GPU: never fits
            },
        }
        code, out = post_json(s.url + "/preempt", meta)
        assert code == 200
        assert out == {"NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": uid["c"]}], "NumPDBViolations": 1}}}
        full = {
            "Pod": high,
            "NodeNameToVictims": {"n1": {"Pods": [kubeapi.get("pods", "b")], "NumPDBViolations": 0}},
            "NodeNameToMetaVictims": None,
        }
        assert post_json(s.url + "/preempt", full) == (
            200,
            {"NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": uid["c"]}], "NumPDBViolations": 0}}},
        )
        # a pod of equal or higher priority is never named
        mid = kubeapi.create("pods", pod("mid", 12288, 100))
        assert post_json(s.url + "/preempt", {**meta, "Pod": mid})[1] == {"NodeNameToMetaVictims": {}}
        assert post_json(s.url + "/preempt", {"Pod": 3})[0] == 400
    with running_scheduler(kubeapi, SchedulerConfig(leader_elect=True, lease_duration_s=60)) as s2:
        s2.service.extender.is_leader = lambda: False
        code, out = post_json(s2.url + "/preempt", meta)
        assert code == 503 and out["Error"] == "vgpu-scheduler: not the leader"


# ----- the selection itself (pure) -----
def view(n: int = 2, mem_gib: int = 16, slots: int = 4) -> NodeView:
    gpus = tuple(GPU(f"G{i}", i, "NVIDIA A100", 0, mem_gib * GiB, 100, slots, True) for i in range(n))
    return NodeView("n", gpus, totals=(n * mem_gib * GiB, n * 100, n * slots))


def holder(uid: str, prio: int, start: str, held: dict[str, tuple[int, int]], deleting: bool = False) -> victims.Holder:
    return victims.Holder(uid, prio, start, deleting, {g: Use(m * MiB, c, 1) for g, (m, c) in held.items()})


def used_by(*hs: victims.Holder) -> dict[str, Use]:
    out: dict[str, Use] = {}
    for h in hs:
        for g, u in h.held.items():
            out.setdefault(g, Use()).add(u)
    return out


def reqs(mem: int, count: int = 1) -> list[requests.ContainerRequest]:
    return [requests.ContainerRequest("main", False, count, mem, None, 10)]


OPTS = requests.PodOptions(node_policy="binpack", gpu_policy="binpack")
CFG = SchedulerConfig()


def test_select_victims_rules() -> None:
    a = holder("a", 100, "2026-12-02T07:01:00Z", {"G0": (8192, 10)})
    b = holder("b", 100, "2026-12-02T07:02:00Z", {"G0": (8192, 10)})
    c = holder("c", 100, "2026-12-02T07:00:00Z", {"G1": (12288, 10)})
    v = view()
    got = victims.select_victims(v, used_by(a, b, c), [a, b, c], [], reqs(12288), OPTS, CFG)
    assert [h.uid for h in got or []] == ["c"]
    # a lower priority wins over fewer pods: two pods of priority 10 rather than one of 100
    a10, b10 = (holder(h.uid, 10, h.start, {"G0": (8192, 10)}) for h in (a, b))
    got = victims.select_victims(v, used_by(a10, b10, c), [a10, b10, c], [], reqs(12288), OPTS, CFG)
    assert [h.uid for h in got or []] == ["a", "b"]  # most important first (a started earlier)
    # a terminating pod costs nothing
    cd = holder("c", 100, c.start, {"G1": (12288, 10)}, deleting=True)
    got = victims.select_victims(v, used_by(a10, b10, cd), [a10, b10, cd], [], reqs(12288), OPTS, CFG)
    assert [h.uid for h in got or []] == ["c"]
    # reprieve: evicting b alone is enough when 8192 MiB are asked
    got = victims.select_victims(v, used_by(a, b, c), [a, b, c], [], reqs(8192), OPTS, CFG)
    assert [h.uid for h in got or []] == ["b"]
    # nothing to evict helps: too large for any GPU, or the space is held by pods not evictable
    assert victims.select_victims(v, used_by(a, b, c), [a, b, c], [], reqs(20000), OPTS, CFG) is None
    assert victims.select_victims(v, used_by(a, b, c), [a], [], reqs(12288), OPTS, CFG) is None
    # fits already: no GPU victim; a victim kube-scheduler needs for another resource stays
    cpu = holder("cpu-hog", 50, "", {})
    assert victims.select_victims(v, used_by(a, c), [a, c], [], reqs(4096), OPTS, CFG) is None
    got = victims.select_victims(v, used_by(a, c), [a, c], [cpu], reqs(4096), OPTS, CFG)
    assert [h.uid for h in got or []] == ["cpu-hog"]
    # two GPUs asked: both must be cleared enough
    got = victims.select_victims(v, used_by(a, b, c), [a, b, c], [], reqs(8192, count=2), OPTS, CFG)
    assert sorted(h.uid for h in got or []) == ["b", "c"]
