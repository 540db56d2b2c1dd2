"""The Helm chart rendered with Helm's own engine (helm-python-sdk, Helm v4 SDK), and checks of
what it renders (every object valid for the kubernetes client models: k8svalidate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import k8svalidate

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "packaging" / "helm" / "k8s-vgpu"
SCHEDULER_ON = {"scheduler": {"enabled": True}}

sdk = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (make venv)")


def render(
    values: dict[str, Any] | None = None, name: str = "k8s-vgpu", namespace: str = "kube-system"
) -> list[dict[str, Any]]:
    with sdk.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values or {})
        manifests = chart.render(values or {}, name=name, namespace=namespace)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects.extend(k8svalidate.load_all(text))
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def daemonset(objects: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    [ds] = [o for o in by_kind(objects, "DaemonSet") if o["metadata"]["name"].endswith(suffix)]
    return ds


def container_args(ds: dict[str, Any]) -> list[str]:
    args: list[str] = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def assert_valid(objects: list[dict[str, Any]]) -> None:
    """Every object valid, but those of CRDs the kubernetes client has no model for (cert-manager's,
    the Prometheus operator's)."""
    problems = {
        f"{o['kind']}/{o['metadata']['name']}": k8svalidate.validate(o)
        for o in objects
        if not o["apiVersion"].startswith(("cert-manager.io/", "monitoring.coreos.com/"))
    }
    assert {k: v for k, v in problems.items() if v} == {}
