"""Writing a region's slots as libvgpu.so does, for tests of its readers (layout: vgpu.region)."""

from __future__ import annotations

import struct
from pathlib import Path

from vgpu import region as vregion


def claim_slot(
    path: Path,
    index: int,
    pid: int,
    host_pid: int = 0,
    start: int = 1,
    *,
    device_bytes: dict[int, int] | None = None,
    state: int = vregion.SLOT_ACTIVE,
    bump_generation: bool = False,
) -> None:
    """An active slot for `pid` (its host pid and start time), with bytes charged per device."""
    buf = bytearray(path.read_bytes())
    off = vregion.slot_offset(index)
    vregion.SLOT_HEAD.pack_into(buf, off, state, pid, host_pid, 0, start, 0, 0, 0, 0)
    for dev, n in (device_bytes or {}).items():
        d = vregion.slot_device_offset(index, dev)
        _, host, extra, reserve = vregion.SLOT_DEVICE.unpack_from(buf, d)
        vregion.SLOT_DEVICE.pack_into(buf, d, n, host, extra, reserve)
    if bump_generation:
        (gen,) = struct.unpack_from("<Q", buf, vregion.GENERATION_OFFSET)
        struct.pack_into("<Q", buf, vregion.GENERATION_OFFSET, gen + 1)
    path.write_bytes(bytes(buf))
