"""The device memory NVML sees for a process beyond what libvgpu.so charged it (the CUDA
context, the driver's own allocations), written into the process's slot of its container's
region (`extra_bytes`, vgpu.region.write_extra_bytes) so that the library counts it against
the limit.  A slot is matched to an NVML process by host pid, else by the pid inside the
container's namespace, and by start time when the slot has one."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from monitor import procs
from monitor.containers import Container
from monitor.gpustate import GpuState
from monitor.procs import ProcKey
from vgpu.log import kv
from vgpu.region import RegionSnapshot, write_extra_bytes

log = logging.getLogger("vgpu.monitor")

EXTRA_WRITE_THRESHOLD = 1 << 20  # a slot is rewritten when its value moves by this much (or to 0)
Tag = tuple[str, int, int, int, int]  # container, slot, device, host pid, start time


class ExtraBytes:
    def __init__(self) -> None:
        self.written: dict[Tag, int] = {}  # what each slot was last given
        self.nspids: dict[ProcKey, list[int]] = {}  # a process's pids by namespace, read once
        # GPU uuid -> the smallest extra bytes of a process on it in the last update(): the base
        # CUDA context (a process's extra also holds its modules and the driver's caches, so the
        # smallest is the one safe to charge every process; monitor/contextsizes.py publishes it).
        # Only values a process showed in two updates in a row count: NVML's view and the region
        # are read at different moments, so an allocation or free between them makes one pass's
        # figure wrong by its size.
        self.measured: dict[str, int] = {}
        self.last: dict[tuple[ProcKey, str], int] = {}  # (process, GPU uuid) -> its previous extra

    def forget_except(self, live: set[ProcKey]) -> None:
        if len(self.nspids) > 2 * len(live) + 64:
            self.nspids = {k: v for k, v in self.nspids.items() if k in live}
        if len(self.last) > 4 * len(live) + 64:
            self.last = {lk: v for lk, v in self.last.items() if lk[0] in live}

    def update(self, gpus: Iterable[GpuState], containers: Iterable[Container], errors: Counter[str]) -> None:
        """Write into each slot the bytes NVML sees for its process beyond what the library charged."""
        up = [g for g in gpus if g.up]
        self.measured = {}
        for c in containers:
            snap = c.region
            if snap is None:
                continue
            keys: dict[ProcKey, dict[str, int]] = {}  # process -> GPU -> bytes NVML sees
            for g in up:
                for k, used in g.members.get(c.id, {}).items():
                    keys.setdefault(k, {})[g.uuid] = used
            if keys:
                self._write(c, snap, keys, errors)
        if len(self.written) > 100_000:
            self.written.clear()

    def _write(
        self, c: Container, snap: RegionSnapshot, keys: dict[ProcKey, dict[str, int]], errors: Counter[str]
    ) -> None:
        writes, tags = self.slot_writes(c.id, snap, keys)
        if not writes:
            return
        try:
            ok = write_extra_bytes(c.region_path, writes)
        except (OSError, ValueError) as e:
            ok = False
            errors["region_write"] += 1
            log.warning(kv("cannot write extra bytes", container=c.id, error=e))
        if not ok:  # lock busy or error: try again next round
            for tag in tags:
                self.written.pop(tag, None)

    def slot_writes(
        self, cid: str, snap: RegionSnapshot, keys: dict[ProcKey, dict[str, int]]
    ) -> tuple[dict[tuple[int, int], int], list[Tag]]:
        """{(slot, device): extra bytes} to write into container `cid`'s region, and their tags
        (recorded as written: forgotten again by the caller if the write fails)."""
        # A claim's region is shared by processes of several pid namespaces (its pods): a
        # slot's namespace pid may name several of them; the start time tells them apart, and
        # a slot that still names more than one is left alone.
        inner: dict[int, list[ProcKey]] = {}
        for k in keys:
            ns = self.nspids.get(k)
            if ns is None:  # a process's pid namespaces never change: read /proc/<pid>/status once
                ns = self.nspids[k] = procs.nspids(k.pid) or []
            if ns:
                inner.setdefault(ns[-1], []).append(k)
        writes: dict[tuple[int, int], int] = {}
        tags: list[Tag] = []
        for s in snap.slots:
            cand = [k for k in keys if k.pid == s.host_pid] if s.host_pid > 0 else inner.get(s.pid, [])
            if s.start_time:
                cand = [k for k in cand if k.start_time == s.start_time]
            if len(cand) != 1:
                continue
            k = cand[0]
            for j, dev in enumerate(snap.devices):
                seen = keys[k].get(dev.uuid)
                if seen is None:
                    continue
                # memory shared with other processes is counted once in the region's ledger:
                # not again as this process's extra
                extra = max(0, seen - s.device_bytes[j] - snap.shared_held(s.index, j))
                prev = self.last.get((k, dev.uuid))
                self.last[(k, dev.uuid)] = extra
                # below the threshold: no context yet, or a charge NVML does not show yet
                if extra >= EXTRA_WRITE_THRESHOLD and prev is not None and abs(extra - prev) < EXTRA_WRITE_THRESHOLD:
                    self.measured[dev.uuid] = min(extra, self.measured.get(dev.uuid, extra))
                tag = (cid, s.index, j, k.pid, k.start_time)
                last = self.written.get(tag, s.extra_bytes[j])
                if abs(extra - last) >= EXTRA_WRITE_THRESHOLD or (extra == 0 and last != 0):
                    writes[(s.index, j)] = extra
                    self.written[tag] = extra
                    tags.append(tag)
        return writes, tags
