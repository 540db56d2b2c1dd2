"""Memory backstop: what NVML sees a container use on a GPU vs its physical share.

The library enforces the limit on what passes through it; the backstop
catches what does not (a process that bypasses the library, a leak in
contexts or modules).  NVML counts device-resident memory, so the bound is the
container's physical share (the limits file's device_limit: the slice itself
without oversubscription; with memory scaling S > 1 the slice / S, whatever it
holds in host memory beyond).  A container whose NVML-observed memory on a GPU
stays above that + tolerance for longer than the grace period is acted on:
`log` (one line and a metric per episode) or `kill` (SIGKILL its largest
process on that GPU, by (pid, start time), then start a new grace period).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from monitor import signals
from monitor.procs import ProcKey
from vgpu.log import kv

log = logging.getLogger("vgpu.monitor.backstop")


class Backstop:
    def __init__(self, action: str, tolerance: int, grace_s: float) -> None:
        self.action = action
        self.tolerance = tolerance
        self.grace_s = grace_s
        self.over_since: dict[tuple[str, str], float] = {}
        self.acted: set[tuple[str, str]] = set()  # `log` episodes already reported
        self.actions: dict[str, Counter[str]] = {}

    def check(
        self, cid: str, uuid: str, used: int, limit: int | None, procs: Mapping[ProcKey, int], now: float
    ) -> ProcKey | None:
        """Evaluate one (container, GPU); returns the process killed, if any."""
        k = (cid, uuid)
        if limit is None or used <= limit + self.tolerance:
            self.over_since.pop(k, None)
            self.acted.discard(k)
            return None
        since = self.over_since.setdefault(k, now)
        if now - since < self.grace_s:
            return None
        if self.action == "log":
            if k not in self.acted:
                self.acted.add(k)
                self.actions.setdefault(cid, Counter())["log"] += 1
                log.warning(kv("container over its GPU memory limit", container=cid, gpu=uuid, used=used, limit=limit))
            return None
        if not procs:
            return None
        victim = max(procs, key=lambda p: procs[p])
        self.over_since[k] = now  # a new grace period for whatever remains
        if signals.kill(victim):
            self.actions.setdefault(cid, Counter())["kill"] += 1
            log.warning(
                kv(
                    "killed process over the container's GPU memory limit",
                    container=cid,
                    gpu=uuid,
                    pid=victim.pid,
                    process_bytes=procs[victim],
                    used=used,
                    limit=limit,
                )
            )
            return victim
        return None

    def forget(self, cid: str) -> None:
        for k in [k for k in self.over_since if k[0] == cid]:
            del self.over_since[k]
        self.acted = {k for k in self.acted if k[0] != cid}
        self.actions.pop(cid, None)
