"""The Grafana dashboard is well-formed, built for the labels prometheus-operator scrapes with, and
every metric it queries is one a real vgpu-monitor exports: the monitor runs on the simulated GPU
and its /metrics endpoint is scraped over HTTP.  tests/monitor/test_prometheus.py evaluates every
expression on a real Prometheus."""

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

from sim.procs import terminate

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "k8s-vgpu-dashboard.json"
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "summary": ("_sum", "_count", ""),
}


# Grafana's global variables (packages/grafana-prometheus/src/datasource.ts: getRangeScopedVars,
# getRateIntervalScopedVariable; the dashboard's __interval)
GLOBALS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
CONTAINER_GPU_METRICS = (
    "vgpu_container_memory_used_bytes",
    "vgpu_container_memory_limit_bytes",
    "vgpu_container_sm_use_percent",
    "vgpu_container_sm_share_percent",
    "vgpu_container_duty_ratio",
)


def _targets(dash: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(p, t) for p in dash["panels"] for t in p.get("targets", [])]


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
                assert var in variables | GLOBALS, f"{p['title']}: ${var} undefined"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    assert len(_exprs(dash)) >= 10


def test_dashboard_reads_the_labels_operators_scrape_with() -> None:
    """The chart's ServiceMonitor labels every target with `node`; honorLabels keeps the containers'
    own namespace/pod/container.  The dashboard selects and names series by those."""
    dash = json.loads(DASHBOARD.read_text())
    var = {v["name"]: v for v in dash["templating"]["list"]}
    assert var["node"]["query"] == "label_values(vgpu_gpu_up, node)"
    assert 'node=~"$node"' in var["namespace"]["query"]  # narrowed by the chosen nodes
    assert "allValue" not in var["job"]  # "All" = the monitors' jobs, never `.*` (every job's up)
    for p, t in _targets(dash):
        expr = t["expr"]
        assert 'node=~"$node"' in expr, (p["title"], expr)
        # no fixed windows: rates over $__rate_interval (>= 4 scrapes), totals over the time range
        assert set(re.findall(r"\[([^\]]+)\]", expr)) <= {"$__rate_interval", "$__range"}, expr
        if any(m in expr for m in CONTAINER_GPU_METRICS):
            # one legend per container and GPU: a two-GPU container has two lines, told apart
            assert "{{gpu}}" in t["legendFormat"] and "{{namespace}}/{{pod}}/{{container}}" in t["legendFormat"]
            assert 'namespace=~"$namespace"' in expr
    assert any(re.match(r"\w+\(up\{", t["expr"]) for _, t in _targets(dash)), "no panel shows whether monitors are up"


def test_monitor_panels_are_not_under_a_container_row() -> None:
    dash = json.loads(DASHBOARD.read_text())
    row = ""
    rows: dict[str, str] = {}
    for p in sorted(dash["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if p["type"] == "row":
            row = p["title"]
        else:
            for t in p["targets"]:
                rows[t["expr"]] = row
    for expr, r in rows.items():
        if "vgpu_monitor_" in expr or "vgpu_gpu_" in expr or "up{" in expr:
            assert not r.startswith("Containers"), (r, expr)


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
