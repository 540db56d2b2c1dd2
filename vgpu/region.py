"""Python view of the shared accounting region (contract 3).

The layout is defined once, in libcuda_intercept/include/vgpu_region.h; the
ctypes structures below mirror it field for field and
tests/intercept/test_region_layout.py compiles a C program against the header
and checks every offset and size.  The container can write anything into a
region: `read_region` validates every field and raises RegionCorrupt with a
reason instead of returning nonsense.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: `typing` costs the OCI hook ~3 ms to import
if TYPE_CHECKING:  # annotation only: keeps msgspec off the OCI hook's import path
    from vgpu.limits import DeviceLimit

MAGIC = 0x4E4F494745525056
VERSION = 1
MAX_DEVICES = 16
MAX_SLOTS = 1024
UUID_LEN = 96
LOCK_BYTE = 1 << 32
SLOT_LOCK_BASE = (1 << 32) + 4096
SLOT_FREE = 0
SLOT_ACTIVE = 1
DEV_OVERSUBSCRIBE = 0x1


class RegionDevice(ctypes.Structure):
    _fields_ = [
        ("uuid", ctypes.c_char * UUID_LEN),
        ("memory_limit", ctypes.c_uint64),
        ("core_percent", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("used_device", ctypes.c_uint64),
        ("used_host", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 4),
    ]


class SlotDevice(ctypes.Structure):
    _fields_ = [
        ("device_bytes", ctypes.c_uint64),
        ("host_bytes", ctypes.c_uint64),
        ("extra_bytes", ctypes.c_uint64),
        ("ctx_reserve", ctypes.c_uint64),
    ]


class Slot(ctypes.Structure):
    _fields_ = [
        ("state", ctypes.c_uint32),
        ("pid", ctypes.c_int32),
        ("host_pid", ctypes.c_int32),
        ("reserved0", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 4),
        ("dev", SlotDevice * MAX_DEVICES),
    ]


class Region(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("num_devices", ctypes.c_uint32),
        ("num_slots", ctypes.c_uint32),
        ("created", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("slot_hwm", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 7),
        ("devices", RegionDevice * MAX_DEVICES),
        ("slots", Slot * MAX_SLOTS),
    ]


REGION_SIZE = ctypes.sizeof(Region)
SLOT_OFFSET = Region.slots.offset
SLOT_SIZE = ctypes.sizeof(Slot)
SLOT_DEV_OFFSET = Slot.dev.offset
SLOT_DEV_SIZE = ctypes.sizeof(SlotDevice)


class RegionCorrupt(ValueError):
    """The region's bytes are not a valid region; the message says why."""


@dataclass(frozen=True)
class DeviceUsage:
    uuid: str
    memory_limit: int
    core_percent: int
    oversubscribe: bool
    used_device: int
    used_host: int


@dataclass(frozen=True)
class SlotInfo:
    index: int
    pid: int
    host_pid: int
    start_time: int
    device_bytes: tuple[int, ...]
    host_bytes: tuple[int, ...]
    extra_bytes: tuple[int, ...]
    ctx_reserve: tuple[int, ...] = ()


@dataclass(frozen=True)
class RegionSnapshot:
    devices: list[DeviceUsage]
    slots: list[SlotInfo]


def initialise(
    path: str, limits: Iterable[DeviceLimit], mode: int = 0o666, *, durable: bool = True, atomic: bool = True
) -> None:
    """Create a fresh region file for `limits` (atomic: temp file + rename; `atomic=False`: created
    in place, O_EXCL, for a directory nobody reads yet).

    `durable` (the hook): the whole file is written and fsynced. Without (the DRA plugin, whose
    checkpoint rebuilds a missing region at start-up): the header and devices are written, the
    zeroed slots are a hole (ftruncate: they read as zeros; a slot's page is allocated when a
    process of the container first takes a slot in it), and nothing is fsynced. Both give the
    same bytes. (On a full filesystem a container's first write to a new page of a sparse region
    would fail with SIGBUS: keep the run dir's tmpfs with room, as the node's /run always needs.)"""
    lim = list(limits)
    if len(lim) > MAX_DEVICES:
        raise ValueError(f"too many devices ({len(lim)} > {MAX_DEVICES})")
    r = Region()
    r.magic = MAGIC
    r.version = VERSION
    r.size = REGION_SIZE
    r.num_devices = len(lim)
    r.num_slots = MAX_SLOTS
    r.created = int(time.time())
    for i, d in enumerate(lim):
        u = d.uuid.encode()
        if len(u) >= UUID_LEN:
            raise ValueError(f"uuid too long: {d.uuid[:40]!r}")
        r.devices[i].uuid = u
        r.devices[i].memory_limit = d.memory_limit
        r.devices[i].core_percent = d.core_percent
        r.devices[i].flags = DEV_OVERSUBSCRIBE if d.oversubscribe else 0
    tmp = path + ".tmp" if atomic else path
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if atomic else os.O_EXCL)
    fd = os.open(tmp, flags, mode)
    try:
        os.fchmod(fd, mode)
        if durable:
            os.write(fd, bytes(r))
            os.fsync(fd)
        else:
            os.write(fd, ctypes.string_at(ctypes.addressof(r), SLOT_OFFSET))
            os.ftruncate(fd, REGION_SIZE)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    if atomic:
        os.rename(tmp, path)


