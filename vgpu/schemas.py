"""The JSON documents of our on-disk contracts, and their one reader and writer (contracts 1 and 2).

| document | file | written by | read by |
| --- | --- | --- | --- |
| `AllocationRecord` | `<state_dir>/allocations/<token>.json` | both front ends | hook, monitor, vgpuctl, front ends |
| `ContainerMetadata` | `<state_dir>/containers/<id>/metadata.json` | hook | monitor, vgpuctl |
| `ClaimMetadata` | `<claims_dir>/<uid>/claim.json` | DRA plugin | monitor, vgpuctl |

(The device plugin writes one record per container, the DRA plugin one per claim.)

Standard library only and cheap to import: the OCI hook reads records and writes metadata with
this module under the node's `python3 -I -S` (no site-packages, so no msgspec), and every other
part uses the same code, so there is nothing to keep in step. Decoding is strict, as the
container's neighbours expect of a file that sets limits: unknown fields, wrong types and values
out of range are refused (`SchemaError`, naming the path of the bad field, e.g.
``Expected `int` >= 0 at `$.gpus[0].memory_limit` ``); a bool is never taken for an integer.
All files are root-only on the host.
"""

from __future__ import annotations

import _thread
import os

from vgpu import jsonfast

TYPE_CHECKING = False  # `typing` costs the hook ~3 ms
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    S = TypeVar("S", bound="Schema")

RECORD_VERSION = 1
METADATA_VERSION = 1
CLAIM_METADATA_VERSION = 1

# Names carried by the device plugin's Allocate response (contract 1).
TOKEN_ENV = "VGPU_ALLOCATION_TOKEN"
TOKEN_ANNOTATION = "vgpu.k8s.io/allocation-token"

_INT_MIN = -(1 << 63)
_UINT_MAX = (1 << 64) - 1
_HEX = frozenset("0123456789abcdef")
_UUID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")


class SchemaError(ValueError):
    """A document that does not match its schema; the message names the field."""


# ----- field checks: (value, path) -> value, or SchemaError -----


def _int(lo: int = _INT_MIN, hi: int = _UINT_MAX) -> Callable[[object, str], int]:
    def check(v: object, where: str) -> int:
        if type(v) is not int:
            raise SchemaError(f"Expected `int` at `{where}`")
        if v < lo:
            raise SchemaError(f"Expected `int` >= {lo} at `{where}`")
        if v > hi:
            raise SchemaError(f"Expected `int` <= {hi} at `{where}`")
        return v

    return check


def _opt_int(lo: int = 0, hi: int = _UINT_MAX) -> Callable[[object, str], int | None]:
    check_int = _int(lo, hi)

    def check(v: object, where: str) -> int | None:
        return None if v is None else check_int(v, where)

    return check


def _float(v: object, where: str) -> float:
    if type(v) is int:
        v = float(v)
    if type(v) is not float or v - v != 0.0:  # also refuses inf and nan
        raise SchemaError(f"Expected `float` at `{where}`")
    return v


def _bool(v: object, where: str) -> bool:
    if type(v) is not bool:
        raise SchemaError(f"Expected `bool` at `{where}`")
    return v


def _str(v: object, where: str) -> str:
    if type(v) is not str:
        raise SchemaError(f"Expected `str` at `{where}`")
    return v


def _uuid(v: object, where: str) -> str:
    s = _str(v, where)
    if not 1 <= len(s) <= 95 or not _UUID_CHARS.issuperset(s):
        raise SchemaError(f"Expected a GPU UUID (1-95 of [A-Za-z0-9-]) at `{where}`")
    return s


def _token(v: object, where: str) -> str:
    s = _str(v, where)
    if len(s) != 32 or not _HEX.issuperset(s):
        raise SchemaError(f"Expected `str` of 32 lowercase hex digits at `{where}`")
    return s


def _list(item: Callable[[object, str], Any]) -> Callable[[object, str], list[Any]]:
    def check(v: object, where: str) -> list[Any]:
        if type(v) is not list:
            raise SchemaError(f"Expected `array` at `{where}`")
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return check


