"""vGPU pods through the scheduler: what each container sees, sizes by memory and compute (3000 MiB
is stored by the API server as "3k"), and two pods that do not fit one GPU together."""

from __future__ import annotations

import re

import pytest

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, MiB, Obj, decision, gpu_is_free, limits_of, offered_gpus
from vgpu import scheduling as sc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _devices(seen: Obj, api: str) -> list[tuple[str, int]]:
    v = seen[api]
    assert not v["error"], f"{api}: {v['error']}"
    assert all(not d["error"] for d in v["devices"]), v
    return [(d["uuid"], d["total"]) for d in v["devices"]]


def _sees_exactly(seen: Obj, uuid: str, memory: int) -> None:
    """Both CUDA and NVML (through libvgpu.so) show one GPU, the decided one, of the decided size."""
    assert _devices(seen, "cuda") == [(uuid, memory)], seen
    assert _devices(seen, "nvml") == [(uuid, memory)], seen


def _shown(cluster: Cluster, node: str, uuid: str, memory: int) -> int:
    """The total a container is shown for a slice of `memory` bytes: the slice, but never more than
    the GPU's own memory (memory scaling S > 1 makes slices larger than the GPU possible;
    docs/operators/virtual-memory.md, "What programs see")."""
    text = (cluster.node(node)["metadata"].get("annotations") or {}).get(sc.INVENTORY_ANNOTATION)
    assert text, f"{node}: no {sc.INVENTORY_ANNOTATION}"
    [gpu] = [g for g in sc.decode_inventory(text).gpus if g.uuid == uuid]
    return min(memory, gpu.memory)


def _one_gpu(pod: Obj) -> tuple[str, str, int, int]:
    d = decision(pod)
    assert d is not None, f"no {sc.DECISION_ANNOTATION} on {pod['metadata']['name']}"
    assert d.node == pod["spec"]["nodeName"]
    [c] = d.containers
    [g] = c.gpus
    return d.node, g.uuid, g.memory, g.cores


def test_a_vgpu_pod_sees_its_slice(cluster: Cluster, pods: Pods) -> None:
    """`nvidia.com/gpu: 1` alone: one vGPU, 1/K of the GPU the scheduler chose (the chart's default
    defaultGpumemMiB 0), and the container sees exactly that GPU and that size."""
    s = cluster.settings
    if not [g for _n, g in offered_gpus(cluster.view()) if g.slots_allocated < g.slots]:
        pytest.skip("no GPU with a free vGPU slot")
    pods.create("one-vgpu", {s.resource: "1"})
    p = cluster.wait_running("one-vgpu")
    assert p["spec"]["schedulerName"] == s.scheduler_name  # the webhook sent it to our scheduler
    node, uuid, memory, cores = _one_gpu(p)
    [row] = [g for n, g in offered_gpus(cluster.view()) if n == node and g.uuid == uuid]
    assert memory == row.memory // row.slots and cores == row.cores // row.slots
    _sees_exactly(cluster.seen("one-vgpu"), uuid, memory)


def test_gpumem_and_gpucores_through_the_scheduler(cluster: Cluster, pods: Pods) -> None:
    """3000 MiB and 30 %: the API server stores "3k", the scheduler decides 3000 MiB, the container
    sees 3000 MiB."""
    s = cluster.settings
    fits = [g for _n, g in offered_gpus(cluster.view()) if g.memory_free >= 3000 * MiB and g.cores_free >= 30]
    if not fits:
        pytest.skip("no GPU with 3000 MiB and 30 % free")
    pods.create("sized", {s.resource: "1", sc.RESOURCE_MEM: "3000", sc.RESOURCE_CORES: "30"})
    p = cluster.wait_running("sized")
    assert limits_of(p)[sc.RESOURCE_MEM] == "3k"  # what kube-apiserver stored
    _node, uuid, memory, cores = _one_gpu(p)
    assert (memory, cores) == (3000 * MiB, 30)
    _sees_exactly(cluster.seen("sized"), uuid, 3000 * MiB)


