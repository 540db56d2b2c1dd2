"""The Grafana dashboard is well-formed and every metric it queries is one a real vgpu-monitor
exports: the monitor runs on the simulated GPU and its /metrics endpoint is scraped over HTTP."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import terminate

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "k8s-vgpu-dashboard.json"
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "summary": ("_sum", "_count", ""),
}


def _exprs(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                assert var in variables, f"{p['title']}: ${var} undefined"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    assert len(_exprs(dash)) >= 10


@pytest.mark.timeout(120)
def test_every_queried_metric_is_exported(fakegpu: Any, tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = dict(fakegpu.env)
    env["VGPU_CONFIG"] = str(tmp_path / "none.toml")  # defaults + flags
    mon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "monitor",
            "--state-dir",
            str(state),
            "--metrics-address",
            "127.0.0.1",
            "--metrics-port",
            "0",
        ],
        env=env,
        cwd=ROOT,
    )
    try:
        status = state / "monitor" / "status.json"
        deadline = time.monotonic() + 60
        port = 0
        while time.monotonic() < deadline and mon.poll() is None:
            try:
                st = json.loads(status.read_text())
                port = int(st.get("metrics_port") or 0) if st.get("pid") == mon.pid else 0
            except (OSError, ValueError):
                port = 0
            if port:
                break
            time.sleep(0.1)
        assert port, "monitor did not report its metrics port"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        terminate(mon, 15)
    exported = {f.name + s for f in text_string_to_metric_families(text) for s in SUFFIXES.get(f.type, ("",))}
    queried = {m for e in _exprs(json.loads(DASHBOARD.read_text())) for m in re.findall(r"\bvgpu_[a-z_]+", e)}
    assert queried, "the dashboard queries nothing"
    assert sorted(queried - exported) == []
