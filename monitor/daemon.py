"""The monitor's main loop: observe, map, control, actuate, backstop, report, clean up.

One thread does everything (the metrics HTTP server reads an immutable
snapshot from its own thread).  The loop sleeps until the next event: an
observation every `period_ms`, or an actuation edge of a GPU's duty cycle
(see monitor/controller.py), so suspensions start and end on time without
a fast polling loop.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from monitor import procs
from monitor.backstop import Backstop
from monitor.cleanup import Collector
from monitor.containers import Container, Registry, init_alive
from monitor.controller import ControlParams, GpuController, MemberInput
from monitor.mapping import Mapper
from monitor.measure import UtilWindow
from monitor.observe import GpuObs, NvmlSource
from monitor.procs import ProcKey
from monitor.suspend import Suspender
from vgpu.config import MonitorConfig
from vgpu.log import kv
from vgpu.paths import Paths
from vgpu.region import write_extra_bytes

log = logging.getLogger("vgpu.monitor")

JITTER = 0.05
MIN_OFF_S = 0.01
EDGE_GRID_S = 0.004
SCAN_INTERVAL_S = 1.0
REGION_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 1.0
EXTRA_WRITE_THRESHOLD = 1 << 20
NVML_HANG_S = 2.0
BACKSTOP_INTERVAL_S = 0.5
STALE_HOLD_S = 1.0

# Every kind of `vgpu_monitor_errors_total` the loop counts (docs/operators/metrics.md, "Error kinds"), created
# at 0 when the monitor starts: a kind that first appears with a count already above 0 is invisible
# to Prometheus's increase()/rate(), which need a previous sample.  (`nvml_call`, the NVML reader's
# own count, is added by monitor/metrics.py.)
ERROR_KINDS = ("actuate", "gc", "loop", "nvml", "nvml_hang", "region_write", "status")


def write_status_file(path: str, snap: dict[str, Any], errors: Counter[str]) -> None:
    import msgspec

    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, msgspec.json.encode(snap))
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as e:
        errors["status"] += 1
        log.warning(kv("cannot write status", path=path, error=e))


def name_thread(name: str) -> None:
    """Name the calling OS thread (visible in top -H, /proc/<pid>/task/<tid>/comm)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


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


