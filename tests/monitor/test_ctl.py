"""vgpuctl status without a running monitor: missing, stale and stopped status files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vgpuctl import cli as ctl

STATUS = {
    "version": 1,
    "running": True,
    "time": 0.0,
    "pid": 123,
    "policy": "strict",
    "suspended_processes": 1,
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-1",
            "name": "Fake",
            "up": True,
            "memory_total": 16 << 30,
            "memory_used": 3 << 30,
            "util": 100,
            "containers": [
                {
                    "container_id": "a" * 64,
                    "namespace": "team",
                    "pod": "train",
                    "container": "main",
                    "memory_used": 2 << 30,
                    "memory_limit": 8 << 30,
                    "memory_device_limit": 4 << 30,
                    "memory_host": 3 << 30,
                    "sm_use": 29.6,
                    "share": 30.0,
                    "suspended": True,
                }
            ],
        },
        {"index": 1, "uuid": "GPU-2", "up": False, "error": "GPU is lost", "memory_total": 0, "containers": []},
    ],
    "containers": [
        {"container_id": "a" * 64, "namespace": "team", "pod": "train", "container": "main", "region_error": ""},
        {"container_id": "b" * 64, "namespace": "x", "pod": "idle", "container": "c", "region_error": "bad magic"},
    ],
}


def test_render_table() -> None:
    out = ctl.render(STATUS, now=1.0)
    assert "running (pid 123, policy strict" in out
    assert "team/train" in out and "30/30" in out and "suspended" in out
    # device memory (NVML) against the physical share, host-resident memory against the slice
    assert "VRAM USED/SHARE GiB" in out and "HOST/SLICE GiB" in out
    assert "2.0/4.0" in out and "3.0/8.0" in out
    # a status written before the share existed shows the slice as the share
    row = STATUS["gpus"][0]["containers"][0]  # type: ignore[index]
    old = {k: v for k, v in row.items() if k not in ("memory_device_limit", "memory_host")}
    gpu0 = {**STATUS["gpus"][0], "containers": [old]}  # type: ignore[dict-item]
    out_old = ctl.render({**STATUS, "gpus": [gpu0]}, now=1.0)
    assert "2.0/8.0" in out_old and "0.0/8.0" in out_old
    assert "DOWN: GPU is lost" in out
    assert "x/idle" in out and "region-corrupt" in out
    assert "stale" in ctl.render(STATUS, now=100.0)
    assert "stopped" in ctl.render({**STATUS, "running": False}, now=1.0)


def test_status_missing_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["status", "--state-dir", str(tmp_path)]) == 1
    assert "is vgpu-monitor running" in capsys.readouterr().err
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "status.json").write_text(json.dumps({**STATUS, "time": time.time()}))
    assert ctl.main(["status", "--state-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pid"] == 123
    assert ctl.main([]) == 2
