"""Region handling: corrupt regions are reported, never fatal; extra_bytes is written
under the region lock, and a lock held by a hostile container never blocks the monitor."""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

import pytest

from monitor.containers import Registry
from tests.monitor.helpers import make_container
from tests.support import regions
from vgpu import region as vregion
from vgpu.paths import Paths
from vgpu.region import write_extra_bytes

pytestmark = pytest.mark.timeout(60)
GPU = ("GPU-00000000-0000-0000-0000-000000000001", 1 << 30, 50)


def _state(tmp_path: Path) -> tuple[Registry, Path]:
    state = tmp_path / "state"
    d = make_container(state, "c1", os.getpid(), [GPU])
    return Registry(Paths(str(state))), d


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:100],  # truncated
        lambda b: b"\0" * 8 + b[8:],  # magic
        lambda b: b[:8] + struct.pack("<I", 99) + b[12:],  # version
        lambda b: b[:16] + struct.pack("<I", 17) + b[20:],  # num_devices > 16
        lambda b: _bump(_slot_state(b, 5, 7)),  # invalid slot state
        lambda b: os.urandom(len(b)),  # noise
    ],
    ids=["short", "magic", "version", "num-devices", "slot-state", "random"],
)
def test_corrupt_region_is_reported(tmp_path: Path, damage) -> None:
    reg, d = _state(tmp_path)
    c = reg.scan()["c1"]
    assert reg.read_region(c) is not None and c.region_error == ""
    (d / "region").write_bytes(damage((d / "region").read_bytes()))
    assert reg.read_region(c) is None
    assert c.region_error and c.region_corrupt_total == 1
    # fixed again: back to normal
    vregion.initialise(str(d / "region"), [])
    assert reg.read_region(c) is not None and c.region_error == ""


def _bump(b: bytes) -> bytes:
    gen = struct.unpack_from("<Q", b, 32)[0] + 1
    return b[:32] + struct.pack("<Q", gen) + b[40:]


def test_unchanged_generation_is_still_revalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from monitor import containers

    reg, d = _state(tmp_path)
    c = reg.scan()["c1"]
    assert reg.read_region(c) is not None
    (d / "region").write_bytes(_slot_state((d / "region").read_bytes(), 1, 9))  # generation untouched
    monkeypatch.setattr(containers, "FULL_PARSE_INTERVAL_S", 0.0)
    assert reg.read_region(c) is None and "slot 1" in c.region_error


def _slot_state(b: bytes, index: int, value: int) -> bytes:
    off = vregion.SLOT_OFFSET + index * vregion.SLOT_SIZE
    return b[:off] + struct.pack("<I", value) + b[off + 4 :]


def test_region_symlink_and_fifo_are_rejected(tmp_path: Path) -> None:
    reg, d = _state(tmp_path)
    c = reg.scan()["c1"]
    (d / "region").unlink()
    (d / "region").symlink_to("/etc/shadow")
    assert reg.read_region(c) is None and c.region_error
    (d / "region").unlink()
    os.mkfifo(d / "region")
    assert reg.read_region(c) is None and "regular" in c.region_error


def test_extra_bytes_written_and_read_back(tmp_path: Path) -> None:
    _reg, d = _state(tmp_path)
    path = str(d / "region")
    regions.claim_slot(Path(path), 2, 10, 0, 1)
    assert write_extra_bytes(path, {(2, 0): 123456789})
    snap = vregion.read_region(path)
    assert snap.slots[0].index == 2 and snap.slots[0].extra_bytes == (123456789,)


def test_busy_region_lock_does_not_block(tmp_path: Path) -> None:
    _reg, d = _state(tmp_path)
    path = str(d / "region")
    fd = os.open(path, os.O_RDWR)
    try:
        lock = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, vregion.LOCK_BYTE, 1, 0)
        fcntl.fcntl(fd, vregion.F_OFD_SETLK, lock)  # "the container" holds the lock forever
        t0 = time.monotonic()
        assert write_extra_bytes(path, {(0, 0): 1}) is False
        assert time.monotonic() - t0 < 0.5
    finally:
        os.close(fd)
    assert write_extra_bytes(path, {(0, 0): 1}) is True
    with pytest.raises(ValueError):
        write_extra_bytes(path, {(vregion.MAX_SLOTS, 0): 1})
