"""Racing processes, threads, kill -9 and fork against one region."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.libcuda_intercept.support import FAKE, MiB, Node
from vgpu import region as R


def _waiting(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None
    while "waiting" not in (ln := p.stdout.readline()):
        assert ln, p.stderr.read() if p.stderr else "exited"


def _sampler(node: Node, stop: threading.Event, peaks: list[int]) -> None:
    """Sample the simulator's device usage (what the driver really handed out)."""
    while not stop.is_set():
        try:
            peaks.append(node.used())
        except (subprocess.SubprocessError, ValueError, KeyError):
            pass


@pytest.mark.timeout(240)
def test_8_processes_x_1000_random_alloc_free_never_exceed(node: Node) -> None:
    limit = 256 * MiB
    node.limit(limit)
    node.cutest("gpa", "init")  # create the simulator state and region first
    stop = threading.Event()
    peaks: list[int] = []
    th = threading.Thread(target=_sampler, args=(node, stop, peaks), daemon=True)
    th.start()
    procs = [node.popen("gpa" if i % 2 else "link", "init", "race", 1000, 48 * MiB, i + 1, 1000) for i in range(8)]
    outs = [p.communicate(timeout=200) for p in procs]
    stop.set()
    th.join(timeout=30)
    oks = ooms = 0
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        race = next(ln for ln in out.splitlines() if ln.startswith("race "))
        f = dict(kv.split("=") for kv in race.split()[1:])
        assert f["other"] == "0", race
        oks += int(f["ok"])
        ooms += int(f["oom"])
    assert oks > 1000 and ooms > 100, (oks, ooms)  # the limit was really contended
    assert len(peaks) > 20, f"only {len(peaks)} simulator samples"
    assert max(peaks) <= limit, f"simulator saw {max(peaks)} bytes in use, limit {limit}"
    assert node.used() == 0
    snap = R.read_region(str(node.region))
    assert sum(s.device_bytes[0] for s in snap.slots) == 0


def test_threads_of_one_process(node: Node) -> None:
    node.limit(8 * MiB)
    r = node.cutest("gpa", "init", "threads", 8, 300, MiB, "info")
    assert r.one("threads")["fails"] == "0"  # 8 threads x 1 MiB fit exactly
    assert r.one("info")["free"] == str(8 * MiB)
    node.limit(5 * MiB)
    r = node.cutest("dlsym", "init", "threads", 8, 300, MiB, "info")
    assert r.rc == 0 and int(r.one("threads")["fails"]) >= 0  # how many overlap depends on scheduling
    assert r.one("info")["free"] == str(5 * MiB)  # every charge returned


def test_kill9_mid_allocation_returns_usage(node_plain: Node) -> None:
    node = node_plain
    limit = 256 * MiB
    node.limit(limit)
    victim = node.popen("gpa", "init", "alloc", 128 * MiB, "race", 10_000_000, MiB, 7)
    assert victim.stdout is not None
    assert "init rc=0" in victim.stdout.readline()
    assert "rc=0" in victim.stdout.readline()
    time.sleep(0.2)  # well inside its alloc/free loop
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    # the victim's 128+ MiB come back: a newcomer gets the whole slice
    r = node.cutest("gpa", "init", "alloc", limit, "info")
    a = r.one("alloc")
    assert a["rc"] == "0", (r.out, r.err)
    assert int(a["ns"]) < 100_000_000, a  # includes finding and reclaiming the dead slot
    snap = R.read_region(str(node.region))
    assert victim.pid not in [s.pid for s in snap.slots]


_HOLDER = """
import fcntl, os, struct, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.fcntl(fd, 38, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 1 << 32, 1, 0))  # F_OFD_SETLKW
print("locked", flush=True)
time.sleep(600)
"""


def test_waiters_proceed_when_the_lock_holder_is_killed(node_plain: Node) -> None:
    node = node_plain
    node.limit(64 * MiB)
    node.cutest("gpa", "init", "alloc", 1)  # region exists
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(node.region)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    waiter = node.popen("gpa", "init", "alloc", MiB)
    assert waiter.stdout is not None
    time.sleep(0.5)
    assert waiter.poll() is None, "the waiter should be blocked on the region lock (joining in cuInit)"
    t0 = time.monotonic()
    holder.kill()
    init = waiter.stdout.readline()
    dt = time.monotonic() - t0
    line = waiter.stdout.readline()
    waiter.communicate(timeout=30)
    holder.wait(timeout=30)
    assert "init rc=0" in init, init
    assert "alloc" in line and "rc=0" in line, line
    # the kernel drops the dead holder's lock at once; generous bound for a loaded CI box
    assert dt < 1.0, dt


