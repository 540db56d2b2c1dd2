"""monitor/contextsizes.py: when the node file of measured context sizes is (re)written."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from monitor.contextsizes import ContextSizes
from monitor.extrabytes import ExtraBytes
from monitor.procs import ProcKey
from vgpu import contextsizes
from vgpu import region as vregion

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


def _snap(uuid: str, slots: list[tuple[int, int]]) -> vregion.RegionSnapshot:
    """A region of one device with a slot per (host pid, device bytes charged)."""
    dev = vregion.DeviceUsage(
        uuid=uuid, memory_limit=8 << 30, core_percent=50, oversubscribe=False, used_device=0, used_host=0
    )
    return vregion.RegionSnapshot(
        [dev],
        [vregion.SlotInfo(i, pid, pid, 0, (charged,), (0,), (0,)) for i, (pid, charged) in enumerate(slots)],
    )


def test_the_measured_context_is_the_smallest_extra_seen_twice_in_a_row() -> None:
    """ExtraBytes.measured: per GPU the smallest extra bytes of its processes, counting only a
    value a process showed in two updates in a row (one pass's figure is off by an allocation made
    between NVML's read and the region's)."""
    ext = ExtraBytes()
    a, b, idle = ProcKey(101, 1), ProcKey(102, 1), ProcKey(103, 1)
    ext.nspids = {a: [], b: [], idle: []}

    def measure(charged_a: int, seen_a: int, charged_b: int, seen_b: int) -> dict[str, int]:
        ext.measured = {}
        ext.slot_writes("c", _snap(G0, [(101, charged_a), (102, charged_b), (103, 0)]),
                        {a: {G0: seen_a}, b: {G0: seen_b}, idle: {G0: 0}})  # fmt: skip
        return ext.measured

    # a: 300 MiB beyond its charge (its context); b: 700 MiB (context + modules); idle: nothing
    assert measure(512 * MIB, 812 * MIB, 0, 700 * MIB) == {}  # first sight: not yet
    assert measure(512 * MIB, 812 * MIB, 0, 700 * MIB) == {G0: 300 * MIB}
    # a's allocation of 100 MiB charged, not yet seen by NVML: 200 MiB this pass only
    assert measure(612 * MIB, 812 * MIB, 0, 700 * MIB) == {G0: 700 * MIB}
    assert measure(612 * MIB, 912 * MIB, 0, 700 * MIB) == {G0: 700 * MIB}
    assert measure(612 * MIB, 912 * MIB, 0, 700 * MIB) == {G0: 300 * MIB}
    # processes that are gone are forgotten once the table grows
    ext.last.update({(ProcKey(1000 + i, 1), G0): MIB for i in range(100)})
    ext.forget_except({b})
    assert set(ext.last) == {(b, G0)}
