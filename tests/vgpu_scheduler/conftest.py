"""Fixtures of the scheduler suite: `kubeapi` (the API stand-in, sim/kubeapi.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sim.kubeapi import KubeAPI


@pytest.fixture
def kubeapi() -> Iterator[KubeAPI]:
    with KubeAPI() as api:
        yield api