def _of(cls: type[S]) -> Callable[[object, str], S]:
    def check(v: object, where: str) -> S:
        return cls.from_builtins(v, where)

    return check


def _oneline(text: str, limit: int) -> str:
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:limit]


class Schema:
    """A document type: `FIELDS` is (name, check, default) in order; a default of `list`
    means a fresh empty list, `REQUIRED` that the field must be given."""

    __slots__ = ()
    FIELDS: tuple[tuple[str, Callable[[object, str], Any], object], ...] = ()

    @classmethod
    def from_builtins(cls: type[S], obj: object, where: str = "$") -> S:
        """Validate decoded JSON (dicts, lists, str, int, float, bool) into an instance."""
        if type(obj) is not dict:
            raise SchemaError(f"Expected `object` at `{where}`")
        names = {f[0] for f in cls.FIELDS}
        for k in obj:
            if k not in names:
                raise SchemaError(f"Object contains unknown field `{_oneline(str(k), 40)}` at `{where}`")
        self = cls.__new__(cls)
        for name, check, default in cls.FIELDS:
            if name in obj:
                value = check(obj[name], f"{where}.{name}")
            elif default is REQUIRED:
                raise SchemaError(f"Object missing required field `{name}` at `{where}`")
            else:
                value = [] if default is list else default
            object.__setattr__(self, name, value)
        return self

    def to_builtins(self) -> dict[str, Any]:
        """An optional field (default None) that is None is left out: a document without it
        reads the same, and one written before the field existed is written back unchanged."""
        out = {}
        for name, _, default in self.FIELDS:
            v = getattr(self, name)
            if v is None and default is None:
                continue
            out[name] = _builtins(v)
        return out

    def encode(self) -> bytes:
        return jsonfast.dumps(self.to_builtins())

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n, _, _ in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n, _, _ in self.FIELDS)
        return f"{type(self).__name__}({body})"


REQUIRED = object()


def _builtins(v: object) -> object:
    if isinstance(v, Schema):
        return v.to_builtins()
    if type(v) is list:
        return [_builtins(x) for x in v]  # type: ignore[union-attr]
    return v


class AllocatedGPU(Schema):
    """One physical GPU of an allocation, with the container's slice of it.

    `memory_limit` is the slice (bytes the container may hold, device- and host-resident);
    `device_limit` its physical share, the bytes that may be resident on the GPU (at most the
    slice; the slice over the memory scaling when it oversubscribes). None (a record written
    before the field existed) means the slice itself, which is only valid without
    oversubscription (vgpu.limits.from_gpu)."""

    __slots__ = ("core_percent", "device_limit", "memory_limit", "uuid", "vgpu_ids")
    uuid: str
    memory_limit: int  # bytes
    core_percent: int  # percent of the GPU's compute (0..10000)
    vgpu_ids: list[str]
    device_limit: int | None  # bytes

    def __init__(
        self,
        *,
        uuid: str,
        memory_limit: int,
        core_percent: int,
        vgpu_ids: list[str] | None = None,
        device_limit: int | None = None,
    ) -> None:
        self.uuid = uuid
        self.memory_limit = memory_limit
        self.core_percent = core_percent
        self.vgpu_ids = [] if vgpu_ids is None else vgpu_ids
        self.device_limit = device_limit


AllocatedGPU.FIELDS = (
    ("uuid", _uuid, REQUIRED),
    ("memory_limit", _int(0), REQUIRED),
    ("core_percent", _int(0, 10_000), REQUIRED),
    ("vgpu_ids", _list(_str), list),
    ("device_limit", _opt_int(0), None),
)


class AllocationRecord(Schema):
    """`<state_dir>/allocations/<token>.json`."""

    __slots__ = ("created", "gpus", "oversubscribe", "resource_name", "token", "version")
    version: int
    token: str
    created: float
    resource_name: str
    oversubscribe: bool
    gpus: list[AllocatedGPU]

    def __init__(
        self,
        *,
        token: str,
        created: float,
        gpus: list[AllocatedGPU],
        resource_name: str = "nvidia.com/gpu",
        oversubscribe: bool = False,
        version: int = RECORD_VERSION,
    ) -> None:
        self.version = version
        self.token = token
        self.created = created
        self.resource_name = resource_name
        self.oversubscribe = oversubscribe
        self.gpus = gpus


