from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.monitor.helpers import Procs


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()
