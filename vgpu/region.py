"""The shared accounting region (contract 3), for every Python part: hook, DRA plugin, monitor,
vgpuctl.

The layout is defined once, in libcuda_intercept/include/vgpu_region.h. `STRUCTS` below spells
it field for field, offsets follow by C's rules (`layout`), and
tests/libcuda_intercept/test_region_layout.py compiles a C program against the header and checks
every field's name, offset and size computed here. Standard library only and no ctypes or
dataclasses: the OCI hook creates a region for every vGPU container.

The container can write any byte of its region: `parse` validates every field it returns and
raises RegionCorrupt with a reason; `write_extra_bytes` never blocks on a lock the container may
hold.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time

TYPE_CHECKING = False  # `typing` costs the hook ~3 ms
if TYPE_CHECKING:
    from collections.abc import Iterable

    from vgpu.limits import DeviceLimit

MAGIC = 0x4E4F494745525056  # "VPREGION" little-endian
VERSION = 2
MAX_DEVICES = 16
MAX_SLOTS = 1024
MAX_SHARED = 256
SHARED_KEYS = 4
SHARED_FDS = 4
UUID_LEN = 96
LOCK_BYTE = 1 << 32  # the region's write lock
SLOT_LOCK_BASE = (1 << 32) + 4096  # + slot index: held (read lock) by the slot's owner
SLOT_FREE = 0
SLOT_ACTIVE = 1
DEV_OVERSUBSCRIBE = 0x1
SHARED_FREE = 0
SHARED_LIVE = 1

# The header's structs, field for field: (name, struct code, count) or (name, nested struct, count).
STRUCTS: dict[str, tuple[tuple[str, str, int], ...]] = {
    "vgpu_region_device": (
        ("uuid", "s", UUID_LEN),
        ("memory_limit", "Q", 1),
        ("core_percent", "I", 1),
        ("flags", "I", 1),
        ("used_device", "Q", 1),
        ("used_host", "Q", 1),
        ("device_limit", "Q", 1),
        ("reserved", "Q", 3),
    ),
    "vgpu_slot_device": (
        ("device_bytes", "Q", 1),
        ("host_bytes", "Q", 1),
        ("extra_bytes", "Q", 1),
        ("ctx_reserve", "Q", 1),
    ),
    "vgpu_slot": (
        ("state", "I", 1),
        ("pid", "i", 1),
        ("host_pid", "i", 1),
        ("reserved0", "I", 1),
        ("start_time", "Q", 1),
        ("reserved", "Q", 4),
        ("dev", "vgpu_slot_device", MAX_DEVICES),
    ),
    "vgpu_shared": (
        ("state", "I", 1),
        ("dev", "I", 1),
        ("bytes", "Q", 1),
        ("generation", "Q", 1),
        ("keys", "Q", SHARED_KEYS),
        ("export_pid", "i", SHARED_FDS),
        ("export_fd", "i", SHARED_FDS),
        ("holders", "Q", MAX_SLOTS // 64),
    ),
    "vgpu_region": (
        ("magic", "Q", 1),
        ("version", "I", 1),
        ("size", "I", 1),
        ("num_devices", "I", 1),
        ("num_slots", "I", 1),
        ("created", "Q", 1),
        ("generation", "Q", 1),
        ("slot_hwm", "I", 1),
        ("shared_hwm", "I", 1),
        ("reserved", "Q", 7),
        ("devices", "vgpu_region_device", MAX_DEVICES),
        ("slots", "vgpu_slot", MAX_SLOTS),
        ("shared", "vgpu_shared", MAX_SHARED),
    ),
}
_SCALAR = {"s": (1, 1), "I": (4, 4), "i": (4, 4), "Q": (8, 8)}


def layout(name: str) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(size, alignment, {field: (offset, size)}) of one struct, by the C rules (x86-64 and arm64:
    natural alignment, the struct padded to its alignment)."""
    off, align, fields = 0, 1, {}
    for fname, code, count in STRUCTS[name]:
        if code in _SCALAR:
            size, a = _SCALAR[code]
        else:
            size, a, _ = layout(code)
        off = (off + a - 1) // a * a
        fields[fname] = (off, size * count)
        off += size * count
        align = max(align, a)
    return (off + align - 1) // align * align, align, fields


