"""The alert rules (packaging/helm/k8s-vgpu/files/k8s-vgpu-rules.yaml): valid for Prometheus's own
`promtool check rules`, each alert fires on the series it is for and stays quiet on healthy ones
(`promtool test rules`, tests/packaging/data/k8s-vgpu-rules.test.yaml), each has its runbook line
in docs/operators/metrics.md, and the chart's PrometheusRule is that same file.  The chart's ServiceMonitor
keeps the monitor's labels (honorLabels).  tests/monitor/test_prometheus.py loads the rules into a
real Prometheus scraping a real monitor."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.prometheus import PROMTOOL

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "packaging" / "helm" / "k8s-vgpu" / "files" / "k8s-vgpu-rules.yaml"
RULE_TESTS = ROOT / "tests" / "packaging" / "data" / "k8s-vgpu-rules.test.yaml"
DOCS = ROOT / "docs" / "operators" / "metrics.md"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs Debian's prometheus (packaging/host-deps.sh test)"
)


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


@needs_promtool
def test_promtool_check_rules() -> None:
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    r = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    spec = yaml.safe_load(RULE_TESTS.read_text())
    assert [str((RULE_TESTS.parent / f).resolve()) for f in spec["rule_files"]] == [str(RULES)]
    fires: set[str] = set()
    quiet: set[str] = set()
    for t in spec["tests"]:
        for case in t.get("alert_rule_test", []):
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fires == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet (before `for`, or on healthy series)"


def test_every_alert_has_a_runbook_line() -> None:
    text = DOCS.read_text()
    section = text.split("\n## Alerts", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(VGPU\w+)`[^|]*\|.*$", section, re.M)}
    for a in _alerts():
        assert a["annotations"]["runbook"] == "docs/operators/metrics.md#alerts"
        assert a["annotations"]["summary"] and a["annotations"]["description"]
        assert a["labels"]["severity"] in ("warning", "critical")
        assert a["alert"] in rows, f"no runbook line for {a['alert']} in docs/operators/metrics.md"
        assert f"({a['labels']['severity']})" in rows[a["alert"]]
    assert set(rows) == {a["alert"] for a in _alerts()}


# ---- the chart -----------------------------------------------------------------------------------


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    from tests.support.helm import render

    return render(values, name="vgpu", namespace="gpu-system")


def test_chart_prometheus_rule_is_the_rules_file() -> None:
    from tests.support.helm import by_kind

    assert by_kind(_render({}), "PrometheusRule") == []  # off by default (needs the operator's CRDs)
    objects = _render({"monitor": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prom"}}}})
    [rule] = by_kind(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "gpu-system"
    assert rule["metadata"]["labels"]["release"] == "kube-prom"  # for the Prometheus's ruleSelector
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "vgpu"
    # one source: the plain rules file, byte for byte once parsed; Helm left Prometheus's templates alone
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert "{{ $labels.node }}" in rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"]
    off = _render({"monitor": {"enabled": False, "prometheusRule": {"enabled": True}}})
    assert by_kind(off, "PrometheusRule") == []


def test_chart_rejects_bad_prometheus_rule_values() -> None:
    from tests.support.helm import sdk as helm

    for bad in ({"enabled": "yes"}, {"labels": {"release": 1}}, {"enable": True}):
        with pytest.raises(helm.HelmError, match="at '/"):
            _render({"monitor": {"prometheusRule": bad}})


def test_service_monitor_keeps_the_monitors_labels() -> None:
    """prometheus-operator adds the monitor pod's namespace/pod/container as target labels; without
    honorLabels they overwrite the containers' own (renamed exported_*)."""
    from tests.support.helm import by_kind

    [sm] = by_kind(_render({"monitor": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    [ep] = sm["spec"]["endpoints"]
    assert ep["honorLabels"] is True
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in ep["relabelings"]


def test_rules_file_is_packaged() -> None:
    nfpm = yaml.safe_load((ROOT / "packaging" / "nfpm.yaml").read_text())
    files = {c["dst"]: c["src"] for c in nfpm["contents"] if "src" in c}
    assert files["/usr/share/vgpu/prometheus/k8s-vgpu-rules.yaml"] == str(RULES.relative_to(ROOT))
