"""msgspec-free reading of allocation records and writing of the hook's state files.

Importing msgspec costs more than everything else a vGPU container's prestart
does (measured by `make bench-hook`, msgspec_import_ms), so the hook reads
and writes the contract-1/2 JSON with the C `_json` scanner and the checks
below.  The schema is still vgpu.schemas: tests/hook/test_records.py fuzzes
this reader against `msgspec.json.decode(..., type=AllocationRecord)` (anything
accepted here is accepted there with equal values, and every well-formed
record is accepted by both), and checks that the metadata written here
decodes as vgpu.schemas.ContainerMetadata and the limits text equals
vgpu.limits.render.  This reader is stricter where it differs (fail closed).
"""

from __future__ import annotations

import os

from runtime_hook import oci

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_INT_MIN = -(1 << 63)
_UINT_MAX = (1 << 64) - 1
_HEX = frozenset("0123456789abcdef")
_UUID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_RECORD_FIELDS = ("version", "token", "created", "resource_name", "oversubscribe", "gpus")
_GPU_FIELDS = ("uuid", "memory_limit", "core_percent", "vgpu_ids")


class RecordError(ValueError):
    pass


class GPU:
    __slots__ = ("core_percent", "memory_limit", "uuid", "vgpu_ids")

    def __init__(self, uuid: str, memory_limit: int, core_percent: int, vgpu_ids: list[str]) -> None:
        self.uuid = uuid
        self.memory_limit = memory_limit
        self.core_percent = core_percent
        self.vgpu_ids = vgpu_ids


class Record:
    __slots__ = ("created", "gpus", "oversubscribe", "resource_name", "token", "version")

    def __init__(
        self, version: int, token: str, created: float, resource_name: str, oversubscribe: bool, gpus: list[GPU]
    ) -> None:
        self.version = version
        self.token = token
        self.created = created
        self.resource_name = resource_name
        self.oversubscribe = oversubscribe
        self.gpus = gpus


class Limit:
    """Duck type of vgpu.limits.DeviceLimit (what vgpu.region.initialise reads)."""

    __slots__ = ("core_percent", "memory_limit", "oversubscribe", "uuid")

    def __init__(self, uuid: str, memory_limit: int, core_percent: int, oversubscribe: bool) -> None:
        self.uuid = uuid
        self.memory_limit = memory_limit
        self.core_percent = core_percent
        self.oversubscribe = oversubscribe


def _int(v: object, where: str, lo: int = _INT_MIN, hi: int = _UINT_MAX) -> int:
    if type(v) is not int:
        raise RecordError(f"Expected `int` at `{where}`")
    if not lo <= v <= hi:
        raise RecordError(f"Expected `int` in [{lo}, {hi}] at `{where}`")
    return v


def _str(v: object, where: str) -> str:
    if type(v) is not str:
        raise RecordError(f"Expected `str` at `{where}`")
    return v


