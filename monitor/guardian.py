"""The guardian: resumes every suspended process if the monitor dies.

Started by the monitor as a separate process (`python -m monitor.guardian`).
It holds a pidfd of the monitor and sleeps in poll(); the pidfd becomes
readable the moment the monitor exits for any reason, SIGKILL included.  It
then SIGCONTs everything in the ledger (`ledger.resume_all`) and exits.  As a
second line, PR_SET_PDEATHSIG delivers SIGTERM to it when its parent dies, and
SIGTERM itself also means "resume everything, then exit".

The guardian runs in its own session so a terminal's ^C or a signal to the
monitor's process group does not take it down before the monitor.  It reports
"armed" by writing one byte to the fd given by --ready-fd; the monitor never
suspends anything before that.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import select
import signal
import sys
import time

from monitor import ledger
from monitor.procs import start_time
from vgpu.log import kv, setup_logging

log = logging.getLogger("vgpu.monitor.guardian")
PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _wait_for_exit(pid: int, expected_start: int) -> None:
    """Return when process `pid` (with start time `expected_start`) is gone."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            if start_time(pid) != expected_start:
                return  # the monitor died before we got its pidfd; the pid is someone else now
            p = select.poll()
            p.register(fd, select.POLLIN)
            while not p.poll(60_000):
                pass
        finally:
            os.close(fd)
        return
    # no pidfd (old kernel): poll the parent relationship
    while os.getppid() == pid and start_time(pid) == expected_start:
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vgpu-monitor-guardian")
    p.add_argument("--ledger", required=True)
    p.add_argument("--pid", type=int, required=True, help="the monitor's pid")
    p.add_argument("--start-time", type=int, required=True, help="the monitor's start time (clock ticks)")
    p.add_argument("--ready-fd", type=int, default=-1)
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    setup_logging(a.log_level)

    def on_term(signum: int, frame: object) -> None:
        ledger.resume_all(a.ledger)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _set_pdeathsig(signal.SIGTERM)
    if os.getppid() != a.pid:
        log.warning(kv("guardian: monitor already gone", pid=a.pid))
    if a.ready_fd >= 0:
        try:
            os.write(a.ready_fd, b"1")
            os.close(a.ready_fd)
        except OSError:
            pass
    _wait_for_exit(a.pid, a.start_time)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    n = ledger.resume_all(a.ledger)
    if n:
        log.warning(kv("guardian: monitor exited, resumed suspended processes", resumed=n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
