"""The scheduler's view of the cluster, kept from the API (list, then watch; relist on 410).

Usage is never state of its own: it is the sum of the pods' decision annotations
(`snapshot.usage_of`), maintained incrementally as pods change and rebuilt from a fresh list on
start, on watch expiry and when a replica becomes leader. A decision being written (filter's
patch in flight) is a provisional pod record, so concurrent filters already see its GPUs taken;
the patch's answer or its failure replaces it.

Ordering: every record keeps its object's resourceVersion; an older version (a late watch event
or a patch answer overtaken by the watch) never replaces a newer one, a provisional record wins
over the version it was made from, and a deleted pod leaves a tombstone until the next relist so
a late answer cannot bring it back.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vgpu import scheduling as sc
from vgpu_scheduler import snapshot
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import APIFailure, Expired, Kube
from vgpu_scheduler.snapshot import NodeInfo, NodeView, PodRec, Usage, Use

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MAX_TOMBSTONES = 20_000


def _rv_key(rv: str, provisional: bool = False) -> tuple[int, int]:
    try:
        return int(rv), 1 if provisional else 0
    except ValueError:
        return -1, 0  # not numeric: always replaced


class ClusterState:
    def __init__(self, cfg: SchedulerConfig, kube: Kube | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.kube = kube
        self.clock = clock
        self.lock = threading.RLock()
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodRec] = {}
        self._keys: dict[str, tuple[int, int]] = {}  # uid -> ordering key of the record kept
        self._tombstones: dict[str, tuple[int, int]] = {}
        self.usage: Usage = {}
        # Generation of each node's inputs to fit (its NodeInfo and its usage); with `epoch` it keys
        # the fit memo: an unchanged node is not fitted again for a request shape seen before.
        self.gens: dict[str, int] = {}
        self.epoch = 0
        self.memo: dict[tuple[object, ...], object] = {}
        self.ready = threading.Event()
        self.relists = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ----- applying objects (all under the lock) -----
    def _set(self, uid: str, rec: PodRec | None, key: tuple[int, int]) -> None:
        old = self.pods.get(uid)
        if old is not None:
            self._touch(snapshot.counts(old))
            snapshot.add_pod(self.usage, old, -1)
        if rec is None:
            self.pods.pop(uid, None)
            self._keys.pop(uid, None)
        else:
            self.pods[uid] = rec
            self._keys[uid] = key
            self._touch(snapshot.counts(rec))
            snapshot.add_pod(self.usage, rec, +1)

    def _touch(self, node: str) -> None:
        if node:
            self.gens[node] = self.gens.get(node, 0) + 1

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.memo.clear()

    def apply_pod(self, obj: Obj, deleted: bool = False) -> None:
        rec = snapshot.pod_rec(obj)
        key = _rv_key(rec.resource_version)
        with self.lock:
            cur = self._keys.get(rec.uid)
            tomb = self._tombstones.get(rec.uid)
            if deleted:
                if rec.uid in self.pods:
                    self._set(rec.uid, None, key)
                self._tombstones[rec.uid] = key
                if len(self._tombstones) > MAX_TOMBSTONES:
                    # A tombstone only has to outlive the late answers of its pod (seconds): the
                    # oldest half goes (dicts keep insertion order).
                    for uid in list(self._tombstones)[: MAX_TOMBSTONES // 2]:
                        del self._tombstones[uid]
                return
            if tomb is not None and key[0] >= 0 and key <= tomb:
                return
            if cur is not None and key[0] >= 0 and key < cur:
                return
            self._set(rec.uid, rec, key)

    def apply_node(self, obj: Obj, deleted: bool = False) -> None:
        info = snapshot.node_info(obj, self.cfg.resource_name)
        with self.lock:
            self._touch(info.name)
            if deleted:
                self.nodes.pop(info.name, None)
            else:
                self.nodes[info.name] = info

    def replace_pods(self, items: list[Obj], list_rv: str = "") -> None:
        """A fresh list (as of list_rv) replaces the records, except where this replica knows better.

        Kept: a record newer than its listed version (a watch event or a patch answer applied
        while the list was in flight, or a provisional reservation) and a record absent from the
        list but newer than the list itself (created after it). Dropped: a listed pod whose
        tombstone is newer (deleted after the list). Without a list_rv, the list is the truth.
        """
        lrv = _rv_key(list_rv)[0] if list_rv else -1
        with self.lock:
            pods: dict[str, PodRec] = {}
            keys: dict[str, tuple[int, int]] = {}
            for obj in items:
                rec = snapshot.pod_rec(obj)
                k = _rv_key(rec.resource_version)
                cur = self._keys.get(rec.uid)
                tomb = self._tombstones.get(rec.uid)
                if tomb is not None and lrv >= 0 and k[0] >= 0 and tomb > k:
                    continue
                if cur is not None and (cur[1] == 1 or lrv >= 0) and k[0] >= 0 and cur > k:
                    pods[rec.uid], keys[rec.uid] = self.pods[rec.uid], cur
                else:
                    pods[rec.uid], keys[rec.uid] = rec, k
            for uid, cur in self._keys.items():
                if uid not in pods and (cur[1] == 1 or (lrv >= 0 and cur[0] > lrv)):
                    pods[uid], keys[uid] = self.pods[uid], cur
            self.pods, self._keys = pods, keys
            self._tombstones = {u: t for u, t in self._tombstones.items() if lrv >= 0 and t[0] > lrv}
            self.usage = snapshot.usage_of(list(self.pods.values()))
            self._new_epoch()
        # The relisted records are long-lived and acyclic: move them out of the cyclic GC's full
        # collections, which otherwise walk all of them (100-200 ms pauses measured at 5,000 pods,
        # long enough for a filter to miss its deadline). Collect first so no garbage is frozen.
        gc.collect()
        gc.freeze()

    def replace_nodes(self, items: list[Obj]) -> None:
        with self.lock:
            self.nodes = {}
            for obj in items:
                info = snapshot.node_info(obj, self.cfg.resource_name)
                self.nodes[info.name] = info
            self._new_epoch()

    # ----- reservations (filter) -----
    def reserve(self, pod: Obj, decision: sc.Decision | None) -> tuple[PodRec | None, tuple[int, int] | None]:
        """Put a provisional record with `decision` for the pod (None: without one); returns what it replaced."""
        rec = snapshot.pod_rec(pod)
        with self.lock:
            old, old_key = self.pods.get(rec.uid), self._keys.get(rec.uid)
            new = PodRec(
                rec.uid, rec.namespace, rec.name, rec.node, rec.phase, rec.deleting, decision, rec.resource_version
            )
            # Provisional: newer than the version it was made from and than anything seen, so
            # no late watch event can drop the reservation while its write is in flight.
            base = max(_rv_key(rec.resource_version)[0], old_key[0] if old_key else -1)
            self._set(rec.uid, new, (base, 1))
            return old, old_key

    def rollback(self, uid: str, old: PodRec | None, old_key: tuple[int, int] | None) -> None:
        with self.lock:
            if self._keys.get(uid, (0, 0))[1] != 1:
                return  # a newer real version arrived meanwhile: keep it
            self._set(uid, old, old_key or (-1, 0))

    def is_settled(self, uid: str) -> bool:
        """The record is an API version (not a provisional reservation). Call under lock."""
        return self._keys.get(uid, (0, 1))[1] == 0

    # ----- views -----
    def views(self, names: list[str] | None = None, infos: list[NodeInfo] | None = None) -> list[NodeView]:
        now = self.clock()
        with self.lock:
            if infos is None:
                infos = (
                    [self.nodes[n] for n in names if n in self.nodes]
                    if names is not None
                    else list(self.nodes.values())
                )
        return [snapshot.node_view(i, now, self.cfg.stale_after_s) for i in infos]

    def usage_without(self, uid: str) -> Usage:
        """The usage as if this pod had no decision (a pod being re-filtered frees its old GPUs). Call under lock."""
        rec = self.pods.get(uid)
        if rec is None or not snapshot.counts(rec):
            return self.usage
        node = snapshot.counts(rec)
        assert rec.decision is not None
        out = dict(self.usage)
        per = {k: Use(v.memory, v.cores, v.slots) for k, v in self.usage.get(node, {}).items()}
        for uuid, u in snapshot.decision_usage(rec.decision).items():
            per.setdefault(uuid, Use()).add(u, -1)
        out[node] = per
        return out

    def gens_without(self, uid: str) -> dict[str, int]:
        """Node generations for the fit memo, less the node whose usage usage_without() changed. Call under lock."""
        rec = self.pods.get(uid)
        node = snapshot.counts(rec) if rec is not None else ""
        if not node:
            return self.gens
        return self.gens | {node: -1}

    def usage_copy(self) -> Usage:
        with self.lock:
            return {n: {u: Use(x.memory, x.cores, x.slots) for u, x in g.items()} for n, g in self.usage.items()}

    def recomputed(self) -> Usage:
        with self.lock:
            return snapshot.usage_of(list(self.pods.values()))

    def limits(self) -> tuple[int, int, int]:
        """(most GPUs on one node, most schedulable memory of one GPU, most cores of one GPU) now offered."""
        most_gpus = most_mem = most_cores = 0
        for v in self.views():
            healthy = [g for g in v.gpus if g.healthy]
            most_gpus = max(most_gpus, len(healthy))
            for g in healthy:
                most_mem, most_cores = max(most_mem, g.memory), max(most_cores, g.cores)
        return most_gpus, most_mem, most_cores

    # ----- sync with the API -----
    def resync(self) -> None:
        """List nodes and pods now (start, leadership, watch expiry)."""
        assert self.kube is not None
        nodes, _ = self.kube.list_nodes(self.cfg.node_label_selector)
        pods, rv = self.kube.list_pods()
        self.replace_nodes(nodes)
        self.replace_pods(pods, rv)
        self.relists += 1

    def _loop(self, kind: str) -> None:
        assert self.kube is not None
        rv = ""
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if not rv:
                    if kind == "pods":
                        items, rv = self.kube.list_pods()
                        self.replace_pods(items, rv)
                    else:
                        items, rv = self.kube.list_nodes(self.cfg.node_label_selector)
                        self.replace_nodes(items)
                    with self.lock:
                        self.relists += 1
                    self._synced(kind)
                for etype, obj in self.kube.watch(kind, rv, 60, self.cfg.node_label_selector):
                    if self._stop.is_set():
                        return
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if etype == "BOOKMARK":
                        continue
                    if kind == "pods":
                        self.apply_pod(obj, deleted=etype == "DELETED")
                    else:
                        self.apply_node(obj, deleted=etype == "DELETED")
                backoff = 0.2
            except Expired:
                log.info("%s watch expired: relisting", kind)
                rv = ""
            except APIFailure as e:
                if self._stop.is_set():
                    return
                log.warning("%s watch: %s", kind, e)
                rv = ""
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    _synced_kinds: set[str]
    _wanted: set[str]

    def _synced(self, kind: str) -> None:
        with self.lock:
            self._synced_kinds.add(kind)
            if self._synced_kinds >= self._wanted:
                self.ready.set()

    def start(self, kinds: tuple[str, ...] = ("nodes", "pods")) -> None:
        """Watch `kinds`; ready once each is listed (the webhook-only server needs only nodes)."""
        self._synced_kinds = set()
        self._wanted = set(kinds)
        for kind in kinds:
            t = threading.Thread(target=self._loop, args=(kind,), name=f"vgpu-watch-{kind}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
