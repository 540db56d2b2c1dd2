"""Preferred allocation and Allocate's slicing, on a table of synthetic GPUs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_plugin.allocator import AllocationError, preferred, slice_for
from nodecore.devices import DeviceTable, Slicing, parse_vgpu_id, vgpu_id
from vgpu.nvml import GPUInfo

GiB = 1 << 30


def gpus(n: int, mem: int = 16 * GiB) -> list[GPUInfo]:
    return [GPUInfo(i, f"GPU-{i:08x}-0000-0000-0000-000000000000", "Fake", mem, None, None) for i in range(n)]


def table(n: int = 3, k: int = 4, s: float = 1.0, c: float = 1.0, mem: int = 16 * GiB) -> DeviceTable:
    return DeviceTable(gpus(n, mem), Slicing(k, s, c))


def gpu_of(t: DeviceTable, ids: list[str]) -> list[int]:
    return [t.gpus[t.by_id[d]].info.index for d in ids]


def test_ids_and_parse() -> None:
    t = table(2, 3)
    assert len(t.all_ids()) == 6
    u = t.gpus[t.by_id[t.all_ids()[0]]].info.uuid
    assert t.all_ids()[:3] == [vgpu_id(u, i) for i in range(3)]
    assert parse_vgpu_id(f"{u}::2") == (u, 2)
    assert parse_vgpu_id("GPU-x") is None
    assert parse_vgpu_id("GPU-x::") is None
    assert parse_vgpu_id("GPU-x::a") is None
    assert all(len(i) <= 63 for i in t.all_ids())


def test_slicing_arithmetic() -> None:
    s = Slicing(3, 1.0, 1.0)
    assert s.memory_per_vgpu(10) == 3  # floor(10/3)
    assert s.cores_for(1) == 33 and s.cores_for(3) == 100
    s2 = Slicing(4, 1.5, 2.0)
    assert s2.memory_per_vgpu(16 * GiB) == 6 * GiB
    assert s2.cores_for(1) == 50 and s2.oversubscribe
    assert not Slicing(2).oversubscribe
    # the physical share: the slice over the scaling; K shares of a GPU never exceed it
    assert s2.device_share(6 * GiB) == 4 * GiB and 4 * s2.device_share(s2.memory_per_vgpu(16 * GiB)) <= 16 * GiB
    s3 = Slicing(3, 1.7)
    m = 10**10 + 7
    assert 3 * s3.device_share(s3.memory_per_vgpu(m)) <= m
    assert Slicing(2, 0.5).device_share(5) == 5 and Slicing(2).device_share(5) == 5


def test_preferred_spreads_over_distinct_gpus() -> None:
    t = table(3, 4)
    ids = preferred(t, t.all_ids(), [], 3, "spread")
    assert sorted(gpu_of(t, ids)) == [0, 1, 2]
    # more than GPUs: distinct first, then again round-robin
    ids = preferred(t, t.all_ids(), [], 5, "spread")
    assert sorted(gpu_of(t, ids)) == [0, 0, 1, 1, 2]


def test_preferred_spread_picks_least_allocated_binpack_most() -> None:
    t = table(3, 4)
    avail = t.all_ids()
    # GPU 0: 3 of 4 allocated, GPU 1: 1 allocated, GPU 2: none
    g0 = t.gpus[t.by_id[avail[0]]].ids
    g1 = t.gpus[t.by_id[avail[4]]].ids
    avail = [d for d in avail if d not in g0[:3] and d not in g1[:1]]
    assert gpu_of(t, preferred(t, avail, [], 1, "spread")) == [2]
    assert gpu_of(t, preferred(t, avail, [], 1, "binpack")) == [0]
    # binpack still puts a 2-vGPU request on two distinct GPUs
    assert sorted(gpu_of(t, preferred(t, avail, [], 2, "binpack"))) == [0, 1]
    assert sorted(gpu_of(t, preferred(t, avail, [], 2, "spread"))) == [1, 2]


def test_preferred_honours_must_include() -> None:
    t = table(3, 4)
    must = [t.gpus[t.by_id[t.all_ids()[5]]].ids[1]]  # a vGPU of GPU 1
    ids = preferred(t, t.all_ids(), must, 2, "spread")
    assert ids[0] == must[0]
    assert len(ids) == 2 and gpu_of(t, ids)[1] != 1
    assert preferred(t, t.all_ids(), must, 1, "spread") == must


def test_preferred_skips_unknown_and_unhealthy() -> None:
    t = table(2, 2)
    u0 = t.gpus[t.by_id[t.all_ids()[0]]].info.uuid
    t.mark_unhealthy(u0, "test")
    ids = preferred(t, [*t.all_ids(), "bogus::1"], [], 2, "spread")
    assert gpu_of(t, ids) == [1, 1]


def test_slice_single_and_two_gpus() -> None:
    t = table(2, 4, mem=16 * GiB)
    a = t.all_ids()
    sl = slice_for(t, [a[0]])
    assert len(sl.gpus) == 1
    g = sl.gpus[0]
    assert g.memory_limit == 4 * GiB and g.core_percent == 25 and g.vgpu_ids == [a[0]]
    sl = slice_for(t, [a[0], a[4]])
    assert [x.memory_limit for x in sl.gpus] == [4 * GiB, 4 * GiB]
    assert sl.uuids == [t.by_id[a[0]], t.by_id[a[4]]]


def test_slice_merges_same_gpu() -> None:
    t = table(2, 4, s=2.0)
    a = t.all_ids()
    sl = slice_for(t, [a[0], a[4], a[1]])
    assert len(sl.gpus) == 2
    merged = sl.gpus[0]
    assert merged.vgpu_ids == [a[0], a[1]]
    assert merged.memory_limit == 2 * (2 * 16 * GiB // 4)
    assert merged.core_percent == 50
    assert sl.gpus[1].core_percent == 25


@pytest.mark.parametrize(
    ("ids", "msg"),
    [
        ([], "empty"),
        (["GPU-nope::0"], "unknown device IDs"),
        (["garbage"], "unknown device IDs"),
    ],
)
def test_slice_rejects(ids: list[str], msg: str) -> None:
    t = table(1, 2)
    with pytest.raises(AllocationError, match=msg):
        slice_for(t, ids)


def test_slice_rejects_duplicates_and_unhealthy() -> None:
    t = table(1, 2)
    a = t.all_ids()
    with pytest.raises(AllocationError, match="duplicate"):
        slice_for(t, [a[0], a[0]])
    t.mark_unhealthy(t.by_id[a[0]], "xid 79")
    with pytest.raises(AllocationError, match="unhealthy"):
        slice_for(t, [a[1]])


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 5),
    k=st.integers(1, 6),
    data=st.data(),
    policy=st.sampled_from(["spread", "binpack"]),
)
def test_preferred_invariants(n: int, k: int, data: st.DataObject, policy: str) -> None:
    t = table(n, k)
    ids = t.all_ids()
    available = data.draw(st.lists(st.sampled_from(ids), unique=True))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=3)) if available else []
    size = data.draw(st.integers(len(must), len(ids)))
    out = preferred(t, available, must, size, policy)
    assert out[: len(must)] == must
    assert len(out) == len(set(out)) == min(size, len(available))
    assert set(out) <= set(available)
    # distinct physical GPUs first: the result spans as many GPUs as it can
    free_gpus = {t.by_id[d] for d in available}
    used = {t.by_id[d] for d in out}
    if not must:
        assert len(used) == min(len(out), len(free_gpus))
    else:
        assert used >= {t.by_id[d] for d in must}
        assert len(used) >= min(len(out), len(free_gpus | {t.by_id[d] for d in must})) - len(must)
