"""Preemption victims (pure): the cheapest set of lower-priority pods whose eviction lets a pod fit
on one node's GPUs (the extender's preempt verb).

Cost, compared in this order (kube-scheduler's own order between candidate nodes, preemption.go
pickOneNodeForPreemption): the highest priority evicted, the number of pods, the sum of their
priorities. Pods already terminating cost nothing. Among sets of equal cost the one that spares
the more important pods wins (MoreImportantPod: priority, then the earlier start), as
SelectVictimsOnNode's reprieve does. The answer is exactly minimal in this order:

1. The highest priority evicted is the lowest level L such that evicting every candidate of
   priority <= L lets the pod fit (fitting is monotone: fewer pods never fit worse). Candidates
   above L are never needed.
2. Below L each pod weighs (1, priority, 2**rank) (rank: its place in importance order), and a set
   weighs the sum: comparing sums compares the count, then the sum of priorities, then the most
   important pod in which the two sets differ (binary numbers). The weights add, so a set that
   spreads over several GPUs costs what its parts on each GPU cost.
3. One container (one GPU or several): the pod fits iff `count` of its GPUs each have room
   (fit_node's rule as arithmetic, `room`; with numa-bind, on one NUMA node). Per GPU, the cheapest
   set among that GPU's holders (at most its split count) is found by an exact branch-and-bound
   search; the `count` cheapest GPUs are taken. Pods that hold several of the pod's GPUs (their
   eviction frees more than one) are enumerated first as a set of their own (branch-and-bound
   over those pods, each GPU's cheapest rest memoised).
4. Several containers (their GPUs add up, init containers apart): fit_node decides; sets are
   tried in increasing weight (every set lighter than the answer is tried first), up to
   MAX_TRIES fit_node calls, then the least important pods are evicted until it fits and the
   needless ones reprieved, most important first (this last is not guaranteed minimal).

Terminating candidates are assumed gone for the search and reprieved afterwards (most important
first) unless the pod needs them. `keep`: victims kube-scheduler needs for another resource (they
hold no GPU here) stay, and the search starts with them gone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.fit import Placement, asked, excluded, fit_node
from vgpu_scheduler.requests import ContainerRequest, PodOptions
from vgpu_scheduler.snapshot import GPU, NodeView, Use

MAX_TRIES = 2000  # fit_node calls of the several-container search before its greedy fallback

Weight = tuple[int, int, int]  # (pods, sum of priorities, sum of 2**rank): compared in this order
ZERO: Weight = (0, 0, 0)


@dataclass(frozen=True, slots=True)
class Holder:
    """A pod that holds GPUs on a node and could be evicted for a higher-priority one."""

    uid: str
    priority: int
    start: str  # status.startTime ("" while not started: kube-scheduler takes "now", the newest)
    deleting: bool
    held: dict[str, Use]  # GPU UUID -> what it holds there
    rank: tuple[int, float] = field(default=(0, 0.0), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", (self.priority, -_epoch(self.start)))


def importance(h: Holder) -> tuple[int, float]:
    """kube-scheduler's MoreImportantPod (pkg/scheduler/util/utils.go): higher priority first, then
    the earlier start time (GetPodStartTime: a pod not started yet counts as starting now). Sorting
    by this, descending, puts the most important first."""
    return h.rank


def _epoch(t: str) -> float:
    if not t:
        return float("inf")
    try:
        return datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("inf")


def cost(vs: Iterable[Holder]) -> tuple[int, int, int]:
    """What evicting `vs` costs, compared in this order: the highest priority evicted, how many,
    the sum of their priorities (pods already terminating cost nothing)."""
    live = [h for h in vs if not h.deleting]
    return (max((h.priority for h in live), default=-(1 << 62)), len(live), sum(h.priority for h in live))


def without(used: dict[str, Use], victims: Iterable[Holder]) -> dict[str, Use]:
    out = {k: Use(v.memory, v.cores, v.slots) for k, v in used.items()}
    for h in victims:
        for uuid, u in h.held.items():
            out.setdefault(uuid, Use()).add(u, -1)
    return out


def room(gpu: GPU, u: Use, mem: int, cores: int) -> bool:
    """fit_node's per-GPU rule, as arithmetic: a free slot, the memory and the compute, the whole
    GPU for whole-GPU compute, some compute left for a 0 % ask."""
    if u.slots >= gpu.slots or gpu.memory - u.memory < mem or gpu.cores - u.cores < cores:
        return False
    if cores >= gpu.cores and u.slots > 0:
        return False
    return not (cores == 0 and u.cores >= gpu.cores)


def _need(gpu: GPU, u: Use, mem: int, cores: int) -> tuple[int, int, int]:
    """What must be freed on this GPU (slots, memory, cores) for `room` to hold: `room` as three
    lower bounds on what the evicted pods hold there."""
    slots = u.slots if cores >= gpu.cores else u.slots - gpu.slots + 1
    need_cores = cores - (gpu.cores - u.cores)
    if cores == 0:
        need_cores = max(need_cores, u.cores - gpu.cores + 1)
    return max(slots, 0), max(mem - (gpu.memory - u.memory), 0), max(need_cores, 0)


def _add(a: Weight, b: Weight) -> Weight:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


@dataclass(frozen=True, slots=True)
class _Item:
    h: Holder
    w: Weight


def _cheapest(
    need: tuple[int, int, int], items: list[tuple[_Item, Use]], bound: Weight | None = None
) -> tuple[Weight, list[Holder]] | None:
    """The lightest subset of `items` (a pod and what it holds on this GPU) whose holdings cover
    `need` in every dimension, if lighter than `bound`; None when none is. Exact: depth-first over
    include / exclude, pruned when the rest cannot cover the need, when the set so far weighs as
    much as the best found (weights only grow), and when the fewest further pods that could cover
    the largest need (per dimension, the largest holdings first) already make more pods than the
    best."""
    if need == (0, 0, 0):
        return (ZERO, []) if bound is None or ZERO < bound else None
    # Largest holdings first: small covers are found early, and the bound below prunes hard.
    items = sorted(items, key=lambda t: (-t[1].memory, -t[1].cores, -t[1].slots, t[0].w))
    n = len(items)
    vals = [(u.slots, u.memory, u.cores) for _, u in items]
    suffix = [(0, 0, 0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        s = suffix[i + 1]
        suffix[i] = (s[0] + vals[i][0], s[1] + vals[i][1], s[2] + vals[i][2])
    if any(suffix[0][d] < need[d] for d in range(3)):
        return None
    # Per suffix and dimension the holdings, largest first (a lower bound on the pods still
    # needed), made when first asked.
    desc: dict[int, list[list[int]]] = {}
    best_w: Weight | None = bound
    best: list[int] | None = None
    chosen: list[int] = []

    def more_needed(i: int, rem: tuple[int, int, int]) -> int:
        if i not in desc:
            desc[i] = [sorted((v[d] for v in vals[i:]), reverse=True) for d in range(3)]
        k = 0
        for d in range(3):
            r, j, vs = rem[d], 0, desc[i][d]
            while r > 0 and j < len(vs):  # the suffix covers rem: it ends before the list does
                r -= vs[j]
                j += 1
            k = max(k, j)
        return k

    def dfs(i: int, w: Weight, got: tuple[int, int, int]) -> None:
        nonlocal best_w, best
        rem = (need[0] - got[0], need[1] - got[1], need[2] - got[2])
        if rem[0] <= 0 and rem[1] <= 0 and rem[2] <= 0:
            if best_w is None or w < best_w:
                best_w, best = w, list(chosen)
            return
        if i == n or any(suffix[i][d] < rem[d] for d in range(3)):
            return
        if best_w is not None and (w >= best_w or w[0] + more_needed(i, rem) > best_w[0]):
            return
        it, _u = items[i]
        v = vals[i]
        chosen.append(i)
        dfs(i + 1, _add(w, it.w), (got[0] + v[0], got[1] + v[1], got[2] + v[2]))
        chosen.pop()
        dfs(i + 1, w, got)

    dfs(0, ZERO, (0, 0, 0))
    if best_w is None or best is None:
        return None
    return best_w, [items[i][0].h for i in best]


def _groups(gpus: list[GPU], count: int, numa_bind: bool) -> list[list[GPU]]:
    """The GPU sets the pod's `count` GPUs must come from (fit._pick): all of them, or with
    numa-bind and more than one GPU each NUMA node's (GPUs of unknown NUMA node in none)."""
    if not numa_bind or count == 1:
        return [gpus] if len(gpus) >= count else []
    by: dict[int, list[GPU]] = {}
    for g in gpus:
        if g.numa >= 0:
            by.setdefault(g.numa, []).append(g)
    return [m for _n, m in sorted(by.items()) if len(m) >= count]


