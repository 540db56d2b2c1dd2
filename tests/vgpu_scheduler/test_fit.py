"""Filter and score as pure functions: fit, policies, include/exclude, NUMA, defaults, reasons."""

from __future__ import annotations

import time

import pytest

from tests.support.inventory import uuid
from tests.vgpu_scheduler.helpers import GiB, MiB, gpu_node
from vgpu import scheduling as sc
from vgpu_scheduler import fit, snapshot
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.requests import ContainerRequest, PodOptions
from vgpu_scheduler.snapshot import Use

CFG = SchedulerConfig()


def view(name: str, **kw: object) -> snapshot.NodeView:
    return snapshot.node_view(snapshot.node_info(gpu_node(name, **kw)), time.time(), 120)


def req(
    name: str = "main",
    count: int = 1,
    mem: int | None = None,
    pct: int | None = None,
    cores: int | None = None,
    init: bool = False,
) -> ContainerRequest:
    return ContainerRequest(name, init, count, mem, pct, cores)


def opts(node: str = "binpack", gpu: str = "spread", **kw: object) -> PodOptions:
    return PodOptions(node, gpu, **kw)  # type: ignore[arg-type]


def test_single_container_gets_asked_memory_and_cores() -> None:
    v = view("n1", n=2)
    p = fit.fit_node(v, {}, [req(mem=8192, cores=30)], opts(), CFG)
    assert isinstance(p, fit.Placement)
    [c] = p.containers
    assert c.name == "main" and not c.init
    assert [(g.memory, g.cores) for g in c.gpus] == [(8192 * MiB, 30)]


def test_defaults_are_the_gpus_1_over_k_slice_and_configurable() -> None:
    v = view("n1", n=1, mem_gib=80, split=4)
    p = fit.fit_node(v, {}, [req()], opts(), CFG)
    assert isinstance(p, fit.Placement)
    assert (p.containers[0].gpus[0].memory, p.containers[0].gpus[0].cores) == (20 * GiB, 25)
    cfg = SchedulerConfig(default_gpumem_mib=1024, default_gpucores=10)
    p = fit.fit_node(v, {}, [req()], opts(), cfg)
    assert isinstance(p, fit.Placement)
    assert (p.containers[0].gpus[0].memory, p.containers[0].gpus[0].cores) == (1024 * MiB, 10)
    p = fit.fit_node(v, {}, [req(pct=50)], opts(), CFG)
    assert isinstance(p, fit.Placement)
    assert p.containers[0].gpus[0].memory == 40 * GiB


def test_memory_reason_names_gpu_free_and_asked() -> None:
    v = view("n1", n=1, mem_gib=16)
    used = {uuid("n1", 0): Use(14 * GiB, 10, 1)}
    f = fit.fit_node(v, used, [req(mem=8192)], opts(), CFG)
    assert isinstance(f, fit.Failure) and not f.unresolvable
    assert f"{uuid('n1', 0)}: 2048 MiB free < 8192 MiB asked" in f.reason
    assert "container main" in f.reason


def test_slots_cores_and_exclusive_rules() -> None:
    v = view("n1", n=1, split=2)
    g = uuid("n1", 0)
    f = fit.fit_node(v, {g: Use(1 * GiB, 10, 2)}, [req(mem=1)], opts(), CFG)
    assert isinstance(f, fit.Failure) and "2/2 vGPU slots used" in f.reason
    f = fit.fit_node(v, {g: Use(1 * GiB, 80, 1)}, [req(mem=1, cores=30)], opts(), CFG)
    assert isinstance(f, fit.Failure) and "20 percent compute free < 30 percent asked" in f.reason
    f = fit.fit_node(v, {g: Use(1 * GiB, 0, 1)}, [req(mem=1, cores=100)], opts(), CFG)
    assert isinstance(f, fit.Failure) and "whole-GPU compute" in f.reason
    f = fit.fit_node(v, {g: Use(1 * GiB, 100, 1)}, [req(mem=1, cores=0)], opts(), CFG)
    assert isinstance(f, fit.Failure) and "compute fully allocated" in f.reason


def test_multi_gpu_container_gets_distinct_gpus_and_too_few_is_unresolvable() -> None:
    v = view("n1", n=4)
    p = fit.fit_node(v, {}, [req(count=3, mem=1000)], opts(), CFG)
    assert isinstance(p, fit.Placement)
    uuids = [g.uuid for g in p.containers[0].gpus]
    assert len(set(uuids)) == 3
    f = fit.fit_node(v, {}, [req(count=5)], opts(), CFG)
    assert isinstance(f, fit.Failure) and f.unresolvable and "4 GPU(s) < 5" in f.reason