AllocationRecord.FIELDS = (
    ("version", _int(), RECORD_VERSION),
    ("token", _token, REQUIRED),
    ("created", _float, REQUIRED),
    ("resource_name", _str, "nvidia.com/gpu"),
    ("oversubscribe", _bool, False),
    ("gpus", _list(_of(AllocatedGPU)), REQUIRED),
)


class ContainerMetadata(Schema):
    """Host-only metadata in `<state_dir>/containers/<id>/metadata.json`, written by the hook."""

    __slots__ = (
        "cgroup_path",
        "container_id",
        "container_name",
        "created",
        "gpus",
        "init_pid",
        "init_start_time",
        "pod_name",
        "pod_namespace",
        "pod_uid",
        "token",
        "version",
    )
    version: int
    container_id: str
    init_pid: int
    init_start_time: int
    created: float
    token: str
    pod_namespace: str
    pod_name: str
    container_name: str
    pod_uid: str
    cgroup_path: str
    gpus: list[AllocatedGPU]

    def __init__(
        self,
        *,
        container_id: str,
        init_pid: int,
        created: float,
        token: str,
        init_start_time: int = 0,
        pod_namespace: str = "",
        pod_name: str = "",
        container_name: str = "",
        pod_uid: str = "",
        cgroup_path: str = "",
        gpus: list[AllocatedGPU] | None = None,
        version: int = METADATA_VERSION,
    ) -> None:
        self.version = version
        self.container_id = container_id
        self.init_pid = init_pid
        self.init_start_time = init_start_time
        self.created = created
        self.token = token
        self.pod_namespace = pod_namespace
        self.pod_name = pod_name
        self.container_name = container_name
        self.pod_uid = pod_uid
        self.cgroup_path = cgroup_path
        self.gpus = [] if gpus is None else gpus


ContainerMetadata.FIELDS = (
    ("version", _int(), METADATA_VERSION),
    ("container_id", _str, REQUIRED),
    ("init_pid", _int(), REQUIRED),
    ("init_start_time", _int(), 0),
    ("created", _float, REQUIRED),
    ("token", _str, REQUIRED),
    ("pod_namespace", _str, ""),
    ("pod_name", _str, ""),
    ("container_name", _str, ""),
    ("pod_uid", _str, ""),
    ("cgroup_path", _str, ""),
    ("gpus", _list(_of(AllocatedGPU)), list),
)


class ClaimDevice(Schema):
    """One allocation result of the DRA driver in a claim: a share of one GPU."""

    __slots__ = ("cores", "device", "memory", "pool", "request", "share_id", "uuid")
    request: str
    pool: str
    device: str
    share_id: str
    uuid: str
    memory: int
    cores: int

    def __init__(
        self, *, request: str, pool: str, device: str, uuid: str, memory: int, cores: int, share_id: str = ""
    ) -> None:
        self.request = request
        self.pool = pool
        self.device = device
        self.share_id = share_id
        self.uuid = uuid
        self.memory = memory
        self.cores = cores


ClaimDevice.FIELDS = (
    ("request", _str, REQUIRED),
    ("pool", _str, REQUIRED),
    ("device", _str, REQUIRED),
    ("share_id", _str, ""),
    ("uuid", _str, REQUIRED),
    ("memory", _int(), REQUIRED),
    ("cores", _int(), REQUIRED),
)


class PodRef(Schema):
    __slots__ = ("name", "uid")
    name: str
    uid: str

    def __init__(self, *, name: str, uid: str) -> None:
        self.name = name
        self.uid = uid


PodRef.FIELDS = (("name", _str, REQUIRED), ("uid", _str, REQUIRED))


