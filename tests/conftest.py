"""Shared pytest fixtures.

- `build_dir`: runs `make build-all` once per session and returns build/.
- `fakegpu`: a simulated GPU node of its own per test (see sim/fakegpu/harness.py).
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
    from sim.fakegpu import harness

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


CLUSTER_SUITE = ROOT / "tests" / "cluster"


def _asked_for_cluster_suite(config: pytest.Config) -> bool:
    for arg in config.args:
        p = Path(arg.split("::", 1)[0])
        p = (p if p.is_absolute() else Path(config.invocation_params.dir) / p).resolve()
        if p == CLUSTER_SUITE or CLUSTER_SUITE in p.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/cluster acts on whatever cluster KUBECONFIG names: it is collected only when a path
    under it is given on the command line (`make test-cluster`), never by `make test`."""
    if collection_path == CLUSTER_SUITE or CLUSTER_SUITE in collection_path.parents:
        return None if _asked_for_cluster_suite(config) else True
    return None