def _struct(name: str, upto: str | None = None) -> struct.Struct:
    """The scalar fields of a struct up to (not including) `upto`, as one little-endian Struct."""
    fmt = "<"
    for fname, code, count in STRUCTS[name]:
        if fname == upto:
            break
        fmt += f"{count}s" if code == "s" else (code if count == 1 else f"{count}{code}")
    return struct.Struct(fmt)


HEADER = _struct("vgpu_region", upto="devices")
DEVICE = _struct("vgpu_region_device")
SLOT_HEAD = _struct("vgpu_slot", upto="dev")
SLOT_DEVICE = _struct("vgpu_slot_device")
SHARED = _struct("vgpu_shared")

_REGION = layout("vgpu_region")[2]
_SLOT = layout("vgpu_slot")[2]
DEVICES_OFFSET = _REGION["devices"][0]
DEVICE_SIZE = layout("vgpu_region_device")[0]
SLOT_DEV_OFFSET = _SLOT["dev"][0]
SLOT_DEV_SIZE = layout("vgpu_slot_device")[0]
SLOT_SIZE = layout("vgpu_slot")[0]
SLOT_OFFSET = _REGION["slots"][0]
SHARED_OFFSET = _REGION["shared"][0]
SHARED_SIZE = layout("vgpu_shared")[0]
REGION_SIZE = layout("vgpu_region")[0]
CREATED_OFFSET = _REGION["created"][0]
GENERATION_OFFSET = _REGION["generation"][0]
EXTRA_BYTES_OFFSET = layout("vgpu_slot_device")[2]["extra_bytes"][0]
assert HEADER.size == DEVICES_OFFSET and DEVICE.size == DEVICE_SIZE and SLOT_HEAD.size == SLOT_DEV_OFFSET
assert SHARED.size == SHARED_SIZE

# Linux OFD lock commands (not exported by the fcntl module on every Python).
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class RegionCorrupt(ValueError):
    """The region's bytes are not a valid region; the message says why."""


def slot_offset(index: int) -> int:
    return SLOT_OFFSET + index * SLOT_SIZE


def slot_device_offset(slot: int, device: int) -> int:
    return slot_offset(slot) + SLOT_DEV_OFFSET + device * SLOT_DEV_SIZE


def device_offset(index: int) -> int:
    return DEVICES_OFFSET + index * DEVICE_SIZE


# ----- creating -----


def render_header(limits: Iterable[DeviceLimit], created: int) -> bytearray:
    """The bytes before the slots (header and devices) of a fresh region; the slots are zero.
    ValueError for anything that does not fit (never truncated: fail closed)."""
    lim = list(limits)
    if len(lim) > MAX_DEVICES:
        raise ValueError(f"too many devices ({len(lim)} > {MAX_DEVICES})")
    buf = bytearray(SLOT_OFFSET)
    HEADER.pack_into(buf, 0, MAGIC, VERSION, REGION_SIZE, len(lim), MAX_SLOTS, created & _U64, 0, 0, 0, *([0] * 7))
    for i, d in enumerate(lim):
        u = d.uuid.encode()
        if len(u) >= UUID_LEN:
            raise ValueError(f"uuid too long: {d.uuid[:40]!r}")
        if not (0 <= d.memory_limit <= _U64 and 0 <= d.core_percent <= _U32):
            raise ValueError(f"device {d.uuid[:40]!r}: limit out of range")
        flags = DEV_OVERSUBSCRIBE if d.oversubscribe else 0
        # "96s" pads with NULs: the C string is NUL-terminated
        if not 0 <= d.device_limit <= _U64:
            raise ValueError(f"device {d.uuid[:40]!r}: device limit out of range")
        DEVICE.pack_into(buf, device_offset(i), u, d.memory_limit, d.core_percent, flags, 0, 0, d.device_limit, 0, 0, 0)
    return buf


def initialise(
    path: str, limits: Iterable[DeviceLimit], mode: int = 0o666, *, sparse: bool = False, atomic: bool = True
) -> None:
    """Create a fresh region file for `limits` (nothing is fsynced: a region means nothing after
    a reboot, and its makers rebuild it).

    `atomic`: a temp file renamed into place (readers never see a partial region); without, the
    file is created in place with O_EXCL, for a directory nobody reads yet. `sparse`: the zeroed
    slots are a hole (ftruncate), allocated when a process of the container first takes a slot
    in a page: fewer bytes to write (the DRA plugin makes 16 claims in one call), but a
    container's first write to a new page fails with SIGBUS on a full filesystem, so only for a
    tmpfs with room (the DRA plugin's run dir). Both give the same bytes."""
    head = render_header(limits, int(time.time()))
    tmp = f"{path}.tmp{os.getpid()}" if atomic else path
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        if sparse:
            os.write(fd, head)
            os.ftruncate(fd, REGION_SIZE)
        else:
            head.extend(bytes(REGION_SIZE - SLOT_OFFSET))
            view = memoryview(head)
            while view:
                view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    if atomic:
        os.rename(tmp, path)