class NvmlWorker:
    """Runs `source.observe()` on a thread of its own, one call at a time.

    NVML calls can hang (a GPU falling off the bus, a driver in trouble, or any
    lock another process holds — including a process we stopped).  The main loop
    never waits on NVML: it keeps resuming processes on time, and after
    NVML_HANG_S without an answer it resumes everything."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.busy = False
        self.since = 0.0
        self._req = threading.Event()
        self._done = threading.Event()
        self._result: tuple[Any, float] | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="nvml", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def request(self) -> None:
        self.busy = True
        self.since = time.monotonic()
        self._req.set()

    def wait(self, timeout: float) -> None:
        """Sleep until `timeout` passes or an observation is done."""
        self._done.wait(timeout)

    def take(self) -> tuple[Any, float] | None:
        if not self._done.is_set():
            return None
        self._done.clear()
        r, self._result = self._result, None
        if r is None:  # woken by stop(), not by a result
            return None
        self.busy = False
        return r

    def wake(self) -> None:
        self._done.set()

    def close(self) -> None:
        self._closing = True
        self._req.set()

    def _loop(self) -> None:
        name_thread("vgpu-nvml")
        while True:
            self._req.wait()
            self._req.clear()
            if self._closing:
                return
            t0 = time.perf_counter()
            try:
                result: Any = self.source.observe()
            except Exception as e:  # handed to the main loop, which counts and logs it
                result = e
            self._result = (result, time.perf_counter() - t0)
            self._done.set()


@dataclass
class GpuState:
    uuid: str
    index: int
    ctl: GpuController
    window: UtilWindow
    name: str = ""
    up: bool = False
    error: str = ""
    obs: GpuObs | None = None
    members: dict[str, dict[ProcKey, int]] = field(default_factory=dict)  # container -> key -> bytes
    pid_cid: dict[int, str] = field(default_factory=dict)
    use: dict[str, float] = field(default_factory=dict)  # as of the last control step / snapshot
    cycle_start: float = 0.0
    cycle_len: float = 0.5
    duty: dict[str, float] = field(default_factory=dict)
    stale_since: float | None = None
    restart: bool = False  # start a new cycle (and control step) now: a container began using the GPU


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
        self.extra_written: dict[tuple[str, int, int, int, int], int] = {}
        self.nspid_cache: dict[ProcKey, list[int]] = {}
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
        self.snapshot = self.build_snapshot(time.monotonic())

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
            g.index, g.name, g.obs = obs.index, obs.name, obs
            if not obs.up:
                if g.up or not g.error:
                    log.warning(kv("GPU unavailable; resuming its containers", gpu=obs.uuid, error=obs.error))
                    self.errors["nvml"] += 1
                g.up, g.error = False, obs.error or "down"
                g.members, g.use, g.duty, g.pid_cid = {}, {}, {}, {}
                g.ctl = GpuController(self.params)
                g.window = UtilWindow(self.cfg.window_s)
                continue
            if not g.up and g.error:
                log.warning(kv("GPU back", gpu=obs.uuid))
            g.up, g.error = True, ""
            g.window.add(obs.samples, now)
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
            g.members = members
            g.pid_cid = pid_cid
            g.window.retain(set(obs.procs))
            for pid, cid in pid_cid.items():
                if cid not in g.duty and g.window.samples.get(pid):
                    owner = self.containers.get(cid)
                    if owner is not None and owner.share(g.uuid) is not None:
                        g.restart = True  # a newcomer with measured use: react now, not at the end of the cycle
            if backstop:
                for cid, keys in members.items():
                    owner = self.containers.get(cid)
                    if owner is not None:
                        self.backstop.check(cid, g.uuid, sum(keys.values()), owner.memory_limit(g.uuid), keys, now)
        self.mapper.forget_except(live)
        if len(self.nspid_cache) > 2 * len(live) + 64:
            self.nspid_cache = {k: v for k, v in self.nspid_cache.items() if k in live}
        if read_regions:
            self.update_extra_bytes()
        if now >= nx["gc"]:
            self.collect_garbage(now)
            nx["gc"] = now + self.gc_interval
        if now >= nx["status"]:
            self.write_status(now)
            nx["status"] = now + STATUS_INTERVAL_S

    # -- control and actuation ---------------------------------------------
    def _update_use(self, g: GpuState, now: float) -> None:
        """Containers' use over the window (computed when needed: control steps, snapshots)."""
        use: dict[str, float] = {}
        for pid, cid in g.pid_cid.items():
            use[cid] = use.get(cid, 0.0) + g.window.use(pid, now)
        g.use = {cid: min(100.0, u) for cid, u in use.items()}

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
        self._update_use(g, now)
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

    # -- region extra bytes ------------------------------------------------
    def update_extra_bytes(self) -> None:
        """Write into each slot the bytes NVML sees for its process beyond what the library charged."""
        by_uuid = {g.uuid: g for g in self.gpus.values() if g.up}
        for c in self.containers.values():
            snap = c.region
            if snap is None:
                continue
            keys: dict[ProcKey, dict[str, int]] = {}
            for g in by_uuid.values():
                for k, used in g.members.get(c.id, {}).items():
                    keys.setdefault(k, {})[g.uuid] = used
            if not keys:
                continue
            # A claim's region is shared by processes of several pid namespaces (its pods): a
            # slot's namespace pid may name several of them; the start time tells them apart, and
            # a slot that still names more than one is left alone.
            inner: dict[int, list[ProcKey]] = {}
            for k in keys:
                ns = self.nspid_cache.get(k)
                if ns is None:  # a process's pid namespaces never change: read /proc/<pid>/status once
                    ns = self.nspid_cache[k] = procs.nspids(k.pid) or []
                if ns:
                    inner.setdefault(ns[-1], []).append(k)
            writes: dict[tuple[int, int], int] = {}
            tags: list[tuple[str, int, int, int, int]] = []
            for s in snap.slots:
                k2: ProcKey | None = None
                if s.host_pid > 0:
                    cand = [k for k in keys if k.pid == s.host_pid]
                else:
                    cand = inner.get(s.pid, [])
                if s.start_time:
                    cand = [k for k in cand if k.start_time == s.start_time]
                if len(cand) != 1:
                    continue
                k2 = cand[0]
                for j, dev in enumerate(snap.devices):
                    seen = keys[k2].get(dev.uuid)
                    if seen is None:
                        continue
                    extra = max(0, seen - s.device_bytes[j])
                    tag = (c.id, s.index, j, k2.pid, k2.start_time)
                    last = self.extra_written.get(tag, s.extra_bytes[j])
                    if abs(extra - last) >= EXTRA_WRITE_THRESHOLD or (extra == 0 and last != 0):
                        writes[(s.index, j)] = extra
                        self.extra_written[tag] = extra
                        tags.append(tag)
            if writes:
                try:
                    ok = write_extra_bytes(c.region_path, writes)
                except (OSError, ValueError) as e:
                    ok = False
                    self.errors["region_write"] += 1
                    log.warning(kv("cannot write extra bytes", container=c.id, error=e))
                if not ok:  # lock busy or error: try again next round
                    for tag in tags:
                        self.extra_written.pop(tag, None)
        if len(self.extra_written) > 100_000:
            self.extra_written.clear()

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
    def build_snapshot(self, now: float, running: bool = True) -> dict[str, Any]:
        gpus = []
        for g in sorted(self.gpus.values(), key=lambda x: x.index):
            if g.up:
                self._update_use(g, now)
            o = g.obs
            rows = []
            for cid, keys in sorted(g.members.items()):
                c = self.containers.get(cid)
                if c is None:
                    continue
                acts = self.backstop.actions.get(cid, Counter())
                rows.append(
                    {
                        **c.labels(),
                        "pids": sorted(k.pid for k in keys),
                        "memory_used": sum(keys.values()),
                        "memory_limit": c.memory_limit(g.uuid),
                        "sm_use": round(g.use.get(cid, 0.0), 2),
                        "share": c.share(g.uuid),
                        "effective_share": g.ctl.targets.get(cid),
                        "duty": round(g.duty.get(cid, 1.0), 4),
                        "suspended": any(k in self.suspender.stopped for k in keys),
                        "backstop_actions": dict(acts),
                    }
                )
            # Containers allocated on this GPU with no process on it (not started yet, between
            # jobs, or done): their series stay, used 0, for as long as the allocation exists.
            allocated = []
            for c in sorted(self.containers.values(), key=lambda x: x.id):
                if c.id in g.members or c.memory_limit(g.uuid) is None:
                    continue
                allocated.append(
                    {
                        **c.labels(),
                        "memory_limit": c.memory_limit(g.uuid),
                        "share": c.share(g.uuid),
                    }
                )
            gpus.append(
                {
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
            )
        containers = []
        for c in sorted(self.containers.values(), key=lambda x: x.id):
            st = self.suspender.stats.get(c.id)
            containers.append(
                {
                    **c.labels(),
                    "kind": c.kind,
                    "gpus": sorted(c.limits),
                    "init_alive": init_alive(c),
                    "region_error": c.region_error,
                    "region_corrupt_total": c.region_corrupt_total,
                    "suspended": self.suspender.is_suspended(c.id),
                    "suspended_seconds": round(self.suspender.suspended_seconds(c.id, now), 3),
                    "suspensions": st.suspensions if st else 0,
                    "longest_stop_s": round(st.longest_stop_s, 3) if st else 0.0,
                    "backstop_actions": dict(self.backstop.actions.get(c.id, Counter())),
                }
            )
        return {
            "version": 1,
            "running": running,
            "time": time.time(),
            "pid": os.getpid(),
            "policy": self.cfg.policy,
            "metrics_port": self.metrics_port,
            "loop_seconds": self.loop_seconds,
            "errors": dict(self.errors),
            "sample_holds": self.sample_holds,
            "nvml_errors": getattr(self.source, "errors", 0),
            "suspended_processes": len(self.suspender.stopped),
            "guardian_armed": self.suspender.armed,
            "gc_removed": self.collector.removed,
            "gpus": gpus,
            "containers": containers,
        }

    def write_status(self, now: float, running: bool = True) -> None:
        """Rebuild the snapshot (metrics read it) and hand it to the status writer.

        The file is written on another thread: a filesystem that stalls (journal
        contention, a slow disk) must never delay a resume in the main loop."""
        snap = self.build_snapshot(now, running)
        self.snapshot = snap
        if running:
            self.status_writer.submit(snap)
        else:  # final state at exit: written here, after the writer thread is done
            self.status_writer.close()
            write_status_file(self.paths.status_path, snap, self.errors)