def test_app_containers_accumulate_init_containers_do_not() -> None:
    v = view("n1", n=1, mem_gib=10, split=10)
    # two app containers of 6 GiB cannot share the 10 GiB GPU; an init container of 6 GiB plus an app of 6 GiB can
    f = fit.fit_node(v, {}, [req("a", mem=6144), req("b", mem=6144)], opts(), CFG)
    assert isinstance(f, fit.Failure) and "container b" in f.reason
    p = fit.fit_node(v, {}, [req("i", mem=6144, init=True), req("a", mem=6144)], opts(), CFG)
    assert isinstance(p, fit.Placement)
    assert [(c.name, c.init) for c in p.containers] == [("i", True), ("a", False)]
    d = sc.Decision(node="n1", time=0, containers=p.containers)
    assert snapshot.decision_usage(d)[uuid("n1", 0)] == Use(6144 * MiB, 10, 1)  # default cores: 100/K, K=10


def test_gpu_policy_binpack_and_spread() -> None:
    v = view("n1", n=3)
    used = {uuid("n1", 1): Use(10 * GiB, 20, 1)}
    p = fit.fit_node(v, used, [req(mem=1024)], opts(gpu="binpack"), CFG)
    assert isinstance(p, fit.Placement) and p.containers[0].gpus[0].uuid == uuid("n1", 1)
    p = fit.fit_node(v, used, [req(mem=1024)], opts(gpu="spread"), CFG)
    assert isinstance(p, fit.Placement) and p.containers[0].gpus[0].uuid == uuid("n1", 0)


def test_node_policy_binpack_and_spread() -> None:
    views = [view("a", n=2), view("b", n=2)]
    usage = {"b": {uuid("b", 0): Use(40 * GiB, 50, 2)}}
    c = fit.choose(views, usage, [req(mem=1024)], opts(node="binpack"), CFG)
    assert c.best is not None and c.best.node == "b"
    c = fit.choose(views, usage, [req(mem=1024)], opts(node="spread"), CFG)
    assert c.best is not None and c.best.node == "a"
    assert set(c.placements) == {"a", "b"} and not c.failures


def test_type_and_uuid_include_exclude() -> None:
    v = view("n1", n=2, model="NVIDIA H100 80GB HBM3")
    f = fit.fit_node(v, {}, [req()], opts(use_types=("a100",)), CFG)
    assert isinstance(f, fit.Failure) and "not in use-gputype" in f.reason
    assert isinstance(fit.fit_node(v, {}, [req()], opts(use_types=("a100", "h100")), CFG), fit.Placement)
    f = fit.fit_node(v, {}, [req()], opts(nouse_types=("h100",)), CFG)
    assert isinstance(f, fit.Failure) and "excluded by nouse-gputype" in f.reason
    p = fit.fit_node(v, {}, [req()], opts(use_uuids=frozenset({uuid("n1", 1)})), CFG)
    assert isinstance(p, fit.Placement) and p.containers[0].gpus[0].uuid == uuid("n1", 1)
    p = fit.fit_node(v, {}, [req()], opts(nouse_uuids=frozenset({uuid("n1", 0)})), CFG)
    assert isinstance(p, fit.Placement) and p.containers[0].gpus[0].uuid == uuid("n1", 1)


def test_unhealthy_gpus_are_not_offered() -> None:
    v = view("n1", n=2, unhealthy=(0,))
    p = fit.fit_node(v, {}, [req()], opts(), CFG)
    assert isinstance(p, fit.Placement) and p.containers[0].gpus[0].uuid == uuid("n1", 1)
    f = fit.fit_node(v, {}, [req(count=2)], opts(), CFG)
    assert isinstance(f, fit.Failure) and f"{uuid('n1', 0)}: unhealthy" in f.reason


def test_numa_bind_keeps_a_container_on_one_numa_node() -> None:
    v = view("n1", n=4, numa=[0, 1, 0, 1])
    used = {uuid("n1", 2): Use(80 * GiB, 10, 1)}  # NUMA 0 has only GPU 0 left
    p = fit.fit_node(v, used, [req(count=2, mem=1024)], opts(numa_bind=True), CFG)
    assert isinstance(p, fit.Placement)
    assert {g.uuid for g in p.containers[0].gpus} == {uuid("n1", 1), uuid("n1", 3)}
    used[uuid("n1", 3)] = Use(80 * GiB, 10, 1)
    f = fit.fit_node(v, used, [req(count=2, mem=1024)], opts(numa_bind=True), CFG)
    assert isinstance(f, fit.Failure) and "numa-bind" in f.reason
    assert isinstance(fit.fit_node(v, used, [req(count=2, mem=1024)], opts(), CFG), fit.Placement)
    unknown = view("n2", n=2)
    f = fit.fit_node(unknown, {}, [req(count=2)], opts(numa_bind=True), CFG)
    assert isinstance(f, fit.Failure) and "no GPU with a known NUMA node" in f.reason


