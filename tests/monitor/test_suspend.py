"""Ledger, signals by (pid, start time), guardian, replay: real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from monitor import ledger, signals
from monitor.procs import ProcKey, parse_stat
from monitor.suspend import Suspender
from tests.monitor.helpers import Procs, key, state
from tests.support.poll import poll

pytestmark = pytest.mark.timeout(60)


def test_parse_stat_with_hostile_comm() -> None:
    st = parse_stat("42 (a) b (c) S 7 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0")
    assert st is not None and st.pid == 42 and st.state == "S" and st.ppid == 7 and st.start_time == 12345
    assert parse_stat("garbage") is None


def test_ledger_roundtrip_and_garbage(tmp_path: Path) -> None:
    p = str(tmp_path / "ledger")
    ledger.write(p, [ProcKey(10, 5), ProcKey(3, 1)])
    assert ledger.read(p) == {ProcKey(10, 5), ProcKey(3, 1)}
    with open(p, "a") as f:
        f.write("x y\n-1 2\n99999999999 1\n7 8 9\n")
    assert ledger.read(p) == {ProcKey(10, 5), ProcKey(3, 1)}
    (tmp_path / "bad").write_text("not a ledger\n1 2\n")
    assert ledger.read(str(tmp_path / "bad")) == set()
    assert ledger.read(str(tmp_path / "missing")) == set()


def test_ledger_appends_and_compacts(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    led = ledger.Ledger(path)
    led.add([ProcKey(5, 50), ProcKey(6, 60)])
    led.discard([ProcKey(5, 50)])
    led.add([ProcKey(7, 70)])
    assert ledger.read(path) == {ProcKey(6, 60), ProcKey(7, 70)}
    assert "- 5 50" in (tmp_path / "ledger").read_text()
    led.COMPACT_BYTES = 0  # next write compacts first
    led.add([ProcKey(8, 80)])
    text = (tmp_path / "ledger").read_text()
    assert "5 50" not in text and ledger.read(path) == {ProcKey(6, 60), ProcKey(7, 70), ProcKey(8, 80)}
    led.close()


def test_stop_and_cont_real_process(procs: Procs) -> None:
    p = procs.spawn(["sleep", "60"])
    k = key(p.pid)
    assert signals.stop(k)
    assert poll(lambda: state(p.pid) == "T", 5)
    assert signals.cont(k)
    assert poll(lambda: state(p.pid) == "S", 5)


def test_reused_pid_is_never_signalled(procs: Procs) -> None:
    p = procs.spawn(["sleep", "60"])
    k = key(p.pid)
    stale = ProcKey(k.pid, k.start_time - 1)  # "an older process that had this pid"
    assert not signals.stop(stale)
    time.sleep(0.1)
    assert state(p.pid) == "S"


def test_process_exiting_while_stopped(tmp_path: Path, procs: Procs) -> None:
    s = Suspender(str(tmp_path / "ledger"), max_suspend_s=10, guardian=False)
    p = procs.spawn(["sleep", "60"])
    k = key(p.pid)
    s.apply({k: "c1"}, time.monotonic())
    assert poll(lambda: state(p.pid) == "T", 5)
    assert ledger.read(s.ledger.path) == {k}
    os.kill(p.pid, signal.SIGKILL)  # SIGKILL ends a stopped process
    p.wait(5)
    s.drop_dead(time.monotonic())
    assert s.stopped == {} and ledger.read(s.ledger.path) == set()
    s.close()


def test_zombie_is_harmless(tmp_path: Path, procs: Procs) -> None:
    # the parent never reaps its child: the child stays a zombie
    parent = procs.spawn(
        [
            sys.executable,
            "-c",
            "import os,time\npid=os.fork()\nif pid==0: os._exit(0)\nprint(pid,flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    zpid = int(parent.stdout.readline())
    assert poll(lambda: state(zpid) == "Z", 5)
    k = key(zpid)
    s = Suspender(str(tmp_path / "ledger"), max_suspend_s=10, guardian=False)
    s.apply({k: "c1"}, time.monotonic())
    s.drop_dead(time.monotonic())
    assert k not in s.stopped
    assert ledger.read(s.ledger.path) == set()
    s.close()


def test_max_suspend_is_enforced(tmp_path: Path, procs: Procs) -> None:
    s = Suspender(str(tmp_path / "ledger"), max_suspend_s=0.2, guardian=False)
    p = procs.spawn(["sleep", "60"])
    k = key(p.pid)
    t0 = time.monotonic()
    s.apply({k: "c1"}, t0)
    assert state(p.pid) == "T" or poll(lambda: state(p.pid) == "T", 2)
    s.apply({k: "c1"}, t0 + 0.25)  # still wanted, but the stretch is over
    assert poll(lambda: state(p.pid) == "S", 2)
    s.apply({k: "c1"}, t0 + 0.26)  # cooling down: stays running
    time.sleep(0.05)
    assert state(p.pid) == "S"
    s.apply({k: "c1"}, t0 + 1.0)
    assert poll(lambda: state(p.pid) == "T", 2)
    assert s.stats["c1"].suspensions == 2
    s.close()
    assert poll(lambda: state(p.pid) == "S", 2)


def test_replay_on_start(tmp_path: Path, procs: Procs) -> None:
    p = procs.spawn(["sleep", "60"])
    k = key(p.pid)
    os.kill(p.pid, signal.SIGSTOP)
    assert poll(lambda: state(p.pid) == "T", 5)
    path = str(tmp_path / "ledger")
    ledger.write(path, [k, ProcKey(k.pid, k.start_time + 7)])
    s = Suspender(path, max_suspend_s=1, guardian=False)
    assert s.start() == 1
    assert poll(lambda: state(p.pid) == "S", 2)
    assert ledger.read(path) == set()
    s.close()


GUARDED = textwrap.dedent(
    """
    import sys, time
    from monitor.suspend import Suspender
    from monitor.procs import key_of
    s = Suspender(sys.argv[1], max_suspend_s=600)
    s.start()
    assert s.armed
    s.apply({key_of(int(p)): "c" for p in sys.argv[2:]}, time.monotonic())
    print("stopped", flush=True)
    time.sleep(600)
    """
)


def test_guardian_resumes_everything_after_kill9(tmp_path: Path, procs: Procs) -> None:
    workers = [procs.spawn(["sleep", "60"]) for _ in range(3)]
    path = str(tmp_path / "ledger")
    mon = procs.spawn(
        [sys.executable, "-c", GUARDED, path, *[str(w.pid) for w in workers]],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    assert mon.stdout is not None
    assert mon.stdout.readline().strip() == b"stopped"
    for w in workers:
        assert poll(lambda w=w: state(w.pid) == "T", 5)
    mon.kill()
    t0 = time.monotonic()
    mon.wait()
    assert poll(lambda: all(state(w.pid) == "S" for w in workers), 2.0), [state(w.pid) for w in workers]
    assert time.monotonic() - t0 <= 2.0
    assert ledger.read(path) == set()


def test_guardian_death_resumes_and_rearms(tmp_path: Path, procs: Procs) -> None:
    s = Suspender(str(tmp_path / "ledger"), max_suspend_s=600)
    s.start()
    try:
        assert s.armed and s.guardian is not None
        procs.adopt(s.guardian.pid)
        p = procs.spawn(["sleep", "60"])
        k = key(p.pid)
        s.apply({k: "c"}, time.monotonic())
        assert poll(lambda: state(p.pid) == "T", 5)
        s.guardian.kill()
        s.guardian.wait()
        s.check_guardian()
        assert state(p.pid) != "T" or poll(lambda: state(p.pid) == "S", 2)
        assert s.armed and s.guardian.poll() is None and s.guardian_restarts == 1
        procs.adopt(s.guardian.pid)
    finally:
        s.close()
