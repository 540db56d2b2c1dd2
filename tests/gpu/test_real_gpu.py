"""Runs tests/gpu/real_gpu.py where a real NVIDIA driver and GPU are present;
skipped elsewhere (CI, the simulator-only machines)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _real_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return "fakegpu" not in str(getattr(lib, "_name", ""))


@pytest.mark.gpu
@pytest.mark.timeout(1800)
def test_real_gpu(build_dir: Path) -> None:
    if not _real_gpu():
        pytest.skip("no NVIDIA driver/GPU on this machine")
    p = subprocess.run([sys.executable, str(HERE / "real_gpu.py")], capture_output=True, text=True, timeout=1700)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
