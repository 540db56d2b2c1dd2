"""Preemption victims are exactly minimal (vgpu_scheduler/victims.py): the highest priority
evicted, then the number of pods, then the sum of their priorities, on one node, for one-GPU,
several-GPU and several-container pods.

The oracle is independent of the search: every subset of the candidates is tried with the
filter's own fit_node (no arithmetic of victims.py), and the documented cost is computed here.
Randomized cases are seeded; a failure names its seed (rerun one with VGPU_TEST_SEED=<seed>).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterable

import pytest

from tests.vgpu_scheduler.helpers import GiB, MiB
from vgpu_scheduler import fit, victims
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.requests import ContainerRequest, PodOptions
from vgpu_scheduler.snapshot import GPU, NodeView, Use

CFG = SchedulerConfig()
OPTS = PodOptions(node_policy="binpack", gpu_policy="spread")


def view_of(gpus: list[GPU]) -> NodeView:
    return NodeView(
        "n",
        tuple(gpus),
        totals=(sum(g.memory for g in gpus), sum(g.cores for g in gpus), sum(g.slots for g in gpus)),
    )


def used_by(hs: Iterable[victims.Holder], extra: dict[str, Use] | None = None) -> dict[str, Use]:
    out: dict[str, Use] = {k: Use(v.memory, v.cores, v.slots) for k, v in (extra or {}).items()}
    for h in hs:
        for g, u in h.held.items():
            out.setdefault(g, Use()).add(u)
    return out


def doc_cost(vs: Iterable[victims.Holder]) -> tuple[int, int, int]:
    """The documented order: highest priority evicted, number of pods, sum of priorities; pods
    already terminating cost nothing."""
    live = [h for h in vs if not h.deleting]
    return (max((h.priority for h in live), default=-(1 << 62)), len(live), sum(h.priority for h in live))


def spare_key(vs: Iterable[victims.Holder]) -> list[tuple[int, float]]:
    """Ties: the set whose most important pod (then the next...) is less important wins."""
    return sorted((victims.importance(h) for h in vs if not h.deleting), reverse=True)


def fits(
    view: NodeView, used: dict[str, Use], gone: Iterable[victims.Holder], reqs: list[ContainerRequest], opts: PodOptions
) -> bool:
    return isinstance(fit.fit_node(view, victims.without(used, gone), reqs, opts, CFG), fit.Placement)


def oracle(
    view: NodeView, used: dict[str, Use], holders: list[victims.Holder], reqs: list[ContainerRequest], opts: PodOptions
) -> list[list[victims.Holder]]:
    """Every cheapest feasible subset (brute force over all subsets)."""
    best: list[list[victims.Holder]] = []
    best_cost: tuple[int, int, int] | None = None
    for k in range(len(holders) + 1):
        for sub in itertools.combinations(holders, k):
            if not fits(view, used, sub, reqs, opts):
                continue
            c = doc_cost(sub)
            if best_cost is None or c < best_cost:
                best, best_cost = [list(sub)], c
            elif c == best_cost:
                best.append(list(sub))
    return best


# ----- one larger pod or two smaller -----
def test_one_larger_pod_rather_than_two_smaller() -> None:
    """Two 16 GiB GPUs split 4, every slot taken by low-priority pods: GPU 0 holds 8192 (started
    first), 4096, 2048, 2048 MiB; GPU 1 four of 4096. 8192 MiB asked: evicting the one 8192 MiB pod
    of GPU 0 suffices (the greedy walk from the least important evicted two pods of GPU 1)."""
    gpus = [GPU(f"G{i}", i, "NVIDIA A100", 0, 16 * GiB, 100, 4, True) for i in range(2)]
    v = view_of(gpus)
    hs = []
    for i, mib in enumerate((8192, 4096, 2048, 2048)):
        hs.append(victims.Holder(f"g0-{mib}-{i}", 100, f"2026-12-02T07:0{i}:00Z", False, {"G0": Use(mib * MiB, 10, 1)}))
    for i in range(4):
        hs.append(victims.Holder(f"g1-{i}", 100, f"2026-12-02T07:1{i}:00Z", False, {"G1": Use(4096 * MiB, 10, 1)}))
    req = [ContainerRequest("main", False, 1, 8192, None, 10)]
    got = victims.select_victims(v, used_by(hs), hs, [], req, OPTS, CFG)
    assert [h.uid for h in got or []] == ["g0-8192-0"]
    # pinned to GPU 1, two of its pods go (the least important: the two started last)
    pinned = PodOptions(node_policy="binpack", gpu_policy="spread", use_uuids=frozenset({"G1"}))
    got = victims.select_victims(v, used_by(hs), hs, [], req, pinned, CFG)
    assert [h.uid for h in got or []] == ["g1-2", "g1-3"]  # most important first


def test_two_gpus_asked_one_pod_on_each_or_one_pod_holding_both() -> None:
    """A pod holding both GPUs (its eviction frees two) is cheaper than one pod on each."""
    gpus = [GPU(f"G{i}", i, "NVIDIA A100", 0, 16 * GiB, 100, 2, True) for i in range(2)]
    v = view_of(gpus)
    both = victims.Holder(
        "both", 100, "2026-12-02T07:00:00Z", False, {"G0": Use(8 * GiB, 10, 1), "G1": Use(8 * GiB, 10, 1)}
    )
    a = victims.Holder("a", 100, "2026-12-02T07:05:00Z", False, {"G0": Use(8 * GiB, 10, 1)})
    b = victims.Holder("b", 100, "2026-12-02T07:06:00Z", False, {"G1": Use(8 * GiB, 10, 1)})
    req = [ContainerRequest("main", False, 2, 16384, None, 10)]
    got = victims.select_victims(v, used_by([both, a, b]), [both, a, b], [], req, OPTS, CFG)
    assert got is not None and sorted(h.uid for h in got) == ["a", "b", "both"]  # 16 GiB each: all go
    req = [ContainerRequest("main", False, 2, 8192, None, 10)]
    got = victims.select_victims(v, used_by([both, a, b]), [both, a, b], [], req, OPTS, CFG)
    assert [h.uid for h in got or []] == ["both"]


# ----- randomized, against the brute-force oracle -----
def _case(
    rng: random.Random,
) -> tuple[NodeView, dict[str, Use], list[victims.Holder], list[victims.Holder], list[ContainerRequest], PodOptions]:
    n_gpus = rng.randint(1, 4)
    gpus = []
    for i in range(n_gpus):
        gpus.append(
            GPU(
                f"G{i}",
                i,
                rng.choice(["NVIDIA A100", "NVIDIA T4"]),
                rng.choice([-1, 0, 1]),
                rng.choice([4, 8, 16]) * GiB,
                100,
                rng.randint(2, 5),
                rng.random() > 0.05,
            )
        )
    use = {g.uuid: Use() for g in gpus}
    holders: list[victims.Holder] = []
    extra: dict[str, Use] = {}
    starts = ["", "2026-12-02T07:00:00Z", "2026-12-02T07:01:00Z", "2026-12-02T07:02:00Z"]
    budget = rng.randint(2, 9)
    for _ in range(40):
        if len(holders) >= budget:
            break
        g = rng.choice(gpus)
        held: dict[str, Use] = {}
        for gg in [g] + ([rng.choice(gpus)] if rng.random() < 0.25 else []):
            u = use[gg.uuid]
            if gg.uuid in held or u.slots >= gg.slots:
                continue
            mem = rng.randint(0, (gg.memory - u.memory) // (512 * MiB)) * 512 * MiB
            cores = rng.choice([0, 5, 10, 25, 50, 100])
            cores = min(cores, gg.cores - u.cores)
            x = Use(mem, cores, 1)
            held[gg.uuid] = x
            u.add(x)
        if not held:
            continue
        if rng.random() < 0.12:  # a pod of higher priority than the preemptor: usage, no candidate
            for k, x in held.items():
                extra.setdefault(k, Use()).add(x)
            continue
        holders.append(
            victims.Holder(
                f"p{len(holders)}", rng.choice([-5, 0, 10, 100]), rng.choice(starts), rng.random() < 0.12, held
            )
        )
    used = used_by(holders, extra)

    def container(name: str, init: bool) -> ContainerRequest:
        count = rng.choice([1, 1, 1, 2, 2, 3])
        mem = rng.choice([None, None, 512, 1024, 2048, 4096, 8192, 12288, 16384])
        pct = rng.choice([25, 50]) if mem is None and rng.random() < 0.3 else None
        cores = rng.choice([None, 0, 5, 10, 30, 60, 100])
        return ContainerRequest(name, init, count, mem, pct, cores)

    reqs = [container("main", False)]
    if rng.random() < 0.2:
        reqs.append(container("side", rng.random() < 0.5))
    opts = PodOptions(
        node_policy="binpack",
        gpu_policy=rng.choice(["binpack", "spread"]),
        use_types=("a100",) if rng.random() < 0.1 else (),
        nouse_uuids=frozenset({"G0"}) if rng.random() < 0.1 else frozenset(),
        numa_bind=rng.random() < 0.25,
    )
    keep = [victims.Holder("cpu-hog", 1, "", False, {})] if rng.random() < 0.1 else []
    return view_of(gpus), used, holders, keep, reqs, opts


def _seeds() -> list[int]:
    if os.environ.get("VGPU_TEST_SEED"):
        return [int(os.environ["VGPU_TEST_SEED"])]
    return list(range(1000))


def test_victims_are_exactly_minimal_against_brute_force() -> None:
    checked = helped = 0
    for seed in _seeds():
        rng = random.Random(seed)
        view, used, holders, keep, reqs, opts = _case(rng)
        got = victims.select_victims(view, used, holders, keep, reqs, opts, CFG)
        base = victims.without(used, keep)
        where = f"seed {seed} (VGPU_TEST_SEED={seed}): reqs={reqs} opts={opts} holders={holders} used={used} got={got}"
        if fits(view, base, [], reqs, opts):
            assert got == (sorted(keep, key=victims.importance, reverse=True) or None), where
            continue
        best = oracle(view, base, holders, reqs, opts)
        checked += 1
        if not best:
            assert got is None, where
            continue
        helped += 1
        assert got is not None, f"{where}: oracle {best[0]}"
        mine = [h for h in got if h not in keep]
        assert all(k in got for k in keep), where
        assert fits(view, base, mine, reqs, opts), where
        assert doc_cost(mine) == doc_cost(best[0]), f"{where}: oracle {best[0]} costs {doc_cost(best[0])}"
        for h in mine:  # nothing needless: each victim is needed by the others
            assert not fits(view, base, [x for x in mine if x is not h], reqs, opts), f"{where}: {h.uid} needless"
        assert [victims.importance(h) for h in got] == sorted((victims.importance(h) for h in got), reverse=True), where
        if not any(h.deleting for h in holders):
            # ties: the more important pods are spared (exact as well)
            assert spare_key(mine) == min(spare_key(b) for b in best), f"{where}: oracle {best}"
    assert checked > 400 and helped > 200, (checked, helped)  # the generator keeps producing real cases


def test_the_several_container_search_falls_back_within_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_TRIES fit_node calls a several-container pod gets the greedy answer: it still
    fits and nothing in it is needless."""
    monkeypatch.setattr(victims, "MAX_TRIES", 1)
    gpus = [GPU(f"G{i}", i, "NVIDIA A100", 0, 16 * GiB, 100, 4, True) for i in range(2)]
    v = view_of(gpus)
    hs = [
        victims.Holder(f"p{i}", 0, f"2026-12-02T07:0{i}:00Z", False, {f"G{i % 2}": Use(4 * GiB, 10, 1)})
        for i in range(8)
    ]
    reqs = [ContainerRequest("a", False, 1, 8192, None, 10), ContainerRequest("b", False, 1, 8192, None, 10)]
    got = victims.select_victims(v, used_by(hs), hs, [], reqs, OPTS, CFG)
    assert got is not None and fits(v, used_by(hs), got, reqs, OPTS)
    for h in got:
        assert not fits(v, used_by(hs), [x for x in got if x is not h], reqs, OPTS)
