"""The monitor loop with a scripted NVML stand-in: real processes, real signals, a real
guardian, metrics over HTTP, the status file and vgpuctl, cleanup, GPU loss."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.monitor.helpers import Procs, ScriptedSource, make_container, metric, state
from tests.support.poll import poll
from vgpuctl import cli as ctl

pytestmark = pytest.mark.timeout(90)
U0 = "GPU-00000000-0000-0000-0000-00000000000a"
GIB = 1 << 30


def test_strict_shares_metrics_status_and_vgpuctl(tmp_path: Path, procs: Procs, run_monitor, capsys) -> None:
    a = procs.spawn(["sleep", "120"])
    b = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "ctr-a", a.pid, [(U0, 4 * GIB, 25)], pod="train-a", namespace="team1")
    make_container(st, "ctr-b", b.pid, [(U0, 8 * GIB, 75)], pod="train-b", namespace="team2")
    src = ScriptedSource({U0: {a.pid: 1 * GIB, b.pid: 2 * GIB}})
    r = run_monitor(src, policy="strict", metrics_port=0)
    # a (share 25) must be suspended part of the time
    assert poll(lambda: state(a.pid) == "T", 10)
    time.sleep(4)
    text = r.scrape()
    lab = {"container_id": "ctr-a", "pod": "train-a", "namespace": "team1", "container": "main", "gpu": "0"}
    assert metric(text, "vgpu_container_memory_used_bytes", **lab) == 1 * GIB
    assert metric(text, "vgpu_container_memory_limit_bytes", **lab) == 4 * GIB
    assert metric(text, "vgpu_container_sm_share_percent", **lab) == 25
    use_a = metric(text, "vgpu_container_sm_use_percent", **lab)
    assert use_a is not None and 10 <= use_a <= 45, use_a
    assert metric(text, "vgpu_gpu_memory_total_bytes", gpu="0", uuid=U0) == 16 * GIB
    assert (metric(text, "vgpu_container_suspensions_total", container_id="ctr-a") or 0) >= 2
    assert (metric(text, "vgpu_container_suspended_seconds_total", container_id="ctr-a") or 0) > 0.2
    sus_a = metric(text, "vgpu_container_suspended_seconds_total", container_id="ctr-a") or 0
    sus_b = metric(text, "vgpu_container_suspended_seconds_total", container_id="ctr-b") or 0
    assert sus_b < sus_a
    assert metric(text, "vgpu_monitor_guardian_armed") == 1
    assert (metric(text, "vgpu_monitor_loop_duration_seconds_count") or 0) > 5
    # status file and vgpuctl
    status = json.loads(Path(r.mon.paths.status_path).read_text())
    assert status["running"] and status["gpus"][0]["uuid"] == U0
    assert ctl.main(["status", "--state-dir", str(st)]) == 0
    out = capsys.readouterr().out
    assert "team1/train-a" in out and "team2/train-b" in out and "1.0/4.0" in out


def test_gpu_loss_resumes_its_containers(tmp_path: Path, procs: Procs, run_monitor) -> None:
    a = procs.spawn(["sleep", "120"])
    b = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "ctr-a", a.pid, [(U0, 4 * GIB, 10)])
    make_container(st, "ctr-b", b.pid, [(U0, 4 * GIB, 90)])
    src = ScriptedSource({U0: {a.pid: GIB, b.pid: GIB}})
    r = run_monitor(src, policy="strict", metrics_port=0)
    assert poll(lambda: state(a.pid) == "T", 10)
    src.down.add(U0)
    # never stopped again while the GPU is down
    time.sleep(0.3)
    assert poll(lambda: state(a.pid) == "S", 2)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert state(a.pid) != "T"
        time.sleep(0.01)
    assert metric(r.scrape(), "vgpu_gpu_up", uuid=U0) == 0
    src.down.clear()
    assert poll(lambda: state(a.pid) == "T", 10)


def test_cleanup_of_gone_containers(tmp_path: Path, procs: Procs, run_monitor) -> None:
    live = procs.spawn(["sleep", "120"])
    dead = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "live", live.pid, [(U0, GIB, 50)])
    make_container(st, "dead", dead.pid, [(U0, GIB, 50)])
    half = st / "containers" / "half-made"
    half.mkdir()
    run_monitor(ScriptedSource({U0: {}}), gc_grace_s=1.0, metrics_port=0)
    time.sleep(0.5)
    assert (st / "containers" / "dead").exists()
    dead.kill()
    dead.wait()
    assert poll(lambda: not (st / "containers" / "dead").exists(), 10)
    assert poll(lambda: not half.exists(), 10)
    time.sleep(1.5)
    assert (st / "containers" / "live" / "metadata.json").exists()


def test_idle_container_is_not_kept_suspended(tmp_path: Path, procs: Procs, run_monitor) -> None:
    a = procs.spawn(["sleep", "120"])
    b = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "ctr-a", a.pid, [(U0, GIB, 10)])
    make_container(st, "ctr-b", b.pid, [(U0, GIB, 90)])
    src = ScriptedSource({U0: {a.pid: GIB, b.pid: GIB}})
    run_monitor(src, policy="strict", metrics_port=0)
    assert poll(lambda: state(a.pid) == "T", 10)
    src.idle = {a.pid, b.pid}  # the GPU goes quiet: no samples at all
    time.sleep(3.0)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert state(a.pid) != "T"
        time.sleep(0.01)
