"""Garbage collection of per-container state directories.

A directory is removed only when its container is gone: its init process
(pid + start time of the metadata) is dead, no live process is mapped to it,
and this has been so for longer than the grace period; a directory without
metadata (a hook that failed half-way) goes once it is older than the grace
period.  A live container's directory is never removed: any evidence of life
resets the clock.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time

from monitor.containers import Container, init_alive
from vgpu.log import kv

log = logging.getLogger("vgpu.monitor.cleanup")


class Collector:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.dead_since: dict[str, float] = {}
        self.removed = 0
        self.failing: set[str] = set()  # logged once; the daemon counts every failed round

    def gone(self, c: Container, has_processes: bool, now: float) -> bool:
        """Update the death clock of `c`; True once it has been dead for the grace period."""
        if c.metadata is None:
            try:
                age = time.time() - os.lstat(c.dir).st_mtime
            except OSError:
                return False
            return age >= self.grace_s
        if has_processes or init_alive(c):
            self.dead_since.pop(c.id, None)
            return False
        since = self.dead_since.setdefault(c.id, now)
        return now - since >= self.grace_s

    def remove(self, c: Container) -> bool:
        try:
            st = os.lstat(c.dir)
        except FileNotFoundError:
            return True
        if not stat.S_ISDIR(st.st_mode):  # never follow a symlink out of the state dir
            return False
        try:
            shutil.rmtree(c.dir)
        except OSError as e:
            if c.id not in self.failing:
                self.failing.add(c.id)
                log.warning(kv("cannot remove state of a gone container; retrying", container=c.id, error=e))
            return False
        self.failing.discard(c.id)
        self.dead_since.pop(c.id, None)
        self.removed += 1
        log.info(kv("removed state of a gone container", container=c.id))
        return True
