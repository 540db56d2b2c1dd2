"""Preemption through the scheduler: a higher-priority pod blocked by GPU memory evicts exactly
the pods whose eviction lets it fit on one GPU; a pod that no GPU of the node could hold, even
empty, evicts nobody (kube-scheduler alone, counting node totals, would evict running vGPU pods
again and again for a pod that can never fit).

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


def test_a_pod_no_gpu_could_hold_evicts_nobody(cluster: Cluster, pods: Pods, priorities: dict[str, str]) -> None:
    """More memory than any GPU of the node has, at the highest priority. The webhook would refuse
    a size no GPU in the cluster has, so this pod skips it (`vgpu.k8s.io/webhook: ignore`, its own
    schedulerName), as a pod created while the webhook was not installed would."""
    s = cluster.settings
    node, gpus = _free_node(cluster)
    filled = _fill(cluster, pods, node, gpus, priorities)
    too_big = max(g.memory for g in gpus) // MiB + 1024
    limits = {s.resource: "1", sc.RESOURCE_MEM: str(too_big), sc.RESOURCE_CORES: "10"}
    pods.create(
        "impossible",
        limits,
        labels={"vgpu.k8s.io/webhook": "ignore"},
        scheduler_name=s.scheduler_name,
        node=node,
        priority_class=priorities["high"],
    )
    cluster.wait_failed_scheduling("impossible")
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        assert _evicted(cluster, filled) == [], cluster.describe("impossible")
        time.sleep(1.0)
    p = cluster.pod("impossible")
    assert p is not None and not p["spec"].get("nodeName")
    assert not p["status"].get("nominatedNodeName"), cluster.describe("impossible")


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
