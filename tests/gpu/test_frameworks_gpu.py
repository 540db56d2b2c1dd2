"""The frameworks cases of tests/frameworks on a real NVIDIA GPU: PyTorch's caching allocator
(default, expandable segments, cudaMallocAsync) under libvgpu.so against a slice raises
torch.cuda.OutOfMemoryError at the slice and not before, and torch's statistics stay inside it.
Skipped where no real driver and GPU are present; run by `make test-frameworks` there."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.gpu.test_real_gpu import _real_gpu
from tests.support import cudart, frameworks

MiB = 1 << 20
CHUNK = 256 * MiB
LIMIT = 16 * CHUNK + 100 * MiB
BUILD = Path(__file__).resolve().parents[2] / "build"

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def uuid0(py: str) -> str:
    code = "import torch; print('GPU-' + str(torch.cuda.get_device_properties(0).uuid))"
    return subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout.strip()


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "backend:cudaMallocAsync"])
def test_caching_allocator_stops_at_the_slice_on_a_real_gpu(conf: str) -> None:
    if not _real_gpu():
        pytest.skip("no NVIDIA driver/GPU on this machine")
    py = frameworks.torch_python()
    if py is None:
        pytest.skip("torch not installed in .venv-frameworks")
    with tempfile.TemporaryDirectory() as d:
        limits = Path(d) / "limits"
        limits.write_text(f"vgpu-limits 1\n{uuid0(py)} {LIMIT} 100 0\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "LD_PRELOAD"))}
        env.update(
            LD_PRELOAD=str(BUILD / "libvgpu.so"),
            VGPU_LIMITS_FILE=str(limits),
            VGPU_REGION_FILE=str(Path(d) / "region"),
            PYTORCH_CUDA_ALLOC_CONF=conf,
        )
        p = subprocess.run(
            [py, "-c", frameworks.TORCH_FILL, str(CHUNK)],
            env=env,
            input="",
            capture_output=True,
            text=True,
            timeout=600,
        )
    [row] = cudart.parse(p.stdout)["fill"]
    assert row["big"] == "16" and int(row["ooms"]) >= 1, p.stdout + p.stderr
    assert int(row["total"]) == LIMIT
    if row["reserved"] != "-1":
        assert int(row["reserved"]) <= LIMIT and LIMIT - int(row["reserved"]) < 20 * MiB
