"""The monitor's main loop: observe, map, control, actuate, backstop, report, clean up.

One thread does everything but NVML calls (monitor/nvmlworker.py: they can hang) and writing
the status file (monitor/status.py: a stalled filesystem must not delay a resume); the metrics
HTTP server reads an immutable snapshot from its own thread.  The loop sleeps until the next
event: an observation every `period_ms`, or an actuation edge of a GPU's duty cycle (see
monitor/controller.py), so suspensions start and end on time without a fast polling loop.
Region slots get NVML's extra bytes from monitor/extrabytes.py; the smallest of them per GPU (its
CUDA context) goes to the node file the device plugin reads (monitor/contextsizes.py).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from typing import Any

from monitor import procs
from monitor.backstop import Backstop
from monitor.cleanup import Collector
from monitor.containers import Container, Registry
from monitor.contextsizes import ContextSizes
from monitor.controller import ControlParams, GpuController, MemberInput
from monitor.extrabytes import ExtraBytes
from monitor.gpustate import GpuState
from monitor.mapping import Mapper
from monitor.measure import UtilWindow
from monitor.nvmlworker import NvmlWorker
from monitor.observe import GpuObs, NvmlSource
from monitor.procs import ProcKey
from monitor.status import StatusWriter, build_snapshot, write_status_file
from monitor.suspend import Suspender
from vgpu.config import MonitorConfig
from vgpu.log import kv
from vgpu.paths import Paths

log = logging.getLogger("vgpu.monitor")

JITTER = 0.05
MIN_OFF_S = 0.01
EDGE_GRID_S = 0.004
SCAN_INTERVAL_S = 1.0
REGION_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 1.0
NVML_HANG_S = 2.0
BACKSTOP_INTERVAL_S = 0.5
STALE_HOLD_S = 1.0

# Every kind of `vgpu_monitor_errors_total` the loop counts (docs/operators/metrics.md, "Error kinds"), created
# at 0 when the monitor starts: a kind that first appears with a count already above 0 is invisible
# to Prometheus's increase()/rate(), which need a previous sample.  (`nvml_call`, the NVML reader's
# own count, is added by monitor/metrics.py.)
ERROR_KINDS = ("actuate", "context_sizes", "gc", "loop", "nvml", "nvml_hang", "region_write", "status")


class Monitor:
    def __init__(
        self,
        cfg: MonitorConfig,
        paths: Paths,
        *,
        source: Any = None,
        guardian: bool = True,
        log_level: str = "warning",
        proc: str = procs.PROC,
    ) -> None:
        self.cfg = cfg
        self.paths = paths
        self.source = source if source is not None else NvmlSource()
        self.registry = Registry(paths)
        self.mapper = Mapper(proc)
        self.suspender = Suspender(
            paths.ledger_path, cfg.max_suspend_ms / 1000.0, guardian=guardian, log_level=log_level
        )
        self.backstop = Backstop(cfg.backstop_action, cfg.backstop_tolerance_bytes, cfg.backstop_grace_s)
        self.collector = Collector(cfg.gc_grace_s)
        self.params = ControlParams(policy=cfg.policy)
        self.gpus: dict[str, GpuState] = {}
        self.containers: dict[str, Container] = {}
        self.rng = random.Random()
        self.period = cfg.period_ms / 1000.0
        self.duty_period = cfg.duty_period_ms / 1000.0
        self.errors: Counter[str] = Counter(dict.fromkeys(ERROR_KINDS, 0))
        self.sample_holds = 0  # times the duties were held for stale samples: normal (an idle GPU), not an error
        self.loop_seconds = 0.0
        self.loop_hist: Any = None  # set by metrics
        self.snapshot: dict[str, Any] = {}
        self.metrics_port = 0
        self.extra = ExtraBytes()
        self.context_sizes = ContextSizes(paths.context_sizes_path)
        self.gc_interval = max(0.5, min(5.0, cfg.gc_grace_s / 2 if cfg.gc_grace_s > 0 else 0.5))
        self._next = {"observe": 0.0, "scan": 0.0, "region": 0.0, "status": 0.0, "gc": 0.0, "backstop": 0.0}
        self.stopping = threading.Event()
        self.worker = NvmlWorker(self.source)
        self.status_writer = StatusWriter(paths.status_path, self.errors)
        self.nvml_hung = False

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        os.makedirs(self.paths.monitor_dir, mode=0o700, exist_ok=True)
        n = self.suspender.start()
        if n:
            log.warning(kv("resumed processes left suspended by a previous monitor", resumed=n))
        # metrics from the first scrape on (error kinds at 0, the guardian state), before the first loop
        self.snapshot = build_snapshot(self, time.monotonic())

    def close(self) -> None:
        self.suspender.close()
        try:
            self.source.close()
        except Exception:
            pass
        self.write_status(time.monotonic(), running=False)

    def stop(self) -> None:
        """Ask run() to return (signal-handler safe)."""
        self.stopping.set()
        self.worker.wake()

    def run(self) -> None:
        self.worker.start()
        try:
            while not self.stopping.is_set():
                wake = self.step(time.monotonic())
                delay = wake - time.monotonic()
                if delay > 0:
                    self.worker.wait(delay)
        finally:
            self.worker.close()

    # -- one iteration -----------------------------------------------------
    def step(self, now: float) -> float:
        """Process a finished observation, request the next one, actuate; returns the next wake-up."""
        nx = self._next
        done = self.worker.take()
        if done is not None:
            result, nvml_s = done
            t0 = time.perf_counter()
            try:
                if isinstance(result, BaseException):
                    raise result
                self.observe(now, result)
            except Exception as e:  # the loop must survive anything; count and log it
                self.errors["loop"] += 1
                log.exception(kv("monitor loop error", error=e))
            self.loop_seconds = nvml_s + time.perf_counter() - t0
            if self.loop_hist is not None:
                self.loop_hist.observe(self.loop_seconds)
            self.nvml_hung = False
        if now >= nx["observe"] and not self.worker.busy:
            self.worker.request()
            nx["observe"] = max(nx["observe"] + self.period, now + self.period / 4)
        if self.worker.busy and now - self.worker.since > NVML_HANG_S and not self.nvml_hung:
            # NVML has not answered for seconds: assume nothing about the GPUs and let everything run
            self.nvml_hung = True
            self.errors["nvml_hang"] += 1
            log.warning(
                kv("NVML call hanging; resuming every suspended process", seconds=round(now - self.worker.since, 1))
            )
            for g in self.gpus.values():
                g.members, g.duty, g.pid_cid = {}, {}, {}
        try:
            self.actuate(now)
        except Exception as e:
            self.errors["actuate"] += 1
            log.exception(kv("actuation error", error=e))
        wake = self.next_edge(now)
        if not self.worker.busy:
            wake = min(wake, nx["observe"])
        elif self.worker.since + NVML_HANG_S > now:
            wake = min(wake, self.worker.since + NVML_HANG_S)
        return wake

    def observe(self, now: float, observations: list[GpuObs]) -> None:
        nx = self._next
        if now >= nx["scan"]:
            self.containers = self.registry.scan()
            self.suspender.check_guardian()
            self.suspender.drop_dead(now)
            nx["scan"] = now + SCAN_INTERVAL_S
        read_regions = now >= nx["region"]
        if read_regions:
            for c in self.containers.values():
                self.registry.read_region(c)
            nx["region"] = now + REGION_INTERVAL_S
        live: set[ProcKey] = set()
        backstop = now >= nx["backstop"]
        if backstop:
            nx["backstop"] = now + BACKSTOP_INTERVAL_S
        for obs in observations:
            self._observe_gpu(self._gpu(obs, now), obs, now, live, backstop)
        self.mapper.forget_except(live)
        self.extra.forget_except(live)
        if read_regions:
            self.extra.update(self.gpus.values(), self.containers.values(), self.errors)
            self.context_sizes.update(self.extra.measured, [o.uuid for o in observations], self.errors)
        if now >= nx["gc"]:
            self.collect_garbage(now)
            nx["gc"] = now + self.gc_interval
        if now >= nx["status"]:
            self.write_status(now)
            nx["status"] = now + STATUS_INTERVAL_S

    def _gpu(self, obs: GpuObs, now: float) -> GpuState:
        g = self.gpus.get(obs.uuid)
        if g is None:
            g = self.gpus[obs.uuid] = GpuState(
                uuid=obs.uuid,
                index=obs.index,
                ctl=GpuController(self.params),
                window=UtilWindow(self.cfg.window_s),
                cycle_start=now,
                cycle_len=self.duty_period,
            )
        return g

    def _observe_gpu(self, g: GpuState, obs: GpuObs, now: float, live: set[ProcKey], backstop: bool) -> None:
        """One GPU's observation: its samples, which container each process belongs to (the
        processes found added to `live`), the memory backstop when due."""
        g.index, g.name, g.obs = obs.index, obs.name, obs
        if not obs.up:
            if g.up or not g.error:
                log.warning(kv("GPU unavailable; resuming its containers", gpu=obs.uuid, error=obs.error))
                self.errors["nvml"] += 1
            g.up, g.error = False, obs.error or "down"
            g.members, g.use, g.duty, g.pid_cid = {}, {}, {}, {}
            g.ctl = GpuController(self.params)
            g.window = UtilWindow(self.cfg.window_s)
            return
        if not g.up and g.error:
            log.warning(kv("GPU back", gpu=obs.uuid))
        g.up, g.error = True, ""
        g.window.add(obs.samples, now)
        g.members, g.pid_cid = self._members(obs, live)
        g.window.retain(set(obs.procs))
        for pid, cid in g.pid_cid.items():
            if cid not in g.duty and g.window.samples.get(pid):
                owner = self.containers.get(cid)
                if owner is not None and owner.share(g.uuid) is not None:
                    g.restart = True  # a newcomer with measured use: react now, not at the end of the cycle
        if backstop:
            for cid, keys in g.members.items():
                owner = self.containers.get(cid)
                if owner is not None:
                    # NVML sees device-resident memory: judged against the physical share
                    self.backstop.check(cid, g.uuid, sum(keys.values()), owner.device_limit(g.uuid), keys, now)

    def _members(self, obs: GpuObs, live: set[ProcKey]) -> tuple[dict[str, dict[ProcKey, int]], dict[int, str]]:
        """({container: {process: bytes}}, {pid: container}) of the processes NVML lists."""
        members: dict[str, dict[ProcKey, int]] = {}
        pid_cid: dict[int, str] = {}
        for pid, used in obs.procs.items():
            k = self.mapper.key(pid)
            if k is None:
                continue
            live.add(k)
            cid = self.mapper.resolve(k, self.containers)
            if cid is not None:
                members.setdefault(cid, {})[k] = used
                pid_cid[pid] = cid
        return members, pid_cid

    # -- control and actuation ---------------------------------------------
    def _control(self, g: GpuState, now: float) -> None:
        if g.window.stale(now) and g.duty:
            # No fresh samples: NVML stalled for a moment, or the GPU went idle.  Hold the
            # duties for a little while rather than act on old data; past that, carry on
            # (the old use ages out and the duties of idle containers climb back to 1).
            # Not an error: every job that finishes or pauses makes its GPU go quiet.
            if g.stale_since is None:
                g.stale_since = now
                self.sample_holds += 1
            if now - g.stale_since < STALE_HOLD_S:
                return
        else:
            g.stale_since = None
        g.update_use(now)
        members: dict[str, MemberInput] = {}
        full = g.window.full(now)
        for cid in g.members:
            c = self.containers.get(cid)
            share = c.share(g.uuid) if c is not None else None
            if share is None:
                continue
            members[cid] = MemberInput(target=share, util=g.use.get(cid, 0.0), measured=full)
        g.duty = g.ctl.step(members)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                kv(
                    "control",
                    gpu=g.index,
                    **{
                        cid: f"use={m.util:.1f}/t={g.ctl.targets.get(cid, 0):.0f}/d={g.duty[cid]:.3f}"
                        f"/e={g.ctl.elasticity.get(cid, 1.0):.2f}"
                        for cid, m in members.items()
                    },
                )
            )

    def actuate(self, now: float) -> None:
        want: dict[ProcKey, str] = {}
        for g in self.gpus.values():
            if not g.up:
                continue
            if now >= g.cycle_start + g.cycle_len or g.restart:
                g.restart = False
                self._control(g, now)
                g.cycle_start = now
                g.cycle_len = self.duty_period * (1 + self.rng.uniform(-JITTER, JITTER))
            for cid, d in g.duty.items():
                off_at = self._off_at(g, d)
                if off_at is not None and now >= off_at:
                    for k in g.members.get(cid, {}):
                        want[k] = cid
        self.suspender.apply(want, now)

    def _off_at(self, g: GpuState, d: float) -> float | None:
        if d >= 1.0:
            return None
        off = min((1.0 - d) * g.cycle_len, self.cfg.max_suspend_ms / 1000.0)
        if off < MIN_OFF_S:
            return None
        # edges on a grid: containers with close duties share one wake-up (and one ledger write)
        off = round(off / EDGE_GRID_S) * EDGE_GRID_S
        return g.cycle_start + g.cycle_len - off

    def next_edge(self, now: float) -> float:
        t = now + 3600.0
        for g in self.gpus.values():
            if not g.up:
                continue
            end = g.cycle_start + g.cycle_len
            t = min(t, end)
            for d in g.duty.values():
                off_at = self._off_at(g, d)
                if off_at is not None and off_at > now:
                    t = min(t, off_at)
        return t

    # -- garbage collection --------------------------------------------------
    def collect_garbage(self, now: float) -> None:
        with_procs = {cid for g in self.gpus.values() for cid in g.members}
        for c in list(self.containers.values()):
            if c.kind == "claim":
                continue  # the DRA plugin removes a claim's files when the kubelet unprepares it
            if self.collector.gone(c, c.id in with_procs, now):
                self.suspender.resume_container(c.id, now)
                if self.collector.remove(c):
                    self.containers.pop(c.id, None)
                    self.registry.containers.pop(c.id, None)
                    self.backstop.forget(c.id)
                else:  # retried every round; counted every round, so a stuck directory keeps alerting
                    self.errors["gc"] += 1

    # -- status ------------------------------------------------------------
    def write_status(self, now: float, running: bool = True) -> None:
        """Rebuild the snapshot (metrics read it) and hand it to the status writer.

        The file is written on another thread: a filesystem that stalls (journal
        contention, a slow disk) must never delay a resume in the main loop."""
        snap = build_snapshot(self, now, running)
        self.snapshot = snap
        if running:
            self.status_writer.submit(snap)
        else:  # final state at exit: written here, after the writer thread is done
            self.status_writer.close()
            write_status_file(self.paths.status_path, snap, self.errors)