def test_two_pods_too_big_for_one_gpu_spread(cluster: Cluster, pods: Pods) -> None:
    """Each asks more than half of the largest free GPU: they land on two different GPUs."""
    s = cluster.settings
    free = [g for _n, g in offered_gpus(cluster.view()) if g.slots_allocated < g.slots]
    ask = max((g.memory_free for g in free), default=0) // MiB // 2 + 1
    if len([g for g in free if g.memory_free >= ask * MiB]) < 2:
        pytest.skip(f"fewer than two GPUs with {ask} MiB free")
    for name in ("half-a", "half-b"):
        pods.create(name, {s.resource: "1", sc.RESOURCE_MEM: str(ask)})
    got = []
    for name in ("half-a", "half-b"):
        node, uuid, memory, _cores = _one_gpu(cluster.wait_running(name))
        assert memory == ask * MiB
        _sees_exactly(cluster.seen(name), uuid, _shown(cluster, node, uuid, ask * MiB))
        got.append(uuid)
    assert got[0] != got[1]


def test_two_pods_over_one_gpus_memory_wait_with_the_reason(cluster: Cluster, pods: Pods) -> None:
    """Both pinned to one GPU (`vgpu.k8s.io/use-gpuuuid`), each asking more than half of it: the
    second stays Pending, its FailedScheduling event says why, and it runs once the first is gone."""
    s = cluster.settings
    free = [(n, g) for n, g in offered_gpus(cluster.view()) if gpu_is_free(g) and g.slots >= 2]
    if not free:
        pytest.skip("no free GPU with two vGPU slots")
    node, gpu = max(free, key=lambda ng: ng[1].memory)
    ask = gpu.memory // MiB // 2 + 1
    pin = {sc.USE_GPUUUID_ANNOTATION: gpu.uuid}
    pods.create("first", {s.resource: "1", sc.RESOURCE_MEM: str(ask)}, annotations=pin, node=node)
    _n, uuid, _m, _c = _one_gpu(cluster.wait_running("first"))
    assert uuid == gpu.uuid
    pods.create("second", {s.resource: "1", sc.RESOURCE_MEM: str(ask)}, annotations=pin, node=node)
    messages = cluster.wait_failed_scheduling("second")
    # The extender's reason (the GPU, what is free, what was asked), or kube-scheduler's own count
    # of the node's GPU memory where the node has no other GPU.
    want = re.compile(rf"{re.escape(gpu.uuid)}: \d+ MiB free < {ask} MiB asked|Insufficient vgpu\.k8s\.io/gpumem-total")
    assert any(want.search(m) for m in messages), messages
    cluster.delete_pod("first")
    _n, uuid, _m, _c = _one_gpu(cluster.wait_running("second"))
    assert uuid == gpu.uuid
    _sees_exactly(cluster.seen("second"), gpu.uuid, _shown(cluster, node, gpu.uuid, ask * MiB))


def test_the_charts_helm_test_pod_passes(cluster: Cluster, pods: Pods) -> None:
    """The chart's `helm test` hook (templates/tests/slice-test.yaml), rendered for this cluster and
    run in the test namespace: it succeeds, having seen exactly its 3000 MiB."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart (make venv)")
    from tests.support.helm import CHART
    from tests.support.k8svalidate import load_all

    s = cluster.settings
    if not [g for _n, g in offered_gpus(cluster.view()) if g.memory_free >= 3000 * MiB]:
        pytest.skip("no GPU with 3000 MiB free")
    repo, _, tag = s.image.rpartition(":")
    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": s.pull_policy},
        "resourceName": s.resource,
        "runtimeClass": {"name": s.runtime_class or "vgpu"},
        "helmTest": {"runtimeClassName": s.runtime_class},
        "scheduler": {"enabled": True, "name": s.scheduler_name},
    }
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="k8s-vgpu", namespace=cluster.namespace)
    [pod] = [o for p, t in manifests.items() if p.endswith(".yaml") for o in load_all(t) if o["kind"] == "Pod"]
    if not s.runtime_class:
        pod["spec"].pop("runtimeClassName", None)
    if s.host_network:
        pod["spec"]["hostNetwork"] = True
    pods.create_body(pod)
    name = pod["metadata"]["name"]
    done = cluster.wait_finished(name)
    assert done["status"]["phase"] == "Succeeded", cluster.describe(name) + "\n" + cluster.logs(name)
    _n, uuid, memory, _c = _one_gpu(done)
    assert memory == 3000 * MiB
    _sees_exactly(cluster.seen(name), uuid, 3000 * MiB)
