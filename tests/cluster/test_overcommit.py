"""No GPU is over-committed by a slice no decision names (issue 15, problem 4): a vGPU pod placed
by default-scheduler (or before vgpu-scheduler was installed) holds 1/K of a GPU that the
scheduler must count, so the rest of that GPU is all it may give away."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, MiB, decision, gpu_is_free, offered_gpus, wait
from vgpu import scheduling as sc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def test_a_default_scheduler_pods_slice_is_counted(cluster: Cluster, pods: Pods) -> None:
    s = cluster.settings
    free = [(n, g) for n, g in offered_gpus(cluster.view()) if gpu_is_free(g) and g.slots >= 2]
    if s.node:
        free = [(n, g) for n, g in free if n == s.node]
    if not free:
        pytest.skip("no free GPU with two vGPU slots")
    node = free[0][0]
    # Placed by default-scheduler: the webhook never sees it (opt-out label), no decision.
    pods.create(
        "classic",
        {s.resource: "1"},
        labels={"vgpu.k8s.io/webhook": "ignore"},
        scheduler_name="default-scheduler",
        node=node,
    )
    p = cluster.wait_running("classic")
    assert p["spec"]["schedulerName"] == "default-scheduler" and decision(p) is None
    [(uuid, held)] = [(d["uuid"], d["total"]) for d in cluster.seen("classic")["cuda"]["devices"]]
    [gpu] = [g for n, g in offered_gpus(cluster.view()) if n == node and g.uuid == uuid]
    assert held == gpu.memory // gpu.slots  # its 1/K

    # The cluster's accounting (what vgpuctl cluster and the scheduler count) includes it.
    def counted() -> bool:
        [g] = [g for n, g in offered_gpus(cluster.view()) if n == node and g.uuid == uuid]
        return g.memory_allocated >= held

    wait(counted, 60, f"the slice of the default-scheduler pod ({held // MiB} MiB on {uuid}) to be counted")
    rest = (gpu.memory - held) // MiB
    pin = {sc.USE_GPUUUID_ANNOTATION: uuid}
    pods.create("one-too-many", {s.resource: "1", sc.RESOURCE_MEM: str(rest + 1)}, annotations=pin, node=node)
    messages = cluster.wait_failed_scheduling("one-too-many")
    assert any(f"{uuid}: {rest} MiB free < {rest + 1} MiB asked" in m for m in messages), messages
    pods.create("the-rest", {s.resource: "1", sc.RESOURCE_MEM: str(rest)}, annotations=pin, node=node)
    p = cluster.wait_running("the-rest")
    d = decision(p)
    assert d is not None and [(g.uuid, g.memory) for g in d.containers[0].gpus] == [(uuid, rest * MiB)]
    assert [(x["uuid"], x["total"]) for x in cluster.seen("the-rest")["cuda"]["devices"]] == [(uuid, rest * MiB)]
    # The GPU now holds exactly its memory, and the pod that asked one MiB more still waits.
    assert held + rest * MiB <= gpu.memory
    late = cluster.pod("one-too-many")
    assert late is not None and not late["spec"].get("nodeName"), cluster.describe("one-too-many")
