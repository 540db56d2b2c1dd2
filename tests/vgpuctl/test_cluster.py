"""`vgpuctl cluster` against the Kubernetes API stand-in (sim/kubeapi.py): the real CLI
in a subprocess, the kubernetes client over real HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim.kubeapi import KubeAPI, node_object, pod_object
from tests.support.inventory import inventory
from vgpu import scheduling as sc
from vgpuctl import cluster as vcluster

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GiB = 1 << 30
A0, A1, B0 = "GPU-aaaa0000", "GPU-aaaa0001", "GPU-bbbb0000"


def decided(
    api: KubeAPI,
    name: str,
    node: str,
    containers: list[tuple[str, bool, list[tuple[str, int, int]]]],
    bind: bool = True,
    phase: str = "Running",
) -> None:
    d = sc.Decision(
        node=node,
        time=time.time(),
        containers=[
            sc.ContainerDecision(name=n, init=i, gpus=[sc.GPUAssignment(uuid=u, memory=m, cores=c) for u, m, c in g])
            for n, i, g in containers
        ],
    )
    api.create(
        "pods",
        pod_object(
            name, [(n, {}) for n, i, _ in containers if not i], annotations={sc.DECISION_ANNOTATION: sc.encode(d)}
        ),
    )
    if bind:
        api.bind(name, "default", node)
    api.patch("pods", name, {"status": {"phase": phase}}, "default")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KubeAPI, Path]]:
    with KubeAPI() as api:
        now = time.time()
        api.create(
            "nodes",
            node_object(
                "node-a",
                {sc.INVENTORY_ANNOTATION: sc.encode(inventory(uuids=[A0, A1], heartbeat=now, numa=[0, 0]))},
                gpus=8,
            ),
        )
        api.create(
            "nodes",
            node_object(
                "node-b",
                {sc.INVENTORY_ANNOTATION: sc.encode(inventory(uuids=[B0], heartbeat=now - 600, numa=[0]))},
                gpus=4,
            ),
        )
        api.create("nodes", node_object("cpu-only"))
        decided(api, "train", "node-a", [("main", False, [(A0, 8192 * MiB, 30)])])
        # init 2 GiB/50 %, app containers 1 + 3 GiB and 10 + 20 %: effective max(init, sum) per dimension
        decided(
            api,
            "job",
            "node-a",
            [
                ("prep", True, [(A1, 2 * GiB, 50)]),
                ("a", False, [(A1, 1 * GiB, 10)]),
                ("b", False, [(A1, 3 * GiB, 20)]),
            ],
        )
        decided(api, "done", "node-a", [("main", False, [(A0, 10 * GiB, 10)])], phase="Succeeded")
        decided(api, "queued", "node-b", [("main", False, [(B0, 1 * GiB, 5)])], bind=False, phase="Pending")
        decided(api, "leaving", "node-a", [("main", False, [(A0, 1 * GiB, 5)])])
        api.set_terminating("leaving")
        yield api, api.write_kubeconfig(tmp_path / "kubeconfig")


def vgpuctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpuctl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **(env or {})},
    )


def test_json(cluster: tuple[KubeAPI, Path]) -> None:
    _api, kc = cluster
    r = vgpuctl("cluster", "--kubeconfig", str(kc), "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert [n["name"] for n in v["nodes"]] == ["node-a", "node-b"]  # cpu-only has no inventory
    a, b = v["nodes"]
    assert a["problem"] == "" and a["allocatable"] == 8
    g0, g1 = a["gpus"]
    assert (g0["memory_allocated"], g0["cores_allocated"], g0["slots_allocated"]) == (9216 * MiB, 35, 2)
    assert (g0["memory_free"], g0["cores_free"]) == (80 * GiB - 9216 * MiB, 65)
    assert [(p["name"], p["terminating"]) for p in g0["pods"]] == [("leaving", True), ("train", False)]
    assert (g1["memory_allocated"], g1["cores_allocated"], g1["slots_allocated"]) == (4 * GiB, 50, 2)
    assert g1["pods"][0]["containers"] == ["prep", "a", "b"]
    assert "stale" in b["problem"]
    assert b["gpus"][0]["memory_allocated"] == 1 * GiB  # reserved by a decision, not bound yet
    assert v["pending"] == 1


def test_text(cluster: tuple[KubeAPI, Path]) -> None:
    _api, kc = cluster
    r = vgpuctl("cluster", env={"KUBECONFIG": str(kc)})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "NODE node-a (2 GPUs, split 4, heartbeat" in out
    assert "NODE node-b (1 GPUs, split 4" in out and "NOT OFFERED: inventory stale" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("0 ") and A0 in line)
    assert "9216/81920" in row and "35/100" in row and "2/4" in row
    assert "default/train [main] 8192 MiB 30% Running" in out
    assert "default/leaving [main] 1024 MiB 5% Running terminating" in out
    assert "done" not in out  # Succeeded: released
    assert "1 decided pod(s) not bound yet" in out


def test_unreachable(tmp_path: Path) -> None:
    with KubeAPI() as api:
        kc: dict[str, Any] = api.kubeconfig()
    # the stand-in is stopped: its port refuses connections
    (tmp_path / "kc").write_text(json.dumps(kc))
    r = vgpuctl("cluster", "--kubeconfig", str(tmp_path / "kc"))
    assert r.returncode == 1 and "vgpuctl: cannot list nodes" in r.stderr and r.stdout == ""
    r = vgpuctl("cluster", "--kubeconfig", str(tmp_path / "absent"))
    assert r.returncode == 1 and "no kubeconfig" in r.stderr


def test_published_slices_named_by_their_pods_counted_once(cluster: tuple[KubeAPI, Path]) -> None:
    """Slices the node handed out: each is shown with its pod, a decided pod's own counts once, an
    init container's and its app containers' slices by max(init, sum(app)), an ended or deleted
    pod's slices do not count although its records stay, a static pod is found by its mirror."""
    api, kc = cluster
    train = api.get("pods", "train")["metadata"]["uid"]
    job = api.get("pods", "job")["metadata"]["uid"]
    # another scheduler's pod (no decision), one that finished, a static pod's mirror
    for name, phase, ann in (
        ("other", "Running", {}),
        ("finished", "Succeeded", {}),
        ("static-x", "Running", {sc.MIRROR_ANNOTATION: "static-hash"}),
    ):
        api.create("pods", pod_object(name, [("main", {"nvidia.com/gpu": "1"})], annotations=ann))
        api.bind(name, "default", "node-a")
        api.patch("pods", name, {"status": {"phase": phase}}, "default")
    other = api.get("pods", "other")["metadata"]["uid"]
    finished = api.get("pods", "finished")["metadata"]["uid"]
    used = sc.NodeUsage(
        time=time.time(),
        slices=[
            sc.UsedSlice(gpu=A0, memory=6144 * MiB, cores=10, pod=other, container="main"),
            sc.UsedSlice(gpu=A0, memory=8192 * MiB, cores=30, pod=train, container="main"),  # train's decision
            sc.UsedSlice(gpu=A0, memory=1024 * MiB, cores=5, pod="static-hash", container="main"),
            sc.UsedSlice(gpu=A0, memory=7 * GiB, cores=7, pod="gone-uid", container="main"),  # its pod is deleted
            sc.UsedSlice(gpu=A0, memory=5 * GiB, cores=7, pod=finished, container="main"),  # Succeeded
            # job: its init container's slot given to app container a, b on another slot
            sc.UsedSlice(gpu=A1, memory=2 * GiB, cores=50, pod=job, container="prep"),
            sc.UsedSlice(gpu=A1, memory=1 * GiB, cores=10, pod=job, container="a"),
            sc.UsedSlice(gpu=A1, memory=3 * GiB, cores=20, pod=job, container="b"),
            sc.UsedSlice(gpu=A1, memory=2048 * MiB, cores=5),  # no pod named yet
        ],
    )
    api.patch("nodes", "node-a", {"metadata": {"annotations": {sc.USAGE_ANNOTATION: sc.encode(used)}}})
    r = vgpuctl("cluster", "--kubeconfig", str(kc), "--json")
    assert r.returncode == 0, r.stderr
    g0, g1 = json.loads(r.stdout)["nodes"][0]["gpus"]
    # 6144 (other) + 8192 (train, once) + 1024 (static) + 1024 (leaving, not published yet)
    assert (g0["memory_allocated"], g0["cores_allocated"], g0["slots_allocated"]) == (16384 * MiB, 50, 4)
    assert sorted((p["name"], p["memory"] // MiB, p["decided"]) for p in g0["pods"]) == [
        ("leaving", 1024, True),
        ("other", 6144, False),
        ("static-x", 1024, False),
        ("train", 8192, True),
    ]
    # job: max(2, 1 + 3) GiB, max(50, 10 + 20) %, max(1, 2) slots; plus the unnamed slice
    assert (g1["memory_allocated"], g1["cores_allocated"], g1["slots_allocated"]) == (6144 * MiB, 55, 3)
    assert sorted((p["name"], p["memory"] // MiB) for p in g1["pods"]) == [(vcluster.UNNAMED, 2048), ("job", 4096)]
    text = vgpuctl("cluster", "--kubeconfig", str(kc)).stdout
    assert "default/other [main] 6144 MiB 10% Running (no decision)" in text
    assert "default/job [prep,a,b] 4096 MiB 50% Running" in text
    assert f"{vcluster.UNNAMED} 2048 MiB 5% -" in text