def _u64s(buf: bytes, off: int, n: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{n}Q", buf, off)


def parse(buf: bytes) -> RegionSnapshot:
    """Validate and decode region bytes; raises RegionCorrupt."""
    if len(buf) < REGION_SIZE:
        raise RegionCorrupt(f"short region ({len(buf)} < {REGION_SIZE} bytes)")
    r = Region.from_buffer_copy(buf[:REGION_SIZE])
    if r.magic != MAGIC:
        raise RegionCorrupt(f"bad magic {r.magic:#x}")
    if r.version != VERSION:
        raise RegionCorrupt(f"unknown version {r.version}")
    if r.size != REGION_SIZE:
        raise RegionCorrupt(f"size field {r.size} != {REGION_SIZE}")
    if r.num_devices > MAX_DEVICES:
        raise RegionCorrupt(f"num_devices {r.num_devices} > {MAX_DEVICES}")
    if r.num_slots != MAX_SLOTS:
        raise RegionCorrupt(f"num_slots {r.num_slots} != {MAX_SLOTS}")
    nd = r.num_devices
    devices: list[DeviceUsage] = []
    for i in range(nd):
        d = r.devices[i]
        raw = bytes(d.uuid)
        if b"\0" in raw:
            raw = raw[: raw.index(b"\0")]
        try:
            uuid = raw.decode("ascii")
        except UnicodeDecodeError:
            raise RegionCorrupt(f"device {i}: non-ASCII uuid") from None
        if not uuid or not all(c.isalnum() or c == "-" for c in uuid):
            raise RegionCorrupt(f"device {i}: invalid uuid")
        if d.core_percent > 10_000:
            raise RegionCorrupt(f"device {i}: core_percent {d.core_percent} out of range")
        devices.append(
            DeviceUsage(
                uuid=uuid,
                memory_limit=d.memory_limit,
                core_percent=d.core_percent,
                oversubscribe=bool(d.flags & DEV_OVERSUBSCRIBE),
                used_device=d.used_device,
                used_host=d.used_host,
            )
        )
    slots: list[SlotInfo] = []
    for i in range(MAX_SLOTS):
        s = r.slots[i]
        if s.state == SLOT_FREE:
            continue
        if s.state != SLOT_ACTIVE:
            raise RegionCorrupt(f"slot {i}: invalid state {s.state}")
        if s.pid <= 0 or s.host_pid < 0:
            raise RegionCorrupt(f"slot {i}: invalid pid {s.pid}/{s.host_pid}")
        slots.append(
            SlotInfo(
                index=i,
                pid=s.pid,
                host_pid=s.host_pid,
                start_time=s.start_time,
                device_bytes=tuple(s.dev[j].device_bytes for j in range(nd)),
                host_bytes=tuple(s.dev[j].host_bytes for j in range(nd)),
                extra_bytes=tuple(s.dev[j].extra_bytes for j in range(nd)),
                ctx_reserve=tuple(s.dev[j].ctx_reserve for j in range(nd)),
            )
        )
    return RegionSnapshot(devices=devices, slots=slots)


def read_region(path: str) -> RegionSnapshot:
    """Read a region file without following a symlink at the final component."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        import stat as _stat

        if not _stat.S_ISREG(st.st_mode):
            raise RegionCorrupt("region is not a regular file")
        buf = os.pread(fd, REGION_SIZE, 0)
    finally:
        os.close(fd)
    return parse(buf)


def write_extra_bytes(path: str, slot_index: int, device_index: int, value: int) -> None:
    """Monitor: store NVML-seen bytes beyond the library's count into a slot (under the region lock)."""
    if not (0 <= slot_index < MAX_SLOTS and 0 <= device_index < MAX_DEVICES):
        raise IndexError("slot or device index out of range")
    if value < 0:
        value = 0
    off = SLOT_OFFSET + slot_index * SLOT_SIZE + SLOT_DEV_OFFSET + device_index * SLOT_DEV_SIZE + 16
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        lock = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, LOCK_BYTE, 1, 0)
        fcntl.fcntl(fd, F_OFD_SETLKW, lock)
        try:
            os.pwrite(fd, struct.pack("<Q", value), off)
        finally:
            unlock = struct.pack("hhqqi", fcntl.F_UNLCK, os.SEEK_SET, LOCK_BYTE, 1, 0)
            fcntl.fcntl(fd, F_OFD_SETLK, unlock)
    finally:
        os.close(fd)


# Linux OFD lock commands (not exported by the fcntl module on every Python).
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)

__all__ = [
    "MAGIC",
    "REGION_SIZE",
    "VERSION",
    "DeviceUsage",
    "RegionCorrupt",
    "RegionSnapshot",
    "SlotInfo",
    "initialise",
    "parse",
    "read_region",
    "write_extra_bytes",
]
