"""Shared pytest fixtures.

- `build_dir`: runs `make build-all` once per session and returns build/.
- `fakegpu`: a simulated GPU node of its own per test (see sim/fakegpu/harness.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import hook

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


# Suites collected only when a path under them is given on the command line, never by `make test`:
# tests/cluster acts on whatever cluster KUBECONFIG names (`make test-cluster`); tests/frameworks
# needs PyTorch, which `make test-frameworks` installs into a venv of its own.
CLUSTER_SUITE = ROOT / "tests" / "cluster"
OPT_IN_SUITES = (CLUSTER_SUITE, ROOT / "tests" / "frameworks")


def _asked_for(suite: Path, config: pytest.Config) -> bool:
    for arg in config.args:
        p = Path(arg.split("::", 1)[0])
        p = (p if p.is_absolute() else Path(config.invocation_params.dir) / p).resolve()
        if p == suite or suite in p.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    for suite in OPT_IN_SUITES:
        if collection_path == suite or suite in collection_path.parents:
            return None if _asked_for(suite, config) else True
    return None


# ----- the OCI hook run directly or behind its sh filter (tests.support.hook) -----


@pytest.fixture(scope="session")
def hook_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hook.placeholder_library(tmp_path_factory.mktemp("lib"))


@pytest.fixture
def node(tmp_path: Path, hook_lib: Path) -> Iterator[hook.Node]:
    """The Python hook invoked directly (`python3 -I -S fastpath.py`)."""
    if not hook.have_runc():
        pytest.skip("needs root, runc and busybox-static")
    yield hook.Node(tmp_path, hook_lib)


@pytest.fixture(params=["python", "shell-filter"])
def any_node(request: pytest.FixtureRequest, tmp_path: Path, hook_lib: Path) -> Iterator[hook.Node]:
    """Both installed forms of the hook: Python directly, and behind the sh filter."""
    if not hook.have_runc():
        pytest.skip("needs root, runc and busybox-static")
    yield hook.Node(tmp_path, hook_lib, shell=request.param == "shell-filter")


@pytest.fixture
def podman(tmp_path: Path) -> Iterator[object]:
    """podman with this test's own state and CDI directories (tests/support/podman.py)."""
    from tests.support.podman import Podman

    p = Podman(tmp_path / "podman")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session")
def image() -> dict[str, Any]:
    """`make image`'s output (built once per session; cached by content hash across sessions)."""
    if os.geteuid() != 0:
        pytest.skip("make image needs root (mmdebstrap, chroot)")
    from tests.support import imagebuild

    return imagebuild.build()