# ----- reading -----


class DeviceUsage:
    __slots__ = ("core_percent", "device_limit", "memory_limit", "oversubscribe", "used_device", "used_host", "uuid")

    def __init__(
        self,
        uuid: str,
        memory_limit: int,
        core_percent: int,
        oversubscribe: bool,
        used_device: int,
        used_host: int,
        device_limit: int = 0,
    ) -> None:
        self.uuid = uuid
        self.memory_limit = memory_limit
        self.core_percent = core_percent
        self.oversubscribe = oversubscribe
        self.used_device = used_device
        self.used_host = used_host
        self.device_limit = device_limit or memory_limit  # 0: a region written before the field

    def __repr__(self) -> str:
        return f"DeviceUsage({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"


class SlotInfo:
    __slots__ = ("ctx_reserve", "device_bytes", "extra_bytes", "host_bytes", "host_pid", "index", "pid", "start_time")

    def __init__(
        self,
        index: int,
        pid: int,
        host_pid: int,
        start_time: int,
        device_bytes: tuple[int, ...],
        host_bytes: tuple[int, ...],
        extra_bytes: tuple[int, ...],
        ctx_reserve: tuple[int, ...] = (),
    ) -> None:
        self.index = index
        self.pid = pid
        self.host_pid = host_pid
        self.start_time = start_time
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.extra_bytes = extra_bytes
        self.ctx_reserve = ctx_reserve

    def __repr__(self) -> str:
        return f"SlotInfo({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"


class SharedInfo:
    """One live entry of the ledger of memory shared between the container's processes."""

    __slots__ = ("bytes", "device", "holders", "index")

    def __init__(self, index: int, device: int, nbytes: int, holders: tuple[int, ...]) -> None:
        self.index = index
        self.device = device
        self.bytes = nbytes
        self.holders = holders

    def __repr__(self) -> str:
        return f"SharedInfo({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"


class RegionSnapshot:
    __slots__ = ("created", "devices", "shared", "slots")

    def __init__(
        self,
        devices: list[DeviceUsage],
        slots: list[SlotInfo],
        created: int = 0,
        shared: list[SharedInfo] | None = None,
    ) -> None:
        self.devices = devices
        self.slots = slots
        self.created = created
        self.shared = shared or []

    def shared_held(self, slot: int, device: int) -> int:
        """Bytes of the shared allocations on `device` that slot `slot` holds."""
        return sum(e.bytes for e in self.shared if e.device == device and slot in e.holders)


