"""State from the API: watch, terminated/terminating/deleted/init pods, restarts, 410 relists, dead plugins."""

from __future__ import annotations

import time
from typing import Any

from sim.kubeapi import KubeAPI, pod_object
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.support.http import post_ok
from tests.support.inventory import uuid
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import (
    GiB,
    MiB,
    api_usage,
    gpu_node,
    running_scheduler,
    start_scheduler,
    state_usage,
    vgpu_pod,
)
from vgpu import scheduling as sc
from vgpu_scheduler import snapshot


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
    post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["n1", "n2"]})
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
        out = post_ok(
            s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["dead", "stale", "live", "bad", "none"]}
        )
        assert out["NodeNames"] == ["live"]
        out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["dead", "stale", "bad", "none"]})
        assert out["NodeNames"] == []
        un = out["FailedAndUnresolvableNodes"]
        assert "device plugin not registered" in un["dead"]
        assert "stale" in un["stale"]
        assert "invalid inventory" in un["bad"]
        assert "no vGPU inventory" in un["none"]


def _pod(uid: str, rv: int, node: str = "n1", mem: int = 1024, phase: str = "Pending") -> dict[str, Any]:
    d = sc.Decision(
        node=node,
        time=0,
        containers=[
            sc.ContainerDecision(name="main", gpus=[sc.GPUAssignment(uuid=uuid(node, 0), memory=mem * MiB, cores=10)])
        ],
    )
    return {
        "metadata": {
            "uid": uid,
            "name": uid,
            "namespace": "default",
            "resourceVersion": str(rv),
            "annotations": {sc.DECISION_ANNOTATION: sc.encode(d)},
        },
        "spec": {},
        "status": {"phase": phase},
    }


def test_ordering_of_watch_events_answers_and_lists() -> None:
    from vgpu_scheduler.config import SchedulerConfig
    from vgpu_scheduler.state import ClusterState

    st = ClusterState(SchedulerConfig())
    g = uuid("n1", 0)
    st.apply_pod(_pod("a", 10, mem=1000))
    st.apply_pod(_pod("a", 9, mem=9000))  # a late, older event: ignored
    assert st.usage["n1"][g].memory == 1000 * MiB
    # a reservation (the filter's choice, not written yet) survives newer versions of its pod
    # (a label change, a status update): bind has not written it yet
    d2000 = sc.decode_decision(_pod("b", 0, mem=2000)["metadata"]["annotations"][sc.DECISION_ANNOTATION])
    with st.lock:
        st.reserve(_pod("a", 10), d2000)
    st.apply_pod(_pod("a", 11, mem=1000))
    assert st.usage["n1"][g].memory == 2000 * MiB
    # the version bind wrote (its decision) takes the reservation's place; nothing is counted twice
    written = _pod("a", 12, mem=2000)
    st.apply_pod(written)
    assert st.reservations == {} and st.usage["n1"][g].memory == 2000 * MiB
    with st.lock:
        st.reserve(_pod("a", 12), d2000)
        st.release("a")  # its bind failed for good
    assert st.usage["n1"][g].memory == 2000 * MiB  # what the API holds
    # deleted, then a late patch answer of the same pod: stays deleted
    st.apply_pod(_pod("a", 14), deleted=True)
    st.apply_pod(_pod("a", 13))
    assert st.usage["n1"][g].memory == 0
    # a list taken at rv 20 while the watch applied newer things: c (rv 25) changed, d created, e deleted
    st.apply_pod(_pod("c", 25, mem=3000))
    st.apply_pod(_pod("d", 26, mem=500))
    st.apply_pod(_pod("e", 27), deleted=True)
    st.replace_pods([_pod("c", 15, mem=100), _pod("e", 14, mem=7000), _pod("f", 16, mem=50)], "20")
    assert sorted(st.pods) == ["c", "d", "f"]
    assert st.usage["n1"][g].memory == (3000 + 500 + 50) * MiB
    assert snapshot.drift_bytes(st.usage, st.recomputed()) == 0
    # a list without a version is the truth
    st.replace_pods([_pod("x", 1, mem=10)])
    assert sorted(st.pods) == ["x"] and st.usage["n1"][g].memory == 10 * MiB


def test_reservation_without_bind_expires_and_a_late_bind_rechecks() -> None:
    from vgpu_scheduler.config import SchedulerConfig
    from vgpu_scheduler.state import ClusterState

    now = [1000.0]
    st = ClusterState(SchedulerConfig(reservation_ttl_s=30), monotonic=lambda: now[0])
    g = uuid("n1", 0)
    d = sc.decode_decision(_pod("x", 0, mem=4000)["metadata"]["annotations"][sc.DECISION_ANNOTATION])
    p = _pod("a", 5)
    p["metadata"]["annotations"] = {}
    with st.lock:
        st.reserve(p, d)
    assert st.usage["n1"][g].memory == 4000 * MiB
    now[0] += 29
    with st.lock:
        st.expire()
    assert st.usage["n1"][g].memory == 4000 * MiB
    now[0] += 2  # no bind within 30 s: the GPUs are free for others
    with st.lock:
        st.expire()
    assert st.usage["n1"][g].memory == 0 and not st.reservations["a"].counted
    with st.lock:
        st.recount_reservation("a")  # a late bind found it still fits
    assert st.usage["n1"][g].memory == 4000 * MiB
    now[0] += 31
    with st.lock:
        st.expire()
        st.expire()
    now[0] += 31
    with st.lock:
        st.expire()
    assert "a" not in st.reservations and st.usage["n1"][g].memory == 0
    assert snapshot.drift_bytes(st.usage, st.recomputed()) == 0


