"""`vgpuctl slice` (vgpuctl/probe.py): what a process sees of its GPUs through CUDA and NVML.

Real parts: the simulated driver (sim/fakegpu: libcuda.so.1, libnvidia-ml.so.1 with pynvml)
and libvgpu.so preloaded with a limits file, as in a vGPU container.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import UUID0, Node, have_fake

MiB = 1 << 20


@pytest.fixture
def node(tmp_path: Path, build_dir: Path) -> Node:
    if not have_fake():
        pytest.skip("simulated driver (build/fakegpu) not built")
    return Node(tmp_path, "plain", devices=f"[device]\nmemory = {16384 * MiB}\n")


def _slice(node: Node, *args: str, preload: bool = True) -> tuple[int, dict, str]:
    p = subprocess.run(
        [sys.executable, "-m", "vgpuctl.cli", "slice", *args],
        env=node.env(preload),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, json.loads(p.stdout), p.stderr


def test_the_physical_gpu_without_the_library(node: Node) -> None:
    rc, view, err = _slice(node, "--expect-memory-mib", "16384", "--expect-gpus", "1", preload=False)
    assert rc == 0, err
    assert [(d["uuid"], d["total"]) for d in view["cuda"]["devices"]] == [(UUID0, 16384 * MiB)]
    assert [(d["uuid"], d["total"]) for d in view["nvml"]["devices"]] == [(UUID0, 16384 * MiB)]
    assert "as expected" in err


def test_the_slice_through_libvgpu(node: Node) -> None:
    node.limit(3000 * MiB)
    rc, view, err = _slice(node, "--expect-memory-mib", "3000")
    assert rc == 0, err
    assert [(d["uuid"], d["total"]) for d in view["cuda"]["devices"]] == [(UUID0, 3000 * MiB)]
    assert [(d["uuid"], d["total"]) for d in view["nvml"]["devices"]] == [(UUID0, 3000 * MiB)]
    assert 0 < view["cuda"]["devices"][0]["free"] <= 3000 * MiB


def test_another_size_fails_with_both_apis_named(node: Node) -> None:
    node.limit(2048 * MiB)
    rc, view, err = _slice(node, "--expect-memory-mib", "3000", "--expect-gpus", "2")
    assert rc == 1
    assert view["cuda"]["devices"][0]["total"] == 2048 * MiB
    assert f"cuda: GPU 0 ({UUID0}): total {2048 * MiB} bytes (2048 MiB), 3000 MiB expected" in err
    assert f"nvml: GPU 0 ({UUID0}): total {2048 * MiB} bytes (2048 MiB), 3000 MiB expected" in err
    assert "cuda: 1 GPU(s) visible, 2 expected" in err


def test_no_driver_is_an_error_not_a_traceback(node: Node) -> None:
    rc, view, err = _slice(node, "--cuda-library", "libcuda-absent.so.1", "--expect-memory-mib", "1")
    assert rc == 1 and "Traceback" not in err
    assert view["cuda"]["error"].startswith("cannot load libcuda-absent.so.1")
    # Without an expectation it only reports.
    rc, view, _err = _slice(node, "--cuda-library", "libcuda-absent.so.1")
    assert rc == 0 and view["cuda"]["devices"] == []
