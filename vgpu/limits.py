"""The per-slice `limits` file (contract 2): written by the hook and the DRA plugin, parsed by
libvgpu.so (C, libcuda_intercept/src/vlimits.c: the authority) and by the monitor and vgpuctl.

Format (ASCII, '\\n'-terminated lines, at most 16 device lines, total < 8 KiB):

    vgpu-limits 1
    <GPU-UUID> <memory_limit_bytes> <core_percent> <oversubscribe 0|1>
    ...

Lines starting with '#' are comments. Standard library only (no `re`): the hook renders this
file for every vGPU container.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from vgpu.schemas import AllocatedGPU, AllocationRecord

LIMITS_VERSION = 1
HEADER = f"vgpu-limits {LIMITS_VERSION}"
MAX_DEVICES = 16
MAX_BYTES = 8192  # VGPU_LIMITS_MAX_BYTES
_UUID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_DIGITS = frozenset("0123456789")


class LimitsError(ValueError):
    pass


class DeviceLimit:
    """One device line: the slice of one GPU."""

    __slots__ = ("core_percent", "memory_limit", "oversubscribe", "uuid")

    def __init__(self, *, uuid: str, memory_limit: int, core_percent: int, oversubscribe: bool) -> None:
        self.uuid = uuid
        self.memory_limit = memory_limit
        self.core_percent = core_percent
        self.oversubscribe = oversubscribe

    def __eq__(self, other: object) -> bool:
        if type(other) is not DeviceLimit:
            return NotImplemented
        return (self.uuid, self.memory_limit, self.core_percent, self.oversubscribe) == (
            other.uuid,
            other.memory_limit,
            other.core_percent,
            other.oversubscribe,
        )

    def __hash__(self) -> int:
        return hash((self.uuid, self.memory_limit, self.core_percent, self.oversubscribe))

    def __repr__(self) -> str:
        return (
            f"DeviceLimit(uuid={self.uuid!r}, memory_limit={self.memory_limit}, "
            f"core_percent={self.core_percent}, oversubscribe={self.oversubscribe})"
        )


def from_record(record: AllocationRecord) -> list[DeviceLimit]:
    return [from_gpu(g, record.oversubscribe) for g in record.gpus]


def from_gpu(g: AllocatedGPU, oversubscribe: bool) -> DeviceLimit:
    return DeviceLimit(
        uuid=g.uuid, memory_limit=g.memory_limit, core_percent=g.core_percent, oversubscribe=oversubscribe
    )


def render(limits: Iterable[DeviceLimit]) -> str:
    """The file's text; LimitsError for more devices than the library takes."""
    lines = [HEADER]
    for d in limits:
        lines.append(f"{d.uuid} {d.memory_limit} {d.core_percent} {1 if d.oversubscribe else 0}")
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
    if head[1] != str(LIMITS_VERSION):
        raise LimitsError(f"unknown limits version {head[1][:16]!r}")
    out: list[DeviceLimit] = []
    for ln in lines[1:]:
        f = ln.split()
        if (
            len(f) != 4
            or f[3] not in ("0", "1")
            or not 1 <= len(f[0]) <= 95
            or not _UUID_CHARS.issuperset(f[0])
            or not _number(f[1])
            or not _number(f[2])
            or int(f[1]) >= 1 << 64
            or int(f[2]) > 10_000
        ):
            raise LimitsError(f"malformed device line {ln[:80]!r}")
        if any(d.uuid.lower() == f[0].lower() for d in out):
            raise LimitsError(f"duplicate device {f[0][:40]!r}")
        out.append(DeviceLimit(uuid=f[0], memory_limit=int(f[1]), core_percent=int(f[2]), oversubscribe=f[3] == "1"))
        if len(out) > MAX_DEVICES:
            raise LimitsError("too many devices")
    return out
