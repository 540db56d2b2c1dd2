"""The frameworks suite runs under `make test-frameworks` only (VGPU_TEST_FRAMEWORKS=1), which
installs PyTorch into .venv-frameworks first; `make test` skips it."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("VGPU_TEST_FRAMEWORKS") == "1":
        return
    skip = pytest.mark.skip(reason="frameworks suite: run `make test-frameworks`")
    for item in items:
        if "tests/frameworks/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture
def node_plain(tmp_path, build_dir):  # type: ignore[no-untyped-def]
    """A simulated node (contexts cost 0) with one container's limits and region files."""
    from tests.libcuda_intercept.support import Node

    return Node(tmp_path, "plain")
