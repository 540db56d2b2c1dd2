"""vgpu-monitor as a real subprocess on the simulated GPU (sim/fakegpu): pynvml against the
fake NVML, `fakegpu-burn` workloads, real signals.  Ground truth for shares is each workload's
executed kernel time from the simulator, never NVML.  Tolerances are loose on purpose (a loaded
2-core CI machine); the precise figures come from `make bench-shares`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitor import ledger
from tests.monitor.helpers import Gated, MonitorProc, Monitors, Procs, exec_ns, make_container, metric, state
from tests.support import regions
from tests.support.poll import poll
from vgpu import region as vregion
from vgpuctl import cli as ctl

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
GIB = 1 << 30
MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def node(fakegpu, tmp_path: Path, procs: Procs) -> Iterator:
    """(fakegpu, state dir, start_monitor(*flags), spawn(cid, share, argv, mem_limit, gpu))."""
    st = tmp_path / "state"
    monitors = Monitors(st, fakegpu.env, procs)
    workers: list[Gated] = []

    def spawn(
        cid: str,
        share: int,
        argv: list[str],
        mem_limit: int = 8 * GIB,
        gpu: int = 0,
        release: bool = True,
        device_limit: int | None = None,
        env: dict[str, str] | None = None,
    ):
        w = Gated(argv, {**fakegpu.env, **(env or {})}, procs)
        g = (
            (fakegpu.uuids[gpu], mem_limit, share)
            if device_limit is None
            else (fakegpu.uuids[gpu], mem_limit, share, device_limit)
        )
        make_container(st, cid, w.pid, [g], pod=f"pod-{cid}", namespace="ns1")
        workers.append(w)
        if release:
            w.release()
        return w

    try:
        yield fakegpu, st, monitors.start, spawn
    finally:
        monitors.stop_all()
        for w in workers:
            w.kill()


def burn(fakegpu, seconds: int = 60, kernel_us: int = 100) -> list[str]:
    return [fakegpu.burn, "--kernel-us", str(kernel_us), "--seconds", str(seconds)]


def measured_shares(fakegpu, pids: list[int], seconds: float) -> dict[int, float]:
    a = exec_ns(fakegpu.state())
    t0 = time.monotonic()
    time.sleep(seconds)
    b = exec_ns(fakegpu.state())
    wall = (time.monotonic() - t0) * 1e9
    return {p: 100.0 * (b.get(p, 0) - a.get(p, 0)) / wall for p in pids}


def _claim_slot(region_path: Path, index: int, pid: int, start: int, device_bytes: int) -> None:
    """Do what libvgpu.so does for a process: an active slot with its pid and start time."""
    regions.claim_slot(region_path, index, pid, 0, start, device_bytes={0: device_bytes}, bump_generation=True)


@pytest.mark.parametrize("shares", [[30, 70], [20, 30, 50]], ids=["30-70", "20-30-50"])
def test_strict_shares_track_targets(node, shares: list[int]) -> None:
    fakegpu, _st, start_monitor, spawn = node
    start_monitor("--policy", "strict")
    ws = [spawn(f"c{i}", s, burn(fakegpu)) for i, s in enumerate(shares)]
    time.sleep(5)  # settle
    got = measured_shares(fakegpu, [w.pid for w in ws], 4.0)
    for w, s in zip(ws, shares, strict=True):
        assert abs(got[w.pid] - s) <= 12, (shares, got)
    assert sum(got.values()) >= 85, got  # the GPU stays busy


def test_contended_lone_container_gets_the_whole_gpu_then_shares(node) -> None:
    fakegpu, _st, start_monitor, spawn = node
    mon = start_monitor("--policy", "contended")
    a = spawn("lone", 30, burn(fakegpu))
    time.sleep(2.5)
    got = measured_shares(fakegpu, [a.pid], 2.0)
    assert got[a.pid] >= 90, got
    assert metric(mon.scrape(), "vgpu_container_suspensions_total", container_id="lone") == 0
    # a demanding neighbour arrives: now the shares hold
    b = spawn("neighbour", 70, burn(fakegpu))
    time.sleep(5)
    got = measured_shares(fakegpu, [a.pid, b.pid], 3.0)
    assert abs(got[a.pid] - 30) <= 12 and abs(got[b.pid] - 70) <= 12, got


def test_metrics_status_vgpuctl_and_extra_bytes(node, capsys) -> None:
    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--policy", "strict")
    a = spawn("ctr-a", 25, [fakegpu.burn, "--alloc", "512m", "--kernel-us", "100", "--seconds", "60"], 4 * GIB)
    b = spawn("ctr-b", 75, burn(fakegpu), 8 * GIB)
    # the library's slot for a's process: it charged 512 MiB itself
    start = int(Path(f"/proc/{a.pid}/stat").read_text().rpartition(")")[2].split()[19])
    _claim_slot(st / "containers" / "ctr-a" / "region", 0, a.pid, start, 512 * MIB)
    assert poll(lambda: state(a.pid) == "T", 10)  # throttled at some point
    time.sleep(3)
    used_a = next(p for p in fakegpu.state()["processes"] if p["host_pid"] == a.pid)["devices"][0]["used"]
    text = mon.scrape()
    lab = {"container_id": "ctr-a", "namespace": "ns1", "pod": "pod-ctr-a", "container": "main", "gpu": "0"}
    assert metric(text, "vgpu_container_memory_used_bytes", **lab) == used_a
    assert metric(text, "vgpu_container_memory_limit_bytes", **lab) == 4 * GIB
    assert metric(text, "vgpu_container_sm_share_percent", **lab) == 25
    use = metric(text, "vgpu_container_sm_use_percent", **lab)
    assert use is not None and 10 <= use <= 45, use
    assert (metric(text, "vgpu_container_suspensions_total", container_id="ctr-a") or 0) >= 1
    assert metric(text, "vgpu_gpu_memory_total_bytes", gpu="0", uuid=fakegpu.uuids[0]) == 16 * GIB
    assert metric(text, "vgpu_gpu_up", gpu="1", uuid=fakegpu.uuids[1]) == 1
    assert metric(text, "vgpu_monitor_guardian_armed") == 1
    # extra_bytes: what NVML sees beyond the library's 512 MiB (the context overhead)
    snap = vregion.read_region(str(st / "containers" / "ctr-a" / "region"))
    assert snap.slots[0].extra_bytes[0] == used_a - 512 * MIB > 0
    assert ctl.main(["status", "--state-dir", str(st)]) == 0
    out = capsys.readouterr().out
    assert "ns1/pod-ctr-a" in out and "ns1/pod-ctr-b" in out and "/4.0" in out
    del b


def test_measured_context_size_is_published_for_the_device_plugin(node) -> None:
    """The smallest extra bytes of a process on a GPU (its base context: by the simulator's own
    count, its context_overhead) goes to <state_dir>/context-sizes.json, once, not every pass."""
    from vgpu import contextsizes

    fakegpu, st, start_monitor, spawn = node
    overhead = fakegpu.state()["devices"][0]["context_overhead"]
    assert overhead > 1 * MIB
    path = st / "context-sizes.json"
    start_monitor()
    a = spawn("ctx-a", 50, [fakegpu.burn, "--alloc", "512m", "--kernel-us", "100", "--seconds", "60"])
    b = spawn("ctx-b", 50, [fakegpu.burn, "--alloc", "1g", "--kernel-us", "100", "--seconds", "60"])
    for cid, w, charged in (("ctx-a", a, 512 * MIB), ("ctx-b", b, 256 * MIB)):
        # b's library charged less than it holds: its extra is larger than its context
        start = int(Path(f"/proc/{w.pid}/stat").read_text().rpartition(")")[2].split()[19])
        _claim_slot(st / "containers" / cid / "region", 0, w.pid, start, charged)
    assert poll(lambda: contextsizes.read(str(path)) == {fakegpu.uuids[0]: overhead}, 15), (
        contextsizes.read(str(path)),
        overhead,
    )
    written = path.stat().st_mtime_ns
    time.sleep(2.5)  # several passes with the same measurement: no rewrite
    assert path.stat().st_mtime_ns == written
    assert contextsizes.read(str(path)) == {fakegpu.uuids[0]: overhead}  # GPU 1 has no process: unknown


def test_program_filling_its_limit_at_once_with_the_measured_reserve_is_not_killed(node) -> None:
    """End to end on one node: the monitor measures the context of a first process; a container
    given that size as VGPU_CONTEXT_RESERVE (what the front ends hand out, reserve_for) through
    libvgpu.so allocates its whole limit at once and stays within it by the simulator's own count.
    The same program without it puts limit + context on the GPU and the backstop kills it."""
    from vgpu import contextsizes

    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--backstop-action", "kill", "--backstop-grace-s", "0.5")
    first = spawn("first", 30, [fakegpu.burn, "--alloc", "256m", "--seconds", "0", "--hold", "60"], 2 * GIB)
    start = int(Path(f"/proc/{first.pid}/stat").read_text().rpartition(")")[2].split()[19])
    _claim_slot(st / "containers" / "first" / "region", 0, first.pid, start, 256 * MIB)
    path = str(st / "context-sizes.json")
    assert poll(lambda: contextsizes.read(path).get(fakegpu.uuids[0]), 15)
    reserve = contextsizes.reserve_for(path, [fakegpu.uuids[0]])
    overhead = fakegpu.state()["devices"][0]["context_overhead"]
    assert reserve == overhead

    def lib(cid: str) -> dict[str, str]:
        d = st / "containers" / cid
        return {"LD_PRELOAD": str(ROOT / "build" / "libvgpu.so"), "VGPU_LIMITS_FILE": str(d / "limits"),
                "VGPU_REGION_FILE": str(d / "region")}  # fmt: skip

    argv = [str(ROOT / "build" / "intercept" / "cutest"), "gpa", "init", *["alloc", str(512 * MIB)] * 4]
    argv += ["sleepms", "60000"]
    fits = spawn("fits", 30, argv, 2 * GIB, env={**lib("fits"), "VGPU_CONTEXT_RESERVE": str(reserve)})
    over = spawn("over", 30, argv, 2 * GIB, env=lib("over"))

    def used(pid: int) -> int:
        return sum(d["used"] for p in fakegpu.state()["processes"] if p["host_pid"] == pid for d in p["devices"])

    assert poll(lambda: over.proc.poll() is not None, 15)  # 4 x 512 MiB + its context on a 2 GiB share
    assert over.proc.returncode == -signal.SIGKILL
    assert poll(lambda: used(fits.pid) == 3 * 512 * MIB + overhead, 10)  # the 4th chunk was refused
    time.sleep(1.5)  # past the backstop's grace
    assert fits.proc.poll() is None and used(fits.pid) <= 2 * GIB
    text = mon.scrape()
    assert metric(text, "vgpu_container_backstop_actions_total", container_id="fits", action="kill") == 0
    assert metric(text, "vgpu_container_backstop_actions_total", container_id="over", action="kill") == 1


def test_kill9_monitor_guardian_resumes_and_restart_replays(node) -> None:
    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--policy", "strict", "--max-suspend-ms", "5000", "--duty-period-ms", "2000")
    ws = [spawn(f"c{i}", s, burn(fakegpu)) for i, s in enumerate([5, 5, 90])]
    assert poll(lambda: state(ws[0].pid) == "T" and state(ws[1].pid) == "T", 15)
    mon.proc.kill()  # no SIGTERM handler runs; nobody restarts it
    t0 = time.monotonic()
    assert poll(lambda: all(state(w.pid) != "T" for w in ws), 2.0)
    assert time.monotonic() - t0 <= 2.0
    # ledger.resume_all sends SIGCONT first and empties the ledger after: it is empty soon after
    assert poll(lambda: ledger.read(str(st / "monitor" / "ledger")) == set(), 2.0)

    # now kill the monitor AND its guardian: the processes stay stopped until a new monitor starts
    mon2 = start_monitor("--policy", "strict", "--max-suspend-ms", "5000", "--duty-period-ms", "2000")
    assert poll(lambda: state(ws[0].pid) == "T" and state(ws[1].pid) == "T", 15)
    g = mon2.guardian_pid()
    assert g is not None
    os.kill(g, signal.SIGKILL)
    mon2.proc.kill()
    mon2.proc.wait()
    stopped = [w for w in ws if state(w.pid) == "T"]
    assert stopped, "expected something left stopped without a guardian"
    assert {k.pid for k in ledger.read(str(st / "monitor" / "ledger"))} >= {w.pid for w in stopped}
    mon3 = MonitorProc(st, fakegpu.env, "--policy", "off")
    try:
        assert poll(lambda: all(state(w.pid) != "T" for w in ws), 10)
    finally:
        mon3.stop()


def test_process_exiting_while_stopped(node) -> None:
    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--policy", "strict", "--max-suspend-ms", "5000", "--duty-period-ms", "2000")
    a = spawn("short", 5, burn(fakegpu))
    spawn("long", 95, burn(fakegpu))
    assert poll(lambda: state(a.pid) == "T", 15)
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(5)
    assert poll(lambda: not ledger.read(str(st / "monitor" / "ledger")), 5)
    assert mon.proc.poll() is None
    assert (mon.status() or {}).get("suspended_processes", 1) == 0 or poll(
        lambda: (mon.status() or {}).get("suspended_processes") == 0, 5
    )


@pytest.mark.parametrize("action", ["kill", "log"])
def test_backstop_for_allocation_bypassing_the_library(node, action: str) -> None:
    fakegpu, _st, start_monitor, spawn = node
    mon = start_monitor("--backstop-action", action, "--backstop-grace-s", "0.5")
    ok = spawn("fits", 50, [fakegpu.burn, "--alloc", "256m", "--seconds", "0", "--hold", "60"], 1 * GIB)
    hog = spawn(
        "hog", 50, [fakegpu.burn, "--device", "1", "--alloc", "2g", "--seconds", "0", "--hold", "60"], GIB, gpu=1
    )
    if action == "kill":
        assert poll(lambda: hog.proc.poll() is not None, 15)
        assert hog.proc.returncode == -signal.SIGKILL
    else:
        time.sleep(3)
        assert hog.proc.poll() is None
    assert poll(
        lambda: metric(mon.scrape(), "vgpu_container_backstop_actions_total", container_id="hog", action=action) == 1,
        10,
    )
    assert ok.proc.poll() is None
    assert metric(mon.scrape(), "vgpu_container_backstop_actions_total", container_id="fits", action=action) == 0


def test_oversubscribed_containers_host_bytes_and_the_backstop_against_the_share(node) -> None:
    """A container with a 4 GiB slice and a 2 GiB physical share, through libvgpu.so: host bytes
    exported, NVML use inside the share, no backstop. One that bypasses the library and holds more
    than its share on the device (though less than its slice) is killed."""
    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--backstop-action", "kill", "--backstop-grace-s", "0.5")
    d = st / "containers" / "ovs"
    lib = {
        "LD_PRELOAD": str(ROOT / "build" / "libvgpu.so"),
        "VGPU_LIMITS_FILE": str(d / "limits"),
        "VGPU_REGION_FILE": str(d / "region"),
        "VGPU_CONTEXT_RESERVE": "300m",  # the simulator's context: the library counts it from the start
    }
    cutest = str(ROOT / "build" / "intercept" / "cutest")
    argv = [cutest, "gpa", "init", *["alloc", str(512 * MIB)] * 8, "sleepms", "60000"]
    ovs = spawn("ovs", 50, argv, 4 * GIB, device_limit=2 * GIB, env=lib)
    hog = spawn("hog", 50, [fakegpu.burn, "--alloc", "2g", "--seconds", "0", "--hold", "60"], 4 * GIB, device_limit=GIB)
    lab = {"container_id": "ovs", "namespace": "ns1", "pod": "pod-ovs", "container": "main", "gpu": "0"}
    # 3 chunks + the context on the device (1.8 GiB of 2), 4 in host memory, the 8th over the slice
    on_device = 3 * 512 * MIB + 300 * MIB  # NVML's view: the context is memory of the process
    assert poll(
        lambda: (
            (
                metric(t := mon.scrape(), "vgpu_container_memory_host_bytes", **lab),
                metric(t, "vgpu_container_memory_used_bytes", **lab),
            )
            == (2 * GIB, on_device)
        ),
        15,
    )
    text = mon.scrape()
    assert metric(text, "vgpu_container_memory_device_limit_bytes", **lab) == 2 * GIB
    assert metric(text, "vgpu_container_memory_limit_bytes", **lab) == 4 * GIB
    assert poll(lambda: hog.proc.poll() is not None, 15)  # 2.3 GiB on the device, share 1 GiB
    assert hog.proc.returncode == -signal.SIGKILL
    time.sleep(1.5)
    assert ovs.proc.poll() is None
    assert metric(mon.scrape(), "vgpu_container_backstop_actions_total", container_id="ovs", action="kill") == 0
    snap = mon.status() or {}
    [row] = [r for g in snap["gpus"] for r in g["containers"] if r["container_id"] == "ovs"]
    assert (row["memory_host"], row["memory_device_limit"], row["memory_limit"]) == (2 * GIB, 2 * GIB, 4 * GIB)


def test_corrupt_region_gpu_loss_and_cleanup(node, procs: Procs) -> None:
    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--policy", "strict", "--gc-grace-s", "1")
    a = spawn("victim", 10, burn(fakegpu))
    spawn("other", 90, burn(fakegpu))
    bystander = procs.spawn(["sleep", "120"])  # a live container with no GPU work yet
    make_container(st, "bystander", bystander.pid, [(fakegpu.uuids[1], GIB, 50)])
    # a hostile container scribbles over its region
    (st / "containers" / "victim" / "region").write_bytes(os.urandom(4096))
    assert poll(lambda: metric(mon.scrape(), "vgpu_container_region_corrupt", container_id="victim") == 1, 10)
    # GPU 0 is lost: everything on it resumes, GPU 1 and the monitor carry on
    assert poll(lambda: state(a.pid) == "T", 10)
    fakegpu.set_lost(0)
    assert poll(lambda: metric(mon.scrape(), "vgpu_gpu_up", gpu="0") == 0, 10)
    assert poll(lambda: state(a.pid) != "T", 3)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert state(a.pid) != "T"
        time.sleep(0.02)
    assert metric(mon.scrape(), "vgpu_gpu_up", gpu="1") == 1
    fakegpu.set_lost(0, False)
    assert poll(lambda: metric(mon.scrape(), "vgpu_gpu_up", gpu="0") == 1, 15)
    assert mon.proc.poll() is None
    # gone containers (the lost GPU may have ended the workloads too) lose their state directory
    a.kill()
    assert poll(lambda: not (st / "containers" / "victim").exists(), 15)
    time.sleep(1.5)
    assert (st / "containers" / "bystander" / "metadata.json").exists()


def test_sigterm_resumes_everything_before_exit(node) -> None:
    fakegpu, st, start_monitor, spawn = node
    mon = start_monitor("--policy", "strict", "--max-suspend-ms", "5000", "--duty-period-ms", "3000")
    a = spawn("small", 5, burn(fakegpu))
    spawn("big", 95, burn(fakegpu))
    assert poll(lambda: state(a.pid) == "T", 15)
    assert mon.stop() == 0
    assert state(a.pid) != "T"
    assert ledger.read(str(st / "monitor" / "ledger")) == set()
    status = mon.status()
    assert status is not None and status["running"] is False
