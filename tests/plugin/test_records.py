"""Allocation records: atomic write, schema, and the stale-record collector."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from device_plugin import records
from device_plugin.allocator import slice_for
from device_plugin.devices import DeviceTable, Slicing
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths, valid_token
from vgpu.schemas import read_record


def _table() -> DeviceTable:
    g = [GPUInfo(i, f"GPU-{i:08x}-1111-2222-3333-444444444444", "Fake", 8 << 30, None, None) for i in range(2)]
    return DeviceTable(g, Slicing(2, 1.5, 1.0))


def test_write_record(tmp_path: Path) -> None:
    p = Paths(str(tmp_path / "state"))
    records.ensure_dir(p)
    t = _table()
    rec = records.write_record(p, "nvidia.com/gpu", True, slice_for(t, t.all_ids()[:1]))
    assert valid_token(rec.token)
    path = p.allocation_record(rec.token)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(p.allocations_dir).st_mode) == 0o700
    back = read_record(path)
    assert back == rec
    assert back.oversubscribe and back.gpus[0].memory_limit == 6 << 30  # floor(1.5 * 8 GiB / 2)
    assert [f for f in os.listdir(p.allocations_dir) if f.startswith(".tmp")] == []


def test_list_skips_garbage(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    records.ensure_dir(p)
    t = _table()
    rec = records.write_record(p, "nvidia.com/gpu", False, slice_for(t, t.all_ids()[:1]))
    Path(p.allocations_dir, "0" * 32 + ".json").write_text("{not json")
    Path(p.allocations_dir, "notatoken.json").write_text("{}")
    assert [r.token for r in records.list_records(p)] == [rec.token]


def test_stale_tokens_newest_owner_wins(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    records.ensure_dir(p)
    t = _table()
    a = t.all_ids()
    old = records.write_record(p, "nvidia.com/gpu", False, slice_for(t, [a[0]]))
    new = records.write_record(p, "nvidia.com/gpu", False, slice_for(t, [a[0]]))
    other = records.write_record(p, "nvidia.com/gpu", False, slice_for(t, [a[1], a[2]]))
    recs = records.list_records(p)
    assert records.stale_tokens(recs, {a[0], a[2]}) == {old.token}
    assert records.stale_tokens(recs, set()) == {old.token, new.token, other.token}


def test_collector_waits_for_grace(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    records.ensure_dir(p)
    t = _table()
    a = t.all_ids()
    keep = records.write_record(p, "nvidia.com/gpu", False, slice_for(t, [a[0]]))
    gone = records.write_record(p, "nvidia.com/gpu", False, slice_for(t, [a[1]]))
    c = records.RecordCollector(p, "nvidia.com/gpu", grace_s=10)
    now = gone.created
    assert c.collect({a[0]}, now=now) == []  # stale, but just seen
    assert c.collect({a[0]}, now=now + 5) == []
    assert c.collect({a[0], a[1]}, now=now + 8) == []  # assigned again: the clock restarts
    assert c.collect({a[0]}, now=now + 12) == []
    assert c.collect({a[0]}, now=now + 22.5) == [gone.token]
    assert os.path.exists(p.allocation_record(keep.token))
    assert not os.path.exists(p.allocation_record(gone.token))
