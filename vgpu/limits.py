"""The per-slice `limits` file (contract 2): written by the hook and the DRA plugin, parsed by
libvgpu.so (C, libcuda_intercept/src/vlimits.c: the authority) and by the monitor and vgpuctl.

Format (ASCII, '\\n'-terminated lines, at most 16 device lines, total < 8 KiB):

    vgpu-limits 2
    <GPU-UUID> <memory_limit_bytes> <core_percent> <oversubscribe 0|1> <device_limit_bytes>
    ...

`memory_limit` is the slice (device-resident plus host-resident bytes), `device_limit` the
physical share: what may be resident on the GPU (at most the slice, equal to it without
oversubscription). Lines starting with '#' are comments. Version 1 (four fields, no
`device_limit`) is still read when no line oversubscribes (the physical share is then the limit,
as version 1 meant); a version-1 line with oversubscription is an error: it does not say how much
may be device-resident, and the library fails closed rather than guess. Standard library only
(no `re`): the hook renders this file for every vGPU container.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from vgpu.schemas import AllocatedGPU, AllocationRecord

LIMITS_VERSION = 2
READ_VERSIONS = ("1", "2")
HEADER = f"vgpu-limits {LIMITS_VERSION}"
MAX_DEVICES = 16
MAX_BYTES = 8192  # VGPU_LIMITS_MAX_BYTES
_UUID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_DIGITS = frozenset("0123456789")


class LimitsError(ValueError):
    pass


class DeviceLimit:
    """One device line: the slice of one GPU (`memory_limit`) and its physical share
    (`device_limit`, the slice itself unless given)."""

    __slots__ = ("core_percent", "device_limit", "memory_limit", "oversubscribe", "uuid")

    def __init__(
        self, *, uuid: str, memory_limit: int, core_percent: int, oversubscribe: bool, device_limit: int | None = None
    ) -> None:
        self.uuid = uuid
        self.memory_limit = memory_limit
        self.core_percent = core_percent
        self.oversubscribe = oversubscribe
        self.device_limit = memory_limit if device_limit is None else device_limit

    def _key(self) -> tuple[str, int, int, bool, int]:
        return (self.uuid, self.memory_limit, self.core_percent, self.oversubscribe, self.device_limit)

    def __eq__(self, other: object) -> bool:
        if type(other) is not DeviceLimit:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"DeviceLimit(uuid={self.uuid!r}, memory_limit={self.memory_limit}, "
            f"core_percent={self.core_percent}, oversubscribe={self.oversubscribe}, "
            f"device_limit={self.device_limit})"
        )


def from_record(record: AllocationRecord) -> list[DeviceLimit]:
    return [from_gpu(g, record.oversubscribe) for g in record.gpus]


def from_gpu(g: AllocatedGPU, oversubscribe: bool) -> DeviceLimit:
    """The limits line of one GPU of a record. A record without `device_limit` (written before
    it existed) means the limit itself, which is only right without oversubscription: an
    oversubscribed one is a LimitsError (the hook fails closed rather than guess the share)."""
    if g.device_limit is None:
        if oversubscribe:
            raise LimitsError(
                f"GPU {g.uuid[:40]}: an oversubscribed allocation without device_limit (the physical share); "
                "the record predates it: recreate the pod"
            )
        dev = g.memory_limit
    else:
        dev = g.device_limit
    return DeviceLimit(
        uuid=g.uuid,
        memory_limit=g.memory_limit,
        core_percent=g.core_percent,
        oversubscribe=oversubscribe,
        device_limit=dev,
    )


def render(limits: Iterable[DeviceLimit]) -> str:
    """The file's text; LimitsError for more devices than the library takes or a line the
    library would refuse (a physical share above the slice, or below it without
    oversubscription)."""
    lines = [HEADER]
    for d in limits:
        if d.device_limit > d.memory_limit or (not d.oversubscribe and d.device_limit != d.memory_limit):
            raise LimitsError(f"device {d.uuid[:40]!r}: device_limit {d.device_limit} vs limit {d.memory_limit}")
        lines.append(f"{d.uuid} {d.memory_limit} {d.core_percent} {1 if d.oversubscribe else 0} {d.device_limit}")
    if len(lines) - 1 > MAX_DEVICES:
        raise LimitsError(f"too many devices ({len(lines) - 1} > {MAX_DEVICES})")
    return "\n".join(lines) + "\n"


def _number(s: str) -> bool:
    return 1 <= len(s) <= 20 and _DIGITS.issuperset(s)


def parse(text: str) -> list[DeviceLimit]:
    """The device lines of a limits file, by the C parser's rules; LimitsError otherwise."""
    if len(text) > MAX_BYTES:
        raise LimitsError(f"file larger than {MAX_BYTES} bytes")
    lines = [ln for ln in text.split("\n") if ln.strip() and not ln.startswith("#")]
    if not lines:
        raise LimitsError("empty limits file")
    head = lines[0].split()
    if len(head) != 2 or head[0] != "vgpu-limits":
        raise LimitsError("missing 'vgpu-limits <version>' header")
    if head[1] not in READ_VERSIONS:
        raise LimitsError(f"unknown limits version {head[1][:16]!r}")
    v1 = head[1] == "1"
    out: list[DeviceLimit] = []
    for ln in lines[1:]:
        f = ln.split()
        if (
            len(f) != (4 if v1 else 5)
            or f[3] not in ("0", "1")
            or not 1 <= len(f[0]) <= 95
            or not _UUID_CHARS.issuperset(f[0])
            or not _number(f[1])
            or not _number(f[2])
            or int(f[1]) >= 1 << 64
            or int(f[2]) > 10_000
            or (not v1 and (not _number(f[4]) or int(f[4]) >= 1 << 64))
        ):
            raise LimitsError(f"malformed device line {ln[:80]!r}")
        mem, over = int(f[1]), f[3] == "1"
        if v1 and over:
            raise LimitsError("version 1 limits with oversubscription do not carry the physical share")
        dev = mem if v1 else int(f[4])
        if dev > mem or (not over and dev != mem):
            raise LimitsError(f"device bytes {dev} vs limit {mem} in {ln[:80]!r}")
        if any(d.uuid.lower() == f[0].lower() for d in out):
            raise LimitsError(f"duplicate device {f[0][:40]!r}")
        out.append(
            DeviceLimit(uuid=f[0], memory_limit=mem, core_percent=int(f[2]), oversubscribe=over, device_limit=dev)
        )
        if len(out) > MAX_DEVICES:
            raise LimitsError("too many devices")
    return out
