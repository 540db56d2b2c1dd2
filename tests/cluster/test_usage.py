"""One truth for usage: a vGPU pod placed by default-scheduler (or before
vgpu-scheduler was installed) holds 1/K of a GPU that the scheduler must count, so the rest of that
GPU is all it may give away; and once that pod is gone, its slice must stop counting, or the GPU
stays partly taken by nobody.

This file runs after the others that need free GPUs (test_preemption, test_slices): a slice that
is released late would make them skip."""

from __future__ import annotations

import os
import time

import pytest

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, MiB, decision, gpu_is_free, offered_gpus, wait
from vgpu import scheduling as sc
from vgpuctl import cluster as vcluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]


RELEASE_S = float(os.environ.get("VGPU_TEST_RELEASE_S", "420"))  # record_gc_grace_s (300) + 2 min


def _classic_pod(cluster: Cluster, pods: Pods) -> tuple[str, str, int, vcluster.GPURow]:
    """A vGPU pod placed by default-scheduler on a node with a free GPU: the webhook never sees it
    (opt-out label), it has no decision, the device plugin gives it 1/K. Once the cluster's
    accounting (what vgpuctl cluster and the scheduler count) includes it: (node, GPU, bytes, row)."""
    s = cluster.settings
    free = [(n, g) for n, g in offered_gpus(cluster.view()) if gpu_is_free(g) and g.slots >= 2]
    if s.node:
        free = [(n, g) for n, g in free if n == s.node]
    if not free:
        pytest.skip("no free GPU with two vGPU slots")
    node = free[0][0]
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

    def counted() -> bool:
        [g] = [g for n, g in offered_gpus(cluster.view()) if n == node and g.uuid == uuid]
        return g.memory_allocated >= held

    wait(counted, 60, f"the slice of the default-scheduler pod ({held // MiB} MiB on {uuid}) to be counted")
    return node, uuid, held, gpu


def test_a_default_scheduler_pods_slice_is_counted(cluster: Cluster, pods: Pods) -> None:
    s = cluster.settings
    node, uuid, held, gpu = _classic_pod(cluster, pods)
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


def test_a_deleted_default_scheduler_pods_slice_is_released(cluster: Cluster, pods: Pods) -> None:
    """Deleted, with nothing else allocated on the node meanwhile, its slice stops counting (within
    `VGPU_TEST_RELEASE_S`, record_gc_grace_s + 2 min by default, a bound and not a target).

    Found on the real cluster before usage followed pods: the device plugin published an untagged
    slice for every allocation record, and the kubelet drops a deleted pod's entries from its
    device checkpoint only in UpdateAllocatedDevices (pkg/kubelet/cm/devicemanager/manager.go), at
    its next Allocate on the node; until then the GPU stayed partly taken by nobody. Every published
    slice now names its pod (from the kubelet checkpoint), and a deleted pod's slice stops counting
    as soon as the pod watch sees it gone, although its record stays (docs/developers/scheduler.md, "Usage
    accounting: one truth"). On the real cluster it was released 0 s after the pod was gone."""
    node, uuid, held, _gpu = _classic_pod(cluster, pods)
    pods.cleanup()  # the pod is gone from the API (its containers stopped)
    t0 = time.monotonic()

    def released() -> bool:
        [g] = [g for n, g in offered_gpus(cluster.view()) if n == node and g.uuid == uuid]
        return g.memory_allocated == 0

    wait(
        released,
        RELEASE_S,
        f"the slice of the deleted default-scheduler pod ({held // MiB} MiB on {uuid}) to stop counting",
        every=5.0,
    )
    print(f"released {time.monotonic() - t0:.0f} s after the pod was gone")
