"""Host pid -> container, for the pids NVML reports.

Order of evidence, strongest first:

1. the cgroup: /proc/<pid>/cgroup names the container (kubelet, containerd,
   docker, CRI-O naming; v1 and v2), and a state directory of that id exists;
2. the cgroup path recorded by the hook (`metadata.cgroup_path`) contains the
   process's cgroup;
3. the process tree: the process is the container's init process (pid + start
   time from the metadata) or one of its descendants;
4. the container's region: a slot names the process (host pid, or container pid
   = last NSpid entry), and the process lives in the same pid namespace as the
   container's init.  The region is untrusted, so a slot can only claim a
   process that is already inside the container's pid namespace.
5. for a DRA claim (one slice shared by the containers of every pod that uses the claim, in as
   many pid namespaces): the claim's region file, identified by device and inode, is the
   process's /run/vgpu/region (walked inside its root without following links) or is mapped by
   it (/proc/<pid>/maps, the kernel's record).  A process can only reach a claim's region if the
   runtime mounted it into its container (the CDI edits of that claim): the container cannot
   name another claim's.  PodResources v1 would name pods and containers but not processes; the
   cgroup names the pod and container but not the claim; the region does both.

On a node (3) and (4) are fallbacks; in tests without containers, (3) is what
places a workload in a "container": a state directory whose init_pid is the
workload or its parent.  Results are cached per (pid, start time); misses are
retried every `retry_s`, since a state directory may appear after its process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from monitor import cgroups, procs
from monitor.containers import Container
from monitor.procs import ProcKey
from vgpu.paths import CONTAINER_REGION

CLAIM_REGION = CONTAINER_REGION.lstrip("/")  # run/vgpu/region, inside the process's root


class Mapper:
    def __init__(self, proc: str = procs.PROC, retry_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.proc = proc
        self.retry_s = retry_s
        self.clock = clock
        self.cache: dict[ProcKey, str] = {}
        self.keys: dict[int, tuple[ProcKey, float]] = {}
        self.key_ttl_s = 5.0
        self.misses: dict[ProcKey, float] = {}

    def key(self, pid: int) -> ProcKey | None:
        """(pid, start time) of a pid NVML reports, re-read from /proc at most every `key_ttl_s`.

        A reused pid is noticed within that time; meanwhile nothing can go wrong,
        because every signal re-checks the start time through a pidfd."""
        now = self.clock()
        hit = self.keys.get(pid)
        if hit is not None and now - hit[1] < self.key_ttl_s:
            return hit[0]
        k = procs.key_of(pid, self.proc)
        if k is None:
            self.keys.pop(pid, None)
        else:
            self.keys[pid] = (k, now)
        return k

    def resolve(self, key: ProcKey, containers: dict[str, Container]) -> str | None:
        cid = self.cache.get(key)
        if cid is not None:
            if cid in containers:
                return cid
            del self.cache[key]
        now = self.clock()
        miss = self.misses.get(key)
        if miss is not None and now - miss < self.retry_s:
            return None
        cid = self._resolve(key, containers)
        if cid is None:
            self.misses[key] = now
        else:
            self.misses.pop(key, None)
            self.cache[key] = cid
        return cid

    def forget_except(self, live: set[ProcKey]) -> None:
        pids = {k.pid for k in live}
        for pid in [p for p in self.keys if p not in pids]:
            del self.keys[pid]
        for k in list(self.cache):
            if k not in live:
                del self.cache[k]
        for k in list(self.misses):
            if k not in live:
                del self.misses[k]

    def _resolve(self, key: ProcKey, containers: dict[str, Container]) -> str | None:
        text = procs.read_cgroup(key.pid, self.proc) or ""
        # 1. container id in the cgroup path
        for cand in cgroups.candidates(text):
            if cand in containers:
                return cand
        # 2. the hook's recorded cgroupsPath
        for c in containers.values():
            m = c.metadata
            if m is not None and m.cgroup_path and cgroups.in_cgroup(text, m.cgroup_path):
                return c.id
        # 3. init process or a descendant of it
        by_init: dict[int, Container] = {}
        for c in containers.values():
            k = c.init_key
            if k is not None:
                by_init[k.pid] = c
        if by_init:
            chain = [key, *procs.ancestors(key.pid, self.proc)]
            for k in chain:
                hit = by_init.get(k.pid)
                if hit is not None:
                    ik = hit.init_key
                    if ik is not None and (ik.start_time == 0 or ik.start_time == k.start_time):
                        return hit.id
        # 4. region slots, confined to the container's pid namespace
        hit4 = self._by_slot(key, containers)
        if hit4 is not None:
            return hit4
        # 5. DRA claims: the claim's region file is the process's /run/vgpu/region, or mapped by it
        claims = {c.region_id: c.id for c in containers.values() if c.kind == "claim" and c.region_id}
        if claims:
            rid = procs.file_in_root(key.pid, CLAIM_REGION, self.proc)
            if rid in claims:
                return claims[rid]
            mapped = procs.mapped_files(key.pid, self.proc) & claims.keys()
            if mapped:
                return claims[min(mapped)]
        return None

    def _by_slot(self, key: ProcKey, containers: dict[str, Container]) -> str | None:
        ns = procs.pid_ns(key.pid, self.proc)
        nsp = procs.nspids(key.pid, self.proc) or [key.pid]
        for c in containers.values():
            snap = c.region
            ik = c.init_key
            if snap is None or ik is None or ns is None:
                continue
            if procs.pid_ns(ik.pid, self.proc) != ns:
                continue
            for s in snap.slots:
                if s.start_time and s.start_time != key.start_time:
                    continue
                if s.host_pid == key.pid or (s.host_pid == 0 and s.pid == nsp[-1]):
                    return c.id
        return None
