"""The monitor's status snapshot: what every GPU and slice looks like now (`build_snapshot`, read
by the metrics collector and written to the status file `vgpuctl` reads), and the thread that
writes it (a stalled filesystem never delays the main loop)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import msgspec

from monitor.containers import Container, init_alive
from monitor.gpustate import GpuState
from monitor.threadname import name_thread
from vgpu.log import kv
from vgpu.schemas import write_atomic

if TYPE_CHECKING:
    from monitor.daemon import Monitor

log = logging.getLogger("vgpu.monitor")


def write_status_file(path: str, snap: dict[str, Any], errors: Counter[str]) -> None:
    """The snapshot as JSON, replaced whole (rebuilt every second: no fsync); errors counted."""
    try:
        write_atomic(path, msgspec.json.encode(snap), 0o644, durable=False)
    except OSError as e:
        errors["status"] += 1
        log.warning(kv("cannot write status", path=path, error=e))


class StatusWriter:
    """Writes the newest submitted snapshot to the status file, on a thread of its own."""

    def __init__(self, path: str, errors: Counter[str]) -> None:
        self.path = path
        self.errors = errors
        self._pending: dict[str, Any] | None = None
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, snap: dict[str, Any]) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="status", daemon=True)
                self._thread.start()
            self._pending = snap
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        name_thread("vgpu-status")
        while True:
            with self._cv:
                while self._pending is None and not self._closing:
                    self._cv.wait()
                if self._closing or self._pending is None:
                    return
                snap, self._pending = self._pending, None
            write_status_file(self.path, snap, self.errors)


def build_snapshot(mon: Monitor, now: float, running: bool = True) -> dict[str, Any]:
    """The monitor's state as plain data (the status file's version 1 schema)."""
    for g in mon.gpus.values():
        if g.up:
            g.update_use(now)
    return {
        "version": 1,
        "running": running,
        "time": time.time(),
        "pid": os.getpid(),
        "policy": mon.cfg.policy,
        "metrics_port": mon.metrics_port,
        "loop_seconds": mon.loop_seconds,
        "errors": dict(mon.errors),
        "sample_holds": mon.sample_holds,
        "nvml_errors": getattr(mon.source, "errors", 0),
        "suspended_processes": len(mon.suspender.stopped),
        "guardian_armed": mon.suspender.armed,
        "gc_removed": mon.collector.removed,
        "gpus": [_gpu_row(mon, g) for g in sorted(mon.gpus.values(), key=lambda x: x.index)],
        "containers": [_container_row(mon, c, now) for c in sorted(mon.containers.values(), key=lambda x: x.id)],
    }


def _gpu_row(mon: Monitor, g: GpuState) -> dict[str, Any]:
    o = g.obs
    rows = []
    for cid, keys in sorted(g.members.items()):
        c = mon.containers.get(cid)
        if c is None:
            continue
        rows.append(
            {
                **c.labels(),
                "pids": sorted(k.pid for k in keys),
                "memory_used": sum(keys.values()),
                "memory_limit": c.memory_limit(g.uuid),
                "memory_device_limit": c.device_limit(g.uuid),
                "memory_host": c.host_bytes(g.uuid),
                "sm_use": round(g.use.get(cid, 0.0), 2),
                "share": c.share(g.uuid),
                "effective_share": g.ctl.targets.get(cid),
                "duty": round(g.duty.get(cid, 1.0), 4),
                "suspended": any(k in mon.suspender.stopped for k in keys),
                "backstop_actions": dict(mon.backstop.actions.get(cid, Counter())),
            }
        )
    # Containers allocated on this GPU with no process on it (not started yet, between
    # jobs, or done): their series stay, used 0, for as long as the allocation exists.
    allocated = [
        {
            **c.labels(),
            "memory_limit": c.memory_limit(g.uuid),
            "memory_device_limit": c.device_limit(g.uuid),
            "memory_host": c.host_bytes(g.uuid),
            "share": c.share(g.uuid),
        }
        for c in sorted(mon.containers.values(), key=lambda x: x.id)
        if c.id not in g.members and c.memory_limit(g.uuid) is not None
    ]
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "up": g.up,
        "error": g.error,
        "memory_total": o.memory_total if o else 0,
        "memory_used": o.memory_used if o and g.up else 0,
        "util": o.util if o and g.up else 0,
        "parent": o.parent if o else "",
        "compute_enforced": o.compute_enforced if o else True,
        "containers": rows,
        "allocated": allocated,
    }


def _container_row(mon: Monitor, c: Container, now: float) -> dict[str, Any]:
    st = mon.suspender.stats.get(c.id)
    return {
        **c.labels(),
        "kind": c.kind,
        "gpus": sorted(c.limits),
        "init_alive": init_alive(c),
        "region_error": c.region_error,
        "region_corrupt_total": c.region_corrupt_total,
        "suspended": mon.suspender.is_suspended(c.id),
        "suspended_seconds": round(mon.suspender.suspended_seconds(c.id, now), 3),
        "suspensions": st.suspensions if st else 0,
        "longest_stop_s": round(st.longest_stop_s, 3) if st else 0.0,
        "backstop_actions": dict(mon.backstop.actions.get(c.id, Counter())),
    }
