"""Preemption through the scheduler: a higher-priority pod blocked by GPU memory evicts exactly
the pods whose eviction lets it fit on one GPU, and the fewest of them (one larger pod rather than
two smaller); pods no node can hold today are created (the webhook's default), stay Pending with
the extender's reason and evict nobody (kube-scheduler alone evicted running vGPU pods again and
again for a pod that could never fit).

One node (VGPU_TEST_NODE, else the first whose GPUs are all free) is filled: on every GPU of
memory M a low-priority pod of M/4 and a medium-priority pod of the rest, each pinned to its GPU.
kube-scheduler's own dry run, counting the node's totals only, would evict the low-priority pods
(M/4 on each GPU: never enough on one GPU); the extender's preempt verb names one medium pod.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, MiB, Obj, decision, gpu_is_free
from vgpu import scheduling as sc
from vgpuctl import cluster as vcluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

WATCH_S = 20.0  # how long "nobody is evicted" is watched after the first FailedScheduling


@pytest.fixture(scope="module")
def priorities(cluster: Cluster) -> Iterator[dict[str, str]]:
    names = {level: f"{cluster.namespace}-{level}" for level in ("low", "mid", "high")}
    for level, value in (("low", 1000), ("mid", 2000), ("high", 100000)):
        cluster.create_priority_class(names[level], value)
    yield names


def _free_node(cluster: Cluster) -> tuple[str, list[vcluster.GPURow]]:
    v = cluster.view()
    want = cluster.settings.node
    for n in v.nodes:
        if n.problem or (want and n.name != want) or not n.gpus:
            continue
        if all(g.healthy and gpu_is_free(g) and g.slots >= 2 and g.cores >= 20 for g in n.gpus):
            return n.name, n.gpus
    pytest.skip(f"no vGPU node {want or ''} whose GPUs are all healthy, free and split in 2 or more")


def _fill(cluster: Cluster, pods: Pods, node: str, gpus: list[vcluster.GPURow], prio: dict[str, str]) -> dict[str, Obj]:
    """Every GPU full: `low-<i>` (M/4) and `mid-<i>` (the rest), 10 % compute each."""
    s = cluster.settings
    for g in gpus:
        m = g.memory // MiB
        pin = {sc.USE_GPUUUID_ANNOTATION: g.uuid}
        for name, size, pc in ((f"low-{g.index}", m // 4, "low"), (f"mid-{g.index}", m - m // 4, "mid")):
            limits = {s.resource: "1", sc.RESOURCE_MEM: str(size), sc.RESOURCE_CORES: "10"}
            pods.create(name, limits, annotations=pin, node=node, priority_class=prio[pc])
    out = {}
    for g in gpus:
        for name in (f"low-{g.index}", f"mid-{g.index}"):
            p = cluster.wait_running(name)
            d = decision(p)
            assert d is not None and [gg.uuid for gg in d.containers[0].gpus] == [g.uuid], cluster.describe(name)
            out[name] = p
    return out


def _evicted(cluster: Cluster, filled: dict[str, Obj]) -> list[str]:
    """Fill pods that are gone, replaced, or being deleted."""
    out = []
    for name, before in sorted(filled.items()):
        now = cluster.pod(name)
        if (
            now is None
            or now["metadata"]["uid"] != before["metadata"]["uid"]
            or now["metadata"].get("deletionTimestamp")
        ):
            out.append(name)
    return out


def _oversized(cluster: Cluster) -> dict[str, dict[str, str]]:
    """Pods no node of the cluster can hold today: more memory than any GPU has, more GPUs than
    any node has."""
    s = cluster.settings
    v = cluster.view()
    biggest = max(g.memory for n in v.nodes for g in n.gpus) // MiB
    most = max(len(n.gpus) for n in v.nodes if n.gpus)
    return {
        "huge": {s.resource: "1", sc.RESOURCE_MEM: str(biggest + 4096), sc.RESOURCE_CORES: "10"},
        "wide": {s.resource: str(most + 1), sc.RESOURCE_MEM: "1024", sc.RESOURCE_CORES: "10"},
    }


def test_pods_no_node_can_hold_today_stay_pending_and_evict_nobody(
    cluster: Cluster, pods: Pods, priorities: dict[str, str]
) -> None:
    """More memory than any GPU, more GPUs than any node, at the highest priority, through the
    webhook: created (an autoscaler adds nodes only for Pending pods), Pending with the
    extender's reason, and once the node is full still evicting nobody (the preempt verb leaves
    the node out). With VGPU_TEST_REFUSE_OVERSIZED=1 (the chart's
    scheduler.webhook.refuseOversized) the webhook refuses them with the reason instead."""
    node, gpus = _free_node(cluster)
    wanted = _oversized(cluster)
    if cluster.settings.refuse_oversized:
        from kubernetes.client.rest import ApiException

        for name, limits in wanted.items():
            with pytest.raises(ApiException) as e:
                pods.create(name, limits, node=node, priority_class=priorities["high"])
            assert "no GPU has more than" in str(e.value.body) or "no node offers more than" in str(e.value.body)
        return
    for name, limits in wanted.items():
        pods.create(name, limits, node=node, priority_class=priorities["high"])
    # Pending with the extender's reason: the GPU too small even empty, or too few GPUs.
    reasons = {name: cluster.wait_failed_scheduling(name) for name in wanted}
    assert any("never fits this node" in m and "MiB asked" in m for m in reasons["huge"]), reasons["huge"]
    assert any(f"GPU(s) < {wanted['wide'][cluster.settings.resource]} asked" in m for m in reasons["wide"]), reasons
    for name in wanted:
        cond = cluster.condition(name)
        assert cond.get("status") == "False" and cond.get("reason") == "Unschedulable", cond
        assert "%" not in (cond.get("message") or ""), cond
    # Now every GPU of the node full of lower-priority pods: kube-scheduler's own filters fail on
    # the node's totals, its dry run proposes victims, the extender's preempt verb leaves the node
    # out. Nobody is evicted, ever.
    filled = _fill(cluster, pods, node, gpus, priorities)
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        assert _evicted(cluster, filled) == [], [cluster.describe(n) for n in wanted]
        time.sleep(1.0)
    for name in wanted:
        p = cluster.pod(name)
        assert p is not None and not p["spec"].get("nodeName"), cluster.describe(name)
        assert not p["status"].get("nominatedNodeName"), cluster.describe(name)
        assert all("%!" not in m for m in cluster.events(name, "FailedScheduling")), cluster.describe(name)


def test_a_pod_blocked_by_gpu_memory_evicts_exactly_the_victims_that_help(
    cluster: Cluster, pods: Pods, priorities: dict[str, str]
) -> None:
    s = cluster.settings
    node, gpus = _free_node(cluster)
    small = min(g.memory for g in gpus) // MiB
    ask = small // 2
    if any(g.memory // MiB // 4 >= ask for g in gpus):
        pytest.skip("the node's GPUs differ too much in size for this scenario")
    filled = _fill(cluster, pods, node, gpus, priorities)
    limits = {s.resource: "1", sc.RESOURCE_MEM: str(ask), sc.RESOURCE_CORES: "10"}
    pods.create("preemptor", limits, node=node, priority_class=priorities["high"])
    p = cluster.wait_running("preemptor")
    d = decision(p)
    assert d is not None
    [uuid] = [g.uuid for g in d.containers[0].gpus]
    [index] = [g.index for g in gpus if g.uuid == uuid]
    # Exactly one pod was evicted: the medium one of the GPU the preemptor got. Every low-priority
    # pod (M/4: evicting it never makes room for M/2) still runs.
    assert _evicted(cluster, filled) == [f"mid-{index}"], [cluster.describe(n) for n in filled]


def test_one_larger_pod_is_evicted_rather_than_two_smaller(
    cluster: Cluster, pods: Pods, priorities: dict[str, str]
) -> None:
    """Two GPUs of memory M (split 4 or more), every byte taken by low-priority pods pinned to them:
    GPU 0 holds M/2 (started first), M/4, M/8 and M/8, GPU 1 four pods of M/4 (any other GPU of the
    node is filled by one medium-priority pod). A high-priority pod of M/2 evicts exactly the M/2
    pod of GPU 0 and runs there: one pod, where walking GPU 1 from its least important pods
    evicts two."""
    s = cluster.settings
    node, gpus = _free_node(cluster)
    m = gpus[0].memory // MiB
    pair = [g for g in gpus if g.memory // MiB == m][:2]
    if len(pair) < 2 or any(g.slots < 4 for g in pair) or m % 8:
        pytest.skip("needs a node with two GPUs of one size (a multiple of 8 MiB), split 4 or more")
    g0, g1 = pair
    sizes = {g0.uuid: [m // 2, m // 4, m // 8, m // 8], g1.uuid: [m // 4] * 4}
    filled: dict[str, Obj] = {}
    for g in (g0, g1):
        for i, size in enumerate(sizes[g.uuid]):
            name = f"g{g.index}-{i}"
            limits = {s.resource: "1", sc.RESOURCE_MEM: str(size), sc.RESOURCE_CORES: "10"}
            pin = {sc.USE_GPUUUID_ANNOTATION: g.uuid}
            pods.create(name, limits, annotations=pin, node=node, priority_class=priorities["low"])
            filled[name] = cluster.wait_running(name)  # one after the other: the first started first
    for g in gpus:
        if g.uuid in sizes:
            continue
        name = f"other-{g.index}"
        limits = {s.resource: "1", sc.RESOURCE_MEM: str(g.memory // MiB), sc.RESOURCE_CORES: "10"}
        pin = {sc.USE_GPUUUID_ANNOTATION: g.uuid}
        pods.create(name, limits, annotations=pin, node=node, priority_class=priorities["mid"])
        filled[name] = cluster.wait_running(name)
    limits = {s.resource: "1", sc.RESOURCE_MEM: str(m // 2), sc.RESOURCE_CORES: "10"}
    pods.create("preemptor", limits, node=node, priority_class=priorities["high"])
    p = cluster.wait_running("preemptor")
    d = decision(p)
    assert d is not None and [g.uuid for g in d.containers[0].gpus] == [g0.uuid], cluster.describe("preemptor")
    assert _evicted(cluster, filled) == [f"g{g0.index}-0"], [cluster.describe(n) for n in filled]
