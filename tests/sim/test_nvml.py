"""NVML of the simulated node: utilisation samples, events and XIDs, lost GPUs, pid namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import popen_py, py, read_json_line

pytestmark = pytest.mark.timeout(180)

SAMPLES = """
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
def samples(last):
    try:
        return [[s.pid, s.timeStamp, s.smUtil] for s in pynvml.nvmlDeviceGetProcessUtilization(h, last)]
    except pynvml.NVMLError_NotFound:
        return "not found"
"""


def test_utilisation_samples_are_proportional_to_executed_kernel_time(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, queue_depth=50, sample_period_ms=100)
    try:
        # a saturating process and one that synchronises after every kernel: unequal shares
        a = gpu.popen(
            [gpu.burn, "--kernel-us", "2000", "--seconds", "2", "--hold", "60"], stdout=subprocess.PIPE, text=True
        )
        b = gpu.popen(
            [gpu.burn, "--kernel-us", "2000", "--seconds", "2", "--sync-every", "1", "--hold", "60"],
            stdout=subprocess.PIPE,
            text=True,
        )
        ra, rb = read_json_line(a), read_json_line(b)  # both done, idle, holding their contexts
        assert ra["kernels"] > 0 and rb["kernels"] > 0
        time.sleep(0.25)  # let the last sample period finish
        st = gpu.state()
        truth = {p["pid"]: p["devices"][0]["exec_ns"] for p in st["processes"]}
        out = py(gpu, SAMPLES, "print(json.dumps(samples(0)))")
        period = st["period_ns"]
        per_pid: dict[int, float] = {}
        for pid, _ts, sm in out:
            assert 0 < sm <= 100
            per_pid[pid] = per_pid.get(pid, 0.0) + sm / 100 * period
        assert set(per_pid) == {a.pid, b.pid}
        total_truth = truth[a.pid] + truth[b.pid]
        total_nvml = per_pid[a.pid] + per_pid[b.pid]
        for pid in (a.pid, b.pid):
            share_truth = truth[pid] / total_truth
            share_nvml = per_pid[pid] / total_nvml
            assert abs(share_truth - share_nvml) <= 0.05, (pid, share_truth, share_nvml)
            # and in absolute terms: each sample is rounded to a whole percent of its period
            n = sum(1 for s in out if s[0] == pid)
            assert abs(per_pid[pid] - truth[pid]) <= n * 0.005 * period + 1
        # the saturating process got the larger share
        assert truth[a.pid] > truth[b.pid]
    finally:
        gpu.close()


def test_last_seen_timestamp_returns_only_newer_samples(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, queue_depth=20, sample_period_ms=50)
    try:
        out = py(gpu, SAMPLES, "print(json.dumps(samples(0)))")
        assert out == "not found"  # nothing ran yet
        p = gpu.popen(
            [gpu.burn, "--kernel-us", "1000", "--seconds", "0.5", "--hold", "60"], stdout=subprocess.PIPE, text=True
        )
        read_json_line(p)
        time.sleep(0.15)
        out = py(
            gpu,
            SAMPLES,
            """
            first = samples(0)
            last = max(s[1] for s in first)
            again = samples(last)
            older = samples(min(s[1] for s in first))
            rates = pynvml.nvmlDeviceGetUtilizationRates(h)
            import time as t
            now_us = int(t.time() * 1e6)
            print(json.dumps(dict(first=first, again=again, older=older, gpu=rates.gpu, now_us=now_us)))
            """,
        )
        assert out["again"] == "not found"
        assert {s[0] for s in out["first"]} == {p.pid}
        ts = [s[1] for s in out["first"]]
        assert len(out["older"]) == len(ts) - 1  # strictly newer than lastSeen
        # timestamps are wall-clock microseconds of the periods' ends, 50 ms apart
        assert all(abs(out["now_us"] - t) < 60_000_000 for t in ts)
        assert all((b - a) % 50_000 == 0 for a, b in zip(sorted(ts), sorted(ts)[1:], strict=False))
        assert 0 <= out["gpu"] <= 100
    finally:
        gpu.close()


def test_utilisation_rates_follow_the_device(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=2, sample_period_ms=50, util_window_ms=500)
    try:
        p = gpu.popen(
            [gpu.burn, "--device", "1", "--kernel-us", "1000", "--seconds", "30"], stdout=subprocess.PIPE, text=True
        )
        time.sleep(1.0)
        out = py(
            gpu,
            """
            import pynvml
            pynvml.nvmlInit()
            r = [pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu for i in range(2)]
            print(json.dumps(r))
            """,
        )
        p.kill()
        assert out[0] == 0
        assert out[1] >= 90
    finally:
        gpu.close()


EVENTS = """
import pynvml
pynvml.nvmlInit()
h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
es = pynvml.nvmlEventSetCreate()
pynvml.nvmlDeviceRegisterEvents(h0, pynvml.nvmlEventTypeXidCriticalError, es)
pynvml.nvmlDeviceRegisterEvents(h1, pynvml.nvmlEventTypeXidCriticalError, es)
try:
    pynvml.nvmlEventSetWait_v2(es, 50)
    print(json.dumps("unexpected event"))
