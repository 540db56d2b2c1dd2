"""The scheduler's view of the cluster, kept from the API (list, then watch; relist on 410).

Usage is never state of its own. Per node it is what the node published as handed out (the
`vgpu.k8s.io/node-usage` annotation of its device plugin: slices named by the pods holding them,
which hold while those pods run, although the records behind them outlive the pods) plus the
decisions of the pods holding GPUs there that the node has not published yet
(vgpu.scheduling.node_usage, pod_usage), plus this replica's reservations: a filter's choice is
held in memory from the filter until bind writes it (the filter makes no API call), and it
expires after `reservation_ttl_s` when no bind comes. The sums
are maintained incrementally per pod and per node, and `recomputed()` derives them from scratch
(`snapshot.usage_of`): tests and the benchmark check both always agree (`drift_bytes`). They are
rebuilt from a fresh list on start, on watch expiry and when a replica starts serving (which also
drops its reservations).

Ordering: every record keeps its object's resourceVersion; an older version (a late watch event
or a patch answer overtaken by the watch) never replaces a newer one, and a deleted pod leaves a
tombstone until the next relist so a late answer cannot bring it back. A reservation is kept
apart from the pod's record, so a newer version of the pod (a label change, a status update)
does not drop it.

Index: the nodes of one shape (GPU sizes) are kept sorted by their usage fraction, once in
binpack order (most used first) and once in spread order. For a pod, every node of a shape gives
the same slices, so the first node of that order that fits is that shape's best placement: the
filter walks these lists and stops at the first fit instead of fitting every node.
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import heapq
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from vgpu import scheduling as sc
from vgpu_scheduler import snapshot
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import APIFailure, Expired, Kube
from vgpu_scheduler.snapshot import NodeInfo, NodeView, PodRec, Usage, Use

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MAX_TOMBSTONES = 20_000
GC_FREEZE_S = 10.0
# Slices named with a pod UID the scheduler does not know count this long when the Node's
# resourceVersion is not a number (the pod watch's lag cannot be compared with it).
UNKNOWN_POD_GRACE_S = 60.0
PerGPU = dict[str, Use]


def _rv_key(rv: str) -> int:
    try:
        return int(rv)
    except ValueError:
        return -1  # not numeric: always replaced


class Reservation(msgspec.Struct, gc=False):
    """A filter's choice for a pod, held until bind writes it (or it expires)."""

    decision: sc.Decision
    expires: float  # monotonic clock
    resource_version: str  # the pod's version the filter decided on (bind's write is conditioned on it)
    counted: bool = True  # False once expired: kept a while so a late bind can re-check it


class Summary(msgspec.Struct, gc=False):
    """Quick rejection data of one node at one generation (the filter's walk)."""

    gen: int
    max_free_mem: int
    max_free_cores: int
    gpus_with_slot: int


def _settle_after_list() -> None:
    """After a list: the relisted records are long-lived and acyclic, so they leave the cyclic
    GC's full collections, which otherwise walk all of them (100-200 ms pauses measured at 5,000
    pods, long enough for a filter to miss its deadline); garbage is collected first so none is
    frozen. Then the memory the list's text and its decoding took goes back to the system
    (glibc keeps freed heap otherwise: 196 MiB after a relist at 5,000 nodes, measured)."""
    gc.collect()
    gc.freeze()
    _malloc_trim()


def _malloc_trim() -> None:
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None


def _add(per: PerGPU, other: PerGPU, sign: int) -> None:
    for uuid, u in other.items():
        cur = per.get(uuid)
        if cur is None:
            cur = per[uuid] = Use()
        cur.add(u, sign)


