"""Notice kubelet restarts: the creation of kubelet.sock in the device-plugins dir.

Uses inotify (through ctypes, Linux) on the directory, so a restart is seen
within milliseconds; where inotify is unavailable it falls back to polling
the socket's inode every 100 ms.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import time

log = logging.getLogger(__name__)

IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_MOVED_TO = 0x00000080
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class SocketWatcher:
    """`wait(timeout)` returns True when `name` was (re)created in `directory`."""

    def __init__(self, directory: str, name: str, wake_fd: int | None = None) -> None:
        """`wake_fd`: a pipe's read end; a byte written to it ends a wait early."""
        self.directory = directory
        self.wake_fd = wake_fd
        self.name = name
        self.path = os.path.join(directory, name)
        self._fd = -1
        self._wd = -1
        self._last_inode = _inode(self.path)
        self._libc: ctypes.CDLL | None = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                raise OSError(ctypes.get_errno(), "inotify_init1")
            self._fd = fd
            self._libc = libc
            self._add_watch()
        except (OSError, AttributeError) as e:
            log.warning("inotify unavailable (%s); polling %s", e, self.path)
            self.close()

    def _add_watch(self) -> None:
        assert self._libc is not None
        mask = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(self.directory), mask)
        if wd < 0:
            err = ctypes.get_errno()
            if err != errno.ENOENT:
                raise OSError(err, f"inotify_add_watch {self.directory}")
        self._wd = wd

    def _poll_changed(self) -> bool:
        ino = _inode(self.path)
        changed = ino is not None and ino != self._last_inode
        self._last_inode = ino
        return changed

    def wait(self, timeout: float) -> bool:
        if self._fd < 0 or self._wd < 0:
            # No inotify, or the directory did not exist yet: poll.
            deadline = time.monotonic() + timeout
            while True:
                if self._fd >= 0 and self._wd < 0 and os.path.isdir(self.directory):
                    try:
                        self._add_watch()
                    except OSError:
                        pass
                if self._poll_changed():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(0.1, left))
        fds = [self._fd] if self.wake_fd is None else [self._fd, self.wake_fd]
        r, _, _ = select.select(fds, [], [], max(0.0, timeout))
        if self.wake_fd is not None and self.wake_fd in r:
            try:
                os.read(self.wake_fd, 512)
            except BlockingIOError:
                pass
        if self._fd not in r:
            # Cheap safety net for missed events (e.g. queue overflow).
            return self._poll_changed()
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return False
        hit = False
        off = 0
        while off + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
            raw = data[off + _EVENT.size : off + _EVENT.size + length]
            off += _EVENT.size + length
            name = raw.rstrip(b"\0").decode("utf-8", "replace")
            if mask & (IN_CREATE | IN_MOVED_TO) and name == self.name:
                hit = True
            if mask & IN_Q_OVERFLOW:
                hit = hit or self._poll_changed()
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                self._wd = -1  # directory replaced: re-add the watch when it is back
        if hit:
            self._last_inode = _inode(self.path)
        return hit

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