def _one_container(
    view: NodeView,
    base: dict[str, Use],
    live: list[_Item],
    req: ContainerRequest,
    opts: PodOptions,
    cfg: SchedulerConfig,
) -> list[Holder] | None:
    """Exact cheapest live victims for a one-container pod (any GPU count); None when none helps."""
    zero = Use()
    asks: dict[str, tuple[int, int]] = {}
    elig: list[GPU] = []
    for gpu in view.gpus:
        if excluded(gpu, opts):
            continue
        mem, cores = asked(req, gpu, cfg)
        if room(gpu, zero, mem, cores):  # an empty GPU would do (else no eviction helps here)
            elig.append(gpu)
            asks[gpu.uuid] = (mem, cores)
    groups = _groups(elig, req.count, opts.numa_bind)
    if not groups:
        return None
    uuids = {g.uuid for g in elig}
    live = [it for it in live if any(u in uuids for u in it.h.held)]

    def fits_all(level: int | None) -> bool:
        gone = [it.h for it in live if level is not None and it.h.priority <= level]
        u = without({k: base.get(k, zero) for k in uuids}, gone)
        ok = {g.uuid for g in elig if room(g, u[g.uuid], *asks[g.uuid])}
        return any(sum(g.uuid in ok for g in grp) >= req.count for grp in groups)

    level: int | None = None
    for lv in [None, *sorted({it.h.priority for it in live})]:
        if fits_all(lv):
            level = lv
            break
    else:
        return None
    if level is None:
        return []
    live = [it for it in live if it.h.priority <= level]

    def on(
        gpu: GPU, items: Iterable[_Item], gone: Iterable[Holder], bound: Weight | None = None
    ) -> tuple[Weight, list[Holder]] | None:
        u = base.get(gpu.uuid, zero)
        u = Use(u.memory, u.cores, u.slots)
        for h in gone:
            x = h.held.get(gpu.uuid)
            if x is not None:
                u.add(x, -1)
        mine = [(it, it.h.held[gpu.uuid]) for it in items if gpu.uuid in it.h.held]
        return _cheapest(_need(gpu, u, *asks[gpu.uuid]), mine, bound)

    if req.count == 1:
        found: tuple[Weight, list[Holder]] | None = None
        for gpu in elig:
            r = on(gpu, live, (), found[0] if found is not None else None)  # only a lighter set
            if r is not None:
                found = r
        return found[1] if found is not None else None

    # Several GPUs: pods holding two or more of them are decided first (a set X of them), then each
    # GPU's cheapest rest among the pods holding only it; the `count` cheapest GPUs of a group.
    shared = [it for it in live if sum(u in uuids for u in it.h.held) >= 2]
    single = [it for it in live if sum(u in uuids for u in it.h.held) < 2]
    memo: dict[tuple[str, tuple[str, ...]], tuple[Weight, list[Holder]] | None] = {}
    best: tuple[Weight, list[Holder]] | None = None

    def cheapest(x: list[Holder], wx: Weight) -> tuple[Weight, list[Holder]] | None:
        """With the shared pods `x` gone (weighing wx): the lightest whole answer, or None."""
        found: tuple[Weight, list[Holder]] | None = None
        for grp in groups:
            per: list[tuple[Weight, int, list[Holder]]] = []
            for gpu in grp:
                key = (gpu.uuid, tuple(h.uid for h in x if gpu.uuid in h.held))
                if key not in memo:
                    memo[key] = on(gpu, single, x)
                r = memo[key]
                if r is not None:
                    per.append((r[0], gpu.index, r[1]))
            if len(per) < req.count:
                continue
            per.sort(key=lambda t: (t[0], t[1]))
            w, hs = wx, list(x)
            for pw, _i, ph in per[: req.count]:
                w = _add(w, pw)
                hs += ph
            if found is None or w < found[0]:
                found = (w, hs)
        return found

    def over_shared(i: int, x: list[_Item], wx: Weight) -> None:
        nonlocal best
        if best is not None and wx >= best[0]:
            return  # every completion weighs at least this much
        if i == len(shared):
            r = cheapest([it.h for it in x], wx)
            if r is not None and (best is None or r[0] < best[0]):
                best = r
            return
        # A lower bound of every completion: each GPU's rest as if every shared pod not decided
        # yet were gone for free (more gone never costs a GPU more).
        lb = cheapest([it.h for it in x] + [it.h for it in shared[i:]], wx)
        if lb is None or (best is not None and lb[0] >= best[0]):
            return
        over_shared(i + 1, x, wx)
        x.append(shared[i])
        over_shared(i + 1, x, _add(wx, shared[i].w))
        x.pop()

    over_shared(0, [], ZERO)
    return best[1] if best is not None else None


