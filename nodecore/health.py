"""GPU health: XID events, lost GPUs, and recovery after a quiet period.

- An XID event outside APPLICATION_XIDS marks that GPU's vGPUs Unhealthy; an
  event whose device cannot be resolved marks every GPU Unhealthy (as NVIDIA's
  plugin does).
- A GPU that NVML reports lost is Unhealthy (checked every `check_interval_s`).
- Unlike NVIDIA's plugin, a GPU with no bad event for `recovery_s` (and not
  lost) returns to Healthy.
- MIG devices (nodecore/mig.py) are watched through their GPU, where NVML reports their events
  ("This API does not currently support per-instance event reporting using MIG device
  handles", nvml.h): an XID attributed to a GPU instance and compute instance marks that MIG
  device; one of the whole GPU (IDs 0xFFFFFFFF) every device of the GPU, as NVIDIA's plugin
  (internal/rm/health.go; it keeps one device per parent, so there only the last MIG device of a
  GPU is marked: here all are).  A MIG device NVML no longer finds (its instance destroyed) is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nodecore.devices import DeviceTable
from vgpu import nvml
from vgpu.log import kv

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        table: DeviceTable,
        recovery_s: float,
        check_interval_s: float = 1.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.table = table
        self.recovery_s = recovery_s
        self.check_interval_s = check_interval_s
        self.on_change = on_change
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target, name in ((self._events_loop, "xid-events"), (self._check_loop, "health-check")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=3)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a callback must not kill the health thread
                log.exception("health change callback failed")

    def targets(self, ev_uuid: str | None, gi: int | None = None, ci: int | None = None) -> list[str]:
        """The devices an event of GPU `ev_uuid` (MIG instance gi/ci, or the whole GPU) concerns;
        every device when the GPU is unknown (NVIDIA's plugin: "Marking all devices as unhealthy")."""
        if ev_uuid is None:
            return list(self.table.gpus)
        known = False
        out = []
        for u, st in self.table.gpus.items():
            info = st.info
            if info.root_uuid != ev_uuid:
                continue
            known = True
            if info.is_mig and gi is not None and ci is not None and (info.mig_gi, info.mig_ci) != (gi, ci):
                continue
            out.append(u)
        return out if known else list(self.table.gpus)

    def bad(self, uuid: str | None, reason: str, gi: int | None = None, ci: int | None = None) -> None:
        targets = self.targets(uuid, gi, ci)
        changed = False
        for u in targets:
            if self.table.mark_unhealthy(u, reason):
                changed = True
                log.warning(kv("gpu unhealthy", gpu=u, reason=reason))
        if changed:
            self._changed()

    def handle_xid(self, ev: nvml.XidEvent) -> None:
        if ev.xid in nvml.APPLICATION_XIDS:
            log.info(kv("application xid ignored", gpu=ev.uuid, xid=ev.xid))
            return
        where = f" gi {ev.gi} ci {ev.ci}" if ev.gi is not None else ""
        self.bad(ev.uuid, f"xid {ev.xid}{where}", ev.gi, ev.ci)

    def _events_loop(self) -> None:
        uuids = list(dict.fromkeys(st.info.root_uuid for st in self.table.gpus.values()))
        if not uuids:
            return
        try:
            watcher = nvml.XidWatcher(uuids)
        except nvml.EventsUnsupported as e:
            log.warning("XID health checks disabled: %s", e)
            return
        except Exception as e:  # NVMLError from nvmlEventSetCreate
            log.warning("XID health checks disabled: %s", e)
            return
        with watcher:
            while not self._stop.is_set():
                try:
                    ev = watcher.wait(500)
                except Exception as e:
                    # NVIDIA's plugin: a wait error makes every device unhealthy.
                    self.bad(None, f"event wait failed: {e}")
                    self._stop.wait(self.check_interval_s)
                    continue
                if ev is not None:
                    self.handle_xid(ev)

    def check_once(self, now: float | None = None) -> None:
        """Mark lost GPUs unhealthy; return quiet ones to healthy."""
        now = time.monotonic() if now is None else now
        changed = False
        for uuid, st in self.table.gpus.items():
            if nvml.device_lost(uuid):
                # mark_unhealthy also restarts the quiet period of a GPU already down.
                if self.table.mark_unhealthy(uuid, "lost", now):
                    changed = True
                    log.warning(kv("gpu unhealthy", gpu=uuid, reason="lost"))
            elif not st.healthy and now - st.last_bad >= self.recovery_s:
                reason = st.reason
                if self.table.mark_healthy(uuid):
                    changed = True
                    log.warning(kv("gpu healthy again", gpu=uuid, after=reason, quiet_s=self.recovery_s))
        if changed:
            self._changed()

    def _check_loop(self) -> None:
        while not self._stop.wait(self.check_interval_s):
            try:
                self.check_once()
            except Exception:
                log.exception("health check failed")
