"""The real `vgpu-scheduler` process against the API stand-in."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from sim.kubeapi import KubeAPI
from tests.support.http import post_json, post_ok
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import decision_of, gpu_node, start_process, vgpu_pod

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu_scheduler", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_invalid_flags_exit_2(tmp_path: Path) -> None:
    r = run("--node-policy", "random", "--kubeconfig", str(tmp_path / "none"))
    assert r.returncode == 2 and "invalid configuration" in r.stderr
    r = run("--kubeconfig", str(tmp_path / "none"))
    assert r.returncode == 2 and "no Kubernetes API configuration" in r.stderr
    r = run("--help")
    assert r.returncode == 0 and "--gpu-policy" in r.stdout and "--leader-elect" in r.stdout


def test_every_config_field_is_a_flag_of_its_type() -> None:
    """Int fields whose default is 0 or 1 are numbers, not booleans (0 == False in Python)."""
    from vgpu_scheduler.__main__ import config_from, parser

    ns = parser().parse_args(
        [
            "--default-gpumem-mib",
            "2048",
            "--default-gpu-count",
            "2",
            "--default-gpucores",
            "20",
            "--no-overwrite-default-scheduler",
            "--leader-elect",
            "--lease-namespace",
            "gpu-system",
            "--stale-after-s",
            "60",
        ]
    )
    cfg = config_from(ns)
    assert (cfg.default_gpumem_mib, cfg.default_gpu_count, cfg.default_gpucores) == (2048, 2, 20)
    assert (cfg.overwrite_default_scheduler, cfg.leader_elect, cfg.lease_namespace, cfg.stale_after_s) == (
        False,
        True,
        "gpu-system",
        60.0,
    )


def test_process_serves_filter_and_stops_on_sigterm(kubeapi: KubeAPI, tmp_path: Path) -> None:
    kubeapi.create("nodes", gpu_node("n1"))
    pod = kubeapi.create("pods", vgpu_pod("p", mem=4096, cores=30))
    kc = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    proc, port = start_process(kc, "--gpu-policy", "binpack")
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    return bool(json.loads(r.read())["ready"])
            except OSError:
                return False

        wait_for(ready, 20, "readyz")
        assert post_ok(url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["n1"]})["NodeNames"] == ["n1"]
        assert decision_of(kubeapi, "p") is None  # filter holds its choice in memory: no API write
        bind = {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"}
        assert post_ok(url + "/bind", bind) == {"Error": ""}
        d = decision_of(kubeapi, "p")
        assert d is not None and d.containers[0].gpus[0].cores == 30
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chart_modes_as_processes(kubeapi: KubeAPI, tmp_path: Path) -> None:
    """The extender follows a Lease held by `<this host>_<uuid>` (its own hostname by default, as
    kube-scheduler's in the same pod); the webhook-only process answers no extender verb."""
    import socket
    import time
    import uuid

    from vgpu_scheduler.kube import micro_time

    kubeapi.create("nodes", gpu_node("n1"))
    pod = kubeapi.create("pods", vgpu_pod("p", mem=4096))
    kc = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    spec = {
        "holderIdentity": f"{socket.gethostname()}_{uuid.uuid4()}",
        "leaseDurationSeconds": 60,
        "renewTime": micro_time(time.time()),
    }
    kubeapi.create(
        "leases", {"metadata": {"name": "ks", "namespace": "gpu"}, "spec": spec}, "gpu", "coordination.k8s.io/v1"
    )
    ext, ext_port = start_process(
        kc, "--serve=extender", "--follow-lease=gpu/ks", "--retry-period-s=0.05", "--handover-s=0.1"
    )
    hook, hook_port = start_process(kc, "--serve=webhook")
    ext_url, hook_url = f"http://127.0.0.1:{ext_port}", f"http://127.0.0.1:{hook_port}"
    try:
        args = {"Pod": pod, "Nodes": None, "NodeNames": ["n1"]}

        def served() -> bool:
            return post_json(ext_url + "/filter", args)[1].get("NodeNames") == ["n1"]

        wait_for(served, 20, "the follower serves")
        bind = {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"}
        assert post_json(ext_url + "/bind", bind) == (200, {"Error": ""})
        assert decision_of(kubeapi, "p") is not None
        code, out = post_json(hook_url + "/filter", args)
        assert code == 404 and "not served here" in str(out["Error"])
        assert post_json(ext_url + "/webhook", {})[0] == 404
        for p in (ext, hook):
            p.send_signal(signal.SIGTERM)
            assert p.wait(15) == 0
    finally:
        for p in (ext, hook):
            if p.poll() is None:
                p.kill()
                p.wait()