@pytest.mark.parametrize("lock", ["region", "device"])
def test_many_waiters_proceed_when_the_lock_holder_is_killed(node_plain: Node, lock: str) -> None:
    """16 processes starting CUDA at once behind a holder of the container's region lock (or of
    the simulated driver's own state lock) that is killed with SIGKILL: the kernel drops an OFD
    lock with its last holder, and every waiter proceeds."""
    node = node_plain
    node.limit(64 * MiB)
    node.cutest("gpa", "init", "alloc", 1)  # the region and the device state exist
    if lock == "region":
        argv = [sys.executable, "-c", _HOLDER, str(node.region)]
    else:
        argv = [str(FAKE / "fakegpu-ctl"), "hold-lock", "600"]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=node.env(False))
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    waiters = [node.popen("gpa", "init", "alloc", MiB) for _ in range(16)]
    try:
        time.sleep(0.5)
        assert all(w.poll() is None for w in waiters), "the waiters should be blocked on the lock"
        t0 = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        outs = [w.communicate(timeout=60)[0] for w in waiters]
        dt = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait(timeout=30)
        for w in waiters:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=30)
    assert all("init rc=0" in o and "alloc" in o and "rc=0 idx" in o for o in outs), outs
    assert dt < 10.0, dt  # 16 processes' CUDA start-up on a loaded 2-core box


def test_fork_child_without_cuda_costs_nothing(node: Node) -> None:
    node.limit(64 * MiB)
    p = node.popen("gpa", "init", "alloc", MiB, "fork", "sleepms", 100, "end", "waitchild", "wait")
    try:
        _waiting(p)
        snap = R.read_region(str(node.region))
        assert [s.pid for s in snap.slots] == [p.pid]  # the child took no slot
        # ...and did not drop the parent's: its MiB is still counted for others
        r = node.cutest("gpa", "init", "alloc", 63 * MiB + 1, "alloc", 63 * MiB)
        assert r.one("alloc", 0)["rc"] == "2" and r.one("alloc", 1)["rc"] == "0"
    finally:
        p.communicate(timeout=30)


def test_fork_child_using_cuda_gets_its_own_slot(node: Node) -> None:
    node.limit(64 * MiB)
    r = node.cutest("gpa", "init", "alloc", MiB, "fork", "init", "alloc", 2 * MiB, "info", "end", "waitchild", "info")
    assert r.rc == 0, r.err
    assert r.one("waitchild")["status"] == "0"
    # the child saw both charges; after it exited only the parent's is left
    assert int(r.one("info", 0)["free"]) == 61 * MiB
    assert int(r.one("info", 1)["free"]) == 63 * MiB


def test_many_processes_start_at_once(node_plain: Node) -> None:
    node = node_plain
    node.limit(64 * MiB)
    procs = [node.popen("gpa", "init", "alloc", MiB, "wait") for _ in range(32)]
    try:
        for p in procs:
            _waiting(p)
        snap = R.read_region(str(node.region))
        assert sorted(s.pid for s in snap.slots) == sorted(p.pid for p in procs)
        assert len({s.index for s in snap.slots}) == 32
        assert sum(s.device_bytes[0] for s in snap.slots) == 32 * MiB
    finally:
        for p in procs:
            p.communicate(timeout=30)


def test_monitor_write_under_lock_does_not_lose_charges(node_plain: Node) -> None:
    """write_extra_bytes (monitor, Python) and charges (library) share the one lock."""
    node = node_plain
    node.limit(64 * MiB)
    p = node.popen("gpa", "init", "alloc", 1, "wait")
    try:
        _waiting(p)
        idx = R.read_region(str(node.region)).slots[0].index
        racer = node.popen("dlsym", "init", "race", 3000, MiB, 3)
        for i in range(200):  # the monitor's writer never blocks: it tries again when the lock is busy
            while not R.write_extra_bytes(str(node.region), {(idx, 0): i * 4096}):
                pass
        _out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err
        snap = R.read_region(str(node.region))
        me = next(s for s in snap.slots if s.pid == p.pid)
        assert me.extra_bytes[0] == 199 * 4096 and me.device_bytes[0] == 1
    finally:
        p.communicate(timeout=30)