def _several_containers(
    view: NodeView,
    base: dict[str, Use],
    live: list[_Item],
    reqs: list[ContainerRequest],
    opts: PodOptions,
    cfg: SchedulerConfig,
) -> list[Holder] | None:
    """Cheapest live victims for a pod of several vGPU containers, fit_node deciding."""

    def fits(gone: Iterable[Holder]) -> bool:
        return isinstance(fit_node(view, without(base, gone), reqs, opts, cfg), Placement)

    uuids = {g.uuid for g in view.gpus if not excluded(g, opts)}
    live = [it for it in live if any(u in uuids for u in it.h.held)]
    level: int | None = None
    for lv in [None, *sorted({it.h.priority for it in live})]:
        if fits([it.h for it in live if lv is not None and it.h.priority <= lv]):
            level = lv
            break
    else:
        return None
    if level is None:
        return []
    items = sorted((it for it in live if it.h.priority <= level), key=lambda it: it.w)
    # Every subset in increasing weight, each once (a heap of (weight, last index, members):
    # successors add the next item, or replace the last by the next; items sorted by weight).
    heap: list[tuple[Weight, int, tuple[int, ...]]] = [(items[0].w, 0, (0,))] if items else []
    tries = 0
    while heap and tries < MAX_TRIES:
        w, last, members = heapq.heappop(heap)
        tries += 1
        if fits(items[i].h for i in members):
            return [items[i].h for i in members]
        if last + 1 < len(items):
            nxt = items[last + 1].w
            heapq.heappush(heap, (_add(w, nxt), last + 1, (*members, last + 1)))
            lw = items[last].w
            heapq.heappush(
                heap,
                (
                    (w[0] - lw[0] + nxt[0], w[1] - lw[1] + nxt[1], w[2] - lw[2] + nxt[2]),
                    last + 1,
                    (*members[:-1], last + 1),
                ),
            )
    if not heap:
        return None
    # Too many sets to try: the least important first until it fits, then reprieves.
    order = sorted((it.h for it in items), key=importance)
    chosen: list[Holder] = []
    for h in order:
        chosen.append(h)
        if fits(chosen):
            break
    for h in sorted(chosen, key=importance, reverse=True):
        rest = [x for x in chosen if x is not h]
        if fits(rest):
            chosen = rest
    return chosen


