"""The device plugin honours scheduler decisions (vgpu/scheduling.py) in GetPreferredAllocation
and Allocate: through the kubelet stand-in (real gRPC over unix sockets) and the Kubernetes API
stand-in (sim/kubeapi.py, real HTTP, the kubernetes client unmodified)."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from device_plugin import decision, decisionpolicy
from nodecore.devices import DeviceTable, Slicing
from sim.kubeapi import KubeAPI, use_kubeconfig
from sim.kubelet import ContainerSpec, FakeKubelet
from tests.device_plugin.conftest import GPUS, NODE, U0, U1, GiB, InProc, add_pod
from vgpu import scheduling
from vgpu.scheduling import ContainerDecision, Decision
from vgpu.schemas import TOKEN_ENV, read_record

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def pod_ann(api: KubeAPI, name: str) -> dict[str, str]:
    out: dict[str, str] = api.get("pods", name, "default")["metadata"]["annotations"]
    return out


def pod_patches(api: KubeAPI) -> list[tuple[str, str, str]]:
    return [r for r in api.requests if r[0] == "PATCH" and "/pods/" in r[1]]


@pytest.fixture
def plugin(kubelet: FakeKubelet, inproc: Callable[..., InProc]) -> Callable[..., InProc]:
    def start(**cfg: Any) -> InProc:
        cfg.setdefault("device_split_count", 4)
        cfg.setdefault("node_name", NODE)
        p = inproc(gpus=GPUS, **cfg)
        kubelet.wait_endpoint()
        return p

    return start


def test_decision_sizes_the_record_and_completes_the_pod(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin()
    add_pod(api, "train", [("main", False, [(U1, 3072 * MiB, 30)])])
    a = kubelet.admit("default", "train", "main", count=1)
    # Spread alone would pick GPU 0 (all free, lowest index): the decision steered kubelet to GPU 1.
    assert a.preferred is not None and [d.rpartition("::")[0] for d in a.preferred] == [U1]
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == U1
    rec = read_record(p.state.allocation_record(a.envs[TOKEN_ENV]))
    [g] = rec.gpus
    assert (g.uuid, g.memory_limit, g.core_percent, g.vgpu_ids) == (U1, 3072 * MiB, 30, list(a.device_ids))
    assert g.device_limit == 3072 * MiB  # memory scaling 1: all of it may be on the GPU
    ann = pod_ann(api, "train")
    assert json.loads(ann[scheduling.ALLOCATED_ANNOTATION]) == ["main"]
    assert ann[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_SUCCESS
    patches = pod_patches(api)
    assert len(patches) == 1 and patches[0][2] == "application/merge-patch+json"
    lists = [r for r in api.requests if r[0] == "GET" and "/pods?" in r[1]]
    assert lists and all("fieldSelector=spec.nodeName%3Dnode-a" in r[1] for r in lists)
    # The next pod without a decision keeps today's n x 1/K.
    b = kubelet.admit("default", "plain", "main", count=1)
    g = read_record(p.state.allocation_record(b.envs[TOKEN_ENV])).gpus[0]
    assert (g.memory_limit, g.core_percent) == (4 * GiB, 25)


def test_init_then_app_containers_in_order(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    """The kubelet allocates the init container first and gives its vGPU to the app container
    (must-include in the app's GetPreferredAllocation): each gets its own decided slice."""
    p = plugin()
    add_pod(
        api,
        "job",
        [
            ("prep", True, [(U0, 1024 * MiB, 10)]),
            ("main", False, [(U0, 5000 * MiB, 40), (U1, 6000 * MiB, 50)]),
        ],
    )
    allocs = kubelet.admit_pod("default", "job", [ContainerSpec("main", 2)], [ContainerSpec("prep", 1)])
    a, b = allocs["prep"], allocs["main"]
    assert a.device_ids[0] in b.device_ids
    rec = read_record(p.state.allocation_record(a.envs[TOKEN_ENV]))
    assert [(g.uuid, g.memory_limit, g.core_percent) for g in rec.gpus] == [(U0, 1024 * MiB, 10)]
    rec = read_record(p.state.allocation_record(b.envs[TOKEN_ENV]))
    assert [(g.uuid, g.memory_limit, g.core_percent) for g in rec.gpus] == [(U0, 5000 * MiB, 40), (U1, 6000 * MiB, 50)]
    assert b.envs["NVIDIA_VISIBLE_DEVICES"] == f"{U0},{U1}"
    ann = pod_ann(api, "job")
    assert json.loads(ann[scheduling.ALLOCATED_ANNOTATION]) == ["prep", "main"]
    assert ann[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_SUCCESS
    assert len(pod_patches(api)) == 2  # one per container, in the kubelet's order


def test_oldest_bind_first_and_other_nodes_ignored(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin()
    add_pod(api, "elsewhere", [("main", False, [(U0, 100 * MiB, 5)])], bind_time=10, node="node-b")
    add_pod(api, "late", [("main", False, [(U0, 2000 * MiB, 20)])], bind_time=2000)
    add_pod(api, "early", [("main", False, [(U1, 1000 * MiB, 10)])], bind_time=1000)
    first = kubelet.admit("default", "early", "main")
    second = kubelet.admit("default", "late", "main")
    sizes = [
        (g.uuid, g.memory_limit)
        for a in (first, second)
        for g in read_record(p.state.allocation_record(a.envs[TOKEN_ENV])).gpus
    ]
    assert sizes == [(U1, 1000 * MiB), (U0, 2000 * MiB)]
    elsewhere = pod_ann(api, "elsewhere")
    assert scheduling.ALLOCATED_ANNOTATION not in elsewhere
    assert elsewhere[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_ALLOCATING
    for name in ("early", "late"):
        assert pod_ann(api, name)[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_SUCCESS


def test_kubelet_ids_off_the_decided_gpu(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    """kubelet may not follow the preference: its IDs are counters, the decision names the GPU."""
    p = plugin()
    add_pod(api, "p", [("main", False, [(U1, 2048 * MiB, 30)])])
    resp = kubelet.endpoint().allocate([f"{U0}::2"])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == U1
    [g] = read_record(p.state.allocation_record(resp.envs[TOKEN_ENV])).gpus
    assert (g.uuid, g.memory_limit, g.core_percent, g.vgpu_ids) == (U1, 2048 * MiB, 30, [f"{U0}::2"])


def test_count_mismatch_keeps_todays_behaviour(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin()
    add_pod(api, "two", [("main", False, [(U0, 1 * GiB, 10), (U1, 1 * GiB, 10)])])
    a = kubelet.admit("default", "one", "main", count=1)  # a 1-GPU container: not that pod's
    g = read_record(p.state.allocation_record(a.envs[TOKEN_ENV])).gpus[0]
    assert (g.memory_limit, g.core_percent) == (4 * GiB, 25)
    assert scheduling.ALLOCATED_ANNOTATION not in pod_ann(api, "two")


def test_decided_gpumem_with_memory_scaling_gets_its_physical_share(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin(device_memory_scaling=2.0)
    add_pod(api, "big", [("main", False, [(U1, 6 * GiB, 30)])])
    a = kubelet.admit("default", "big", "main", count=1)
    rec = read_record(p.state.allocation_record(a.envs[TOKEN_ENV]))
    [g] = rec.gpus
    assert rec.oversubscribe and (g.memory_limit, g.device_limit) == (6 * GiB, 3 * GiB)  # gpumem x 1/S


@pytest.mark.parametrize(
    ("gpus", "needle"),
    [
        ([("GPU-ffffffff-0000-0000-0000-000000000000", 1 * GiB, 10)], "is not on this node"),
        ([(U0, 17 * GiB, 10)], "exceeds GPU"),
        ([(U0, 1 * GiB, 101)], "exceeds GPU"),
    ],
)
def test_decision_that_cannot_be_honoured_fails(
    api: KubeAPI, kubelet: FakeKubelet, plugin, gpus: list[tuple[str, int, int]], needle: str
) -> None:
    p = plugin()
    add_pod(api, "bad", [("main", False, gpus)])
    with pytest.raises(grpc.RpcError) as e:
        kubelet.admit("default", "bad", "main", count=1)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert needle in e.value.details()
    assert os.listdir(p.state.allocations_dir) == []
    assert pod_ann(api, "bad")[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_FAILED


def test_unhealthy_decided_gpu_fails(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin()
    p.daemon.table.mark_unhealthy(U1, "xid 79")
    add_pod(api, "p", [("main", False, [(U1, 1 * GiB, 10)])])
    with pytest.raises(grpc.RpcError) as e:
        kubelet.endpoint().allocate([f"{U0}::0"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "unhealthy" in e.value.details()


def test_conflict_is_retried(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin()
    add_pod(api, "p", [("main", False, [(U0, 1 * GiB, 10)])])
    api.fail_next("PATCH", r"/pods/p$", 409)
    a = kubelet.admit("default", "p", "main")
    assert read_record(p.state.allocation_record(a.envs[TOKEN_ENV])).gpus[0].memory_limit == 1 * GiB
    assert pod_ann(api, "p")[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_SUCCESS
    assert len(pod_patches(api)) == 2


def test_confirm_merges_a_concurrent_write(api: KubeAPI) -> None:
    """The patch carries the resourceVersion read: a write in between is a real 409, then a merge."""
    add_pod(api, "p", [("a", False, [(U0, 1 * GiB, 10)]), ("b", False, [(U1, 1 * GiB, 10)])])
    table = DeviceTable(GPUS, Slicing(4))
    d = decision.Decisions(table, NODE)
    claim = d.claim([f"{U0}::0"])
    assert claim is not None and claim.container.name == "a"
    # Someone else (the scheduler, a user) writes the pod after our list, before our patch;
    # here even "b" was recorded by an earlier instance of the plugin.
    api.patch(
        "pods",
        "p",
        {"metadata": {"annotations": {"other": "x", scheduling.ALLOCATED_ANNOTATION: '["b"]'}}},
        "default",
    )
    assert d.confirm(claim)
    ann = pod_ann(api, "p")
    assert ann["other"] == "x"
    assert json.loads(ann[scheduling.ALLOCATED_ANNOTATION]) == ["b", "a"]
    assert ann[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_SUCCESS
    assert len(pod_patches(api)) == 2  # the stale one (409) and the merged one


def _dead_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "dead-kubeconfig").write_text(json.dumps(kc))
    use_kubeconfig(monkeypatch, tmp_path / "dead-kubeconfig")


def test_api_unreachable_auto_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kubelet: FakeKubelet, plugin, caplog: pytest.LogCaptureFixture
) -> None:
    _dead_kubeconfig(tmp_path, monkeypatch)
    caplog.set_level(logging.WARNING, logger="device_plugin.decision")
    p = plugin()
    for pod in ("a", "b"):
        a = kubelet.admit("default", pod, "main")
        g = read_record(p.state.allocation_record(a.envs[TOKEN_ENV])).gpus[0]
        assert (g.memory_limit, g.core_percent) == (4 * GiB, 25)
    warned = [r for r in caplog.records if "cannot look up scheduler decisions" in r.getMessage()]
    assert len(warned) == 1  # once per outage


def test_api_unreachable_required_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kubelet: FakeKubelet, plugin
) -> None:
    _dead_kubeconfig(tmp_path, monkeypatch)
    p = plugin(decisions="required")
    with pytest.raises(grpc.RpcError) as e:
        kubelet.admit("default", "a", "main")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot list the pods of node node-a" in e.value.details()
    assert os.listdir(p.state.allocations_dir) == []


def test_off_never_asks(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin(decisions="off")
    add_pod(api, "p", [("main", False, [(U1, 1 * GiB, 10)])])
    a = kubelet.admit("default", "p", "main")
    assert read_record(p.state.allocation_record(a.envs[TOKEN_ENV])).gpus[0].memory_limit == 4 * GiB
    assert not [r for r in api.requests if "/pods" in r[1]]


def test_terminating_and_invalid_decisions_are_skipped() -> None:
    good = Decision(node=NODE, time=1, containers=[ContainerDecision(name="m", gpus=[])])

    def pod(ann: dict[str, str], **meta: Any) -> dict[str, Any]:
        return {"metadata": {"name": "x", "namespace": "d", "uid": "u", "annotations": ann, **meta}}

    base = {
        scheduling.DECISION_ANNOTATION: scheduling.encode(good),
        scheduling.BIND_PHASE_ANNOTATION: scheduling.PHASE_ALLOCATING,
    }
    items = [
        pod(base),
        pod(base, deletionTimestamp="2026-01-01T00:00:00Z"),
        pod({**base, scheduling.DECISION_ANNOTATION: '{"version":1}'}),
        pod({**base, scheduling.ALLOCATED_ANNOTATION: "not json"}),
        pod({**base, scheduling.BIND_PHASE_ANNOTATION: scheduling.PHASE_SUCCESS}),
        {**pod(base), "status": {"phase": "Failed"}},
    ]
    got = decisionpolicy.pending_pods(json.dumps({"items": items}).encode(), NODE)
    assert len(got) == 1 and got[0].bind_time == 1.0  # no bind-time: the decision's time


def test_record_failure_leaves_the_container_to_the_retry(api: KubeAPI, kubelet: FakeKubelet, plugin) -> None:
    p = plugin()
    add_pod(api, "p", [("main", False, [(U1, 2 * GiB, 20)])])
    os.rmdir(p.state.allocations_dir)  # the record cannot be written
    with pytest.raises(grpc.RpcError) as e:
        kubelet.endpoint().allocate([f"{U1}::0"])
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert scheduling.ALLOCATED_ANNOTATION not in pod_ann(api, "p")
    os.makedirs(p.state.allocations_dir, mode=0o700)
    resp = kubelet.endpoint().allocate([f"{U1}::0"])
    g = read_record(p.state.allocation_record(resp.envs[TOKEN_ENV])).gpus[0]
    assert (g.memory_limit, g.core_percent) == (2 * GiB, 20)
    assert pod_ann(api, "p")[scheduling.BIND_PHASE_ANNOTATION] == scheduling.PHASE_SUCCESS
