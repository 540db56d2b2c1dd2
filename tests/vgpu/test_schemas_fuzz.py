"""vgpu.schemas, the one reader and writer of the contract documents, under arbitrary input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu import schemas

pytestmark = pytest.mark.timeout(120)

TOKEN = "0123456789abcdef0123456789abcdef"
_UUID_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")

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


def _valid(rec: schemas.AllocationRecord) -> None:
    """What a reader of the record relies on (the hook turns it into limits and paths)."""
    assert len(rec.token) == 32 and set(rec.token) <= set("0123456789abcdef")
    assert type(rec.created) is float and type(rec.oversubscribe) is bool
    for g in rec.gpus:
        assert 1 <= len(g.uuid) <= 95 and set(g.uuid) <= _UUID_CHARS
        assert type(g.memory_limit) is int and 0 <= g.memory_limit < 2**64
        assert type(g.core_percent) is int and 0 <= g.core_percent <= 10_000
        assert all(type(v) is str for v in g.vgpu_ids)


@settings(max_examples=1500, deadline=None, database=None)
@given(obj=st.one_of(record, well_formed))
def test_any_document_is_refused_with_schema_error_or_read_valid(obj: dict) -> None:
    data = json.dumps(obj).encode()
    try:
        rec = schemas.decode(data, schemas.AllocationRecord)
    except schemas.SchemaError as e:
        assert str(e).startswith(("Expected", "Object", "invalid JSON: non-standard JSON constant")), e
        return
    _valid(rec)
    assert schemas.decode(rec.encode(), schemas.AllocationRecord) == rec


@settings(max_examples=500, deadline=None, database=None)
@given(obj=well_formed)
def test_well_formed_records_are_read_as_written(obj: dict) -> None:
    rec = schemas.decode(json.dumps(obj).encode(), schemas.AllocationRecord)
    assert rec.to_builtins() == obj
    assert json.loads(rec.encode()) == obj  # what we write is plain JSON any reader takes


@settings(max_examples=300, deadline=None, database=None)
@given(
    cid=st.text(min_size=1, max_size=20),
    pod=st.fixed_dictionaries(
        {k: st.text(max_size=10) for k in ("pod_namespace", "pod_name", "pod_uid", "container_name")}
    ),
    obj=well_formed,
)
def test_container_metadata_round_trips_any_text(cid: str, pod: dict[str, str], obj: dict) -> None:
    rec = schemas.decode(json.dumps(obj).encode(), schemas.AllocationRecord)
    meta = schemas.ContainerMetadata(
        container_id=cid,
        init_pid=42,
        init_start_time=7,
        created=1.5,
        token=TOKEN,
        cgroup_path="/x",
        gpus=rec.gpus,
        **pod,
    )
    data = meta.encode()
    assert data.isascii()
    back = schemas.decode(data, schemas.ContainerMetadata)
    assert back == meta
    assert json.loads(data)["pod_name"] == pod["pod_name"]


def test_errors_name_the_field() -> None:
    bad = {"token": TOKEN, "created": 1.0, "gpus": [{"uuid": "GPU-1", "memory_limit": -1, "core_percent": 5}]}
    with pytest.raises(schemas.SchemaError, match=r"Expected `int` >= 0 at `\$\.gpus\[0\]\.memory_limit`"):
        schemas.decode(json.dumps(bad).encode(), schemas.AllocationRecord)
    with pytest.raises(schemas.SchemaError, match="unknown field `x`"):
        schemas.decode(json.dumps({**bad, "x": 1}).encode(), schemas.AllocationRecord)
    with pytest.raises(schemas.SchemaError, match="missing required field `gpus`"):
        schemas.decode(json.dumps({"token": TOKEN, "created": 1.0}).encode(), schemas.AllocationRecord)
    with pytest.raises(schemas.SchemaError, match="Expected `int`"):
        schemas.decode(json.dumps({**bad, "version": True}).encode(), schemas.AllocationRecord)
    with pytest.raises(schemas.SchemaError, match="invalid JSON"):
        schemas.decode(b"{", schemas.AllocationRecord)