def test_mixed_requests_fill_a_node_exactly() -> None:
    """Memory is the binding dimension: 80 GiB GPUs take 8192 + 16384 + ... until full, never more."""
    v = view("n1", n=2, split=10)
    usage: dict[str, Use] = {}
    placed = 0
    for mem in [8192, 16384, 40960, 4096, 20480, 8192, 30000, 16384, 2048, 50000] * 2:
        p = fit.fit_node(v, usage, [req(mem=mem, cores=5)], opts(gpu="binpack"), CFG)
        if isinstance(p, fit.Failure):
            continue
        placed += 1
        for g in p.containers[0].gpus:
            usage.setdefault(g.uuid, Use()).add(Use(g.memory, g.cores, 1))
    assert placed > 0
    for u in usage.values():
        assert u.memory <= 80 * GiB and u.cores <= 100 and u.slots <= 10


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_choose_reports_every_failing_node(policy: str) -> None:
    views = [view("a", n=1, mem_gib=8), view("b", n=1, mem_gib=80)]
    views.append(snapshot.NodeView("c", problem="no vGPU inventory (device plugin not running?)"))
    c = fit.choose(views, {}, [req(mem=16384)], opts(node=policy), CFG)
    assert c.best is not None and c.best.node == "b"
    assert "8192 MiB free < 16384 MiB asked" in c.failures["a"].reason
    assert c.failures["c"].unresolvable


def test_the_index_walk_finds_what_fitting_every_node_finds() -> None:
    """fit.search over state.py's index (nodes of one shape sorted by usage, the first fit per
    shape) chooses the node and GPUs fit.choose chooses by fitting every node, on a mixed cluster
    filled pod by pod under both policies; and it skips the nodes kube-scheduler did not send."""
    import random

    from vgpu_scheduler.state import ClusterState

    rng = random.Random(20261202)
    st = ClusterState(CFG)
    shapes = [{"n": 8, "mem_gib": 80, "split": 10}, {"n": 4, "mem_gib": 40, "split": 4}, {"n": 2, "mem_gib": 16}]
    names = [f"n{i:02d}" for i in range(45)]
    for i, name in enumerate(names):
        st.apply_node(gpu_node(name, **shapes[i % 3]))  # type: ignore[arg-type]
    now = time.time()
    placed = 0
    for i in range(400):
        reqs = [
            req(
                count=rng.choice((1, 1, 1, 2)), mem=rng.choice((1024, 4096, 8192, 20000)), cores=rng.choice((5, 10, 30))
            )
        ]
        o = opts(rng.choice(("binpack", "spread")), rng.choice(("binpack", "spread")))
        sent = set(rng.sample(names, 40))
        with st.lock:
            got = fit.search(
                st.ordered(o.node_policy), sent, lambda n: st.view(n, now), st.usage, st.summary, reqs, o, CFG
            )
            want = fit.choose(st.views(sorted(sent)), st.usage, reqs, o, CFG).best
            if want is None:
                assert got is None
                continue
            assert got is not None and got.node in sent
            assert (got.node, got.containers) == (want.node, want.containers), i
            pod = {"metadata": {"uid": f"u{i}", "name": f"p{i}", "namespace": "d", "resourceVersion": "1"}}
            st.reserve(pod, sc.Decision(node=got.node, time=0, containers=got.containers))
            placed += 1
    assert placed > 200
    assert snapshot.drift_bytes(st.usage, st.recomputed()) == 0


def test_oversubscribed_gpus_take_slices_whose_physical_shares_fit_the_memory() -> None:
    """Memory scaling S = 2 on 16 GiB GPUs split 2 ways: `gpumem` asks up to the slice (S*M/K =
    16 GiB by default), and whatever mix of requests is placed, the physical shares (gpumem / S,
    what the device plugin writes as device_limit) of a GPU add up to at most its 16 GiB."""
    import random

    v = view("n1", n=2, mem_gib=16, split=2, scaling=2.0)
    p = fit.fit_node(v, {}, [req()], opts(), CFG)
    assert isinstance(p, fit.Placement) and p.containers[0].gpus[0].memory == 16 * GiB
    usage: dict[str, Use] = {}
    for _ in range(2):  # two full 16 GiB slices per GPU, no third
        for _ in range(2):
            p = fit.fit_node(v, usage, [req(mem=16384, cores=10)], opts(gpu="binpack"), CFG)
            assert isinstance(p, fit.Placement)
            for g in p.containers[0].gpus:
                usage.setdefault(g.uuid, Use()).add(Use(g.memory, g.cores, 1))
    f = fit.fit_node(v, usage, [req(mem=1, cores=10)], opts(), CFG)
    assert isinstance(f, fit.Failure)
    rng = random.Random(7)
    for _ in range(200):
        v = view("n1", n=2, mem_gib=16, split=8, scaling=2.0)
        usage = {}
        shares: dict[str, int] = {}
        for _ in range(20):
            p = fit.fit_node(
                v, usage, [req(mem=rng.choice([1024, 4096, 8192, 12288, 16384, 24576]), cores=1)], opts(), CFG
            )
            if isinstance(p, fit.Failure):
                continue
            for g in p.containers[0].gpus:
                usage.setdefault(g.uuid, Use()).add(Use(g.memory, g.cores, 1))
                shares[g.uuid] = shares.get(g.uuid, 0) + g.memory // 2
        assert all(s <= 16 * GiB for s in shares.values())
        assert all(u.memory <= 32 * GiB for u in usage.values())