def parse(buf: bytes | bytearray) -> RegionSnapshot:
    """Validate and decode region bytes; raises RegionCorrupt."""
    if len(buf) < REGION_SIZE:
        raise RegionCorrupt(f"short region ({len(buf)} < {REGION_SIZE} bytes)")
    magic, version, size, nd, ns, created, *_ = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RegionCorrupt(f"bad magic {magic:#x}")
    if version != VERSION:
        raise RegionCorrupt(f"unknown version {version}")
    if size != REGION_SIZE:
        raise RegionCorrupt(f"size field {size} != {REGION_SIZE}")
    if nd > MAX_DEVICES:
        raise RegionCorrupt(f"num_devices {nd} > {MAX_DEVICES}")
    if ns != MAX_SLOTS:
        raise RegionCorrupt(f"num_slots {ns} != {MAX_SLOTS}")
    devices: list[DeviceUsage] = []
    for i in range(nd):
        raw, limit, pct, flags, used_device, used_host, device_limit, *_ = DEVICE.unpack_from(buf, device_offset(i))
        if b"\0" in raw:
            raw = raw[: raw.index(b"\0")]
        try:
            uuid = raw.decode("ascii")
        except UnicodeDecodeError:
            raise RegionCorrupt(f"device {i}: non-ASCII uuid") from None
        if not uuid or not all(c.isalnum() or c == "-" for c in uuid):
            raise RegionCorrupt(f"device {i}: invalid uuid")
        if pct > 10_000:
            raise RegionCorrupt(f"device {i}: core_percent {pct} out of range")
        devices.append(
            DeviceUsage(uuid, limit, pct, bool(flags & DEV_OVERSUBSCRIBE), used_device, used_host, device_limit)
        )
    slots: list[SlotInfo] = []
    for i in range(MAX_SLOTS):
        off = slot_offset(i)
        st, pid, host_pid, _r0, start, *_ = SLOT_HEAD.unpack_from(buf, off)
        if st == SLOT_FREE:
            continue
        if st != SLOT_ACTIVE:
            raise RegionCorrupt(f"slot {i}: invalid state {st}")
        if pid <= 0 or host_pid < 0:
            raise RegionCorrupt(f"slot {i}: invalid pid {pid}/{host_pid}")
        per = [SLOT_DEVICE.unpack_from(buf, off + SLOT_DEV_OFFSET + j * SLOT_DEV_SIZE) for j in range(nd)]
        slots.append(
            SlotInfo(
                index=i,
                pid=pid,
                host_pid=host_pid,
                start_time=start,
                device_bytes=tuple(d[0] for d in per),
                host_bytes=tuple(d[1] for d in per),
                extra_bytes=tuple(d[2] for d in per),
                ctx_reserve=tuple(d[3] for d in per),
            )
        )
    shared: list[SharedInfo] = []
    for i in range(MAX_SHARED):
        st, dev, nbytes, _gen, *rest = SHARED.unpack_from(buf, SHARED_OFFSET + i * SHARED_SIZE)
        if st == SHARED_FREE:
            continue
        if st != SHARED_LIVE:
            raise RegionCorrupt(f"shared entry {i}: invalid state {st}")
        if dev >= nd:
            raise RegionCorrupt(f"shared entry {i}: device {dev} out of range")
        words = rest[SHARED_KEYS + 2 * SHARED_FDS :]
        holders = tuple(w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1)
        shared.append(SharedInfo(i, dev, nbytes, holders))
    return RegionSnapshot(devices, slots, created, shared)


def _open_regular(path: str, flags: int) -> int:
    """Open without following a link at the last component and without blocking on a FIFO;
    RegionCorrupt unless it is a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RegionCorrupt("region is not a regular file")
    return fd


def read_region(path: str) -> RegionSnapshot:
    fd = _open_regular(path, os.O_RDONLY)
    try:
        buf = os.pread(fd, REGION_SIZE, 0)
    finally:
        os.close(fd)
    return parse(buf)


# ----- the monitor's one write -----


def _lock(kind: int) -> bytes:
    return struct.pack("hhqqi", kind, os.SEEK_SET, LOCK_BYTE, 1, 0)


def write_extra_bytes(path: str, values: dict[tuple[int, int], int], attempts: int = 3) -> bool:
    """Write {(slot, device): bytes} (NVML-seen usage the library cannot see) under the region's
    write lock; False when the lock stayed busy (written next round).

    Never blocks: the region is shared with the container, so a hostile process could hold the
    lock forever and would hang a blocking writer. Only F_OFD_SETLK (non-blocking) is tried, a
    few times; the path must be a regular file of a region's size (O_NOFOLLOW)."""
    for (slot, dev), v in values.items():
        if not (0 <= slot < MAX_SLOTS and 0 <= dev < MAX_DEVICES) or v < 0:
            raise ValueError("slot/device/value out of range")
    try:
        fd = _open_regular(path, os.O_RDWR)
    except RegionCorrupt:
        return False
    try:
        if os.fstat(fd).st_size < REGION_SIZE:
            return False
        for i in range(attempts):
            try:
                fcntl.fcntl(fd, F_OFD_SETLK, _lock(fcntl.F_WRLCK))
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if i == attempts - 1:
                    return False
                time.sleep(0.001)
        try:
            for (slot, dev), v in values.items():
                os.pwrite(fd, struct.pack("<Q", min(v, _U64)), slot_device_offset(slot, dev) + EXTRA_BYTES_OFFSET)
        finally:
            fcntl.fcntl(fd, F_OFD_SETLK, _lock(fcntl.F_UNLCK))
        return True
    finally:
        os.close(fd)
