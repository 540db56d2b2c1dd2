"""Allocation records: atomic write, schema, the kubelet checkpoint reader and the stale-record collector."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from device_plugin import checkpoint
from device_plugin.allocator import slice_for
from device_plugin.api import deviceplugin_pb2 as pb
from nodecore import records
from nodecore.devices import DeviceTable, Slicing
from sim import kubelet_checkpoint as kc
from tests.support import traces
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths, valid_token
from vgpu.schemas import TOKEN_ANNOTATION, TOKEN_ENV, read_record


def _table() -> DeviceTable:
    g = [GPUInfo(i, f"GPU-{i:08x}-1111-2222-3333-444444444444", "Fake", 8 << 30, None, None) for i in range(2)]
    return DeviceTable(g, Slicing(2, 1.5, 1.0))


def test_write_record(tmp_path: Path) -> None:
    p = Paths(str(tmp_path / "state"))
    records.ensure_dir(p)
    t = _table()
    rec = records.RecordStore(p, "nvidia.com/gpu").write(slice_for(t, t.all_ids()[:1]).gpus, True)
    assert valid_token(rec.token)
    path = p.allocation_record(rec.token)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(p.allocations_dir).st_mode) == 0o700
    back = read_record(path)
    assert back == rec
    assert back.oversubscribe and back.gpus[0].memory_limit == 6 << 30  # floor(1.5 * 8 GiB / 2)
    assert back.gpus[0].device_limit == 4 << 30  # its physical share, M/K
    assert [f for f in os.listdir(p.allocations_dir) if f.startswith(".tmp")] == []


def test_list_skips_garbage(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    records.ensure_dir(p)
    t = _table()
    rec = records.RecordStore(p, "nvidia.com/gpu").write(slice_for(t, t.all_ids()[:1]).gpus, False)
    Path(p.allocations_dir, "0" * 32 + ".json").write_text("{not json")
    Path(p.allocations_dir, "notatoken.json").write_text("{}")
    assert [r.token for r in records.list_records(p)] == [rec.token]


def _answer(token: str | None = None, annotation: str | None = None) -> bytes:
    r = pb.ContainerAllocateResponse()
    r.envs["NVIDIA_VISIBLE_DEVICES"] = "GPU-x"
    if token:
        r.envs[TOKEN_ENV] = token
    if annotation:
        r.annotations[TOKEN_ANNOTATION] = annotation
    return r.SerializeToString()


def _checkpoint(path: Path, entries: list[kc.Entry] | None) -> str:
    path.write_bytes(kc.marshal(entries, {"nvidia.com/gpu": ["a"]}))
    return str(path)


def test_replayable_tokens_are_the_kept_answers_of_our_resource(tmp_path: Path) -> None:
    t1, t2, t3 = (records.new_token() for _ in range(3))
    path = _checkpoint(
        tmp_path / "ck",
        [
            kc.Entry("uid-1", "init", "nvidia.com/gpu", {-1: ["a"]}, _answer(t1)),
            kc.Entry("uid-1", "app", "nvidia.com/gpu", {-1: ["a"]}, _answer(annotation=t2)),
            kc.Entry("uid-2", "c", "example.com/other", {0: ["b"]}, _answer(t3)),
            kc.Entry("uid-3", "c", "nvidia.com/gpu", {-1: ["c"]}, None),
        ],
    )
    assert checkpoint.replayable_tokens(path, "nvidia.com/gpu") == {t1, t2}
    assert checkpoint.replayable_tokens(path, "example.com/other") == {t3}
    assert checkpoint.replayable_tokens(_checkpoint(tmp_path / "empty", None), "nvidia.com/gpu") == set()


def test_each_kept_answer_names_its_pod_and_container(tmp_path: Path) -> None:
    """Who holds each record: the kept answer's PodUID and ContainerName (usage names its slices)."""
    t1, t2, t3 = (records.new_token() for _ in range(3))
    path = _checkpoint(
        tmp_path / "ck",
        [
            kc.Entry("uid-1", "init", "nvidia.com/gpu", {-1: ["a"]}, _answer(t1)),
            kc.Entry("uid-1", "app", "nvidia.com/gpu", {-1: ["a"]}, _answer(annotation=t2)),
            kc.Entry("uid-2", "c", "example.com/other", {0: ["b"]}, _answer(t3)),
            kc.Entry("uid-3", "c", "nvidia.com/gpu", {-1: ["c"]}, None),
        ],
    )
    assert checkpoint.holders(path, "nvidia.com/gpu") == {t1: ("uid-1", "init"), t2: ("uid-1", "app")}
    assert checkpoint.holders(path, "example.com/other") == {t3: ("uid-2", "c")}
    bad = tmp_path / "bad"
    bad.write_bytes(b'{"Data":{"PodDeviceEntries":[{"ResourceName":"nvidia.com/gpu","AllocResp":"","PodUID":7}]}}')
    with pytest.raises(checkpoint.CheckpointUnusable, match="PodUID or ContainerName"):
        checkpoint.holders(str(bad), "nvidia.com/gpu")


