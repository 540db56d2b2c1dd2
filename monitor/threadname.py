"""Names for the monitor's OS threads (visible in top -H, /proc/<pid>/task/<tid>/comm)."""

from __future__ import annotations

import ctypes


def name_thread(name: str) -> None:
    """Name the calling OS thread (15 bytes at most, PR_SET_NAME)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
