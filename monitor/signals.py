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
