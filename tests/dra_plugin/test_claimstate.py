"""Per-claim files, allocation records and claim parsing, without sockets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_plugin import claims
from dra_plugin.claimstate import ClaimState, new_metadata
from dra_plugin.driver import merge
from nodecore.devices import Slicing
from nodecore.records import RecordStore
from runtime_hook import prestart as hook_prestart
from tests.dra_plugin.conftest import GIB, gpus
from vgpu import limits as vlimits
from vgpu import region as vregion
from vgpu.paths import Paths
from vgpu.schemas import AllocatedGPU

UID = "3f2504e0-4f89-41d3-9a0c-0305e82c3301"
_uuid = st.from_regex(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}", fullmatch=True)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(_uuid, st.integers(0, (1 << 64) - 1), st.integers(0, 10_000), st.booleans()),
        min_size=0,
        max_size=16,
        unique_by=lambda t: t[0],
    )
)
def test_sparse_region_is_the_hooks_region_byte_for_byte(tmp_path_factory: pytest.TempPathFactory, devs: list) -> None:
    """A claim's region (sparse, in place) holds the bytes of the hook's (written out, by rename)."""
    lim = [vlimits.DeviceLimit(uuid=u, memory_limit=m, core_percent=c, oversubscribe=o) for u, m, c, o in devs]
    d = tmp_path_factory.mktemp("r")
    vregion.initialise(str(d / "ref"), lim)
    vregion.initialise(str(d / "ours"), lim, sparse=True, atomic=False)
    ref = bytearray((d / "ref").read_bytes())
    ours = bytearray((d / "ours").read_bytes())
    assert oct(os.stat(d / "ours").st_mode & 0o777) == "0o666"
    created = vregion.CREATED_OFFSET
    ours[created : created + 8] = ref[created : created + 8]  # the creation time differs
    assert ours == ref
    assert len(ours) == vregion.REGION_SIZE
    assert os.stat(d / "ours").st_blocks * 512 < vregion.REGION_SIZE  # the slots are a hole


@pytest.mark.parametrize("durable", [False, True])
def test_records_are_the_device_plugins(tmp_path: Path, durable: bool) -> None:
    rc = RecordStore(Paths(str(tmp_path)), "gpu.vgpu.k8s.io", durable=durable)
    rc.ensure_dir()
    gpu = AllocatedGPU(uuid=gpus(1)[0].uuid, memory_limit=6 * GIB, core_percent=30, vgpu_ids=["x"])
    rec = rc.write([gpu], oversubscribe=False)
    path = tmp_path / "allocations" / f"{rec.token}.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    hook = hook_prestart.load_record(Paths(str(tmp_path)), rec.token)  # what the OCI hook would read
    assert (hook.token, hook.resource_name, hook.gpus[0].memory_limit) == (rec.token, "gpu.vgpu.k8s.io", 6 * GIB)
    assert rc.has(rec.token) and [r.token for r in rc.list()] == [rec.token]
    # Records of another front end are not ours.
    RecordStore(Paths(str(tmp_path)), "nvidia.com/gpu").write([gpu], False)
    assert [r.token for r in rc.list()] == [rec.token]
    # A record a crash left empty is not there: start-up writes it again.
    path.write_bytes(b"")
    assert not rc.has(rec.token)
    rc.restore(rec)
    assert rc.has(rec.token)
    rc.remove(rec.token)
    rc.remove(rec.token)
    assert not rc.has(rec.token)
    assert not [p for p in os.listdir(tmp_path / "allocations") if p.startswith(".")]  # no temporary left


def test_shares_of_one_gpu_merge_and_cores_are_capped() -> None:
    s = [
        claims.Share("a", "node-1", "gpu-0", "s1", "GPU-a", 2 * GIB, 70),
        claims.Share("b", "node-1", "gpu-1", "s2", "GPU-b", GIB, 10),
        claims.Share("c", "node-1", "gpu-0", "s3", "GPU-a", 3 * GIB, 50),
    ]
    out = merge(UID, s, cores_cap=100)
    assert [(g.uuid, g.memory_limit, g.core_percent, len(g.vgpu_ids)) for g in out] == [
        ("GPU-a", 5 * GIB, 100, 2),
        ("GPU-b", GIB, 10, 1),
    ]
    assert [g.device_limit for g in out] == [5 * GIB, GIB]  # no scaling: the whole slice
    # memory scaling 2: each share's physical share is half of it, summed per GPU
    out = merge(UID, s, cores_cap=100, slicing=Slicing(2, 2.0))
    assert [(g.memory_limit, g.device_limit) for g in out] == [(5 * GIB, GIB + 3 * GIB // 2), (GIB, GIB // 2)]
    assert all(v.rpartition("::")[0] == g.uuid for g in out for v in g.vgpu_ids)  # device plugin ID rule


def test_claim_dir_keeps_a_live_region_and_refuses_links(tmp_path: Path) -> None:
    st_ = ClaimState(Paths(str(tmp_path)))
    st_.ensure_dir()
    rc = RecordStore(Paths(str(tmp_path)), "gpu.vgpu.k8s.io", durable=False)
    rc.ensure_dir()
    rec = rc.write([AllocatedGPU(uuid="GPU-a", memory_limit=GIB, core_percent=10)], False)
    meta = new_metadata(claim_uid=UID, namespace="ns", name="c", rec=rec, driver="d", devices=[], reserved_for=[])
    st_.create(rec, meta)
    region = Path(st_.files(UID)["region"])
    region.write_bytes(region.read_bytes()[:-1] + b"\x01")  # a container accounted something
    st_.create(rec, meta)
    assert region.read_bytes()[-1:] == b"\x01"  # kept
    assert st_.complete(UID)
    os.unlink(st_.files(UID)["limits"])
    os.symlink("/etc/passwd", st_.files(UID)["limits"])
    assert not st_.complete(UID)
    with pytest.raises(ValueError):
        st_.path("../x")


def _claim(results: list[dict], uid: str = UID) -> claims.ResourceClaim:
    obj = {
        "metadata": {"name": "c", "namespace": "ns", "uid": uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }
    return claims.decode(json.dumps(obj).encode())


CAPS = {"gpu-0": claims.DeviceCapacity(uuid="GPU-a", memory=16 * GIB, cores=100)}


def _shares(results: list[dict]) -> list[claims.Share]:
    return claims.shares(
        _claim(results), namespace="ns", name="c", uid=UID, driver="gpu.vgpu.k8s.io", pool="node-1", devices=CAPS
    )


def test_exclusive_allocation_is_the_whole_gpu() -> None:
    # DRAConsumableCapacity off: no consumedCapacity, the device is allocated whole.
    [s] = _shares([{"request": "r", "driver": "gpu.vgpu.k8s.io", "pool": "node-1", "device": "gpu-0"}])
    assert (s.memory, s.cores, s.share_id) == (16 * GIB, 100, None)


@pytest.mark.parametrize(
    ("consumed", "error"),
    [
        ({"memory": "1Gi"}, "no 'cores'"),
        ({"memory": "0", "cores": "10"}, "memory is 0"),
        ({"memory": "-1Gi", "cores": "10"}, "outside"),
        ({"memory": "1Gi", "cores": "101"}, "outside"),
        ({"memory": "1Qi", "cores": "1"}, "consumedCapacity memory: quantities must match"),
    ],
)
def test_consumed_capacity_checks(consumed: dict, error: str) -> None:
    r = {"request": "r", "driver": "gpu.vgpu.k8s.io", "pool": "node-1", "device": "gpu-0", "consumedCapacity": consumed}
    with pytest.raises(claims.ClaimError, match=error):
        _shares([r])


def test_other_drivers_results_are_not_ours() -> None:
    mine = {"request": "a", "driver": "gpu.vgpu.k8s.io", "pool": "node-1", "device": "gpu-0"}
    theirs = {"request": "b", "driver": "net.example.com", "pool": "x", "device": "nic-0"}
    assert [s.request for s in _shares([theirs, mine])] == ["a"]
    assert claims.request_names(_shares([{**mine, "request": "a/big"}])) == ["a"]


def test_malformed_claim_json() -> None:
    with pytest.raises(claims.ClaimError, match="malformed ResourceClaim"):
        claims.decode(b'{"status": {"allocation": {"devices": {"results": "x"}}}}')


def test_the_device_plugins_record_collector_leaves_dra_records_alone(tmp_path: Path) -> None:
    from nodecore.records import RecordCollector

    paths = Paths(str(tmp_path))
    dra = RecordStore(paths, "gpu.vgpu.k8s.io")
    dra.ensure_dir()
    gpu = AllocatedGPU(uuid="GPU-a", memory_limit=GIB, core_percent=10, vgpu_ids=[f"GPU-a::dra:{UID}:s"])
    mine = dra.write([gpu], False)
    theirs = RecordStore(paths, "nvidia.com/gpu").write([gpu], False)
    # No vGPU ID is assigned to any container (PodResources), the grace period is over.
    deleted = RecordCollector(paths, "nvidia.com/gpu", grace_s=0).collect(set(), now=mine.created + 3600)
    assert deleted == [theirs.token] and dra.has(mine.token)