def _used_node(rv: str, *slices: tuple[str, str, int]) -> dict[str, Any]:
    """Node n1 (one 16 GiB GPU, split 8) publishing slices (pod UID, container, MiB), at version rv."""
    node = gpu_node("n1", n=1, mem_gib=16, split=8)
    used = sc.NodeUsage(
        time=0,
        slices=[sc.UsedSlice(gpu=uuid("n1", 0), memory=m * MiB, cores=5, pod=p, container=c) for p, c, m in slices],
    )
    node["metadata"]["annotations"][sc.USAGE_ANNOTATION] = sc.encode(used)
    node["metadata"]["resourceVersion"] = rv
    return node


def _plain_pod(uid: str, rv: int, phase: str = "Running", **ann: str) -> dict[str, Any]:
    p = _pod(uid, rv, phase=phase)
    p["metadata"]["annotations"] = dict(ann)
    p["spec"] = {"nodeName": "n1"}
    return p


def test_slices_of_pods_not_known_count_until_the_pod_watch_passes_their_node_version() -> None:
    """A slice named with a pod UID the scheduler does not have: a pod its watch has not brought yet
    (counted) or one deleted before its list (not counted); told apart by resourceVersion."""
    from vgpu_scheduler.config import SchedulerConfig
    from vgpu_scheduler.state import UNKNOWN_POD_GRACE_S, ClusterState

    now = [1000.0]
    st = ClusterState(SchedulerConfig(), monotonic=lambda: now[0])
    g = uuid("n1", 0)

    def mem() -> int:
        assert snapshot.drift_bytes(st.usage, st.recomputed()) == 0
        return st.usage.get("n1", {}).get(g, sc.GPUUse()).memory // MiB

    st.replace_pods([], "40")  # the pod list (or watch) is at 40
    st.apply_node(_used_node("50", ("new", "main", 1000), ("gone", "main", 2000)))
    assert mem() == 3000  # published at 50 > 40: maybe pods the watch has not brought yet
    with st.lock:
        st.note_pod_rv("45")
    assert mem() == 3000
    st.apply_pod(_plain_pod("new", 48))  # the watch brings one of them ...
    with st.lock:
        st.note_pod_rv("50")  # ... and passes 50: the other was deleted before
    assert mem() == 1000
    # the known pod ends: its slices stop counting although the node still publishes them
    st.apply_pod(_plain_pod("new", 52, phase="Succeeded"))
    assert mem() == 0
    # published after the watch's position, then the pod is deleted (seen): not counted
    st.apply_node(_used_node("60", ("new", "main", 1000), ("late", "main", 500)))
    assert mem() == 500
    st.apply_pod(_plain_pod("late", 55))
    st.apply_pod(_plain_pod("late", 61), deleted=True)
    assert mem() == 0
    # a static pod: the kubelet names its slices with the static pod's UID, its mirror pod's
    # annotation carries it
    st.apply_node(_used_node("70", ("static-hash", "main", 700)))
    with st.lock:
        st.note_pod_rv("71")
    assert mem() == 0  # not known, watch past it
    st.apply_pod(_plain_pod("mirror-uid", 72, **{sc.MIRROR_ANNOTATION: "static-hash"}))
    assert mem() == 700
    # a relist at a version past the node's: unknown pods are gone, the mirror pod is kept
    st.apply_node(_used_node("80", ("static-hash", "main", 700), ("vanished", "main", 300)))
    assert mem() == 1000
    st.replace_pods([_plain_pod("mirror-uid", 72, **{sc.MIRROR_ANNOTATION: "static-hash"})], "85")
    assert mem() == 700
    # a resourceVersion that is not a number: UNKNOWN_POD_GRACE_S on this replica's clock
    st.apply_node(_used_node("x9", ("static-hash", "main", 700), ("odd", "main", 100)))
    assert mem() == 800
    now[0] += UNKNOWN_POD_GRACE_S - 1
    with st.lock:
        st.expire()
    assert mem() == 800
    now[0] += 2
    with st.lock:
        st.expire()
    assert mem() == 700


def test_an_init_and_an_app_container_published_on_one_vgpu_count_once() -> None:
    """An init container's slice and the app container's the kubelet gave its vGPU to: per GPU
    max(init, sum(app)), from the pod's spec even without a decision."""
    from vgpu_scheduler.config import SchedulerConfig
    from vgpu_scheduler.state import ClusterState

    st = ClusterState(SchedulerConfig())
    g = uuid("n1", 0)
    p = _plain_pod("job", 10)
    p["spec"]["initContainers"] = [{"name": "prep"}, {"name": "side", "restartPolicy": "Always"}]
    st.replace_pods([p], "10")
    st.apply_node(_used_node("11", ("job", "prep", 6000), ("job", "app", 2000), ("job", "side", 1000)))
    u = st.usage["n1"][g]
    # max(prep 6000, app 2000 + side 1000 (a sidecar runs beside the app)); cores max(5, 10); slots max(1, 2)
    assert (u.memory // MiB, u.cores, u.slots) == (6000, 10, 2)
    assert snapshot.drift_bytes(st.usage, st.recomputed()) == 0
