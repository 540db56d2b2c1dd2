"""What this node handed out, for the scheduler (`vgpu.k8s.io/node-usage`, vgpu.scheduling.NodeUsage).

Every slice the node gave a container is in an allocation record, whether a scheduler decided it
or not (a pod of another scheduler, one placed before vgpu-scheduler ran, or one given n x 1/K).
The scheduler counts them all (one truth for usage, docs/developers/scheduler.md) from this document: one
entry per vGPU slot and record holding it, with the memory limit and compute share of the record.

Each entry names the pod UID and container holding it, so that the scheduler counts a pod's
slices while the pod runs and stops when it ends. A record lives longer than that: until the
kubelet's device checkpoint no longer keeps its answer (records.py), which the kubelet rewrites
only at its next allocation or device list change, so an ended pod's records may stay for hours on
a node that admits nothing new; its slices must not keep the node "full" meanwhile. The names come
from that same checkpoint (each kept answer's PodUID and ContainerName, checkpoint.holders), which
the kubelet writes right after each Allocate (manager.go allocateContainerResources ->
writeCheckpoint), and, for a slice that followed a scheduler decision, from Allocate itself. A
record the checkpoint does not name yet (the moment between our answer and the kubelet's write, or
a checkpoint that cannot be read) is published without a name: the scheduler counts it as long as
it is published, never less. A record that a readable checkpoint, written at least
`UNHELD_AFTER_S` after the record, does not hold is not published: the kubelet writes its whole
state at each write, so it no longer holds that answer (its pod is gone) even if the record stays
on disk for the collector's grace (records.py). After a restart, which loses Allocate's names,
such records would otherwise make the node look full until the collector deletes them.

A slot named by records of several pods is the newest pod's (the kubelet gives a device to one
pod at a time; the older records belong to pods that ended). Records of one pod that share a slot
are an init container's and the app container the kubelet gave its devices to (manager.go
Allocate, devicesToReuse): all are listed, and the scheduler counts the pod's larger use of the
GPU once (vgpu.scheduling.pod_usage). Without a name, the newest record of a slot wins.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from device_plugin import checkpoint
from device_plugin.dynmig import Placed
from nodecore import records
from vgpu import scheduling as sc
from vgpu.log import kv
from vgpu.paths import Paths
from vgpu.schemas import AllocationRecord

log = logging.getLogger(__name__)

# The kubelet records an answer in its checkpoint right after Allocate returns (manager.go
# allocateContainerResources -> writeCheckpoint); a checkpoint written this long after a record
# and without it means the kubelet does not hold that answer.
UNHELD_AFTER_S = 5.0


def _shape(gpus: Iterable[tuple[str, int, int]]) -> tuple[tuple[str, int, int], ...]:
    return tuple(sorted(gpus))


def slices(
    recs: list[AllocationRecord], tags: dict[str, tuple[str, str]], placed: Mapping[str, Placed] | None = None
) -> list[sc.UsedSlice]:
    """One slice per vGPU slot and record holding it (see the module's docstring), tagged from
    `tags` (token -> (pod UID, container)); pure. A GPU entry holding k slots (n x 1/K without a
    decision) is k slices that share its memory and compute; one without vGPU IDs counts once.
    An entry naming a MIG device made for its container (`placed`: MIG UUID -> instance, dynamic
    MIG) is a slice of the GPU in MIG mode holding that instance's memory slices."""
    ordered = sorted(recs, key=lambda r: (r.created, r.token))
    owner: dict[str, str] = {}  # vGPU ID -> pod UID of its newest record ("" when unnamed)
    newest: dict[str, str] = {}  # vGPU ID -> token of its newest record
    for r in ordered:
        pod = tags.get(r.token, ("", ""))[0]
        for g in r.gpus:
            for vid in g.vgpu_ids:
                owner[vid], newest[vid] = pod, r.token  # the newest wins
    out: list[sc.UsedSlice] = []
    for r in ordered:
        pod, container = tags.get(r.token, ("", ""))
        for g in r.gpus:
            k = max(len(g.vgpu_ids), 1)
            for i in range(k):
                if g.vgpu_ids:
                    vid = g.vgpu_ids[i]
                    if newest.get(vid) != r.token and (not pod or owner.get(vid) != pod):
                        continue
                mem = g.memory_limit // k + (g.memory_limit % k if i == 0 else 0)
                made = placed.get(g.uuid) if placed else None
                if made is not None:
                    out.append(sc.UsedSlice(gpu=made.parent, memory=mem, cores=made.cores, pod=pod,
                                            container=container, mig=made.assignment))  # fmt: skip
                    continue
                cores = g.core_percent // k + (g.core_percent % k if i == 0 else 0)
                out.append(sc.UsedSlice(gpu=g.uuid, memory=mem, cores=cores, pod=pod, container=container))
    return out


class Tracker:
    """The records of one resource and who holds them; thread-safe.

    Names come from the kubelet's checkpoint (`checkpoint_path`, re-read when the file changed:
    `refresh()`, a stat per call) and from Allocate for decided slices (`note()`); the checkpoint's
    win. Without a checkpoint path only Allocate's names are known."""

    def __init__(self, paths: Paths, resource_name: str, checkpoint_path: str = "") -> None:
        self.paths = paths
        self.resource_name = resource_name
        self.checkpoint_path = checkpoint_path
        self._lock = threading.Lock()
        self._tags: dict[str, tuple[str, str]] = {}  # from Allocate (decisions) and the API (rebuild)
        self._held: dict[str, tuple[str, str]] = {}  # from the kubelet's checkpoint
        self._sig: tuple[int, int, int] | None = None  # of the last checkpoint read (inode, size, mtime ns)
        self.placed: Callable[[], dict[str, Placed]] | None = None  # dynamic MIG's instances

    def note(self, token: str, pod_uid: str = "", container: str = "") -> None:
        """A record was written (Allocate); `pod_uid`/`container`: the decision it honoured."""
        if pod_uid:
            with self._lock:
                self._tags[token] = (pod_uid, container)

    def refresh(self) -> bool:
        """Read the kubelet's checkpoint again if it changed (size, mtime, inode); True when the
        names it gives changed. An unusable file keeps the names read before (they were true)."""
        if not self.checkpoint_path:
            return False
        try:
            st = os.stat(self.checkpoint_path)
        except OSError:
            return False
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig == self._sig:
            return False
        try:
            held = checkpoint.holders(self.checkpoint_path, self.resource_name)
        except checkpoint.CheckpointUnusable:
            return False  # records.py's collector says so in the log
        with self._lock:
            self._sig = sig
            changed = held != self._held
            self._held = held
        return changed

    def records(self) -> list[AllocationRecord]:
        return [r for r in records.list_records(self.paths) if r.resource_name == self.resource_name]

    def names(self) -> dict[str, tuple[str, str]]:
        """token -> (pod UID, container) now known (the checkpoint's over Allocate's)."""
        with self._lock:
            return self._tags | self._held

    def doc(self, now: float | None = None) -> sc.NodeUsage:
        self.refresh()
        recs = self.records()
        with self._lock:
            live = {r.token for r in recs}
            for tok in [t for t in self._tags if t not in live]:
                del self._tags[tok]
            tags = self._tags | self._held
            written = self._sig[2] / 1e9 if self._sig is not None else None
        if written is not None:
            recs = [r for r in recs if r.token in tags or written < r.created + UNHELD_AFTER_S]
        placed = self.placed() if self.placed is not None else None
        return sc.NodeUsage(time=time.time() if now is None else now, slices=slices(recs, tags, placed))

    def rebuild(self, pods: list[Any]) -> int:
        """Name the records neither Allocate nor the checkpoint named (after a restart, with a
        checkpoint that cannot be read) from the pods' decisions and `allocated` lists; returns how
        many were named. `pods`: Pod objects (dicts) of this node."""
        recs = self.records()
        with self._lock:
            named = self._tags | self._held
            free: dict[tuple[tuple[str, int, int], ...], list[str]] = {}
            for r in sorted(recs, key=lambda r: r.created):
                if r.token not in named:
                    shape = _shape((g.uuid, g.memory_limit, g.core_percent) for g in r.gpus)
                    free.setdefault(shape, []).append(r.token)
            tagged = set(named.values())
            n = 0
            for p in pods:
                meta = p.get("metadata") or {}
                ann = meta.get("annotations") or {}
                uid = meta.get("uid") or ""
                try:
                    d = sc.decode_decision(ann[sc.DECISION_ANNOTATION]) if sc.DECISION_ANNOTATION in ann else None
                    done = sc.decode_allocated(ann.get(sc.ALLOCATED_ANNOTATION))
                except sc.ContractError:
                    continue
                if d is None or not uid:
                    continue
                for c in d.containers:
                    if c.name not in done or (uid, c.name) in tagged:
                        continue
                    toks = free.get(_shape((g.uuid, g.memory, g.cores) for g in c.gpus))
                    if toks:
                        self._tags[toks.pop(0)] = (uid, c.name)
                        n += 1
        return n


class _PodList(msgspec.Struct):
    items: list[dict[str, Any]] | None = None


def list_node_pods(api: Any, node: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    resp = api.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={node}", _request_timeout=timeout, _preload_content=False
    )
    return msgspec.json.decode(resp.data, type=_PodList).items or []


def rebuild_from_api(tracker: Tracker, api: Any, node: str) -> None:
    """Best effort: without the API (and the checkpoint) the records stay unnamed (counted as long
    as they exist, never less)."""
    try:
        n = tracker.rebuild(list_node_pods(api, node))
    except Exception as e:  # ApiException, connection errors
        log.warning(kv("cannot read this node's pods to tag allocation records", node=node, error=str(e)[:200]))
        return
    if n:
        log.info(kv("allocation records tagged with their decisions", node=node, records=n))
