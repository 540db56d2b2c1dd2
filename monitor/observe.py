"""NVML observation for the monitor: per GPU, processes with contexts and their
memory, per-process SM utilisation samples, device memory and utilisation.

NVML facts this relies on (see docs/developers/monitor.md):
- nvmlDeviceGetComputeRunningProcesses (pynvml maps it to _v3, 24-byte entries)
  lists host pids (the driver knows no pid namespaces).
- nvmlDeviceGetProcessUtilization is called directly with a fixed buffer of
  1024 samples (the sizing call is unreliable on some drivers), chaining
  lastSeenTimeStamp from the timestamps NVML itself returned (no assumption
  about its clock), NVML_ERROR_NOT_FOUND meaning "no newer samples".  Rows are
  kept only if the pid has a context, every utilisation is <= 100 and the
  timestamp is newer than lastSeen (garbage rows were seen in the field).
- MIG devices (a GPU in MIG mode, nodecore/mig.py) are observed as devices of their own, by
  their MIG UUID (the limits' key), re-enumerated every MIG_REFRESH_S: their memory and
  processes come from their MIG handles; NVML has no per-process utilisation on MIG ("On
  MIG-enabled GPUs, querying process utilization is not currently supported", nvml.h: NOT_SUPPORTED),
  so `compute_enforced` is False for them and the compute shares of containers on them are not
  enforced (said once in the log; docs/operators/mig.md).
- Any other error (GPU_IS_LOST included) marks that GPU down for the loop;
  the others carry on.  Errors meaning the library or driver went away
  (UNINITIALIZED, UNKNOWN, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH), or
  every GPU failing at once, trigger a full nvmlShutdown/nvmlInit, retried
  with exponential backoff.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vgpu.log import kv

log = logging.getLogger("vgpu.monitor.observe")

UTIL_BUFFER = 1024
MIG_REFRESH_S = 2.0
DEVICE_INFO_INTERVAL_S = 1.0
PROCESS_LIST_INTERVAL_S = 0.5


@dataclass
class UtilSample:
    pid: int
    ts: int  # NVML timestamp, microseconds (clock base unknown)
    sm: int


@dataclass
class GpuObs:
    index: int
    uuid: str
    name: str = ""
    up: bool = True
    error: str = ""
    memory_total: int = 0
    memory_used: int = 0
    util: int = 0
    procs: dict[int, int] = field(default_factory=dict)  # host pid -> used bytes
    samples: list[UtilSample] = field(default_factory=list)
    parent: str = ""  # a MIG device: its GPU's UUID
    compute_enforced: bool = True  # NVML samples per-process use here (not on MIG)


def _pynvml() -> Any:
    import pynvml

    return pynvml


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


class NvmlSource:
    """Stateful NVML reader: keeps handles, lastSeen per GPU, and re-initialises after failures."""

    def __init__(self, backoff_min: float = 0.5, backoff_max: float = 30.0, clock: Any = time.monotonic) -> None:
        self.nv = _pynvml()
        self.clock = clock
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self.backoff = backoff_min
        self.ready = False
        self.next_try = 0.0
        self.handles: list[tuple[int, str, str, Any]] = []  # index, uuid, name, handle
        self.last_seen: dict[str, int] = {}
        self.device_read_at: dict[str, float] = {}
        self.proc_cache: dict[str, tuple[float, dict[int, int]]] = {}
        self.known: dict[str, GpuObs] = {}  # last good view per uuid (for reporting while down)
        self.mig_handles: list[tuple[int, str, str, Any]] = []  # MIG devices, as handles
        self.mig_parent: dict[str, str] = {}
        self.mig_at = -MIG_REFRESH_S
        self.no_util: set[str] = set()  # devices whose process utilisation is NOT_SUPPORTED
        self.reinits = 0
        self.errors = 0
        self._fn_util: Any = None
        self._fn_procs: Any = None
        self._util_buf: Any = None
        self._proc_buf: Any = None
        self._global_codes = {
            getattr(self.nv, n)
            for n in (
                "NVML_ERROR_UNINITIALIZED",
                "NVML_ERROR_UNKNOWN",
                "NVML_ERROR_DRIVER_NOT_LOADED",
                "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
                "NVML_ERROR_LIBRARY_NOT_FOUND",
                "NVML_ERROR_FUNCTION_NOT_FOUND",
            )
            if hasattr(self.nv, n)
        }

    # -- lifecycle ---------------------------------------------------------
    def _init(self) -> bool:
        nv = self.nv
        now = self.clock()
        if now < self.next_try:
            return False
        try:
            nv.nvmlInit()
            n = nv.nvmlDeviceGetCount()
            handles = []
            for i in range(n):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                try:
                    name = _text(nv.nvmlDeviceGetName(h))
                except nv.NVMLError:
                    name = ""
                handles.append((i, uuid, name, h))
            self._fn_util = nv._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
            try:
                self._fn_procs = nv._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
            except nv.NVMLError:
                self._fn_procs = None  # old driver: pynvml's wrapper picks what exists
        except Exception as e:  # NVMLError and ctypes load failures alike
            self.errors += 1
            self._fail(f"init: {e}")
            return False
        self.handles = handles
        self.mig_at = -MIG_REFRESH_S
        self.ready = True
        self.backoff = self.backoff_min
        if self.reinits:
            log.warning(kv("NVML re-initialised", gpus=len(handles)))
        self.reinits += 1
        # keep lastSeen per uuid across re-inits: timestamps only ever grow
        return True

    def _fail(self, why: str) -> None:
        if self.ready:
            try:
                self.nv.nvmlShutdown()
            except Exception:
                pass
        self.ready = False
        self.next_try = self.clock() + self.backoff
        log.warning(kv("NVML unavailable, will retry", error=why, retry_s=round(self.backoff, 2)))
        self.backoff = min(self.backoff * 2, self.backoff_max)

    def close(self) -> None:
        if self.ready:
            try:
                self.nv.nvmlShutdown()
            except Exception:
                pass
            self.ready = False

    # -- reading -----------------------------------------------------------
    def observe(self) -> list[GpuObs]:
        """One observation of every GPU.  GPUs that fail are returned with up=False."""
        if not self.ready and not self._init():
            return [
                GpuObs(
                    index=o.index,
                    uuid=o.uuid,
                    name=o.name,
                    up=False,
                    error="nvml unavailable",
                    memory_total=o.memory_total,
                )
                for o in self.known.values()
            ]
        out: list[GpuObs] = []
        global_fail = ""
        if self.clock() - self.mig_at >= MIG_REFRESH_S:
            self._refresh_migs()
        for index, uuid, name, h in self.handles + self.mig_handles:
            obs = GpuObs(index=index, uuid=uuid, name=name, parent=self.mig_parent.get(uuid, ""))
            try:
                self._read(h, obs)
            except self.nv.NVMLError as e:
                self.errors += 1
                obs = GpuObs(index=index, uuid=uuid, name=name, up=False, error=str(e))
                prev = self.known.get(uuid)
                if prev:
                    obs.memory_total = prev.memory_total
                if getattr(e, "value", None) in self._global_codes:
                    global_fail = str(e)
            out.append(obs)
            if obs.up:
                self.known[uuid] = obs
        if out and not any(o.up for o in out):
            global_fail = global_fail or out[0].error  # every GPU failing: start NVML over
        if global_fail:
            self._fail(global_fail)
            for o in out:
                o.up = False
                o.error = o.error or global_fail
        return out

    def _refresh_migs(self) -> None:
        """The MIG devices of the GPUs in MIG mode (their instances come and go)."""
        nv = self.nv
        self.mig_at = self.clock()
        found: list[tuple[int, str, str, Any]] = []
        for index, uuid, _name, h in self.handles:
            try:
                if int(nv.nvmlDeviceGetMigMode(h)[0]) != 1:
                    continue
                count = int(nv.nvmlDeviceGetMaxMigDeviceCount(h))
            except nv.NVMLError:  # not MIG-capable, or an old library
                continue
            for j in range(count):
                try:
                    m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                    mu = _text(nv.nvmlDeviceGetUUID(m))
                    mn = _text(nv.nvmlDeviceGetName(m))
                except nv.NVMLError:
                    continue
                found.append((index, mu, mn, m))
                self.mig_parent[mu] = uuid
        self.mig_handles = found

    def _read(self, h: Any, obs: GpuObs) -> None:
        nv = self.nv
        # device totals only feed metrics and status: read them once a second
        prev = self.known.get(obs.uuid)
        now = self.clock()
        if prev is None or now - self.device_read_at.get(obs.uuid, 0.0) >= DEVICE_INFO_INTERVAL_S:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            obs.memory_total = int(mem.total)
            obs.memory_used = int(mem.used)
            try:
                obs.util = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except nv.NVMLError_NotSupported:
                obs.util = 0
            self.device_read_at[obs.uuid] = now
        else:
            obs.memory_total, obs.memory_used, obs.util = prev.memory_total, prev.memory_used, prev.util
        # The process list changes only when processes come and go: refresh it every
        # PROCESS_LIST_INTERVAL_S, or at once when a sample names a pid it lacks.
        raw = self._raw_samples(h, obs.uuid)
        cached = self.proc_cache.get(obs.uuid)
        if cached is None or now - cached[0] >= PROCESS_LIST_INTERVAL_S or any(s.pid not in cached[1] for s in raw):
            procs: dict[int, int] = {}
            for pid, used in self._processes(h):
                if 0 < pid < 1 << 22:
                    procs[pid] = procs.get(pid, 0) + (used if used < 1 << 63 else 0)
            cached = self.proc_cache[obs.uuid] = (now, procs)
        obs.procs = dict(cached[1])
        obs.compute_enforced = obs.uuid not in self.no_util
        # keep a sample only if its pid has a context (garbage rows were seen in the field)
        obs.samples = [s for s in raw if s.pid in obs.procs]
        if obs.samples:
            self.last_seen[obs.uuid] = max(self.last_seen.get(obs.uuid, 0), max(s.ts for s in obs.samples))

    def _processes(self, h: Any) -> list[tuple[int, int]]:
        """(pid, used bytes) of processes with a compute context: `_v3` into a reused buffer
        (pynvml's wrapper builds Python objects per entry, several times slower)."""
        nv = self.nv
        if self._fn_procs is None:
            out = []
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory
                out.append((int(p.pid), int(used) if used is not None else 0))
            return out
        n = len(self._proc_buf) if self._proc_buf is not None else 64
        while True:
            if self._proc_buf is None or len(self._proc_buf) < n:
                self._proc_buf = (nv.c_nvmlProcessInfo_t * n)()
            buf = self._proc_buf
            count = ctypes.c_uint(len(buf))
            ret = self._fn_procs(h, ctypes.byref(count), buf)
            if ret == nv.NVML_ERROR_INSUFFICIENT_SIZE and n < 1 << 16:
                n = max(n * 2, count.value * 2 + 5)
                continue
            if ret != nv.NVML_SUCCESS:
                raise nv.NVMLError(ret)
            return [(int(buf[i].pid), int(buf[i].usedGpuMemory)) for i in range(min(count.value, len(buf)))]

    def _raw_samples(self, h: Any, uuid: str) -> list[UtilSample]:
        """Samples newer than lastSeen with plausible values (the caller filters pids, advances lastSeen)."""
        nv = self.nv
        last = self.last_seen.get(uuid, 0)
        n = len(self._util_buf) if self._util_buf is not None else UTIL_BUFFER
        while True:
            if self._util_buf is None or len(self._util_buf) < n:
                self._util_buf = (nv.c_nvmlProcessUtilizationSample_t * n)()
            buf = self._util_buf
            count = ctypes.c_uint(n)
            ret = self._fn_util(h, buf, ctypes.byref(count), ctypes.c_ulonglong(last))
            if ret == nv.NVML_ERROR_NOT_FOUND:
                return []
            if ret == nv.NVML_ERROR_NOT_SUPPORTED:
                if uuid not in self.no_util:
                    self.no_util.add(uuid)
                    log.warning(kv("compute shares not enforced: NVML has no per-process utilisation here "
                                   "(MIG: nvml.h 'querying process utilization is not currently supported')",
                                   gpu=uuid))  # fmt: skip
                return []
            if ret == nv.NVML_ERROR_INSUFFICIENT_SIZE and n < 16 * UTIL_BUFFER:
                n *= 4
                continue
            if ret != nv.NVML_SUCCESS:
                raise nv.NVMLError(ret)
            break
        out: list[UtilSample] = []
        for i in range(min(count.value, n)):
            s = buf[i]
            pid, ts, sm = int(s.pid), int(s.timeStamp), int(s.smUtil)
            if pid <= 0 or ts <= last or not (0 <= sm <= 100) or s.memUtil > 100:
                continue
            out.append(UtilSample(pid=pid, ts=ts, sm=sm))
        return out
