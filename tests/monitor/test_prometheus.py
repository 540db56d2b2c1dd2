"""The monitor's metrics as operators see them, on a real Prometheus (Debian's package).

The real vgpu-monitor runs on the simulated GPU with three vGPU containers: two throttled
workloads on GPU 0 and a notebook allocated on both GPUs that runs nothing.  Two Prometheus
servers scrape it every second:
- "plain": a static scrape job with a `node` label (docs/operators/metrics.md, "Prometheus without the
  operator");
- "operator": the scrape configuration prometheus-operator generates for the chart's
  ServiceMonitor (tests/support/promoperator.py), with the target labels Kubernetes discovery
  gives the monitor pod (namespace kube-system, its pod and container names), and the chart's
  PrometheusRule loaded as its rules.
In each, every dashboard variable and every panel expression is evaluated through the HTTP API
with the variables substituted the way Grafana does (tests/support/grafana.py), and the results
must be data with sane values whose legends name each container's own namespace/pod/container.
The exposition is checked as OpenMetrics, the format Prometheus asks for: no scrape errors and
every family with its own type in Prometheus's metadata.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

from tests.monitor.helpers import Gated, MonitorProc, Procs, make_container
from tests.support import grafana, promoperator
from tests.support.poll import poll
from tests.support.prometheus import BINARY, Prometheus, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (host-deps.sh test)"),
]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "k8s-vgpu-dashboard.json"
GIB = 1 << 30
NODE = "gpu-node-1"
RELEASE, NAMESPACE = "k8s-vgpu", "kube-system"
MONITOR_POD = "k8s-vgpu-monitor-x7k2p"
SCRAPE_S = 1
DATA_S = 12  # seconds of samples before evaluating (>= 3 x $__rate_interval)
ACCEPT = (  # Prometheus 2.42's scrape Accept header (scrape/scrape.go)
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


class World:
    """What runs on the node: containers by (namespace, pod) with their per-GPU limits and shares."""

    def __init__(self, uuids: list[str]) -> None:
        self.uuids = uuids
        # (namespace, pod) -> {gpu index: (memory limit, share)}
        self.alloc: dict[tuple[str, str], dict[str, tuple[int, int]]] = {
            ("team-a", "train-a"): {"0": (4 * GIB, 30)},
            ("team-b", "train-b"): {"0": (8 * GIB, 50)},
            ("team-c", "notebook-c"): {"0": (2 * GIB, 20), "1": (3 * GIB, 40)},  # idle
        }

    def per_gpu(self, namespaces: set[str] | None = None) -> set[tuple[str, str, str, str]]:
        return {
            (ns, pod, "main", gpu)
            for (ns, pod), gpus in self.alloc.items()
            for gpu in gpus
            if namespaces is None or ns in namespaces
        }

    def per_container(self, namespaces: set[str] | None = None) -> set[tuple[str, str, str]]:
        return {(ns, pod, "main") for (ns, pod) in self.alloc if namespaces is None or ns in namespaces}


def _chart(port: int) -> dict[str, dict[str, Any]]:
    from tests.support.helm import by_kind, render

    objects = render(
        {
            "monitor": {
                "port": port,
                "serviceMonitor": {"enabled": True, "interval": f"{SCRAPE_S}s", "scrapeTimeout": f"{SCRAPE_S}s"},
                "prometheusRule": {"enabled": True},
            }
        },
        name=RELEASE,
        namespace=NAMESPACE,
    )
    [sm] = by_kind(objects, "ServiceMonitor")
    [svc] = by_kind(objects, "Service")
    [rule] = by_kind(objects, "PrometheusRule")
    [ds] = [d for d in by_kind(objects, "DaemonSet") if d["metadata"]["name"].endswith("-monitor")]
    return {"servicemonitor": sm, "service": svc, "rule": rule, "daemonset": ds}


def _operator_config(chart: dict[str, dict[str, Any]], port: int, rules_path: Path) -> dict[str, Any]:
    ds = chart["daemonset"]
    pod = {
        "metadata": {
            "name": MONITOR_POD,
            "namespace": NAMESPACE,
            "labels": ds["spec"]["template"]["metadata"]["labels"],
            "ownerReferences": [{"kind": "DaemonSet", "name": ds["metadata"]["name"], "controller": True}],
        },
        "spec": ds["spec"]["template"]["spec"],
    }
    job = promoperator.scrape_config(chart["servicemonitor"])
    meta = promoperator.endpoints_target(chart["service"], pod, f"127.0.0.1:{port}", NODE, "metrics")
    address = meta.pop("__address__")
    job["static_configs"] = [{"targets": [address], "labels": meta}]
    rules_path.write_text(yaml.safe_dump(chart["rule"]["spec"], sort_keys=False))
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(rules_path)],
        "scrape_configs": [job],
    }


def _plain_config(port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [
            {
                "job_name": "vgpu-monitor",
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"node": NODE}}],
            }
        ],
    }


# -- checks ---------------------------------------------------------------------------------------

Series = list[dict[str, Any]]


def _values(series: Series) -> list[float]:
    return [float(v) for s in series for _, v in s["values"]]


def _by_legend(series: Series, fmt: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for s in series:
        name = grafana.legend(fmt, s["metric"])
        assert name not in out, f"two series with the legend {name!r}"
        out[name] = [float(v) for _, v in s["values"]]
    return out


def _pairs(a: dict[str, list[float]], b: dict[str, list[float]], sa: str, sb: str) -> list[tuple[float, float]]:
    """Values of legends `X sa` and `X sb` side by side (the same series, step by step)."""
    pairs = []
    for name, va in a.items():
        base = name.removesuffix(" " + sa)
        vb = b[base + " " + sb]
        pairs += list(zip(va[-min(len(va), len(vb)) :], vb[-min(len(va), len(vb)) :], strict=True))
    return pairs


def _container_legends(legends: list[str], suffix: str, gpu: bool) -> set[tuple[str, ...]]:
    out = set()
    pattern = r"([^/]+)/([^/]+)/(\S+) GPU (\S+)" if gpu else r"([^/]+)/([^/]+)/(\S+)"
    for name in legends:
        m = re.fullmatch(pattern + (" " + suffix if suffix else ""), name)
        assert m, f"legend {name!r} does not name a container"
        out.add(m.groups())
    return out


def check_dashboard(
    prom: Prometheus, world: World, start: float, end: float, selected: dict[str, list[str] | str]
) -> dict[str, int]:
    """Evaluate every variable and every panel target as Grafana would; returns series per panel."""
    dash = grafana.Dashboard(json.loads(DASHBOARD.read_text()), grafana.TimeRange(start, end, SCRAPE_S), selected)
    dash.resolve_variables(lambda label, sel: prom.label_values(label, sel, start, end))
    assert dash.options["node"] == [NODE]
    assert dash.options["namespace"] == ["team-a", "team-b", "team-c"]  # the idle notebook's too
    assert len(dash.options["job"]) == 1
    namespaces = None if selected.get("namespace", grafana.ALL) == grafana.ALL else set(selected["namespace"])
    step = dash.time.interval_s
    results: dict[str, Series] = {}
    for panel, target in dash.targets():
        key = f"{panel['title']}/{target['refId']}"
        expr = dash.interpolate(target["expr"])
        assert "$" not in expr, expr
        series = prom.query_range(expr, start, end, step)
        assert series, f"{key}: no data for {expr}"
        vals = _values(series)
        assert vals and all(math.isfinite(v) for v in vals), (key, expr, vals)
        results[key] = series
    fmt = {f"{p['title']}/{t['refId']}": t["legendFormat"] for p, t in dash.targets()}

    def legends(key: str) -> dict[str, list[float]]:
        return _by_legend(results[key], fmt[key])

    # the node row (one scrape timing out on a loaded machine would be a 0: allowed, not all of them)
    assert set(_values(results["Monitors scraped/B"])) == {1.0}
    up = _values(results["Monitors scraped/A"])
    assert set(up) <= {0.0, 1.0} and max(up) == 1
    assert set(_values(results["GPUs up/A"])) == {2.0} == set(_values(results["GPUs up/B"]))
    assert set(_values(results["Guardian armed/A"])) == {1.0}
    assert all(0 <= v <= 3 for v in _values(results["Processes suspended now/A"]))
    assert all(v >= 0 for v in _values(results["Monitor errors (time range)/A"]))
    assert all(0 < v <= 1 for v in _values(results["Loop duration p99/A"]))
    assert set(legends("Loop duration p99/A")) == {NODE}
    util = legends("GPU utilisation/A")
    assert set(util) == {f"{NODE} GPU 0", f"{NODE} GPU 1"}
    assert all(0 <= v <= 100 for v in _values(results["GPU utilisation/A"]))
    mem = _pairs(legends("GPU memory/A"), legends("GPU memory/B"), "used", "total")
    assert mem and all(0 <= u <= t for u, t in mem) and {t for _, t in mem} == {16 * GIB}
    # the monitor row: every error kind is there from the start, at rate >= 0
    kinds = {name.split()[-1] for name in legends("Monitor errors by kind/A")}
    assert kinds >= {"actuate", "gc", "loop", "nvml", "nvml_call", "nvml_hang", "region_write", "status"}
    assert all(v >= 0 for v in _values(results["Monitor errors by kind/A"]))
    for key in ("State directories collected (time range)/A", "Duties held for stale samples (time range)/A"):
        assert all(v >= 0 for v in _values(results[key])), key
    # containers: every allocated container on every GPU, named by its own namespace/pod/container
    expect_gpu, expect_c = world.per_gpu(namespaces), world.per_container(namespaces)
    use, share = legends("SM use vs share/A"), legends("SM use vs share/B")
    assert _container_legends(list(use), "use", True) == expect_gpu
    assert _container_legends(list(share), "share", True) == expect_gpu
    assert all(0 <= v <= 100 for v in _values(results["SM use vs share/A"]))
    for name, vals in share.items():  # the shares as configured
        ns, pod, _, gpu = _container_legends([name], "share", True).pop()
        assert set(vals) == {world.alloc[(ns, pod)][gpu][1]}, name
    duty = legends("Duty ratio/A")
    assert _container_legends(list(duty), "", True) == expect_gpu
    assert all(0 < v <= 1 for v in _values(results["Duty ratio/A"]))
    for name, vals in duty.items():
        if name.startswith("team-c/"):
            assert set(vals) == {1.0}, name  # idle: runs the whole cycle
    for key in ("Time suspended (s/s)/A", "Suspensions per second/A"):
        assert _container_legends(list(legends(key)), "", False) == expect_c, key
        assert all(v >= 0 for v in _values(results[key])), key
    # seconds per second: at most 1, give or take the once-a-second snapshots within a short window
    assert all(v < 2 for v in _values(results["Time suspended (s/s)/A"]))
    used, limit = legends("Device memory vs limit/A"), legends("Device memory vs limit/B")
    assert _container_legends(list(used), "used", True) == expect_gpu
    assert _container_legends(list(limit), "limit", True) == expect_gpu
    pairs = _pairs(used, limit, "used", "limit")
    assert pairs and all(0 <= u <= lim for u, lim in pairs)
    for name, vals in limit.items():
        ns, pod, _, gpu = _container_legends([name], "limit", True).pop()
        assert set(vals) == {world.alloc[(ns, pod)][gpu][0]}, name
    for name, vals in used.items():
        if name.startswith("team-c/"):
            assert set(vals) == {0.0}, name  # idle, and still there
    backstop = legends("Memory backstop actions (time range)/A")
    assert {n.rsplit(" ", 1)[1] for n in backstop} == {"kill", "log"}
    assert _container_legends([n.rsplit(" ", 1)[0] for n in backstop], "", False) == expect_c
    assert all(v >= 0 for v in _values(results["Memory backstop actions (time range)/A"]))
    assert set(_values(results["Corrupt regions/A"])) == {0.0}
    assert all(v >= 0 for v in _values(results["Corrupt regions/B"]))
    return {k: len(v) for k, v in results.items()}


def check_openmetrics(prom: Prometheus, job: str, om_types: dict[str, str]) -> None:
    """Prometheus scraped OpenMetrics without error and recorded every family's own type."""

    def healthy() -> list[dict[str, Any]]:
        return [t for t in prom.targets() if t["labels"].get("job") == job and t["health"] == "up"]

    assert poll(healthy, 10), prom.targets()  # a scrape that timed out on a loaded machine is retried
    assert healthy()[0]["lastError"] == ""
    meta = {m["metric"]: m["type"] for m in prom.target_metadata(job)}
    for name, typ in om_types.items():
        assert meta.get(name) == typ, (name, typ, meta.get(name))


