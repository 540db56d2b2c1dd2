"""What the node handed out (`vgpu.k8s.io/node-usage`) and its node-level totals in the Node's
status: from the plugin's allocation records, through the kubelet stand-in (real gRPC) and the
Kubernetes API stand-in (real HTTP, the kubernetes client unmodified)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from device_plugin import usage
from tests.plugin.conftest import GiB, InProc
from tests.plugin.test_decision import GPUS, NODE, U0, U1, add_pod, api  # noqa: F401 - the `api` fixture
from tests.support.kubeapi import KubeAPI, pod_object
from tests.support.kubelet import FakeKubelet
from vgpu import scheduling
from vgpu.schemas import AllocatedGPU, AllocationRecord

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def rec(token: str, created: float, *gpus: tuple[str, int, int, list[str]]) -> AllocationRecord:
    return AllocationRecord(
        token=token * 32,
        created=created,
        gpus=[AllocatedGPU(uuid=u, memory_limit=m, core_percent=c, vgpu_ids=ids) for u, m, c, ids in gpus],
    )


def test_one_slice_per_slot_the_newest_record_owns_it() -> None:
    recs = [
        rec("a", 1, (U0, 12 * GiB, 75, [f"{U0}::0", f"{U0}::1", f"{U0}::2"])),  # n x 1/K: 3 slots
        rec("b", 2, (U1, 3 * GiB, 30, [f"{U1}::0"])),  # an init container's record ...
        rec("c", 3, (U1, 5 * GiB, 40, [f"{U1}::0"])),  # ... whose slot the app container reuses
        rec("d", 4, (U1, 1 * GiB, 10, [])),  # no IDs (an older record form): counts once
    ]
    tags = {"c" * 32: ("pod-uid", "app")}
    got = [(s.gpu, s.memory, s.cores, s.pod, s.container) for s in usage.slices(recs, tags)]
    assert got == [
        (U0, 4 * GiB, 25, "", ""),
        (U0, 4 * GiB, 25, "", ""),
        (U0, 4 * GiB, 25, "", ""),
        (U1, 5 * GiB, 40, "pod-uid", "app"),
        (U1, 1 * GiB, 10, "", ""),
    ]
    # The scheduler's arithmetic over it: every slice once, the decided pod's own container once.
    d = scheduling.Decision(
        node=NODE,
        time=0,
        containers=[
            scheduling.ContainerDecision(
                name="app", gpus=[scheduling.GPUAssignment(uuid=U1, memory=5 * GiB, cores=40)]
            ),
            scheduling.ContainerDecision(
                name="side", gpus=[scheduling.GPUAssignment(uuid=U1, memory=2 * GiB, cores=5)]
            ),
        ],
    )
    per = scheduling.node_usage(usage.slices(recs, tags), {"pod-uid": d}, {"pod-uid": True})
    assert (per[U0].memory, per[U0].cores, per[U0].slots) == (12 * GiB, 75, 3)
    assert (per[U1].memory, per[U1].cores, per[U1].slots) == (8 * GiB, 55, 3)  # 5 + 1 published, 2 decided
    # a deleted (or finished) pod's tagged slice no longer holds; an untagged one does until collected
    per = scheduling.node_usage(usage.slices(recs, tags), {}, {})
    assert per[U1].memory == 1 * GiB


def node_usage_of(kube: KubeAPI) -> scheduling.NodeUsage | None:
    text = kube.get("nodes", NODE)["metadata"].get("annotations", {}).get(scheduling.USAGE_ANNOTATION)
    return scheduling.decode_usage(text) if text else None


def wait(cond: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_published_on_allocate_tagged_by_decision_collected_and_rebuilt(
    api: KubeAPI,  # noqa: F811 - the fixture
    kubelet: FakeKubelet,
    inproc: Callable[..., InProc],
) -> None:
    def start() -> InProc:
        p = inproc(gpus=GPUS, device_split_count=4, node_name=NODE, record_gc_grace_s=0.0, record_gc_interval_s=0.2)
        kubelet.wait_endpoint()
        return p

    p = start()
    # node-level totals in the Node's status, for kube-scheduler's own fit
    want = {scheduling.RESOURCE_NODE_MEM: "32768", scheduling.RESOURCE_NODE_CORES: "200"}

    def status_ok() -> bool:
        st = api.get("nodes", NODE)["status"]
        return all(st["capacity"].get(k) == v and st["allocatable"].get(k) == v for k, v in want.items())

    wait(status_ok, "the node-level totals in the Node's status")
    assert api.get("nodes", NODE)["status"]["allocatable"]["nvidia.com/gpu"] == "8"  # the kubelet's own kept
    # a decided pod and a pod without a decision (another scheduler's)
    add_pod(api, "decided", [("main", False, [(U1, 3000 * MiB, 30)])])
    api.create("pods", pod_object("other", [("main", {"nvidia.com/gpu": "1"})]))
    kubelet.admit("default", "decided", "main")
    kubelet.admit("default", "other", "main")
    uid = api.get("pods", "decided")["metadata"]["uid"]

    def two() -> scheduling.NodeUsage | None:
        u = node_usage_of(api)
        return u if u is not None and len(u.slices) == 2 else None

    u = wait(two, "both slices published")
    got = sorted((s.gpu, s.memory, s.cores, s.pod, s.container) for s in u.slices)
    assert (U1, 3000 * MiB, 30, uid, "main") in got
    assert [x for x in got if x[3] == ""] and all(x[1] == 4 * GiB for x in got if x[3] == "")  # 1/K of 16 GiB
    # a burst of Allocates is one write, not one per container (USAGE_INTERVAL_S)
    usage_patches = [r for r in api.requests if r[0] == "PATCH" and r[1] == f"/api/v1/nodes/{NODE}"]
    assert len(usage_patches) <= 4
    # restart: the tags come back from the pods' `allocated` lists
    p.stop()
    api.patch("nodes", NODE, {"metadata": {"annotations": {scheduling.USAGE_ANNOTATION: None}}})
    p = start()
    u = wait(two, "republished after the restart")
    assert sorted(s.pod for s in u.slices) == ["", uid]
    # the pods end: the collector removes their records, the annotation follows
    kubelet.release("default", "decided")
    kubelet.release("default", "other")
    wait(lambda: (x := node_usage_of(api)) is not None and x.slices == [], "the records collected")
    assert os.listdir(p.state.allocations_dir) == []
    p.stop()