class ClusterState:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kube: Kube | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.kube = kube
        self.clock = clock
        self.monotonic = monotonic
        self.lock = threading.RLock()
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodRec] = {}
        self._keys: dict[str, int] = {}  # uid -> resourceVersion of the record kept
        self._tombstones: dict[str, int] = {}
        self.reservations: dict[str, Reservation] = {}  # uid -> (oldest first)
        self.usage: Usage = {}
        self._contrib: dict[str, dict[str, PerGPU]] = {}  # uid -> node -> what the pod holds there
        self._on: dict[str, set[str]] = {}  # node -> uids holding something there
        self._base: dict[str, PerGPU] = {}  # node -> published slices no pod UID is named on
        self._tags: dict[str, dict[str, dict[str, PerGPU]]] = {}  # node -> uid -> container -> published
        self._tagged_on: dict[str, set[str]] = {}  # uid -> nodes with slices named with it
        self._alias: dict[str, str] = {}  # a static pod's UID (kubelet's) -> its mirror pod's UID
        # Slices named with a pod UID this replica does not know, published before its pod watch
        # reached that point: (node, uid) -> (the Node's resourceVersion, monotonic time) when
        # first seen. They count until the watch passes that version ("Usage accounting").
        self.pod_rv = -1  # how far the pod watch (or list) has come
        self._unknown: dict[tuple[str, str], tuple[int, float]] = {}
        self._unknown_rv: list[tuple[int, str, str]] = []  # heap of (node version, node, uid)
        self._prev_unknown: dict[tuple[str, str], tuple[int, float]] = {}
        self._timed: set[tuple[str, str]] = set()  # those of them whose version is not a number
        # Generation of each node's inputs to fit (its NodeInfo and its usage); with `epoch` it keys
        # the fit memo: an unchanged node is not fitted again for a request shape seen before.
        self.gens: dict[str, int] = {}
        self.epoch = 0
        self.memo: dict[tuple[object, ...], object] = {}
        self._index: dict[tuple[object, ...], tuple[list[tuple[float, str]], list[tuple[float, str]]]] = {}
        self._ikey: dict[str, tuple[tuple[object, ...], float]] = {}
        self._summary: dict[str, Summary] = {}
        self._views: dict[str, tuple[NodeInfo, NodeView]] = {}
        self.ready = threading.Event()
        self.relists = 0
        self.last_relist_s = 0.0  # how long the last list (and its rebuild) took
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ----- accounting (all under the lock) -----
    def _touch(self, node: str) -> None:
        if not node:
            return
        self.gens[node] = self.gens.get(node, 0) + 1
        self._reindex(node)

    def _pod_of(self, uid: str) -> PodRec | None:
        """The pod a published slice names: by UID, or the mirror pod of a static pod."""
        rec = self.pods.get(uid)
        if rec is None and self._alias:
            real = self._alias.get(uid)
            if real is not None:
                rec = self.pods.get(real)
        return rec

    def _published_holds(self, uid: str, node: str) -> bool:
        """Whether the slices `node` published for pod `uid` hold their GPUs: while the pod exists
        and is not Succeeded/Failed (kubelet marks a pod terminal only once its containers have
        stopped: status_manager.go mergePodStatus; and its device manager then frees the devices,
        manager.go UpdateAllocatedDevices over activePods), or while it is not known because the
        pod watch has not reached the version of the Node that first named it."""
        rec = self._pod_of(uid)
        if rec is not None:
            return rec.phase not in sc.TERMINATED_PHASES
        if uid in self._tombstones:
            return False
        return (node, uid) in self._unknown

    def unknown_holds(self, node: str, uid: str) -> bool:
        """For a pod UID that no kept pod has: whether its slices on `node` count (recomputed())."""
        return uid not in self._tombstones and (node, uid) in self._unknown

    def holding(self, uid: str) -> tuple[str, sc.Decision | None]:
        """(node, decision) whose GPUs the pod holds: its counted reservation, else its API decision."""
        rec = self.pods.get(uid)
        res = self.reservations.get(uid)
        if res is not None and res.counted:
            if rec is None or (rec.phase not in sc.TERMINATED_PHASES and rec.node in ("", res.decision.node)):
                return res.decision.node, res.decision
            return "", None
        if rec is None:
            return "", None
        return snapshot.counts(rec), rec.decision

    def _contribution(self, uid: str) -> dict[str, PerGPU]:
        """What the pod holds per node: on each node, vgpu.scheduling.pod_usage of the slices the
        node published for it (while they hold) and of its decision if it holds GPUs there."""
        out: dict[str, PerGPU] = {}
        node_d, d = self.holding(uid)
        rec = self._pod_of(uid)
        inits = rec.inits if rec is not None else None
        on = self._tagged_on.get(uid)
        if on:
            for node in on:
                pub = self._tags.get(node, {}).get(uid)
                if pub is not None and not self._published_holds(uid, node):
                    pub = None
                dec = d if node == node_d else None
                if pub is None and dec is None:
                    continue
                part = sc.pod_usage(pub, dec, inits)
                if part:
                    out[node] = part
        if node_d and d is not None and not (on and node_d in on):
            part = sc.pod_usage(None, d, inits)
            if part:
                out[node_d] = part
        return out

    def _recount(self, uid: str, touched: set[str] | None = None) -> None:
        """Replace the pod's contribution by what it holds now; `touched`: collect the nodes whose
        usage changed instead of touching them one by one."""
        nodes: set[str] = set()
        old = self._contrib.pop(uid, None)
        if old:
            for node, per in old.items():
                _add(self.usage.setdefault(node, {}), per, -1)
                on = self._on.get(node)
                if on is not None:
                    on.discard(uid)
                nodes.add(node)
        new = self._contribution(uid)
        if new:
            self._contrib[uid] = new
            for node, per in new.items():
                _add(self.usage.setdefault(node, {}), per, +1)
                self._on.setdefault(node, set()).add(uid)
                nodes.add(node)
        if touched is not None:
            touched |= nodes
        else:
            for node in nodes:
                self._touch(node)

    def _set_used(self, name: str, used: sc.NodeUsage | None, rv: str = "") -> None:
        """Replace what node `name` published (its base, its named slices) and recount the pods
        concerned; `rv`: the Node's resourceVersion."""
        base, tags = sc.split_slices(used.slices if used is not None else ())
        old_tags = self._tags.get(name, {})
        if base == self._base.get(name, {}) and tags == old_tags:
            return
        for uid in tags.keys() - old_tags.keys():
            self._first_seen(name, uid, rv)
        for uid in old_tags.keys() - tags.keys():
            self._unknown.pop((name, uid), None)
        _add(self.usage.setdefault(name, {}), self._base.get(name, {}), -1)
        _add(self.usage[name], base, +1)
        self._base[name] = base
        self._tags[name] = tags
        for uid in old_tags.keys() - tags.keys():
            on = self._tagged_on.get(uid)
            if on is not None:
                on.discard(name)
                if not on:
                    del self._tagged_on[uid]
        for uid in tags:
            self._tagged_on.setdefault(uid, set()).add(name)
        # Only a pod whose slices here changed holds something else now (a contribution depends on
        # the pod's own slices and decision alone).
        touched = {name}
        for uid in old_tags.keys() | tags.keys():
            if old_tags.get(uid) != tags.get(uid):
                self._recount(uid, touched)
        for node in touched:
            self._touch(node)

    # ----- slices of pods not known yet -----
    def _first_seen(self, node: str, uid: str, rv: str) -> None:
        """A slice named with `uid` appeared on `node`. If no pod of that UID is known, it is either
        one the pod watch has not brought yet or one deleted before this replica listed (after a
        restart, a relist): the kubelet admits only pods that exist in the API, and the device
        plugin names a slice only after the kubelet admitted its pod (its checkpoint entry), so the
        pod was created before this Node version. Once the pod watch has passed that version
        (resourceVersions of one etcd are one sequence: comparable across pods and nodes, as
        kube-apiserver's etcd3 store makes them), a pod it does not have is gone. Until then the
        slices count. A resourceVersion that is not a number gives UNKNOWN_POD_GRACE_S instead."""
        key = (node, uid)
        if self._pod_of(uid) is not None or uid in self._tombstones:
            return
        prev = self._prev_unknown.get(key)
        k, t = prev if prev is not None else (_rv_key(rv), self.monotonic())
        if 0 <= k <= self.pod_rv:
            return  # the pod watch is past it: that pod is gone
        self._unknown[key] = (k, t)
        if k >= 0:
            heapq.heappush(self._unknown_rv, (k, node, uid))
        else:
            self._timed.add(key)

    def note_pod_rv(self, rv: str) -> None:
        """The pod watch (or a pod list) has come to `rv`: slices of pods unknown at a Node version
        up to it stop counting. Call under lock."""
        k = _rv_key(rv)
        if k <= self.pod_rv:
            return
        self.pod_rv = k
        heap = self._unknown_rv
        while heap and heap[0][0] <= k:
            v, node, uid = heapq.heappop(heap)
            cur = self._unknown.get((node, uid))
            if cur is not None and cur[0] == v:
                del self._unknown[(node, uid)]
                self._recount(uid)

    def _expire_unknown(self) -> None:
        """Slices of unknown pods first seen at a version that is not a number: UNKNOWN_POD_GRACE_S."""
        if not self._timed:
            return
        now = self.monotonic()
        for key in list(self._timed):
            cur = self._unknown.get(key)
            if cur is None or cur[0] >= 0:
                self._timed.discard(key)
            elif now - cur[1] >= UNKNOWN_POD_GRACE_S:
                self._timed.discard(key)
                del self._unknown[key]
                self._recount(key[1])

    # ----- the filter's index -----
    def _fraction(self, name: str, info: NodeInfo) -> float:
        tm, tc, ts = info.totals
        um = uc = us = 0
        for u in self.usage.get(name, {}).values():
            um, uc, us = um + u.memory, uc + u.cores, us + u.slots
        return (um / max(tm, 1) + (uc / tc if tc else 1.0) + us / max(ts, 1)) / 3

    def _unindex(self, name: str) -> None:
        old = self._ikey.pop(name, None)
        if old is None:
            return
        shape, f = old
        lists = self._index.get(shape)
        if lists is None:
            return
        for lst, key in ((lists[0], (-f, name)), (lists[1], (f, name))):
            i = bisect.bisect_left(lst, key)
            if i < len(lst) and lst[i] == key:
                del lst[i]
        if not lists[0]:
            del self._index[shape]

    def _reindex(self, name: str) -> None:
        self._unindex(name)
        info = self.nodes.get(name)
        if info is None or not info.gpus:
            return
        f = self._fraction(name, info)
        lists = self._index.setdefault(info.shape, ([], []))
        bisect.insort(lists[0], (-f, name))
        bisect.insort(lists[1], (f, name))
        self._ikey[name] = (info.shape, f)

    def ordered(self, policy: str) -> list[list[tuple[float, str]]]:
        """Per node shape, its indexed nodes in `policy` order (binpack: most used first, ties by
        name; spread: least used first). The lists are live: iterate under the lock."""
        k = 0 if policy == sc.POLICY_BINPACK else 1
        return [lists[k] for lists in self._index.values()]

    def summary(self, name: str) -> Summary:
        """The node's quick rejection data (largest free memory and compute on one healthy GPU,
        healthy GPUs with a free slot), cached per generation. Call under lock."""
        gen = self.gens.get(name, 0)
        s = self._summary.get(name)
        if s is not None and s.gen == gen:
            return s
        info = self.nodes.get(name)
        used = self.usage.get(name, {})
        mm = mc = slots = 0
        zero = Use()
        for g in info.gpus if info is not None else ():
            if not g.healthy:
                continue
            u = used.get(g.uuid, zero)
            if u.slots < g.slots:
                slots += 1
                mm, mc = max(mm, g.memory - u.memory), max(mc, g.cores - u.cores)
        s = self._summary[name] = Summary(gen, mm, mc, slots)
        return s

    # ----- applying objects (all under the lock) -----
    def apply_pod(self, obj: Obj, deleted: bool = False) -> None:
        self.apply_pod_rec(snapshot.pod_rec(obj), deleted)

    def apply_pod_rec(self, rec: PodRec, deleted: bool = False) -> None:
        key = _rv_key(rec.resource_version)
        with self.lock:
            cur = self._keys.get(rec.uid)
            tomb = self._tombstones.get(rec.uid)
            if deleted:
                if rec.uid in self.pods:
                    self.pods.pop(rec.uid, None)
                    self._keys.pop(rec.uid, None)
                self.reservations.pop(rec.uid, None)
                self._tombstones[rec.uid] = key  # first: its published slices no longer hold
                self._recount(rec.uid)
                if rec.mirror and self._alias.get(rec.mirror) == rec.uid:
                    del self._alias[rec.mirror]
                    self._recount(rec.mirror)
                if len(self._tombstones) > MAX_TOMBSTONES:
                    # A tombstone only has to outlive the late answers of its pod (seconds): the
                    # oldest half goes (dicts keep insertion order).
                    for uid in list(self._tombstones)[: MAX_TOMBSTONES // 2]:
                        del self._tombstones[uid]
                return
            if tomb is not None and key >= 0 and key <= tomb:
                return
            if cur is not None and key >= 0 and key < cur:
                return
            self.pods[rec.uid] = rec
            self._keys[rec.uid] = key
            res = self.reservations.get(rec.uid)
            if res is not None and rec.decision == res.decision and rec.node in ("", res.decision.node):
                del self.reservations[rec.uid]  # written (bind's patch): the API holds it now
            self._recount(rec.uid)
            if rec.mirror:
                self._alias[rec.mirror] = rec.uid
                self._recount(rec.mirror)  # the slices the kubelet named with its static pod's UID

    def apply_node(self, obj: Obj, deleted: bool = False) -> None:
        self.apply_node_info(snapshot.node_info(obj, self.cfg.resource_name), deleted)

    def apply_node_info(self, info: NodeInfo, deleted: bool = False) -> None:
        with self.lock:
            if deleted:
                self.nodes.pop(info.name, None)
                self._set_used(info.name, None)
            else:
                self.nodes[info.name] = info
                self._set_used(info.name, info.used, info.resource_version)
            self._touch(info.name)

    def replace_pods(self, items: list[Obj], list_rv: str = "") -> None:
        self.replace_pod_recs([snapshot.pod_rec(o) for o in items], list_rv)

    def replace_pod_recs(self, items: list[PodRec], list_rv: str = "") -> None:
        """A fresh list (as of list_rv) replaces the records, except where this replica knows better.

        Kept: a record newer than its listed version (a watch event or a patch answer applied
        while the list was in flight) and a record absent from the list but newer than the list
        itself (created after it). Dropped: a listed pod whose tombstone is newer (deleted after
        the list). Without a list_rv, the list is the truth.
        """
        lrv = _rv_key(list_rv) if list_rv else -1
        with self.lock:
            pods: dict[str, PodRec] = {}
            keys: dict[str, int] = {}
            for rec in items:
                k = _rv_key(rec.resource_version)
                cur = self._keys.get(rec.uid)
                tomb = self._tombstones.get(rec.uid)
                if tomb is not None and lrv >= 0 and k >= 0 and tomb > k:
                    continue
                if cur is not None and lrv >= 0 and k >= 0 and cur > k:
                    pods[rec.uid], keys[rec.uid] = self.pods[rec.uid], cur
                else:
                    pods[rec.uid], keys[rec.uid] = rec, k
            for uid, cur in self._keys.items():
                if uid not in pods and lrv >= 0 and cur > lrv:
                    pods[uid], keys[uid] = self.pods[uid], cur
            self.pods, self._keys = pods, keys
            self._alias = {r.mirror: uid for uid, r in pods.items() if r.mirror}
            self._tombstones = {u: t for u, t in self._tombstones.items() if lrv >= 0 and t > lrv}
            self.reservations = {u: r for u, r in self.reservations.items() if u in pods}
            self.pod_rv = max(self.pod_rv, lrv)  # every pod that existed at list_rv is in the list
            self._rebuild()
        _settle_after_list()

    def replace_nodes(self, items: list[Obj]) -> None:
        self.replace_node_infos([snapshot.node_info(o, self.cfg.resource_name) for o in items])

    def replace_node_infos(self, items: list[NodeInfo]) -> None:
        with self.lock:
            self.nodes = {info.name: info for info in items}
            self._rebuild()
        _settle_after_list()

    def _rebuild(self) -> None:
        """All sums from scratch (after a list). Call under lock."""
        self.usage, self._contrib, self._on = {}, {}, {}
        self._base, self._tags, self._tagged_on = {}, {}, {}
        self._index, self._ikey, self._summary = {}, {}, {}
        # Unknown pods' slices are seen again; each keeps the version it was first seen at.
        self._prev_unknown, self._unknown, self._unknown_rv, self._timed = self._unknown, {}, [], set()
        self.epoch += 1
        self.memo.clear()
        for name, info in self.nodes.items():
            self._set_used(name, info.used, info.resource_version)
        self._prev_unknown = {}
        for uid in list(self.pods.keys() | self.reservations.keys()):
            self._recount(uid)
        for name in self.nodes:
            self._touch(name)

    # ----- reservations (filter → bind) -----
    def reserve(self, pod: Obj, decision: sc.Decision) -> None:
        """Hold `decision` for the pod until bind writes it or `reservation_ttl_s` passes. Call under lock."""
        rec = snapshot.pod_rec(pod)
        if rec.uid not in self.pods:
            self.apply_pod(pod)  # the pod's own version (the watch may not have brought it yet)
        self.reservations.pop(rec.uid, None)  # re-inserted last: the dict stays in expiry order
        self.reservations[rec.uid] = Reservation(
            decision, self.monotonic() + self.cfg.reservation_ttl_s, rec.resource_version
        )
        self._recount(rec.uid)

    def release(self, uid: str) -> None:
        """Drop the pod's reservation (its bind failed for good). Call under lock."""
        if self.reservations.pop(uid, None) is not None:
            self._recount(uid)

    def expire(self) -> None:
        """Reservations whose bind did not come in time stop counting; kept as long again so a late
        bind can still re-check its decision against the usage of now. Call under lock."""
        self._expire_unknown()
        now = self.monotonic()
        ttl = self.cfg.reservation_ttl_s
        while self.reservations:
            uid = next(iter(self.reservations))  # the oldest: the dict is kept in expiry order
            res = self.reservations[uid]
            if res.expires > now:
                break
            del self.reservations[uid]
            if res.counted:
                res.counted = False
                res.expires = now + ttl
                self.reservations[uid] = res  # kept as long again, for a late bind to re-check
                log.info("reservation of pod %s expired (no bind within %.0f s)", uid, ttl)
            self._recount(uid)

    def recount_reservation(self, uid: str) -> None:
        """Make an expired reservation count again (bind re-checked it). Call under lock."""
        res = self.reservations.get(uid)
        if res is not None and not res.counted:
            res.counted = True
            self.reservations.pop(uid)
            res.expires = self.monotonic() + self.cfg.reservation_ttl_s
            self.reservations[uid] = res
            self._recount(uid)

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

    def view(self, name: str, now: float) -> NodeView | None:
        """The node's view now: built once per Node version, only the heartbeat's age is checked
        on each call. Call under lock."""
        info = self.nodes.get(name)
        if info is None:
            return None
        v = self._views.get(name)
        if v is None or v[0] is not info:
            v = self._views[name] = (info, snapshot.node_view(info, now, self.cfg.stale_after_s))
        view = v[1]
        if not view.problem and now - view.heartbeat > self.cfg.stale_after_s:
            return snapshot.node_view(info, now, self.cfg.stale_after_s)
        return view

    def usage_without(self, uid: str) -> Usage:
        """The usage as if this pod held nothing (a pod being re-filtered frees its old GPUs). Call under lock."""
        mine = self._contrib.get(uid)
        if not mine:
            return self.usage
        out = dict(self.usage)
        for node, per in mine.items():
            cur = {k: v.copy() for k, v in self.usage.get(node, {}).items()}
            _add(cur, per, -1)
            out[node] = cur
        return out

    def node_usage_without(self, uid: str, node: str) -> dict[str, Use]:
        """One node's usage as if this pod held nothing there. Call under lock."""
        mine = self._contrib.get(uid, {}).get(node)
        cur = self.usage.get(node, {})
        if not mine:
            return cur
        out = {k: v.copy() for k, v in cur.items()}
        _add(out, mine, -1)
        return out

    def gens_without(self, uid: str) -> dict[str, int]:
        """Node generations for the fit memo, less the nodes whose usage usage_without() changed. Call under lock."""
        mine = self._contrib.get(uid)
        if not mine:
            return self.gens
        return self.gens | dict.fromkeys(mine, -1)

    def holders(self, node: str) -> dict[str, PerGPU]:
        """uid -> what each pod holds on `node` (its unpublished decided containers and its
        published slices). Call under lock."""
        return {uid: self._contrib[uid][node] for uid in self._on.get(node, ()) if node in self._contrib.get(uid, {})}

    def usage_copy(self) -> Usage:
        with self.lock:
            out = {n: {u: x.copy() for u, x in g.items()} for n, g in self.usage.items()}
        return {n: {u: x for u, x in g.items() if x.memory or x.cores or x.slots or x.mig} for n, g in out.items()}

    def recomputed(self) -> Usage:
        with self.lock:
            reserved = {u: r.decision for u, r in self.reservations.items() if r.counted}
            return snapshot.usage_of(list(self.pods.values()), list(self.nodes.values()), reserved, self.unknown_holds)

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
    def _list(self, kind: str) -> str:
        """List pods or nodes and replace what is kept; returns the list's resourceVersion."""
        assert self.kube is not None
        if kind == "pods":
            recs, rv = snapshot.decode_pod_list(self.kube.list_raw("pods"))
            self.replace_pod_recs(recs, rv)
        else:
            infos, rv = snapshot.decode_node_list(
                self.kube.list_raw("nodes", self.cfg.node_label_selector), self.cfg.resource_name
            )
            self.replace_node_infos(infos)
        return rv

    def resync(self) -> None:
        """List nodes and pods now (start, leadership, watch expiry); reservations of an earlier
        term are dropped (their binds are refused while this replica did not serve). Nodes first:
        every pod a Node's usage names was created before the pods' list (see _first_seen)."""
        assert self.kube is not None
        t = time.monotonic()
        with self.lock:
            self.reservations = {}
        self._list("nodes")
        self._list("pods")
        self.relists += 1
        self.last_relist_s = time.monotonic() - t
        log.info("relisted nodes and pods in %.2f s", self.last_relist_s)

    def _apply_event(self, kind: str, etype: str, raw: bytes) -> None:
        deleted = etype == "DELETED"
        if kind == "pods":
            self.apply_pod_rec(snapshot.decode_pod(raw), deleted)
        else:
            # The record kept for the node lets an unchanged inventory go undecoded.
            self.apply_node_info(snapshot.decode_node(raw, self.cfg.resource_name, self.nodes.get), deleted)

    def _loop(self, kind: str) -> None:
        assert self.kube is not None
        rv = ""
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if not rv:
                    t = time.monotonic()
                    rv = self._list(kind)
                    with self.lock:
                        self.relists += 1
                    self.last_relist_s = time.monotonic() - t
                    self._synced(kind)
                for etype, ev_rv, raw in self.kube.watch_raw(kind, rv, 60, self.cfg.node_label_selector):
                    if self._stop.is_set():
                        return
                    rv = ev_rv or rv
                    if etype != "BOOKMARK":
                        try:
                            self._apply_event(kind, etype, bytes(raw))
                        except snapshot.DecodeError as e:
                            log.warning("%s watch: skipping an event: %s", kind, e)
                    if kind == "pods":
                        with self.lock:
                            self.note_pod_rv(rv)  # events come in resourceVersion order
                        self._settle_gc()
                backoff = 0.2
            except Expired:
                log.info("%s watch expired: relisting", kind)
                rv = ""
            except (APIFailure, snapshot.DecodeError) as e:
                if self._stop.is_set():
                    return
                log.warning("%s watch: %s", kind, e)
                rv = ""
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    _gc_at = 0.0

    def _settle_gc(self) -> None:
        """What the state keeps is long-lived and acyclic: every GC_FREEZE_S it leaves the cyclic
        GC's walks (young garbage collected first). Without it a full collection walks every pod
        and node record kept since the last relist: pauses of 100+ ms measured at 5,000 nodes,
        in the middle of filters. Frozen objects are still freed by reference counting."""
        now = self.monotonic()
        if now - self._gc_at >= GC_FREEZE_S:
            self._gc_at = now
            gc.collect(1)
            gc.freeze()

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
