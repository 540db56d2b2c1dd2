"""A fresh accounting region file for the hook, without ctypes or dataclasses.

`vgpu.region.initialise` builds the region through ctypes structures (and its
module imports dataclasses); on the hook's path those imports cost more than
the write itself.  This writes the same bytes with `struct`: the header and
one record per device, the rest (every slot) zero.  The offsets below are
those of libcuda_intercept/include/vgpu_region.h as mirrored by
vgpu.region; tests/hook/test_regionfile.py compares the offsets with the
ctypes structures and the whole file with `vgpu.region.initialise` byte for
byte (apart from `created`).

Differences, both deliberate: values outside a field's range raise
ValueError instead of being truncated as ctypes would (the record reader
already rejects them: fail closed), and there is no fsync (the per-container
state directory is rebuilt at every container start and means nothing after
a crash of the node; the rename still makes the file appear complete).
"""

from __future__ import annotations

import struct
import time

from runtime_hook import records

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from runtime_hook.records import Limit

MAGIC = 0x4E4F494745525056  # vgpu.region.MAGIC
VERSION = 1
MAX_DEVICES = 16
MAX_SLOTS = 1024
UUID_LEN = 96
DEV_OVERSUBSCRIBE = 0x1
REGION_SIZE = 584296  # sizeof(struct vgpu_region)
DEVICES_OFFSET = 104  # offsetof(struct vgpu_region, devices)
DEVICE_SIZE = 160  # sizeof(struct vgpu_region_device)

# magic, version, size, num_devices, num_slots, created (generation, slot_hwm, reserved: zero)
_HEADER = struct.Struct("=QIIIIQ")
# uuid[96], memory_limit, core_percent, flags (used_*, reserved: zero)
_DEVICE = struct.Struct("=96sQII")
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


def render(limits: Iterable[Limit], created: int) -> bytearray:
    """The region bytes for `limits` (ValueError for anything that does not fit)."""
    lim = list(limits)
    if len(lim) > MAX_DEVICES:
        raise ValueError(f"too many devices ({len(lim)} > {MAX_DEVICES})")
    buf = bytearray(REGION_SIZE)
    _HEADER.pack_into(buf, 0, MAGIC, VERSION, REGION_SIZE, len(lim), MAX_SLOTS, created & _U64)
    for i, d in enumerate(lim):
        u = d.uuid.encode()
        if len(u) >= UUID_LEN:
            raise ValueError(f"uuid too long: {d.uuid[:40]!r}")
        if not (0 <= d.memory_limit <= _U64 and 0 <= d.core_percent <= _U32):
            raise ValueError(f"device {d.uuid[:40]!r}: limit out of range")
        flags = DEV_OVERSUBSCRIBE if d.oversubscribe else 0
        # struct's "96s" pads with NULs, as assigning a shorter bytes to a ctypes c_char array does
        _DEVICE.pack_into(buf, DEVICES_OFFSET + i * DEVICE_SIZE, u, d.memory_limit, d.core_percent, flags)
    return buf


def initialise(path: str, limits: Iterable[Limit], mode: int = 0o666) -> None:
    """Create the region file for `limits` as vgpu.region.initialise does (temp file + rename)."""
    records.write_file(path, render(limits, int(time.time())), mode)