def check_operator_labels(prom: Prometheus, job: str, at: float) -> None:
    """honorLabels: container series keep the workload's namespace/pod/container; prometheus-operator's
    target labels stay on everything else; nothing renamed exported_*."""
    series = prom.query('vgpu_container_memory_limit_bytes{namespace="team-c"}', at)
    assert len(series) == 2, series
    for s in series:
        m = s["metric"]
        assert (m["namespace"], m["pod"], m["container"]) == ("team-c", "notebook-c", "main"), m
        assert (m["node"], m["job"], m["service"], m["endpoint"]) == (NODE, job, job, "metrics"), m
    [gpu] = prom.query('vgpu_gpu_up{gpu="0"}', at)
    assert (gpu["metric"]["namespace"], gpu["metric"]["pod"]) == (NAMESPACE, MONITOR_POD), gpu
    assert gpu["metric"]["container"] == "vgpu-monitor" and gpu["metric"]["node"] == NODE
    renamed = prom.query('{__name__=~"vgpu_.+", exported_namespace!=""} or {__name__=~"vgpu_.+", exported_pod!=""}', at)
    assert renamed == [], renamed


def check_rules(prom: Prometheus) -> None:
    """The chart's alert rules evaluate on real data without error, and in this healthy run the
    ones that no load hiccup (a scrape timing out, a slow loop, a share not yet settled) can
    trigger stay inactive."""
    groups = prom.get("/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 9
    for r in rules:
        assert r["health"] == "ok" and not r.get("lastError"), r
        if r["name"] not in ("VGPUMonitorDown", "VGPUContainerOffShare", "VGPUMonitorErrors"):
            assert r["state"] == "inactive", r


# -- the test -------------------------------------------------------------------------------------


def _wait_scraped(prom: Prometheus, series: int, timeout: float = 60.0) -> float:
    """Time of the first scrape that had every container series."""

    def ready() -> bool:
        try:
            return len(prom.query("vgpu_container_memory_limit_bytes")) >= series
        except Exception:
            return False

    assert poll(ready, timeout, 0.2), f"prometheus never scraped {series} container series"
    return time.time()


def _parallel(fns: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_dashboard_alerts_and_openmetrics_on_a_real_prometheus(fakegpu: Any, tmp_path: Path, procs: Procs) -> None:
    assert Path(BINARY).exists()
    st = tmp_path / "state"
    port = free_port()
    mon = MonitorProc(st, fakegpu.env, "--policy", "strict", "--metrics-port", str(port), procs=procs)
    mon.wait_ready()
    if (g := mon.guardian_pid()) is not None:
        procs.adopt(g)
    world = World(fakegpu.uuids)
    burn = [fakegpu.burn, "--alloc", "256m", "--kernel-us", "100", "--seconds", "120"]
    for (ns, pod), gpus in world.alloc.items():
        argv = burn if ns != "team-c" else ["sleep", "120"]  # the notebook runs nothing on the GPU
        w = Gated(argv, fakegpu.env, procs)
        limits = [(fakegpu.uuids[int(i)], lim, sh) for i, (lim, sh) in gpus.items()]
        make_container(st, secrets.token_hex(32), w.pid, limits, pod=pod, namespace=ns)
        w.release()

    chart = _chart(port)
    sm_ep = chart["servicemonitor"]["spec"]["endpoints"][0]
    assert sm_ep["honorLabels"] is True
    operator_job = chart["service"]["metadata"]["name"]
    plain = Prometheus(tmp_path / "prom-plain", _plain_config(port))
    operator = Prometheus(tmp_path / "prom-operator", _operator_config(chart, port, tmp_path / "rules.yaml"))
    with plain, operator:
        t0 = max(_parallel([lambda: _wait_scraped(plain, 4), lambda: _wait_scraped(operator, 4)]))
        # the exposition, as Prometheus asks for it: strict OpenMetrics
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": ACCEPT})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            om_types = {f.name: f.type for f in om_families(r.read().decode())}
        time.sleep(max(0.0, t0 + DATA_S - time.time()))
        end = time.time()
        start = t0 + 4 * SCRAPE_S  # every rate window full
        for prom, job in ((plain, "vgpu-monitor"), (operator, operator_job)):
            check_openmetrics(prom, job, om_types)
            everything = check_dashboard(prom, world, start, end, {})
            assert everything["SM use vs share/A"] == 4, everything
            # a multi-value selection: Grafana's (a|b) regex
            some = check_dashboard(prom, world, start, end, {"node": [NODE], "namespace": ["team-a", "team-c"]})
            assert some["Device memory vs limit/B"] == 3, some
            # $namespace is narrowed by $node
            dash = grafana.Dashboard(
                json.loads(DASHBOARD.read_text()), grafana.TimeRange(start, end, SCRAPE_S), {"node": ["other-node"]}
            )
            dash.resolve_variables(lambda label, sel, p=prom: p.label_values(label, sel, start, end))
            assert dash.options["namespace"] == []
        check_operator_labels(operator, operator_job, end)
        check_rules(operator)
    assert plain.proc is not None and plain.proc.poll() is not None
    assert operator.proc is not None and operator.proc.poll() is not None
