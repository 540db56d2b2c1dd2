"""Shared pytest fixtures.

- `build_dir`: runs `make build-all` once per session and returns build/.
- `fakegpu`: a simulated GPU node of its own per test (see tests/fakegpu/harness.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"


@pytest.fixture(scope="session")
def build_dir() -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT), "build-all"], check=True)
    return BUILD


def _harness():  # imported lazily so suites that need no GPU never load it
    from tests.fakegpu import harness

    return harness


@pytest.fixture
def fakegpu(tmp_path: Path, build_dir: Path) -> Iterator[object]:
    """A fresh simulated node: 2 GPUs of 16 GiB unless the test reconfigures it."""
    h = _harness()
    gpu = h.FakeGPU(tmp_path / "fakegpu", build_dir)
    try:
        yield gpu
    finally:
        gpu.close()


def is_root() -> bool:
    return os.geteuid() == 0
