"""The frameworks suite runs under `make test-frameworks` only, which installs PyTorch into
.venv-frameworks first; `make test` does not collect it (tests/conftest.py, OPT_IN_SUITES)."""

from __future__ import annotations

import pytest


@pytest.fixture
def node_plain(tmp_path, build_dir):  # type: ignore[no-untyped-def]
    """A simulated node (contexts cost 0) with one container's limits and region files."""
    from tests.libcuda_intercept.support import Node

    return Node(tmp_path, "plain")