def _fields(obj: object, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    if type(obj) is not dict:
        raise RecordError(f"Expected `object` at `{where}`")
    for k in obj:
        if k not in allowed:
            raise RecordError(f"Object contains unknown field `{oci.oneline(str(k), 40)}` at `{where}`")
    return obj


def parse_record(data: bytes) -> Record:
    """Validate an allocation record (vgpu.schemas.AllocationRecord); raises RecordError."""
    try:
        obj = oci.loads(data)
    except ValueError as e:
        raise RecordError(f"invalid JSON: {e}") from None
    d = _fields(obj, _RECORD_FIELDS, "$")
    for req in ("token", "created", "gpus"):
        if req not in d:
            raise RecordError(f"Object missing required field `{req}`")
    version = _int(d.get("version", 1), "$.version")
    token = _str(d["token"], "$.token")
    if len(token) != 32 or not _HEX.issuperset(token):
        raise RecordError("Expected `str` matching 32 lowercase hex digits at `$.token`")
    created = d["created"]
    if type(created) is int:
        created = float(created)
    if type(created) is not float or created - created != 0.0:  # also rejects inf and nan
        raise RecordError("Expected `float` at `$.created`")
    resource_name = _str(d.get("resource_name", "nvidia.com/gpu"), "$.resource_name")
    over = d.get("oversubscribe", False)
    if type(over) is not bool:
        raise RecordError("Expected `bool` at `$.oversubscribe`")
    gl = d["gpus"]
    if type(gl) is not list:
        raise RecordError("Expected `array` at `$.gpus`")
    gpus: list[GPU] = []
    for i, g in enumerate(gl):
        w = f"$.gpus[{i}]"
        gd = _fields(g, _GPU_FIELDS, w)
        for req in ("uuid", "memory_limit", "core_percent"):
            if req not in gd:
                raise RecordError(f"Object missing required field `{req}` at `{w}`")
        uuid = _str(gd["uuid"], f"{w}.uuid")
        if not 1 <= len(uuid) <= 95 or not _UUID_CHARS.issuperset(uuid):
            raise RecordError(f"Expected a GPU UUID at `{w}.uuid`")
        mem = _int(gd["memory_limit"], f"{w}.memory_limit", 0)
        pct = _int(gd["core_percent"], f"{w}.core_percent", 0, 10_000)
        ids = gd.get("vgpu_ids", [])
        if type(ids) is not list:
            raise RecordError(f"Expected `array` at `{w}.vgpu_ids`")
        gpus.append(GPU(uuid, mem, pct, [_str(x, f"{w}.vgpu_ids[{j}]") for j, x in enumerate(ids)]))
    return Record(version, token, created, resource_name, over, gpus)


def read_record(path: str) -> Record:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        data = os.read(fd, 1 << 20)
    finally:
        os.close(fd)
    return parse_record(data)


def limits_of(rec: Record) -> list[Limit]:
    return [Limit(g.uuid, g.memory_limit, g.core_percent, rec.oversubscribe) for g in rec.gpus]


LIMITS_HEADER = "vgpu-limits 1"  # vgpu.limits.HEADER
MAX_DEVICES = 16  # vgpu.limits.MAX_DEVICES


def render_limits(limits: list[Limit]) -> str:
    """The `limits` file text, as vgpu.limits.render."""
    if len(limits) > MAX_DEVICES:
        raise RecordError(f"too many devices ({len(limits)} > {MAX_DEVICES})")
    lines = [LIMITS_HEADER]
    lines += [f"{d.uuid} {d.memory_limit} {d.core_percent} {1 if d.oversubscribe else 0}" for d in limits]
    return "\n".join(lines) + "\n"


def _jstr(s: str) -> str:
    import _json

    return str(_json.encode_basestring_ascii(s))


def metadata_json(
    *,
    container_id: str,
    init_pid: int,
    init_start_time: int,
    created: float,
    token: str,
    pod: dict[str, str],
    cgroup_path: str,
    gpus: list[GPU],
) -> bytes:
    """vgpu.schemas.ContainerMetadata as JSON (field for field)."""
    g = ",".join(
        "{"
        f'"uuid":{_jstr(x.uuid)},"memory_limit":{x.memory_limit},"core_percent":{x.core_percent},'
        f'"vgpu_ids":[{",".join(_jstr(v) for v in x.vgpu_ids)}]'
        "}"
        for x in gpus
    )
    text = (
        "{"
        f'"version":1,"container_id":{_jstr(container_id)},"init_pid":{int(init_pid)},'
        f'"init_start_time":{int(init_start_time)},"created":{float(created)!r},"token":{_jstr(token)},'
        f'"pod_namespace":{_jstr(pod["pod_namespace"])},"pod_name":{_jstr(pod["pod_name"])},'
        f'"container_name":{_jstr(pod["container_name"])},"pod_uid":{_jstr(pod["pod_uid"])},'
        f'"cgroup_path":{_jstr(cgroup_path)},"gpus":[{g}]'
        "}"
    )
    return text.encode()


def write_file(path: str, data: bytes | bytearray, mode: int) -> None:
    """Write via a temp file and rename (no fsync: per-container state dies with the node)."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
