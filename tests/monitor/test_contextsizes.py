"""monitor/contextsizes.py: when the node file of measured context sizes is (re)written."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from monitor.contextsizes import ContextSizes
from vgpu import contextsizes

MIB = 1 << 20
G0, G1, M0 = "GPU-0", "GPU-1", "MIG-0"


def test_written_on_change_kept_without_processes_dropped_when_gone(tmp_path: Path) -> None:
    path = str(tmp_path / "context-sizes.json")
    errors: Counter[str] = Counter()
    cs = ContextSizes(path)
    cs.update({}, [G0, G1], errors)
    assert not os.path.exists(path)  # nothing measured: no file
    cs.update({G0: 300 * MIB, M0: 150 * MIB}, [G0, G1, M0], errors)
    assert contextsizes.read(path) == {G0: 300 * MIB, M0: 150 * MIB}
    before = os.stat(path).st_ino
    cs.update({G0: 300 * MIB + MIB // 2}, [G0, G1, M0], errors)  # below the change threshold
    cs.update({}, [G0, G1, M0], errors)  # no process: the last value stays
    assert os.stat(path).st_ino == before
    cs.update({G0: 310 * MIB}, [G0, G1, M0], errors)
    assert contextsizes.read(path) == {G0: 310 * MIB, M0: 150 * MIB}
    cs.update({}, [G0, G1], errors)  # the MIG device is gone (dynamic MIG)
    assert contextsizes.read(path) == {G0: 310 * MIB}
    assert ContextSizes(path).known == {G0: 310 * MIB}  # a restarted monitor starts from the file
    assert errors["context_sizes"] == 0


def test_write_failure_is_counted_and_retried(tmp_path: Path) -> None:
    d = tmp_path / "state"
    path = str(d / "context-sizes.json")
    errors: Counter[str] = Counter()
    cs = ContextSizes(path)
    cs.update({G0: 300 * MIB}, [G0], errors)  # its directory does not exist yet
    assert errors["context_sizes"] == 1 and not os.path.exists(path)
    d.mkdir()
    cs.update({}, [G0], errors)  # nothing new measured, but the value is still owed
    assert contextsizes.read(path) == {G0: 300 * MIB} and errors["context_sizes"] == 1


def test_bad_file_at_start_is_replaced(tmp_path: Path) -> None:
    p = tmp_path / "context-sizes.json"
    p.write_text("garbage")
    cs = ContextSizes(str(p))
    assert cs.known == {}
    cs.update({G1: 200 * MIB}, [G1], Counter())
    assert contextsizes.read(str(p)) == {G1: 200 * MIB}
