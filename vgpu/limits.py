"""The per-container `limits` file (contract 2): written by the hook, parsed by libvgpu.so (C).

Format (ASCII, '\n'-terminated lines, at most 16 device lines, total < 8 KiB):

    vgpu-limits 1
    <GPU-UUID> <memory_limit_bytes> <core_percent> <oversubscribe 0|1>
    ...

Lines starting with '#' are comments.  The C parser in
libcuda_intercept/ is the authority; `parse` here mirrors it for tests and
vgpuctl.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

from vgpu.schemas import AllocatedGPU, AllocationRecord

LIMITS_VERSION = 1
HEADER = f"vgpu-limits {LIMITS_VERSION}"
MAX_DEVICES = 16


class DeviceLimit(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    memory_limit: int
    core_percent: int
    oversubscribe: bool


class LimitsError(ValueError):
    pass


def from_record(record: AllocationRecord) -> list[DeviceLimit]:
    return [_from_gpu(g, record.oversubscribe) for g in record.gpus]


def _from_gpu(g: AllocatedGPU, oversubscribe: bool) -> DeviceLimit:
    return DeviceLimit(
        uuid=g.uuid, memory_limit=g.memory_limit, core_percent=g.core_percent, oversubscribe=oversubscribe
    )


def render(limits: Iterable[DeviceLimit]) -> str:
    lines = [HEADER]
    for d in limits:
        lines.append(f"{d.uuid} {d.memory_limit} {d.core_percent} {1 if d.oversubscribe else 0}")
    if len(lines) - 1 > MAX_DEVICES:
        raise LimitsError(f"too many devices ({len(lines) - 1} > {MAX_DEVICES})")
    return "\n".join(lines) + "\n"


def parse(text: str) -> list[DeviceLimit]:
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
            or not _UUID_RE.fullmatch(f[0])
            or not _DIGITS_RE.fullmatch(f[1])
            or not _DIGITS_RE.fullmatch(f[2])
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


# the C parser's rules (libcuda_intercept/src/vlimits.c): 1-95 of [A-Za-z0-9-], decimal digits
_UUID_RE = re.compile(r"[A-Za-z0-9-]{1,95}")
_DIGITS_RE = re.compile(r"[0-9]{1,20}")
