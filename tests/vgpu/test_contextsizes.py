"""The node file of measured CUDA context sizes (vgpu/contextsizes.py): round trip, and every bad
or missing file read as "unknown" with a log line, never an exception."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from vgpu import contextsizes
from vgpu.paths import Paths

U0 = "GPU-11111111-2222-3333-4444-555555555555"
U1 = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def test_round_trip(tmp_path: Path) -> None:
    path = Paths(str(tmp_path)).context_sizes_path
    assert path == str(tmp_path / "context-sizes.json")
    contextsizes.write(path, {U0: 300 << 20, U1: 1})
    assert contextsizes.read(path) == {U0: 300 << 20, U1: 1}
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert json.loads(Path(path).read_text()) == {"version": 1, "gpus": {U0: 300 << 20, U1: 1}}
    contextsizes.write(path, {})
    assert contextsizes.read(path) == {}


def test_missing_file_is_unknown_and_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert contextsizes.read(str(tmp_path / "none.json")) == {}
    assert not caplog.records


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not JSON"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "exactly"),
        (b'{"version": 1}', "exactly"),
        (b'{"version": 1, "gpus": {}, "x": 1}', "exactly"),
        (b'{"version": 2, "gpus": {}}', "version"),
        (b'{"version": true, "gpus": {}}', "version"),
        (b'{"version": 1, "gpus": []}', "gpus"),
        (b'{"version": 1, "gpus": {"GPU-1": "300"}}', "bad size"),
        (b'{"version": 1, "gpus": {"GPU-1": true}}', "bad size"),
        (b'{"version": 1, "gpus": {"GPU-1": 0}}', "bad size"),
        (b'{"version": 1, "gpus": {"GPU-1": -5}}', "bad size"),
        (b'{"version": 1, "gpus": {"GPU-1": 1.5}}', "bad size"),
        (b'{"version": 1, "gpus": {"GPU-1": 1099511627777}}', "bad size"),
        (b'{"version": 1, "gpus": {"": 1}}', "bad GPU UUID"),
        (b'{"version": 1, "gpus": {"../x": 1}}', "bad GPU UUID"),
        (b'{"version": 1, "gpus": {"GPU-\\n": 1}}', "bad GPU UUID"),
        (b'{"version": 1, "gpus": {"' + b"G" * 97 + b'": 1}}', "bad GPU UUID"),
        (b'{"version": 1, "gpus": {' + b",".join(b'"G%d": 1' % i for i in range(257)) + b"}}", "at most"),
        (b" " * (64 * 1024 + 1), "larger than"),
    ],
)
def test_bad_file_is_unknown_with_a_clear_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    path = tmp_path / "context-sizes.json"
    path.write_bytes(content)
    with pytest.raises(contextsizes.ContextSizesError, match=reason):
        contextsizes.decode(content)
    with caplog.at_level(logging.WARNING):
        assert contextsizes.read(str(path)) == {}
    assert any("bad context sizes" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_unreadable_paths_are_unknown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "dir.json").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link.json")
    (tmp_path / "elsewhere").write_bytes(b'{"version": 1, "gpus": {"GPU-1": 5}}')
    with caplog.at_level(logging.WARNING):
        assert contextsizes.read(str(tmp_path / "dir.json")) == {}
        assert contextsizes.read(str(tmp_path / "link.json")) == {}  # never through a link
    assert len([r for r in caplog.records if "treating them as unknown" in r.getMessage()]) == 2


def test_writer_refuses_what_readers_refuse(tmp_path: Path) -> None:
    path = tmp_path / "context-sizes.json"
    for bad in ({U0: 0}, {"a/b": 5}, {U0: True}):
        with pytest.raises(contextsizes.ContextSizesError):
            contextsizes.write(str(path), bad)  # type: ignore[arg-type]
    assert not path.exists()
