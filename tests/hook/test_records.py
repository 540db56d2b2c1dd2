"""The hook's msgspec-free record reader and state writers agree with the shared schemas in vgpu/."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_hook import poststop, records
from vgpu import limits as vlimits
from vgpu import paths as vpaths
from vgpu import schemas

pytestmark = pytest.mark.timeout(120)

TOKEN = "0123456789abcdef0123456789abcdef"

ints = st.one_of(st.integers(-5, 20_000), st.integers(-(2**70), 2**70), st.just(2**64 - 1), st.just(2**64))
gpu = st.dictionaries(
    st.sampled_from(["uuid", "memory_limit", "core_percent", "vgpu_ids", "extra"]),
    st.one_of(
        st.sampled_from(["GPU-1234-abcd", "", "GPU/../x", "g\n", "x" * 96]),
        ints,
        st.lists(st.text(max_size=4), max_size=2),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False),
    ),
)
record = st.dictionaries(
    st.sampled_from(["version", "token", "created", "resource_name", "oversubscribe", "gpus", "bogus"]),
    st.one_of(
        st.sampled_from([TOKEN, TOKEN.upper(), TOKEN[:-1], TOKEN + "\n"]),
        ints,
        st.floats(allow_nan=False),
        st.booleans(),
        st.text(max_size=6),
        st.lists(gpu, max_size=3),
        st.none(),
    ),
)
well_formed = st.builds(
    lambda gs, over, created: {
        "version": 1,
        "token": TOKEN,
        "created": created,
        "resource_name": "nvidia.com/gpu",
        "oversubscribe": over,
        "gpus": [
            {"uuid": f"GPU-{i:04d}-{u}", "memory_limit": m, "core_percent": c, "vgpu_ids": [f"v{i}"]}
            for i, (u, m, c) in enumerate(gs)
        ],
    },
    st.lists(st.tuples(st.uuids().map(str), st.integers(0, 2**64 - 1), st.integers(0, 10_000)), max_size=4),
    st.booleans(),
    st.floats(0, 2e9, allow_nan=False),
)


def _same(lite: records.Record, ref: schemas.AllocationRecord) -> None:
    assert (lite.version, lite.token, lite.created, lite.resource_name, lite.oversubscribe) == (
        ref.version, ref.token, ref.created, ref.resource_name, ref.oversubscribe,
    )  # fmt: skip
    assert [(g.uuid, g.memory_limit, g.core_percent, g.vgpu_ids) for g in lite.gpus] == [
        (g.uuid, g.memory_limit, g.core_percent, g.vgpu_ids) for g in ref.gpus
    ]


@settings(max_examples=1500, deadline=None, database=None)
@given(obj=st.one_of(record, well_formed), raw=st.booleans())
def test_lite_reader_is_never_more_permissive_than_the_schema(obj: dict, raw: bool) -> None:
    data = json.dumps(obj).encode()
    try:
        lite = records.parse_record(data)
    except records.RecordError:
        lite = None
    try:
        ref = msgspec.json.decode(data, type=schemas.AllocationRecord)
    except (msgspec.ValidationError, msgspec.DecodeError):
        ref = None
    if lite is not None:
        assert ref is not None, f"accepted what the schema rejects: {data!r}"
        _same(lite, ref)


@settings(max_examples=500, deadline=None, database=None)
@given(obj=well_formed)
def test_well_formed_records_are_accepted_identically(obj: dict) -> None:
    data = json.dumps(obj).encode()
    ref = msgspec.json.decode(data, type=schemas.AllocationRecord)
    lite = records.parse_record(data)
    _same(lite, ref)
    # limits text and region inputs equal the shared implementation's
    assert records.render_limits(records.limits_of(lite)) == vlimits.render(vlimits.from_record(ref))


@settings(max_examples=300, deadline=None, database=None)
@given(
    cid=st.text(min_size=1, max_size=20),
    pod=st.fixed_dictionaries(
        {k: st.text(max_size=10) for k in ("pod_namespace", "pod_name", "pod_uid", "container_name")}
    ),
    obj=well_formed,
)
def test_metadata_decodes_as_container_metadata(cid: str, pod: dict[str, str], obj: dict) -> None:
    rec = records.parse_record(json.dumps(obj).encode())
    data = records.metadata_json(
        container_id=cid,
        init_pid=42,
        init_start_time=7,
        created=1.5,
        token=TOKEN,
        pod=pod,
        cgroup_path="/x",
        gpus=rec.gpus,
    )
    meta = msgspec.json.decode(data, type=schemas.ContainerMetadata)
    assert (meta.container_id, meta.init_pid, meta.init_start_time, meta.created, meta.token) == (
        cid,
        42,
        7,
        1.5,
        TOKEN,
    )
    assert (meta.pod_namespace, meta.pod_name, meta.pod_uid, meta.container_name) == (
        pod["pod_namespace"], pod["pod_name"], pod["pod_uid"], pod["container_name"],
    )  # fmt: skip
    assert [g.uuid for g in meta.gpus] == [g.uuid for g in rec.gpus]


@settings(max_examples=1000, deadline=None, database=None)
@given(cid=st.one_of(st.text(max_size=140), st.sampled_from([".", "..", "a/b", "x" * 128, "x" * 129, "ok-1.2_3+4"])))
def test_container_id_rule_matches_vgpu_paths(cid: str) -> None:
    assert poststop.valid_container_id(cid) == (vpaths.valid_container_id(cid) and "\n" not in cid)
