from __future__ import annotations

import os
from pathlib import Path

import pytest

from vgpu import limits, paths, region, schemas


def _record(device_limit: int | None = 4 << 30) -> schemas.AllocationRecord:
    return schemas.AllocationRecord(
        token="0123456789abcdef0123456789abcdef",
        created=1.0,
        oversubscribe=True,
        gpus=[
            schemas.AllocatedGPU(
                uuid="GPU-aaaa-1",
                memory_limit=8 << 30,
                core_percent=50,
                vgpu_ids=["GPU-aaaa-1::0"],
                device_limit=device_limit,
            )
        ],
    )


def test_record_roundtrip_and_atomic_write(tmp_path: Path) -> None:
    rec = _record()
    p = tmp_path / "r.json"
    schemas.write_atomic(str(p), schemas.encode(rec))
    assert os.stat(p).st_mode & 0o777 == 0o600
    assert schemas.read_record(str(p)) == rec
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_limits_render_parse() -> None:
    lim = limits.from_record(_record())
    text = limits.render(lim)
    assert text.splitlines() == ["vgpu-limits 2", f"GPU-aaaa-1 {8 << 30} 50 1 {4 << 30}"]
    assert limits.parse(text) == lim and lim[0].device_limit == 4 << 30
    with pytest.raises(limits.LimitsError):
        limits.parse("vgpu-limits 3\n")
    with pytest.raises(limits.LimitsError):
        limits.parse("vgpu-limits 1\nGPU-x 12x 50 0\n")
    # version 1 (written before the physical share existed) still reads without oversubscription
    assert limits.parse("vgpu-limits 1\nGPU-x 12 50 0\n")[0].device_limit == 12
    with pytest.raises(limits.LimitsError, match="physical share"):
        limits.parse("vgpu-limits 1\nGPU-x 12 50 1\n")


def test_a_record_without_the_physical_share() -> None:
    """A record written before `device_limit` existed: read and written back unchanged; its limits
    are the slice when it does not oversubscribe, and refused (the hook fails closed) when it does."""
    old = _record(device_limit=None)
    assert "device_limit" not in old.to_builtins()["gpus"][0]
    assert schemas.decode(old.encode(), schemas.AllocationRecord) == old
    with pytest.raises(limits.LimitsError, match="device_limit"):
        limits.from_record(old)
    old.oversubscribe = False
    assert limits.from_record(old)[0].device_limit == 8 << 30
    with pytest.raises(limits.LimitsError):  # a share above the slice is never rendered
        limits.render(
            [limits.DeviceLimit(uuid="GPU-x", memory_limit=1, core_percent=1, oversubscribe=True, device_limit=2)]
        )


def test_paths_reject_traversal() -> None:
    p = paths.Paths("/var/lib/vgpu")
    for bad in ["..", "a/b", "", "x" * 200, "../etc", "abc\n"]:
        with pytest.raises(paths.InvalidName):
            p.container_dir(bad)
    with pytest.raises(paths.InvalidName):
        p.allocation_record("../../etc/passwd")
    with pytest.raises(paths.InvalidName):
        p.allocation_record("0123456789abcdef0123456789abcdef\n")
    assert p.container_dir("abc123") == "/var/lib/vgpu/containers/abc123"


def test_region_initialise_and_parse(tmp_path: Path) -> None:
    p = tmp_path / "region"
    region.initialise(str(p), limits.from_record(_record()))
    snap = region.read_region(str(p))
    assert snap.devices[0].uuid == "GPU-aaaa-1"
    assert snap.devices[0].memory_limit == 8 << 30
    assert snap.devices[0].device_limit == 4 << 30
    assert snap.devices[0].oversubscribe
    assert snap.slots == []
    assert p.stat().st_size == region.REGION_SIZE


def test_region_corrupt_is_reported(tmp_path: Path) -> None:
    p = tmp_path / "region"
    p.write_bytes(os.urandom(region.REGION_SIZE))
    with pytest.raises(region.RegionCorrupt):
        region.read_region(str(p))
    p.write_bytes(b"short")
    with pytest.raises(region.RegionCorrupt):
        region.read_region(str(p))