@pytest.mark.parametrize("name", ["before-restart", "after-restart", "before-restart2"])
def test_the_recorded_kubelet_checkpoints_name_pods_and_containers(name: str) -> None:
    """The real kubelet's files: every entry of the resource with its pod UID and container, in the
    order written (the recording plugin's answers carry no token of ours)."""
    path = traces.path(f"deviceplugin/kubelet_internal_checkpoint.{name}.json")
    doc = json.loads(path.read_bytes())
    want = [(e["PodUID"], e["ContainerName"]) for e in doc["Data"]["PodDeviceEntries"]]
    got = checkpoint.kept_answers(str(path), "nvidia.com/gpu")
    assert [(k.pod_uid, k.container) for k in got] == want and want
    assert [c for _, c in want].count("init") == 1  # an init container's entry is kept beside its app's
    assert all(k.tokens == frozenset() for k in got)
    assert checkpoint.holders(str(path), "nvidia.com/gpu") == {}


@pytest.mark.parametrize("name", ["before-restart", "after-restart", "before-restart2"])
def test_reads_the_recorded_kubelet_checkpoints(name: str) -> None:
    """The files the real kubelet wrote (its recording plugin's answers carry no token of ours)."""
    path = traces.path(f"deviceplugin/kubelet_internal_checkpoint.{name}.json")
    assert checkpoint.replayable_tokens(str(path), "nvidia.com/gpu") == set()


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "does not exist"),
        (b"{not json", "not JSON"),
        (b"[]", "no Data object"),
        (b'{"Data":{"PodDeviceEntries":{}}}', "not a list"),
        (b'{"Data":{"PodDeviceEntries":[{"PodUID":"x"}]}}', "no ResourceName"),
        (b'{"Data":{"PodDeviceEntries":[{"ResourceName":"nvidia.com/gpu","AllocResp":"%%"}]}}', "not an Allocate"),
        (b'{"Data":{"PodDeviceEntries":[{"ResourceName":"nvidia.com/gpu","AllocResp":"/w=="}]}}', "not an Allocate"),
        (b'{"Data":{"PodDeviceEntries":[{"ResourceName":"nvidia.com/gpu","AllocResp":7}]}}', "not a string"),
    ],
)
def test_an_unusable_checkpoint_is_an_error_never_an_empty_set(
    tmp_path: Path, content: bytes | None, needle: str
) -> None:
    path = tmp_path / "ck"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(checkpoint.CheckpointUnusable, match=needle):
        checkpoint.replayable_tokens(str(path), "nvidia.com/gpu")


def test_an_oversized_checkpoint_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "MAX_BYTES", 100)
    path = _checkpoint(tmp_path / "ck", [kc.Entry("u", "c", "nvidia.com/gpu", {-1: ["a"]}, _answer("0" * 32))])
    with pytest.raises(checkpoint.CheckpointUnusable, match="larger than 100 bytes"):
        checkpoint.replayable_tokens(path, "nvidia.com/gpu")


def test_collector_waits_for_grace(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    records.ensure_dir(p)
    t = _table()
    a = t.all_ids()
    keep = records.RecordStore(p, "nvidia.com/gpu").write(slice_for(t, [a[0]]).gpus, False)
    gone = records.RecordStore(p, "nvidia.com/gpu").write(slice_for(t, [a[0]]).gpus, False)  # same vGPU: no matter
    other = records.RecordStore(p, "example.com/other").write(slice_for(t, [a[1]]).gpus, False)
    c = records.RecordCollector(p, "nvidia.com/gpu", grace_s=10)
    now = gone.created
    kept = {keep.token}
    assert c.collect(kept, now=now) == []  # stale, but just seen
    assert c.collect(kept, now=now + 5) == []
    assert c.collect(kept | {gone.token}, now=now + 8) == []  # kept again: the clock restarts
    assert c.collect(kept, now=now + 12) == []
    assert c.collect(kept, now=now + 22.5) == [gone.token]
    assert os.path.exists(p.allocation_record(keep.token))
    assert not os.path.exists(p.allocation_record(gone.token))
    assert os.path.exists(p.allocation_record(other.token))  # another resource's: not ours to judge
