"""State from the API: watch, terminated/terminating/deleted/init pods, restarts, 410 relists, dead plugins."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from tests.scheduler.helpers import (
    GiB,
    MiB,
    api_usage,
    gpu_node,
    running_scheduler,
    start_scheduler,
    state_usage,
    uuid,
    vgpu_pod,
    wait_for,
)
from tests.support.kubeapi import KubeAPI, pod_object
from tests.support.kubescheduler import ExtenderConfig, KubeScheduler
from vgpu import scheduling as sc
from vgpu_scheduler import snapshot


def post(url: str, body: Any) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def schedule_all(ks: KubeScheduler, names: list[str]) -> dict[str, str]:
    return {n: ks.schedule_one("default", n).status for n in names}


def synced(s: Any, api: KubeAPI) -> None:
    wait_for(lambda: state_usage(s.service) == api_usage(api), what="scheduler usage == API usage")


def test_terminated_release_terminating_keep_deleted_release(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=8))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        for n in ("a", "b", "c", "d"):
            kubeapi.create("pods", vgpu_pod(n, mem=4096))
        assert set(schedule_all(ks, ["a", "b", "c", "d"]).values()) == {"Scheduled"}
        g = uuid("n1", 0)
        kubeapi.create("pods", vgpu_pod("e", mem=4096))
        assert ks.schedule_one("default", "e").status == "Unschedulable"  # 16 GiB full
        kubeapi.patch("pods", "a", {"status": {"phase": "Succeeded"}})
        kubeapi.patch("pods", "b", {"status": {"phase": "Failed"}})
        kubeapi.set_terminating("c")
        synced(s, kubeapi)
        assert s.service.state.usage["n1"][g].memory == 8 * GiB  # c (terminating) and d still hold
        kubeapi.delete("pods", "c")
        synced(s, kubeapi)
        assert s.service.state.usage["n1"][g].memory == 4 * GiB
        assert ks.schedule_one("default", "e").status == "Scheduled"


def test_init_container_usage_is_the_larger_of_init_and_apps(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=8))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create(
            "pods",
            pod_object(
                "p",
                [
                    ("a", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2000"}),
                    ("b", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}),
                ],
                init=[("i", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "9000", "nvidia.com/gpucores": "10"})],
                scheduler="vgpu-scheduler",
            ),
        )
        assert ks.schedule_one("default", "p").status == "Scheduled"
        synced(s, kubeapi)
        u = s.service.state.usage["n1"][uuid("n1", 0)]
        # memory: max(9000, 2000 + 3000); cores: max(10, 2 + 2 (1/K of 100 with K=8 = 12 each)) ; slots: max(1, 2)
        assert (u.memory, u.cores, u.slots) == (9000 * MiB, 24, 2)


def test_restart_mid_stream_loses_nothing(kubeapi: KubeAPI) -> None:
    for n in ("n1", "n2"):
        kubeapi.create("nodes", gpu_node(n, n=2, mem_gib=16, split=8))
    names = [f"p{i:02d}" for i in range(24)]
    for n in names:
        kubeapi.create("pods", vgpu_pod(n, mem=2500))
    s = start_scheduler(kubeapi)
    ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
    first = schedule_all(ks, names[:12])
    # a decision written by filter whose bind never came (the scheduler died in between)
    pod = kubeapi.get("pods", names[12])
    post(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["n1", "n2"]})
    s.stop()
    # while it is down: deletions, a failure, new pods
    kubeapi.delete("pods", names[0])
    kubeapi.delete("pods", names[1])
    kubeapi.patch("pods", names[2], {"status": {"phase": "Failed"}})
    s2 = start_scheduler(kubeapi)
    try:
        assert state_usage(s2.service) == api_usage(kubeapi)
        ks2 = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s2.url)])
        rest = schedule_all(ks2, names[12:])
        assert "Scheduled" in rest.values() and "Scheduled" in first.values()
        synced(s2, kubeapi)
        for node, gpus in api_usage(kubeapi).items():
            for mem, cores, slots in gpus.values():
                assert mem <= 16 * GiB and cores <= 100 and slots <= 8, node
        recs = [snapshot.pod_rec(p) for p in kubeapi.objects("pods")]
        assert snapshot.drift_bytes(s2.service.state.usage_copy(), snapshot.usage_of(recs)) == 0
    finally:
        s2.stop()


def test_watch_expiry_relists(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1"))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("a", mem=1000))
        assert ks.schedule_one("default", "a").status == "Scheduled"
        before = s.service.state.relists
        kubeapi.expire_history()
        kubeapi.create("pods", vgpu_pod("b", mem=1000))  # wakes the watches: they find their version gone
        wait_for(lambda: s.service.state.relists >= before + 2, what="relist after 410")
        kubeapi.delete("pods", "a")
        synced(s, kubeapi)
        assert ks.schedule_one("default", "b").status == "Scheduled"
        synced(s, kubeapi)


def test_node_whose_plugin_died_or_went_stale_offers_nothing(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("dead"))
    kubeapi.create("nodes", gpu_node("stale", heartbeat=time.time() - 600))
    kubeapi.create("nodes", gpu_node("live"))
    bad = gpu_node("bad")
    bad["metadata"]["annotations"][sc.INVENTORY_ANNOTATION] = '{"version": 1}'
    kubeapi.create("nodes", bad)
    kubeapi.create("nodes", gpu_node("none") | {"metadata": {"name": "none"}})
    pod = kubeapi.create("pods", vgpu_pod("p"))
    with running_scheduler(kubeapi) as s:
        kubeapi.patch("nodes", "dead", {"status": {"allocatable": {"nvidia.com/gpu": "0"}}})
        wait_for(lambda: s.service.state.nodes["dead"].allocatable == 0, what="node update")
        out = post(
            s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["dead", "stale", "live", "bad", "none"]}
        )
        assert out["NodeNames"] == ["live"]
        un = out["FailedAndUnresolvableNodes"]
        assert "device plugin not registered" in un["dead"]
        assert "stale" in un["stale"]
        assert "invalid inventory" in un["bad"]
        assert "no vGPU inventory" in un["none"]
