from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitor.daemon import Monitor
from monitor.metrics import serve
from tests.monitor.helpers import Procs, ScriptedSource
from vgpu.config import MonitorConfig
from vgpu.paths import Paths


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


class Running:
    def __init__(self, mon: Monitor, port: int) -> None:
        self.mon = mon
        self.port = port

    def scrape(self, accept: str = "") -> str:
        headers = {"Accept": accept} if accept else {}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()


@pytest.fixture
def run_monitor(tmp_path: Path, procs: Procs) -> Iterator:
    started: list[tuple[Monitor, threading.Thread]] = []

    def start(source: ScriptedSource, **cfg) -> Running:
        mon = Monitor(MonitorConfig(**cfg), Paths(str(tmp_path / "state")), source=source)
        mon.start()
        assert mon.suspender.guardian is not None
        procs.adopt(mon.suspender.guardian.pid)
        port = serve(mon, "127.0.0.1", 0)
        mon.metrics_port = port
        t = threading.Thread(target=mon.run, daemon=True)
        t.start()
        started.append((mon, t))
        return Running(mon, port)

    try:
        yield start
    finally:
        for mon, t in started:
            mon.stop()
            t.join(10)
            mon.close()
