"""Fixtures for the libvgpu.so suite.

`node` is a fresh simulated node plus one container's limits/region files;
it is parametrised over the normal library and its AddressSanitizer +
UBSan build (`node_plain` when a test is about timing or volume only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.libcuda_intercept.support import BUILD, Node, asan_runtime, have_fake


def _need(build_dir: Path) -> None:
    if not have_fake():
        pytest.skip("simulated driver (build/fakegpu) not built")


@pytest.fixture(params=["plain", "asan"])
def node(request: pytest.FixtureRequest, tmp_path: Path, build_dir: Path) -> Node:
    _need(build_dir)
    if request.param == "asan" and (asan_runtime() is None or not (BUILD / "intercept" / "libvgpu-asan.so").exists()):
        pytest.skip("ASan runtime not installed")
    return Node(tmp_path, request.param)


@pytest.fixture
def node_plain(tmp_path: Path, build_dir: Path) -> Node:
    _need(build_dir)
    return Node(tmp_path, "plain")
