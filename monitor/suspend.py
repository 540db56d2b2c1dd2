"""Suspending and resuming processes, with the ledger and the guardian.

Invariants ("nothing stays stopped"):
- a process is written to the ledger before it is sent SIGSTOP, and leaves the
  ledger only after SIGCONT;
- nothing is stopped unless a guardian is armed: the guardian resumes the
  whole ledger the moment the monitor dies (pidfd), and if the guardian
  itself dies the monitor resumes everything and starts a new one;
- no stop lasts longer than `max_suspend_s`: the process is resumed and not
  stopped again until it has run for `min_run_s`;
- `close()` (SIGTERM/SIGINT, normal exit) resumes everything.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from monitor import ledger as ledgermod
from monitor import procs, signals
from monitor.procs import ProcKey
from vgpu.log import kv

log = logging.getLogger("vgpu.monitor.suspend")


@dataclass
class ContainerStats:
    suspended_seconds: float = 0.0
    suspensions: int = 0
    off_since: float | None = None  # while any of its processes is stopped
    longest_stop_s: float = 0.0


class Suspender:
    def __init__(
        self,
        ledger_path: str,
        max_suspend_s: float,
        *,
        guardian: bool = True,
        log_level: str = "warning",
    ) -> None:
        self.ledger = ledgermod.Ledger(ledger_path)
        self.max_suspend_s = max_suspend_s
        self.min_run_s = max(0.02, min(0.2, max_suspend_s / 5))
        self.use_guardian = guardian
        self.log_level = log_level
        self.guardian: subprocess.Popen[bytes] | None = None
        self.armed = not guardian
        self.stopped: dict[ProcKey, tuple[str, float]] = {}  # key -> (container, since)
        self.cooldown: dict[ProcKey, float] = {}  # key -> not before
        self.stats: dict[str, ContainerStats] = {}
        self.guardian_restarts = 0
        self.fds = signals.PidfdCache()
        self.signal_errors = 0

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> int:
        """Replay the ledger left by a previous monitor, then arm a guardian. Returns how many were resumed."""
        n = ledgermod.resume_all(self.ledger.path)
        self.ledger.reopen()
        if self.use_guardian:
            self._spawn_guardian()
        return n

    def _spawn_guardian(self, timeout: float = 15.0) -> None:
        me = procs.key_of(os.getpid())
        if me is None:
            raise RuntimeError("cannot read own start time")
        r, w = os.pipe()
        try:
            self.guardian = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "monitor.guardian",
                    "--ledger",
                    self.ledger.path,
                    "--pid",
                    str(me.pid),
                    "--start-time",
                    str(me.start_time),
                    "--ready-fd",
                    str(w),
                    "--log-level",
                    self.log_level,
                ],
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd="/",
                env={**os.environ, "PYTHONPATH": _package_root() + os.pathsep + os.environ.get("PYTHONPATH", "")},
            )
            os.close(w)
            w = -1
            ready, _, _ = select.select([r], [], [], timeout)
            self.armed = bool(ready) and os.read(r, 1) == b"1"
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if not self.armed:
            log.error(kv("guardian did not arm; not suspending anything", pid=self.guardian.pid))
        else:
            log.info(kv("guardian armed", pid=self.guardian.pid))

    def check_guardian(self) -> None:
        if not self.use_guardian:
            return
        if self.guardian is not None and self.guardian.poll() is None and self.armed:
            return
        if self.guardian is not None:
            log.warning(kv("guardian gone; resuming everything and restarting it", rc=self.guardian.returncode))
            self.guardian_restarts += 1
        self.armed = False
        self.resume_all(now=None)
        self.ledger.reopen()  # a dying guardian may have replaced the file under our fd
        self._spawn_guardian()

    def close(self) -> None:
        self.resume_all(now=None)
        self.fds.close()
        self.ledger.close()
        ledgermod.resume_all(self.ledger.path)
        g = self.guardian
        if g is not None and g.poll() is None:
            g.terminate()  # its SIGTERM handler resumes the (now empty) ledger and exits
            try:
                g.wait(5)
            except subprocess.TimeoutExpired:
                g.kill()
                g.wait()
        self.guardian = None

    # -- actuation ---------------------------------------------------------
    def apply(self, want: Mapping[ProcKey, str], now: float) -> None:
        """Make the set of stopped processes equal to `want` (key -> container), within the guard rails."""
        resume = [k for k in self.stopped if k not in want or now - self.stopped[k][1] >= self.max_suspend_s]
        for k in resume:
            if k in want:  # hit the longest allowed stretch: let it run a while
                self.cooldown[k] = now + self.min_run_s
        if resume:
            self._resume(resume, now)
        if self.cooldown:
            for k in [k for k, t in self.cooldown.items() if t <= now]:
                del self.cooldown[k]
        if not self.armed:
            return
        stop = [k for k in want if k not in self.stopped and k not in self.cooldown]
        if not stop:
            return
        self.ledger.add(stop)
        failed = []
        for k in stop:
            if self.fds.send(k, signal.SIGSTOP, now):
                cid = want[k]
                self.stopped[k] = (cid, now)
                st = self.stats.setdefault(cid, ContainerStats())
                if st.off_since is None:
                    st.off_since = now
                    st.suspensions += 1
            else:
                failed.append(k)
        if failed:
            self.ledger.discard(failed)

    def _resume(self, keys: list[ProcKey], now: float | None) -> None:
        touched: set[str] = set()
        for k in keys:
            entry = self.stopped.pop(k, None)
            self.fds.send(k, signal.SIGCONT, now if now is not None else 0.0)  # False when it is gone
            if entry is not None:
                touched.add(entry[0])
                if now is not None:
                    st = self.stats.setdefault(entry[0], ContainerStats())
                    st.longest_stop_s = max(st.longest_stop_s, now - entry[1])
        self.ledger.discard(keys)
        still = {cid for cid, _ in self.stopped.values()}
        for cid in touched - still:
            st = self.stats.setdefault(cid, ContainerStats())
            if st.off_since is not None:
                if now is not None:
                    st.suspended_seconds += max(0.0, now - st.off_since)
                st.off_since = None

    def resume_container(self, cid: str, now: float | None) -> None:
        keys = [k for k, (c, _) in self.stopped.items() if c == cid]
        if keys:
            self._resume(keys, now)

    def resume_all(self, now: float | None) -> None:
        if self.stopped:
            self._resume(list(self.stopped), now)

    def drop_dead(self, now: float) -> None:
        """Forget stopped processes that exited (zombies included)."""
        dead = [k for k in self.stopped if not procs.alive(k)]
        if dead:
            self._resume(dead, now)
        for k in [k for k in self.fds.fds if k not in self.stopped and not procs.alive(k)]:
            self.fds.drop(k)
        self.fds.prune(now)

    def suspended_seconds(self, cid: str, now: float) -> float:
        st = self.stats.get(cid)
        if st is None:
            return 0.0
        extra = now - st.off_since if st.off_since is not None else 0.0
        return st.suspended_seconds + extra

    def is_suspended(self, cid: str) -> bool:
        st = self.stats.get(cid)
        return st is not None and st.off_since is not None


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
