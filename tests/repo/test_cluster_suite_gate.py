"""The acceptance suite (tests/cluster) acts on whatever cluster KUBECONFIG names, so `make test`
must never collect it, and without KUBECONFIG it must skip; its settings come from VGPU_TEST_*."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cluster.kube import Settings

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args: str, kubeconfig: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = kubeconfig
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.stdout + r.stderr


def test_make_test_never_collects_the_cluster_suite(tmp_path: Path) -> None:
    # Even with a KUBECONFIG in the environment (a developer's own cluster).
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\nkind: Config\n")
    out = _pytest("--collect-only", "-q", "tests", kubeconfig=str(kc))
    assert "tests/cluster/" not in out and "tests/vgpu/" in out, out[-2000:]


def test_named_it_is_collected_and_skips_without_kubeconfig() -> None:
    out = _pytest("-q", "-rs", "tests/cluster/test_nodes.py")
    assert "1 skipped" in out and "no cluster: set KUBECONFIG" in out, out[-2000:]


def test_settings_from_the_environment() -> None:
    assert Settings.from_env({}) is None
    s = Settings.from_env({"KUBECONFIG": "/k"})
    assert s is not None and (s.runtime_class, s.scheduler_name, s.disruptive, s.kubelet_restart) == (
        "vgpu",
        "vgpu-scheduler",
        False,
        "",
    )
    s = Settings.from_env(
        {
            "KUBECONFIG": "/k",
            "VGPU_TEST_RUNTIME_CLASS": "",
            "VGPU_TEST_SCHEDULER_NAME": "mine",
            "VGPU_TEST_TIMEOUT_S": "30",
            "VGPU_TEST_DISRUPTIVE": "1",
            "VGPU_TEST_HOST_NETWORK": "true",
            "VGPU_TEST_KUBELET_RESTART": "systemctl restart kubelet",
        }
    )
    assert s is not None
    assert (s.runtime_class, s.scheduler_name, s.timeout_s, s.disruptive, s.host_network) == (
        "",
        "mine",
        30.0,
        True,
        True,
    )
    assert s.kubelet_restart == "systemctl restart kubelet"
