"""Race-free signalling of a process named by (pid, start time).

`pidfd_open` pins the process: once we hold the pidfd and have checked that the
pid still has the expected start time, a signal sent through the pidfd can only
reach that process, never a newcomer that reused the pid.  Kernels without
pidfds (< 5.3) fall back to kill() right after the start-time check (a tiny
race that only a pid wrapping around in microseconds could hit).
"""

from __future__ import annotations

import errno
import os
import signal

from monitor.procs import ProcKey, read_stat

_HAVE_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def send(key: ProcKey, sig: int, proc: str = "/proc") -> bool:
    """Send `sig` to the process `key`; False when it is gone or the pid now names another process."""
    fd = -1
    if _HAVE_PIDFD:
        try:
            fd = os.pidfd_open(key.pid)
        except ProcessLookupError:
            return False
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EINVAL):
                return False
    try:
        st = read_stat(key.pid, proc)
        if st is None or st.start_time != key.start_time:
            return False
        try:
            if fd >= 0:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(key.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
        return True
    finally:
        if fd >= 0:
            os.close(fd)


def stop(key: ProcKey) -> bool:
    return send(key, signal.SIGSTOP)


def cont(key: ProcKey) -> bool:
    return send(key, signal.SIGCONT)


def kill(key: ProcKey) -> bool:
    """SIGKILL, then SIGCONT: a stopped process must be woken to die promptly."""
    ok = send(key, signal.SIGKILL)
    if ok:
        send(key, signal.SIGCONT)
    return ok


def open_verified(key: ProcKey, proc: str = "/proc") -> int:
    """A pidfd for `key`, or -1 if it is gone, names another process, or pidfds are unsupported."""
    if not _HAVE_PIDFD:
        return -1
    try:
        fd = os.pidfd_open(key.pid)
    except OSError:
        return -1
    st = read_stat(key.pid, proc)
    if st is None or st.start_time != key.start_time:
        os.close(fd)
        return -1
    return fd


class PidfdCache:
    """Verified pidfds of the processes the monitor signals over and over.

    A pidfd always names the process it was opened for, so once verified it
    needs no start-time check again: a stop or a resume is one syscall."""

    def __init__(self) -> None:
        self.fds: dict[ProcKey, list[float | int]] = {}  # key -> [fd, last used]

    def send(self, key: ProcKey, sig: int, now: float) -> bool:
        ent = self.fds.get(key)
        if ent is None:
            fd = open_verified(key)
            if fd < 0:
                return send(key, sig) if not _HAVE_PIDFD else False
            ent = self.fds[key] = [fd, now]
        ent[1] = now
        try:
            signal.pidfd_send_signal(int(ent[0]), sig)
            return True
        except OSError:  # ESRCH: it exited (a zombie's pidfd still takes signals)
            self.drop(key)
            return False

    def drop(self, key: ProcKey) -> None:
        ent = self.fds.pop(key, None)
        if ent is not None:
            os.close(int(ent[0]))

    def prune(self, now: float, idle_s: float = 10.0) -> None:
        for k in [k for k, e in self.fds.items() if now - e[1] > idle_s]:
            self.drop(k)

    def close(self) -> None:
        for k in list(self.fds):
            self.drop(k)
