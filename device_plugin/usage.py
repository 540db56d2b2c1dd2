"""What this node handed out, for the scheduler (`vgpu.k8s.io/node-usage`, vgpu.scheduling.NodeUsage).

Every slice the node gave a container is in an allocation record, whether a scheduler decided it
or not (a pod of another scheduler, one placed before vgpu-scheduler ran, or one given n x 1/K).
The scheduler counts them all (one truth for usage, docs/scheduler.md) from this document: one
entry per vGPU slot in use, with the memory limit and compute share of the record holding it.
A slot named by several records belongs to the newest (the kubelet gives a slot to one container
at a time; the older records are stale and the collector removes them, records.stale_tokens).

An entry is tagged with the pod UID and container of the decision it honoured (Allocate knows it),
so the scheduler counts a decided pod once: its published slices, plus the decided containers not
published yet. The tags live in memory; after a restart they are found again from the API: a
container the pod's `vgpu.k8s.io/allocated` annotation lists is matched to an untagged record of
exactly its decided GPUs and sizes (two such records are interchangeable for counting).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from device_plugin import records
from vgpu import scheduling as sc
from vgpu.log import kv
from vgpu.paths import Paths
from vgpu.schemas import AllocationRecord

log = logging.getLogger(__name__)


def _shape(gpus: Iterable[tuple[str, int, int]]) -> tuple[tuple[str, int, int], ...]:
    return tuple(sorted(gpus))


def slices(recs: list[AllocationRecord], tags: dict[str, tuple[str, str]]) -> list[sc.UsedSlice]:
    """One slice per vGPU slot in use (its newest record), tagged from `tags` (token -> (pod UID,
    container)); pure. A GPU entry holding k slots (n x 1/K without a decision) is k slices that
    share its memory and compute; one without vGPU IDs counts once."""
    ordered = sorted(recs, key=lambda r: (r.created, r.token))
    owner: dict[str, str] = {}
    for r in ordered:
        for g in r.gpus:
            for vid in g.vgpu_ids:
                owner[vid] = r.token  # the newest wins
    out: list[sc.UsedSlice] = []
    for r in ordered:
        pod, container = tags.get(r.token, ("", ""))
        for g in r.gpus:
            k = max(len(g.vgpu_ids), 1)
            for i in range(k):
                if g.vgpu_ids and owner.get(g.vgpu_ids[i]) != r.token:
                    continue
                mem = g.memory_limit // k + (g.memory_limit % k if i == 0 else 0)
                cores = g.core_percent // k + (g.core_percent % k if i == 0 else 0)
                out.append(sc.UsedSlice(gpu=g.uuid, memory=mem, cores=cores, pod=pod, container=container))
    return out


class Tracker:
    """The records of one resource and their tags; thread-safe."""

    def __init__(self, paths: Paths, resource_name: str) -> None:
        self.paths = paths
        self.resource_name = resource_name
        self._lock = threading.Lock()
        self._tags: dict[str, tuple[str, str]] = {}

    def note(self, token: str, pod_uid: str = "", container: str = "") -> None:
        """A record was written (Allocate); `pod_uid`/`container`: the decision it honoured."""
        if pod_uid:
            with self._lock:
                self._tags[token] = (pod_uid, container)

    def records(self) -> list[AllocationRecord]:
        return [r for r in records.list_records(self.paths) if r.resource_name == self.resource_name]

    def doc(self, now: float | None = None) -> sc.NodeUsage:
        recs = self.records()
        with self._lock:
            live = {r.token for r in recs}
            for tok in [t for t in self._tags if t not in live]:
                del self._tags[tok]
            tags = dict(self._tags)
        return sc.NodeUsage(time=time.time() if now is None else now, slices=slices(recs, tags))

    def rebuild(self, pods: list[Any]) -> int:
        """Tag untagged records from the pods' decisions and `allocated` lists (after a restart);
        returns how many were tagged. `pods`: Pod objects (dicts) of this node."""
        recs = self.records()
        with self._lock:
            free: dict[tuple[tuple[str, int, int], ...], list[str]] = {}
            for r in sorted(recs, key=lambda r: r.created):
                if r.token not in self._tags:
                    shape = _shape((g.uuid, g.memory_limit, g.core_percent) for g in r.gpus)
                    free.setdefault(shape, []).append(r.token)
            tagged = {v for v in self._tags.values()}
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
    """Best effort: without the API the records stay untagged (counted twice until their pods end,
    never less)."""
    try:
        n = tracker.rebuild(list_node_pods(api, node))
    except Exception as e:  # ApiException, connection errors
        log.warning(kv("cannot read this node's pods to tag allocation records", node=node, error=str(e)[:200]))
        return
    if n:
        log.info(kv("allocation records tagged with their decisions", node=node, records=n))
