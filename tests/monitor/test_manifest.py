"""packaging/k8s/monitor.yaml: a DaemonSet whose command line the monitor accepts."""

from __future__ import annotations

from pathlib import Path

import yaml

from monitor.__main__ import build_parser
from vgpu.config import MonitorConfig

ROOT = Path(__file__).resolve().parents[2]


def test_monitor_daemonset() -> None:
    docs = list(yaml.safe_load_all((ROOT / "packaging/k8s/monitor.yaml").read_text()))
    assert len(docs) == 1
    ds = docs[0]
    assert ds["kind"] == "DaemonSet" and ds["metadata"]["name"] == "vgpu-monitor"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True  # NVML pids are host pids
    (c,) = spec["containers"]
    assert c["command"] == ["vgpu-monitor"]
    ns = build_parser().parse_args(c["args"])  # every flag exists
    assert ns.state_dir == "/var/lib/vgpu"
    port = int(ns.monitor__metrics_port)
    assert port == MonitorConfig().metrics_port == c["ports"][0]["containerPort"]
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    caps = c["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"] and set(caps["add"]) == {"KILL", "SYS_PTRACE"}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/var/lib/vgpu" in mounts
