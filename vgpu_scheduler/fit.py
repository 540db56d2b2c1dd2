"""Filter and score (pure): which nodes can take a pod, which exact GPUs each container gets.

Per container: `count` distinct GPUs, each with room for the asked memory and cores and a free
vGPU slot, allowed by the pod's type/UUID include/exclude lists, all on one NUMA node when
`numa-bind` is true. App containers of one pod accumulate on a GPU; each init container only
has to fit next to the other pods (it runs alone, before the app containers). GPUs are
ordered by the GPU policy (binpack: the most used first; spread: the least used first), nodes
by the node policy on their usage after the placement. Whole-GPU compute (cores >= the GPU's
cores) needs a GPU no other container uses; a 0 % compute request cannot go onto a GPU whose
compute is fully given away (HAMi's rules). On a GPU that makes MIG instances per container
(dynamic MIG) a container gets an instance of its own instead: the smallest profile that holds
it, at a free placement (vgpu_scheduler/mig.py).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from vgpu import scheduling as sc
from vgpu_scheduler import mig
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.requests import ContainerRequest, PodOptions
from vgpu_scheduler.snapshot import GPU, NodeView, Use, decision_usage

MiB = 1 << 20
MAX_REASONS = 8
MEMO_MAX = 10_000


@dataclass(frozen=True, slots=True)
class Placement:
    node: str
    containers: list[sc.ContainerDecision]
    score: float  # 0..10, the node's usage fraction after placement x 10
    preference: float  # 0..10, higher is better under the pod's node policy


@dataclass(frozen=True, slots=True)
class Failure:
    node: str
    reason: str
    unresolvable: bool  # no preemption can help (no inventory, plugin dead, GPUs too few or too small)


@dataclass(slots=True)
class Choice:
    best: Placement | None = None
    placements: dict[str, Placement] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)


def asked(req: ContainerRequest, gpu: GPU, cfg: SchedulerConfig) -> tuple[int, int]:
    """(memory bytes, cores percent) the container asks of this GPU."""
    if req.mem_mib is not None:
        mem = req.mem_mib * MiB
    elif req.mem_pct is not None:
        mem = gpu.memory * req.mem_pct // 100
    elif cfg.default_gpumem_mib > 0:
        mem = cfg.default_gpumem_mib * MiB
    else:
        mem = gpu.memory // gpu.slots
    if req.cores is not None:
        cores = req.cores
    elif cfg.default_gpucores >= 0:
        cores = cfg.default_gpucores
    else:
        cores = gpu.cores // gpu.slots
    return mem, cores


def excluded(gpu: GPU, opts: PodOptions) -> str:
    """Why the pod may not use this GPU (unhealthy, type or UUID lists); "" when it may."""
    if not gpu.healthy:
        return f"{gpu.uuid}: unhealthy"
    model = gpu.model.lower()
    if opts.use_types and not any(t in model for t in opts.use_types):
        return f"{gpu.uuid}: type {gpu.model} not in use-gputype"
    if opts.nouse_types and any(t in model for t in opts.nouse_types):
        return f"{gpu.uuid}: type {gpu.model} excluded by nouse-gputype"
    if opts.use_uuids and gpu.uuid not in opts.use_uuids:
        return f"{gpu.uuid}: not in use-gpuuuid"
    if gpu.uuid in opts.nouse_uuids:
        return f"{gpu.uuid}: excluded by nouse-gpuuuid"
    return ""


def _pick(cands: list[tuple[float, GPU]], count: int, policy: str, numa_bind: bool) -> tuple[list[GPU] | None, str]:
    """`count` GPUs from (fraction, gpu) candidates by policy; with numa_bind all on one NUMA node."""
    binpack = policy == sc.POLICY_BINPACK
    cands.sort(key=lambda t: (-t[0] if binpack else t[0], t[1].index))
    if not numa_bind or count == 1:
        return ([g for _, g in cands[:count]], "") if len(cands) >= count else (None, "")
    groups: dict[int, list[tuple[float, GPU]]] = {}
    for t in cands:
        if t[1].numa >= 0:
            groups.setdefault(t[1].numa, []).append(t)
    best: tuple[float, list[GPU]] | None = None
    for _numa, members in sorted(groups.items()):
        if len(members) < count:
            continue
        chosen = members[:count]
        s = sum(f for f, _ in chosen) / count
        key = s if binpack else -s
        if best is None or key > best[0]:
            best = (key, [g for _, g in chosen])
    if best is None:
        sizes = ", ".join(f"NUMA {n}: {len(m)}" for n, m in sorted(groups.items())) or "no GPU with a known NUMA node"
        return None, f"numa-bind: no NUMA node has {count} fitting GPUs ({sizes})"
    return best[1], ""


def _reason(code: str, gpu: GPU, u: Use, mem: int, cores: int) -> str:
    if code == "slots":
        return f"{gpu.uuid}: {u.slots}/{gpu.slots} vGPU slots used"
    if code == "mem":
        return f"{gpu.uuid}: {max(gpu.memory - u.memory, 0) // MiB} MiB free < {mem // MiB} MiB asked"
    if code == "cores":
        return f"{gpu.uuid}: {max(gpu.cores - u.cores, 0)} percent compute free < {cores} percent asked"
    if code == "whole":
        return f"{gpu.uuid}: whole-GPU compute asked, GPU shared by {u.slots} container(s)"
    return f"{gpu.uuid}: compute fully allocated"


def _fit_mig(gpu: GPU, u: Use, mine: Use | None, mem: int, cores: int) -> tuple[mig.Pick, float] | str:
    """A container's MIG instance on a GPU that creates them (vgpu_scheduler/mig.py) and the GPU's
    usage fraction after it, or why none: the pod asked for MIG and the GPU does not create
    instances, no vGPU slot is free, no profile holds the request, no placement is free."""
    if gpu.mig is None:
        return f"{gpu.uuid}: no MIG instances created here ({sc.MIG_ANNOTATION} asked)"
    slots, lanes, used_mem, used_cores = u.slots, u.mig, u.memory, u.cores
    if mine is not None:
        slots, lanes = slots + mine.slots, lanes + mine.mig
        used_mem, used_cores = used_mem + mine.memory, used_cores + mine.cores
    if slots >= gpu.slots:
        return f"{gpu.uuid}: {slots}/{gpu.slots} vGPU slots used"
    r = mig.fit(gpu.mig, gpu.uuid, lanes, mem, cores)
    if isinstance(r, str):
        return r
    f = (slots + 1) / gpu.slots + (used_mem + r.profile.memory) / (gpu.memory or 1)
    f += (used_cores + r.cores) / gpu.cores if gpu.cores else 1.0
    return r, f / 3


def fit_node(
    view: NodeView, used: dict[str, Use], reqs: list[ContainerRequest], opts: PodOptions, cfg: SchedulerConfig
) -> Placement | Failure:
    """Place every container of the pod on this node, or say why not (pure).

    The hot path (every node, every filter) builds no strings: a GPU that does not fit leaves a
    (code, gpu, usage, asked) tuple, formatted only when the whole node fails.
    """
    if view.problem:
        return Failure(view.name, view.problem, True)
    gpus_all = view.gpus
    most = max(r.count for r in reqs)
    if most > len(gpus_all):
        return Failure(view.name, f"node has {len(gpus_all)} GPU(s) < {most} asked by one container", True)
    filtered = bool(opts.use_types or opts.nouse_types or opts.use_uuids or opts.nouse_uuids)
    zero = Use()
    tent: dict[str, Use] = {}  # the pod's own app containers so far
    tent_mig: dict[str, Use] = {}  # the pod's MIG instances so far (init containers' too: they stay)
    decided: list[sc.ContainerDecision] = []
    def_mem = cfg.default_gpumem_mib * MiB
    def_cores = cfg.default_gpucores
    for req in reqs:
        misses: list[tuple[str, GPU, Use, int, int] | str] = []
        cands: list[tuple[float, GPU]] = []
        picks: dict[str, mig.Pick] = {}
        rmem, rpct, rcores = req.mem_mib, req.mem_pct, req.cores
        for gpu in gpus_all:
            if not gpu.healthy or filtered:
                why = excluded(gpu, opts)
                if why:
                    misses.append(why)
                    continue
            if rmem is not None:
                mem = rmem * MiB
            elif rpct is not None:
                mem = gpu.memory * rpct // 100
            else:
                mem = def_mem if def_mem > 0 else gpu.memory // gpu.slots
            if rcores is not None:
                cores = rcores
            else:
                cores = def_cores if def_cores >= 0 else gpu.cores // gpu.slots
            u = used.get(gpu.uuid, zero)
            if gpu.mig is not None or opts.mig:
                r = _fit_mig(gpu, u, tent_mig.get(gpu.uuid), mem, cores)
                if isinstance(r, str):
                    misses.append(r)
                else:
                    picks[gpu.uuid] = r[0]
                    cands.append((r[1], gpu))
                continue
            if tent and not req.init:
                t = tent.get(gpu.uuid)
                if t is not None:
                    u = Use(u.memory + t.memory, u.cores + t.cores, u.slots + t.slots)
            if u.slots >= gpu.slots:
                code = "slots"
            elif gpu.memory - u.memory < mem:
                code = "mem"
            elif gpu.cores - u.cores < cores:
                code = "cores"
            elif cores >= gpu.cores and u.slots > 0:
                code = "whole"
            elif cores == 0 and u.cores >= gpu.cores:
                code = "full"
            else:
                f = (u.slots + 1) / gpu.slots + (u.memory + mem) / (gpu.memory or 1)
                f += (u.cores + cores) / gpu.cores if gpu.cores else 1.0
                cands.append((f / 3, gpu))
                continue
            misses.append((code, gpu, u, mem, cores))
        n_fit = len(cands)
        chosen, why = _pick(cands, req.count, opts.gpu_policy, opts.numa_bind)
        if chosen is None:
            reasons = [m if isinstance(m, str) else _reason(*m) for m in misses[: MAX_REASONS + 1]]
            head = f"container {req.name}: {n_fit}/{len(gpus_all)} GPUs fit, {req.count} asked"
            if why:
                reasons.insert(0, why)
            extra = len(misses) + (1 if why else 0) - MAX_REASONS
            more = f"; +{extra} more" if extra > 0 else ""
            return Failure(view.name, head + (": " + "; ".join(reasons[:MAX_REASONS]) if reasons else "") + more, False)
        out = []
        for gpu in chosen:
            pick = picks.get(gpu.uuid)
            if pick is not None:
                a = pick.assignment()
                mem, cores = pick.profile.memory, pick.cores
                out.append(sc.GPUAssignment(uuid=gpu.uuid, memory=mem, cores=cores, mig=a))
                tent_mig.setdefault(gpu.uuid, Use()).add(Use(mem, cores, 1, sc.mig_lanes(a.start, a.size)))
                if not req.init:
                    tent.setdefault(gpu.uuid, Use()).add(Use(mem, cores, 1, sc.mig_lanes(a.start, a.size)))
                continue
            mem, cores = asked(req, gpu, cfg)
            out.append(sc.GPUAssignment(uuid=gpu.uuid, memory=mem, cores=cores))
            if not req.init:
                tent.setdefault(gpu.uuid, Use()).add(Use(mem, cores, 1))
        decided.append(sc.ContainerDecision(name=req.name, init=req.init, gpus=out))
    # Node score: its usage fraction (memory, cores, slots) after the placement.
    if any(c.init for c in decided):
        mine = decision_usage(sc.Decision(node=view.name, time=0.0, containers=decided))
    else:
        mine = tent
    tm, tc, ts = view.totals
    um = uc = us = 0
    for u in used.values():
        um, uc, us = um + u.memory, uc + u.cores, us + u.slots
    for u in mine.values():
        um, uc, us = um + u.memory, uc + u.cores, us + u.slots
    score = 10 * (um / max(tm, 1) + (uc / tc if tc else 1.0) + us / max(ts, 1)) / 3
    pref = score if opts.node_policy == sc.POLICY_BINPACK else 10 - score
    return Placement(view.name, decided, score, pref)


def choose(
    views: list[NodeView],
    usage: dict[str, dict[str, Use]],
    reqs: list[ContainerRequest],
    opts: PodOptions,
    cfg: SchedulerConfig,
    memo: dict[tuple[object, ...], object] | None = None,
    gens: dict[str, int] | None = None,
    epoch: int = 0,
) -> Choice:
    """Fit the pod on every node; the best placement by node policy (ties: node name).

    With `memo` and `gens` (node -> generation of its inventory and usage; absent: 0; negative: do
    not memoise), a node whose
    generation is unchanged is not fitted again for the same requests: fit_node is pure, so its
    answer for (node, generation, requests, options) is reused. `cfg` must not change under one memo.
    """
    out = Choice()
    empty: dict[str, Use] = {}
    shape = (tuple(reqs), opts, epoch)
    if memo is not None and len(memo) > MEMO_MAX:
        memo.clear()
    r: Placement | Failure | None
    for v in views:
        gen = gens.get(v.name, 0) if memo is not None and gens is not None and not v.problem else -1
        if gen >= 0:
            assert memo is not None
            key = (v.name, gen, shape)
            r = memo.get(key)  # type: ignore[assignment]  # values are fit_node's answers
            if r is None:
                r = fit_node(v, usage.get(v.name, empty), reqs, opts, cfg)
                memo[key] = r
        else:
            r = fit_node(v, usage.get(v.name, empty), reqs, opts, cfg)
        if isinstance(r, Failure):
            if not r.unresolvable:
                r = never_fits(v, reqs, opts, cfg, memo) or r
            out.failures[v.name] = r
        else:
            out.placements[v.name] = r
            if out.best is None or (r.preference, out.best.node) > (out.best.preference, r.node):
                out.best = r
    return out


def never_fits(
    view: NodeView,
    reqs: list[ContainerRequest],
    opts: PodOptions,
    cfg: SchedulerConfig,
    memo: dict[tuple[object, ...], object] | None = None,
) -> Failure | None:
    """An unresolvable Failure when the pod cannot fit on this node even with nothing else on it
    (GPUs too small, of the wrong type, too few on one NUMA node): evicting pods cannot help, and
    kube-scheduler must not try (FailedAndUnresolvableNodes → "Preemption is not helpful for
    scheduling", preemption.go findCandidates). None when it would fit an empty node."""
    key = ("empty", view.gpus, tuple(reqs), opts)
    r = memo.get(key) if memo is not None else None
    if r is None:
        r = fit_node(view, {}, reqs, opts, cfg)
        if memo is not None:
            memo[key] = r
    if isinstance(r, Failure):
        return Failure(view.name, f"never fits this node: {r.reason}", True)
    return None


class Summary(Protocol):
    max_free_mem: int
    max_free_cores: int
    gpus_with_slot: int


def _quick_reject(s: Summary, reqs: list[ContainerRequest]) -> bool:
    """True when the node surely cannot take the pod (no GPU with that much free, too few slots);
    False means only "maybe" (fit_node decides)."""
    for r in reqs:
        if r.count > s.gpus_with_slot:
            return True
        if r.mem_mib is not None and r.mem_mib * MiB > s.max_free_mem:
            return True
        if r.cores is not None and r.cores > s.max_free_cores:
            return True
    return False


def search(
    orders: Iterable[list[tuple[float, str]]],
    allowed: Container[str],
    view_of: Callable[[str], NodeView | None],
    usage: dict[str, dict[str, Use]],
    summary_of: Callable[[str], Summary],
    reqs: list[ContainerRequest],
    opts: PodOptions,
    cfg: SchedulerConfig,
    memo: dict[tuple[object, ...], object] | None = None,
    gens: dict[str, int] | None = None,
    epoch: int = 0,
    extra: Iterable[str] = (),
) -> Placement | None:
    """The best placement among `allowed` nodes, found without fitting every node.

    `orders` are the nodes of each shape (GPU sizes) in the pod's node policy order (state.py's
    index: binpack most used first, spread least used first; ties by name). All nodes of a shape
    give the pod the same slices, so the placement score after placing it follows that order: the
    first node of each list that fits is that shape's best, and the best of those is the best of
    all, as `choose` would find it. `extra` nodes (those whose usage differs from the index's, the
    pod's own earlier node) are fitted in any case. Cost: a quick rejection per node passed over
    (largest free memory and compute on one GPU, GPUs with a free slot) and fit_node for the few
    that may fit; None when no allowed node fits (the caller then asks `choose` for the reasons).
    """
    best: Placement | None = None
    skip = set(extra)
    empty: dict[str, Use] = {}
    shape = (tuple(reqs), opts, epoch)

    def fitted(name: str) -> Placement | None:
        v = view_of(name)
        if v is None or v.problem:
            return None
        gen = gens.get(name, 0) if memo is not None and gens is not None else -1
        r: Placement | Failure | None = None
        if gen >= 0:
            assert memo is not None
            key = (name, gen, shape)
            r = memo.get(key)  # type: ignore[assignment]
            if r is None:
                r = fit_node(v, usage.get(name, empty), reqs, opts, cfg)
                memo[key] = r
        else:
            r = fit_node(v, usage.get(name, empty), reqs, opts, cfg)
        return r if isinstance(r, Placement) else None

    def better(r: Placement) -> bool:
        return best is None or (r.preference, best.node) > (best.preference, r.node)

    for name in skip:
        if name in allowed:
            r = fitted(name)
            if r is not None and better(r):
                best = r
    for lst in orders:
        for _k, name in lst:
            # Cheapest test first: the quick rejection reads the index's own data; whether
            # kube-scheduler sent the node may mean a search in the request's bytes.
            if name in skip or _quick_reject(summary_of(name), reqs) or name not in allowed:
                continue
            r = fitted(name)
            if r is not None:
                if better(r):
                    best = r
                break
    return best