def select_victims(
    view: NodeView,
    used: dict[str, Use],
    holders: list[Holder],
    keep: list[Holder],
    reqs: list[ContainerRequest],
    opts: PodOptions,
    cfg: SchedulerConfig,
) -> list[Holder] | None:
    """The pods to evict so that the pod fits on this node's GPUs, most important first; None when
    no eviction of `holders` (the lower-priority pods bound here) makes it fit (module docstring).
    The answer is confirmed by fit_node. Pure."""
    if view.problem:
        return None
    base = without(used, keep)
    if isinstance(fit_node(view, base, reqs, opts, cfg), Placement):
        return sorted(keep, key=importance, reverse=True) or None
    order = sorted(holders, key=lambda h: (importance(h), h.uid))  # least important first
    live = [_Item(h, (1, h.priority, 1 << i)) for i, h in enumerate(order) if not h.deleting]
    dying = [h for h in order if h.deleting]
    rest = without(base, dying)  # terminating pods cost nothing: assume them gone, reprieve later
    if len(reqs) == 1:
        chosen = _one_container(view, rest, live, reqs[0], opts, cfg)
    else:
        chosen = _several_containers(view, rest, live, reqs, opts, cfg)
    if chosen is None:
        return None

    def fits(gone: list[Holder]) -> bool:
        return isinstance(fit_node(view, without(base, gone), reqs, opts, cfg), Placement)

    needed = list(dying)
    for h in reversed(dying):  # most important first
        if fits(chosen + [x for x in needed if x is not h]):
            needed.remove(h)
    victims = chosen + needed
    if not victims or not fits(victims):
        return None
    return sorted(victims + keep, key=importance, reverse=True)
