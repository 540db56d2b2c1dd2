"""The kernel model: one kernel at a time per device, bounded asynchronous queues, time-slicing,
queued work that drains while its process is stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.support.poll import wait_for

pytestmark = pytest.mark.timeout(180)


def proc_dev(state: dict[str, Any], pid: int, index: int = 0) -> dict[str, Any]:
    for p in state["processes"]:
        if p["pid"] == pid:
            for d in p["devices"]:
                if d["index"] == index:
                    return dict(d)
    raise AssertionError(f"pid {pid} not in the state")


def test_launches_block_on_a_full_queue_and_synchronisation_waits(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, queue_depth=10)
    try:
        r = gpu.run([gpu.burn, "--kernel-us", "50000", "--seconds", "0.3"])
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        # 10 queue immediately, then one per 50 ms kernel: never many more
        assert 10 <= out["kernels"] <= 10 + 0.3 / 0.05 + 3
        # every kernel ran (one at a time) before the final synchronisation returned
        assert out["elapsed_s"] >= out["kernel_ns_total"] / 1e9 * 0.98
    finally:
        gpu.close()


def test_competing_processes_time_slice_fairly(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1)
    try:
        # different kernel lengths: time-slicing, not kernel counts, decides the share
        a = gpu.popen([gpu.burn, "--kernel-us", "1000", "--seconds", "4"], stdout=subprocess.PIPE, text=True)
        b = gpu.popen([gpu.burn, "--kernel-us", "3000", "--seconds", "4"], stdout=subprocess.PIPE, text=True)

        def both_queued() -> bool:
            st = gpu.state()
            try:
                return proc_dev(st, a.pid)["queued"] > 0 and proc_dev(st, b.pid)["queued"] > 0
            except AssertionError:
                return False

        wait_for(both_queued, 30)
        s0 = gpu.state()
        time.sleep(1.0)
        s1 = gpu.state()
        da = proc_dev(s1, a.pid)["exec_ns"] - proc_dev(s0, a.pid)["exec_ns"]
        db = proc_dev(s1, b.pid)["exec_ns"] - proc_dev(s0, b.pid)["exec_ns"]
        busy = s1["devices"][0]["busy_ns"] - s0["devices"][0]["busy_ns"]
        elapsed = s1["now_ns"] - s0["now_ns"]
        assert da + db == busy
        assert busy >= 0.95 * elapsed  # saturated: a kernel always ran
        assert 0.4 <= da / busy <= 0.6, (da, db)
        a.kill()
        b.kill()
    finally:
        gpu.close()


def test_queued_kernels_drain_while_the_process_is_stopped(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, queue_depth=100)
    try:
        p = gpu.popen([gpu.burn, "--kernel-us", "5000", "--seconds", "30"], stdout=subprocess.PIPE, text=True)
        wait_for(
            lambda: any(
                q["pid"] == p.pid and q["devices"] and q["devices"][0]["queued"] >= 50 for q in gpu.state()["processes"]
            ),
            30,
        )
        os.kill(p.pid, signal.SIGSTOP)
        try:
            s0 = gpu.state()
            queued = proc_dev(s0, p.pid)["queued"]
            launched = proc_dev(s0, p.pid)["launched"]
            assert queued > 0
            # the queue (<= 100 x 5 ms) drains with nobody from the process running
            wait_for(lambda: proc_dev(gpu.state(), p.pid)["queued"] == 0, timeout=20)
            s1 = gpu.state()
            d1 = proc_dev(s1, p.pid)
            assert d1["launched"] == launched  # stopped: no new launches
            assert d1["completed"] == launched
            assert d1["exec_ns"] - proc_dev(s0, p.pid)["exec_ns"] >= (queued - 1) * 5_000_000
            time.sleep(0.3)
            assert proc_dev(gpu.state(), p.pid)["exec_ns"] == d1["exec_ns"]  # and then the device idles
        finally:
            os.kill(p.pid, signal.SIGCONT)
        # resumed, it launches again
        wait_for(lambda: proc_dev(gpu.state(), p.pid)["launched"] > launched, 30)
        p.kill()
    finally:
        gpu.close()


def test_a_process_holding_memory_killed_with_sigkill_is_reaped(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, context_overhead=1 << 20)
    try:
        p = gpu.popen(
            [gpu.burn, "--alloc", "2g", "--kernel-us", "1000", "--seconds", "30"], stdout=subprocess.PIPE, text=True
        )
        wait_for(
            lambda: any(
                q["pid"] == p.pid and q["devices"] and q["devices"][0]["queued"] > 0 for q in gpu.state()["processes"]
            ),
            30,
        )
        assert gpu.state()["devices"][0]["used"] == (2 << 30) + (1 << 20)
        p.kill()
        p.wait()
        st = gpu.state()
        assert st["processes"] == []
        assert st["devices"][0]["used"] == 0
        # its queued work is gone with it: the device goes idle
        busy = st["devices"][0]["busy_ns"]
        time.sleep(0.2)
        assert gpu.state()["devices"][0]["busy_ns"] == busy
    finally:
        gpu.close()


def test_kill_9_while_holding_the_state_lock_blocks_nobody(fakegpu: FakeGPU) -> None:
    holder = fakegpu.popen([fakegpu.ctl_path, "hold-lock", "600"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    waiter = fakegpu.popen([fakegpu.ctl_path, "lock-wait"], stdout=subprocess.PIPE, text=True)
    assert waiter.stdout is not None and waiter.stdout.readline().strip() == "waiting"
    time.sleep(0.3)  # the waiter is blocked in the lock by now
    assert waiter.poll() is None
    killed = time.monotonic_ns()  # CLOCK_MONOTONIC, as the waiter's timestamp
    holder.kill()
    acquired = int(waiter.stdout.readline())
    assert waiter.wait(timeout=10) == 0
    assert acquired - killed < 100_000_000, f"{(acquired - killed) / 1e6:.1f} ms"
    # and a driver user gets through right away
    r = fakegpu.run([fakegpu.burn, "--alloc", "1m"], timeout=30)
    assert r.returncode == 0 and read_json_line_text(r.stdout)["alloc_result"] == 0


def read_json_line_text(text: str) -> Any:
    return json.loads(text.splitlines()[-1])


def test_readers_do_not_wait_for_a_stopped_lock_holder(fakegpu: FakeGPU) -> None:
    """A monitor SIGSTOPs processes; one stopped inside the simulator's lock must not hang NVML."""
    p = fakegpu.popen([fakegpu.burn, "--alloc", "1g", "--hold", "60"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and json.loads(p.stdout.readline())["alloc_result"] == 0
    holder = fakegpu.popen([fakegpu.ctl_path, "hold-lock", "600"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        st = fakegpu.state()
        code = (
            "import json, pynvml\n"
            "pynvml.nvmlInit()\n"
            "h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
            "print(json.dumps([pynvml.nvmlDeviceGetMemoryInfo(h).used,"
            " [q.pid for q in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],"
            " pynvml.nvmlDeviceGetUtilizationRates(h).gpu]))\n"
        )
        import sys

        r = fakegpu.run([sys.executable, "-c", code], timeout=60)
        elapsed = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        used, pids, util = json.loads(r.stdout)
        assert st["snapshot"] is True
        assert proc_dev(st, p.pid)["allocated"] == 1 << 30
        assert pids == [p.pid] and used == (1 << 30) + (300 << 20) and util == 0
        assert elapsed < 10  # answered from snapshots (20 ms lock timeout per call), not after the stop
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    holder.kill()
    holder.wait()
    assert fakegpu.state()["snapshot"] is False


STOPPED_HOLDER_CLIENT = """
from ctypes import byref, c_int, c_uint, c_ulonglong, c_void_p
ctx(0)
mod, fn = c_void_p(), c_void_p()
ck(cu.cuModuleLoadData(byref(mod), SPIN_PTX), "load")
ck(cu.cuModuleGetFunction(byref(fn), mod, b"spin"), "func")
cu.cuLaunchKernel.argtypes = [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                              c_void_p, c_void_p]
ns = c_ulonglong(1000)
params = (c_void_p * 1)(ctypes.cast(byref(ns), c_void_p))
ck(alloc(1 << 20)[0], "first alloc")  # registered, before the lock is taken
print(json.dumps("ready"), flush=True)
sys.stdin.readline()  # the lock is held by a stopped process now
t0 = time.monotonic()
ok = [alloc(1 << 20)[0] == 0 for _ in range(4)]
ok += [cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None) == 0 for _ in range(20)]
print(json.dumps({"ok": all(ok), "elapsed_ms": (time.monotonic() - t0) * 1e3}), flush=True)
"""


@pytest.mark.xfail(
    strict=True,
    reason="known fidelity gap (docs/developers/simulators.md, Locking): launches and allocations take the state lock, "
    "so a process stopped inside it stalls them until it is resumed; readers already do not wait",
)
def test_a_stopped_lock_holder_does_not_stall_launches_and_allocations(fakegpu: FakeGPU) -> None:
    """On a real GPU a stopped process cannot block other processes' launches or allocations."""
    import sys

    from tests.sim.helpers import CUDA_PRELUDE

    client = fakegpu.popen(
        [sys.executable, "-u", "-c", CUDA_PRELUDE + STOPPED_HOLDER_CLIENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    assert json.loads(client.stdout.readline()) == "ready"
    holder = fakegpu.popen([fakegpu.ctl_path, "hold-lock", "600"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGSTOP)  # stopped inside the lock, as by a monitor mid driver call
    resumed = False
    try:
        client.stdin.write("go\n")
        client.stdin.flush()
        os.set_blocking(client.stdout.fileno(), False)
        deadline = time.monotonic() + 3.0  # generous: the bound asserted below is 200 ms
        line = ""
        while time.monotonic() < deadline and not line:
            time.sleep(0.02)
            line = client.stdout.readline() or ""
        if not line:
            # still blocked: resume the holder so the client finishes, then report the stall
            os.kill(holder.pid, signal.SIGCONT)
            resumed = True
            holder.kill()
            os.set_blocking(client.stdout.fileno(), True)
            line = client.stdout.readline()
        out = json.loads(line)
        assert out["ok"]
        assert not resumed and out["elapsed_ms"] < 200, f"stalled {out['elapsed_ms']:.0f} ms by a stopped holder"
    finally:
        if not resumed:
            os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
        client.kill()
        client.wait()
