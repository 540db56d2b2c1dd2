"""Health state machine (XID filter, lost GPUs, recovery) without a driver.

The end-to-end path (events from the simulated NVML through the real daemon
to ListAndWatch) is in test_process.py.
"""

from __future__ import annotations

import pytest

from nodecore import health as health_mod
from nodecore.devices import DeviceTable, Slicing
from nodecore.health import HealthMonitor
from tests.device_plugin.conftest import synthetic_gpus
from vgpu.nvml import XidEvent


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> tuple[DeviceTable, HealthMonitor, set[str]]:
    lost: set[str] = set()
    monkeypatch.setattr(health_mod.nvml, "device_lost", lambda uuid: uuid in lost)
    t = DeviceTable(synthetic_gpus(2), Slicing(2))
    changes: list[int] = []
    hm = HealthMonitor(t, recovery_s=10, on_change=lambda: changes.append(1))
    return t, hm, lost


def test_xid_filter_and_recovery(setup: tuple[DeviceTable, HealthMonitor, set[str]]) -> None:
    t, hm, _ = setup
    u0, u1 = list(t.gpus)
    v = t.version
    hm.handle_xid(XidEvent(u0, 13))  # application error: ignored
    hm.handle_xid(XidEvent(u0, 43))
    assert t.version == v and t.is_healthy(u0)
    hm.handle_xid(XidEvent(u0, 79))  # fell off the bus
    assert not t.is_healthy(u0) and t.is_healthy(u1) and t.version == v + 1
    bad_at = t.gpus[u0].last_bad
    hm.check_once(now=bad_at + 5)
    assert not t.is_healthy(u0)
    hm.check_once(now=bad_at + 10.5)
    assert t.is_healthy(u0) and t.version == v + 2


def test_unresolved_event_marks_all(setup: tuple[DeviceTable, HealthMonitor, set[str]]) -> None:
    t, hm, _ = setup
    hm.handle_xid(XidEvent(None, 48))
    assert not any(t.is_healthy(u) for u in t.gpus)


def test_lost_gpu_never_recovers_while_lost(setup: tuple[DeviceTable, HealthMonitor, set[str]]) -> None:
    t, hm, lost = setup
    u0, u1 = list(t.gpus)
    lost.add(u1)
    hm.check_once(now=100)
    assert not t.is_healthy(u1) and t.is_healthy(u0)
    hm.check_once(now=500)
    assert not t.is_healthy(u1)
    lost.clear()
    hm.check_once(now=505)
    assert not t.is_healthy(u1)  # quiet period counts from the last time it was seen lost
    hm.check_once(now=510.5)
    assert t.is_healthy(u1)