except pynvml.NVMLError_Timeout:
    print(json.dumps("timeout"))
print(json.dumps("ready"), flush=True)
got = []
for _ in range(2):
    d = pynvml.nvmlEventSetWait_v2(es, 30000)
    got.append([pynvml.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData, d.gpuInstanceId])
print(json.dumps(got), flush=True)
pynvml.nvmlEventSetFree(es)
"""


def test_injected_xid_reaches_an_event_set_waiter(fakegpu: FakeGPU) -> None:
    fakegpu.inject_xid(0, 13)  # before registration: not delivered
    child = popen_py(fakegpu, EVENTS)
    assert read_json_line(child) == "timeout"
    assert read_json_line(child) == "ready"
    fakegpu.inject_xid(1, 43)
    fakegpu.inject_xid(0, 48)
    got = read_json_line(child)
    assert child.wait(timeout=30) == 0
    assert got == [[1, 8, 43, 0xFFFFFFFF], [0, 8, 48, 0xFFFFFFFF]]


def test_a_lost_gpu(fakegpu: FakeGPU) -> None:
    child = popen_py(fakegpu, EVENTS)
    assert read_json_line(child) == "timeout"
    assert read_json_line(child) == "ready"
    holder = fakegpu.popen(
        [fakegpu.burn, "--device", "1", "--alloc", "1g", "--hold", "60"], stdout=subprocess.PIPE, text=True
    )
    read_json_line(holder)
    fakegpu.set_lost(1)
    fakegpu.inject_xid(0, 31)
    # Xid 79 ("fallen off the bus") announces the loss
    assert read_json_line(child) == [[1, 8, 79, 0xFFFFFFFF], [0, 8, 31, 0xFFFFFFFF]]
    out = py(
        fakegpu,
        """
        import pynvml
        pynvml.nvmlInit()
        res = {}
        try:
            pynvml.nvmlDeviceGetHandleByIndex(1)
            res["handle"] = "ok"
        except pynvml.NVMLError_GpuIsLost:
            res["handle"] = "lost"
        res["other"] = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total > 0
        ck(cu.cuInit(0), "init")
        c = ctypes.c_void_p()
        res["retain"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), 1)
        print(json.dumps(res))
        """,
    )
    assert out == {"handle": "lost", "other": True, "retain": 46}  # CUDA_ERROR_DEVICE_UNAVAILABLE
    assert fakegpu.state()["devices"][1]["lost"] is True
    fakegpu.set_lost(1, False)
    r = fakegpu.run([fakegpu.burn, "--device", "1", "--alloc", "1m"])
    assert r.returncode == 0, r.stdout


def _host_pid_of(unshare_pid: int, timeout: float = 20) -> int:
    """The pid (here) of the process unshare forked into the new namespace."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if int(fields.get("PPid", "0").strip() or 0) == unshare_pid and "fakegpu-burn" in fields.get("Name", ""):
                return int(entry)
        time.sleep(0.05)
    raise AssertionError("no child in the new pid namespace")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_processes_in_other_pid_namespaces_show_with_host_pids(fakegpu: FakeGPU) -> None:
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create pid namespaces here: {probe.stderr!r}")
    u = fakegpu.popen(
        ["unshare", "--pid", "--fork", "--mount-proc", fakegpu.burn, "--alloc", "256m", "--hold", "60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    inner = read_json_line(u)
    assert inner["pid"] == 1  # as the process sees itself
    host_pid = _host_pid_of(u.pid)
    mine = fakegpu.popen([fakegpu.burn, "--alloc", "128m", "--hold", "60"], stdout=subprocess.PIPE, text=True)
    read_json_line(mine)
    out = py(
        fakegpu,
        """
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps(sorted([p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))))
        """,
    )
    overhead = 300 << 20
    assert out == sorted([[host_pid, (256 << 20) + overhead], [mine.pid, (128 << 20) + overhead]])
    st = fakegpu.state()
    row = next(p for p in st["processes"] if p["pid"] == 1)
    assert row["host_pid"] == host_pid
    # inside the namespace, NVML reports the host pids too (as the real driver does)
    script = textwrap.dedent(
        """
        import json, pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps(sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))))
        """
    )
    r = fakegpu.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == sorted([host_pid, mine.pid])
    u.kill()


NVML_WATCH = """
import json, sys, time, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
def view():
    return [sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
            pynvml.nvmlDeviceGetMemoryInfo(h).used]
print(json.dumps(view()), flush=True)
sys.stdin.readline()  # the process has been killed
t0 = time.monotonic()
while view()[0] and time.monotonic() - t0 < 20:
    time.sleep(0.01)
print(json.dumps(view() + [time.monotonic() - t0]), flush=True)
"""


def test_a_long_lived_nvml_caller_sees_a_killed_process_go(fakegpu: FakeGPU) -> None:
    """NVML probes slot liveness at most every 200 ms per process (docs/developers/simulators.md): a killed
    process still leaves the process list and its memory is released, within that bound."""
    p = fakegpu.popen([fakegpu.burn, "--alloc", "1g", "--hold", "60"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and json.loads(p.stdout.readline())["alloc_result"] == 0
    w = fakegpu.popen(
        [sys.executable, "-u", "-c", NVML_WATCH], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert w.stdin is not None and w.stdout is not None
    assert json.loads(w.stdout.readline()) == [[p.pid], (1 << 30) + (300 << 20)]
    p.kill()
    p.wait()
    w.stdin.write("killed\n")
    w.stdin.flush()
    pids, used, elapsed = json.loads(w.stdout.readline())
    assert pids == [] and used == 0
    assert elapsed < 5  # 200 ms sweep; generous for a loaded machine
    assert w.wait(timeout=30) == 0


def test_samples_keep_coming_while_a_stopped_process_holds_the_lock(fakegpu: FakeGPU) -> None:
    """The device does not stop when a process is stopped inside the simulator's lock: queued
    kernels keep running, and NVML reports their samples without waiting for the lock."""
    import signal

    p = fakegpu.popen([fakegpu.burn, "--kernel-us", "1000", "--seconds", "60"], stdout=subprocess.PIPE, text=True)
    w = fakegpu.popen(
        [sys.executable, "-u", "-c", textwrap.dedent(SAMPLES) + WATCH_SAMPLES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert w.stdin is not None and w.stdout is not None
    assert w.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # the burn's queue is full: about a second of queued kernels
    holder = fakegpu.popen([fakegpu.ctl_path, "hold-lock", "600"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        stopped_us = time.time_ns() // 1000
        w.stdin.write(f"{stopped_us}\n")
        w.stdin.flush()
        got = json.loads(w.stdout.readline())
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
    # samples of periods after the stop, of the burn, busy (its queue drains at full speed)
    assert got["elapsed"] < 5
    mine = [s for s in got["samples"] if s[0] == p.pid]
    assert len(mine) >= 2, got
    assert all(s[1] > stopped_us for s in mine)
    assert max(s[2] for s in mine) >= 90, got


WATCH_SAMPLES = """
import json, sys, time
print("ready", flush=True)
since = int(sys.stdin.readline())
t0 = time.monotonic()
time.sleep(0.45)  # a few 100 ms periods after the stop
out = samples(since)
print(json.dumps({"samples": out if isinstance(out, list) else [], "elapsed": time.monotonic() - t0}), flush=True)
"""