class ClaimMetadata(Schema):
    """Host-only metadata of a prepared claim, `<claims_dir>/<claim-uid>/claim.json`
    (written by the DRA plugin; read by the monitor and vgpuctl)."""

    __slots__ = (
        "claim_uid",
        "created",
        "devices",
        "driver",
        "gpus",
        "name",
        "namespace",
        "reserved_for",
        "token",
        "version",
    )
    version: int
    claim_uid: str
    namespace: str
    name: str
    token: str
    created: float
    driver: str
    devices: list[ClaimDevice]
    gpus: list[AllocatedGPU]
    # The pods the claim was reserved for when it was prepared (status.reservedFor). The kubelet
    # prepares a claim once per node: pods that join a shared claim later are not listed.
    reserved_for: list[PodRef]

    def __init__(
        self,
        *,
        claim_uid: str,
        namespace: str,
        name: str,
        token: str,
        created: float,
        driver: str,
        devices: list[ClaimDevice] | None = None,
        gpus: list[AllocatedGPU] | None = None,
        reserved_for: list[PodRef] | None = None,
        version: int = CLAIM_METADATA_VERSION,
    ) -> None:
        self.version = version
        self.claim_uid = claim_uid
        self.namespace = namespace
        self.name = name
        self.token = token
        self.created = created
        self.driver = driver
        self.devices = [] if devices is None else devices
        self.gpus = [] if gpus is None else gpus
        self.reserved_for = [] if reserved_for is None else reserved_for


ClaimMetadata.FIELDS = (
    ("version", _int(), CLAIM_METADATA_VERSION),
    ("claim_uid", _str, REQUIRED),
    ("namespace", _str, REQUIRED),
    ("name", _str, REQUIRED),
    ("token", _str, REQUIRED),
    ("created", _float, REQUIRED),
    ("driver", _str, REQUIRED),
    ("devices", _list(_of(ClaimDevice)), list),
    ("gpus", _list(_of(AllocatedGPU)), list),
    ("reserved_for", _list(_of(PodRef)), list),
)


def decode(data: bytes, cls: type[S]) -> S:
    """Decode and validate one document; SchemaError (a ValueError) on anything else."""
    try:
        obj = jsonfast.loads(data)
    except ValueError as e:
        raise SchemaError(f"invalid JSON: {e}") from None
    return cls.from_builtins(obj)


def encode(obj: Schema) -> bytes:
    return obj.encode()


# Reading: never through a link at the last component, never blocking on a FIFO, at most 1 MiB.
_MAX_DOC = 1 << 20


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        return os.read(fd, _MAX_DOC)
    finally:
        os.close(fd)


def read_record(path: str) -> AllocationRecord:
    return decode(_read(path), AllocationRecord)


def read_metadata(path: str) -> ContainerMetadata:
    return decode(_read(path), ContainerMetadata)


def read_claim_metadata(path: str) -> ClaimMetadata:
    return decode(_read(path), ClaimMetadata)


# ----- writing -----


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The process's umask, read once at import (daemons start single-threaded and never change it):
# a created file needs an fchmod only when the umask would strip bits of its mode.
UMASK = _current_umask()


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: str, data: bytes | bytearray, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write a file atomically: temp file in the same directory (a leading dot and no extension:
    readers that list `*.json` never see it), then rename. `durable`: fsync of the file before the
    rename and of the directory after it; without, the file appears whole or not at all, but a
    machine crash may lose it (for files rebuilt from a durable source: the hook's per-container
    state, the DRA checkpoint's claim directories).

    The temporary name is this process's and thread's own (created with O_EXCL, never through a
    link; a leftover of a killed writer with the same name is removed first): the directories
    written here are root-owned, so nobody else can race for it."""
    d, base = os.path.split(path)
    tmp = os.path.join(d or ".", f".tmp-{base}.{os.getpid()}.{_thread.get_ident()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, mode)
    try:
        if mode & UMASK:
            os.fchmod(fd, mode)
        _write_all(fd, data)
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
        tmp = ""
        if not durable:
            return
        dfd = os.open(d or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def write_new(path: str, data: bytes | bytearray, mode: int) -> None:
    """Create `path` with `data` (O_EXCL, never through a link), in place and without fsync: for a
    directory made a moment ago that nothing reads yet."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if mode & UMASK:
            os.fchmod(fd, mode)
        _write_all(fd, data)
    finally:
        os.close(fd)
