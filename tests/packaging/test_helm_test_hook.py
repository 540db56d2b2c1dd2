"""The chart's `helm test` hook (templates/tests/slice-test.yaml): a pod that asks for a vGPU and
checks what its container sees with `vgpuctl slice`.

Rendered with Helm's own engine; the pod is a valid Pod; its command parses with vgpuctl's own
parser; created through the API stand-in (which stores quantities as kube-apiserver does) its
gpumem is the canonical "3k" that the scheduler reads as the size the command expects; and the
command itself, run against the simulated GPU through libvgpu.so, passes on a slice of exactly
that size and fails on any other (the real-cluster run is in docs/operators/install.md, "helm test").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.libcuda_intercept.support import Node, have_fake
from tests.support.helm import SCHEDULER_ON as ON
from tests.support.helm import assert_valid, by_kind, render
from vgpu import quantity
from vgpuctl import cli as ctl

MiB = 1 << 20


def hook_pod(values: dict[str, Any] | None = None) -> dict[str, Any]:
    [pod] = by_kind(render(values), "Pod")
    return pod


def test_the_hook_asks_for_a_sized_slice_through_the_scheduler() -> None:
    pod = hook_pod(ON)
    assert_valid([pod])
    meta = pod["metadata"]
    assert meta["annotations"] == {
        "helm.sh/hook": "test",
        "helm.sh/hook-delete-policy": "before-hook-creation",
    }
    assert meta["namespace"] == "kube-system"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["schedulerName"] == "vgpu-scheduler"  # placed by it even where the webhook skips the namespace
    assert spec["runtimeClassName"] == "vgpu"
    [c] = spec["containers"]
    assert c["image"] == "ghcr.io/k8s-vgpu/k8s-vgpu:0.1.0"
    limits = c["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["nvidia.com/gpumem"], limits["nvidia.com/gpucores"]) == ("1", "3000", "10")
    assert c["command"][:2] == ["vgpuctl", "slice"]
    a = ctl.parser().parse_args(c["command"][1:])
    assert (a.cmd, a.expect_memory_mib, a.expect_gpus) == ("slice", 3000, 1)


def test_the_hook_follows_the_values() -> None:
    pod = hook_pod(
        {
            "scheduler": {"enabled": True, "name": "my-sched"},
            "helmTest": {"gpumemMiB": 4096, "gpucores": 25, "runtimeClassName": "other"},
            "resourceName": "example.com/vgpu",
        }
    )
    [c] = pod["spec"]["containers"]
    assert pod["spec"]["schedulerName"] == "my-sched" and pod["spec"]["runtimeClassName"] == "other"
    limits = c["resources"]["limits"]
    sizes = (limits["example.com/vgpu"], limits["nvidia.com/gpumem"], limits["nvidia.com/gpucores"])
    assert sizes == ("1", "4096", "25")
    assert ctl.parser().parse_args(c["command"][1:]).expect_memory_mib == 4096
    # Without the scheduler: one vGPU (its size is 1/K of whichever GPU), default-scheduler.
    pod = hook_pod()
    [c] = pod["spec"]["containers"]
    assert "schedulerName" not in pod["spec"]
    assert set(c["resources"]["limits"]) == {"memory", "nvidia.com/gpu"}
    a = ctl.parser().parse_args(c["command"][1:])
    assert (a.expect_memory_mib, a.expect_gpus) == (None, 1)
    assert by_kind(render({**ON, "helmTest": {"enabled": False}}), "Pod") == []
    with pytest.raises(Exception, match="gpucores"):
        render({"helmTest": {"gpucores": 101}})


def test_stored_as_the_api_server_stores_it() -> None:
    from sim.kubeapi import KubeAPI

    pod = hook_pod(ON)
    with KubeAPI() as api:
        stored = api.create("pods", pod, "kube-system")
    [c] = stored["spec"]["containers"]
    # kube-apiserver writes 3000 as "3k" (tests/data/real-traces/quantities/); the extender reads
    # it back as the 3000 MiB the container's check expects.
    assert c["resources"]["limits"]["nvidia.com/gpumem"] == "3k" == c["resources"]["requests"]["nvidia.com/gpumem"]
    expect = ctl.parser().parse_args(c["command"][1:]).expect_memory_mib
    assert quantity.whole(c["resources"]["limits"]["nvidia.com/gpumem"]) == expect


def test_the_hooks_command_passes_on_its_slice_and_fails_on_another(tmp_path: Path, build_dir: Path) -> None:
    if not have_fake():
        pytest.skip("simulated driver (build/fakegpu) not built")
    [c] = hook_pod(ON)["spec"]["containers"]
    node = Node(tmp_path, "plain", devices=f"[device]\nmemory = {16384 * MiB}\n")

    def run() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "vgpuctl.cli", *c["command"][1:]]
        return subprocess.run(argv, env=node.env(True), capture_output=True, text=True, timeout=120)

    node.limit(3000 * MiB)  # the decision's size, as the device plugin's record gives it
    r = run()
    assert r.returncode == 0, r.stderr
    node.limit(8192 * MiB)  # 1/K of the GPU: what a pod placed without the scheduler's decision gets
    r = run()
    assert r.returncode == 1 and "8192 MiB), 3000 MiB expected" in r.stderr
