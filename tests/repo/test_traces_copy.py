"""tests/data/real-traces is a byte-identical copy of the shared recordings (when they are here)."""

from __future__ import annotations

import pytest

from tests.support import traces


def _files(base):  # type: ignore[no-untyped-def]
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())


def test_copy_matches_shared_recordings() -> None:
    if not traces.SHARED.is_dir():
        pytest.skip("no ../shared/real-traces beside this checkout (clean clone): the copy is the reference")
    assert _files(traces.COPY) == _files(traces.SHARED)
    for rel in _files(traces.SHARED):
        assert (traces.COPY / rel).read_bytes() == (traces.SHARED / rel).read_bytes(), rel


def test_copy_has_readme() -> None:
    assert "Real traces" in traces.text("README.md")
