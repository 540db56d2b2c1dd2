"""msgspec schemas for the records exchanged between the daemons (contracts 1, 2 and 6).

Allocation records are written by either front end (the device plugin per container, the DRA
plugin per claim) and read by the hook, the monitor and vgpuctl; container metadata is written
by the hook, claim metadata by the DRA plugin, both read by the monitor and vgpuctl.
All are JSON files on the host, root-only.
"""

from __future__ import annotations

import _thread
import os
from typing import Annotated

import msgspec

RECORD_VERSION = 1
METADATA_VERSION = 1
CLAIM_METADATA_VERSION = 1

# Names carried by the device plugin's Allocate response (contract 1).
TOKEN_ENV = "VGPU_ALLOCATION_TOKEN"
TOKEN_ANNOTATION = "vgpu.k8s.io/allocation-token"

Bytes = Annotated[int, msgspec.Meta(ge=0)]
Percent = Annotated[int, msgspec.Meta(ge=0, le=10_000)]
Uuid = Annotated[str, msgspec.Meta(min_length=1, max_length=95, pattern=r"^[A-Za-z0-9-]+$")]


class AllocatedGPU(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One physical GPU of an allocation, with the container's slice of it."""

    uuid: Uuid
    memory_limit: Bytes
    core_percent: Percent
    vgpu_ids: list[str] = msgspec.field(default_factory=list)


class AllocationRecord(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/var/lib/vgpu/allocations/<token>.json`."""

    version: int = RECORD_VERSION
    token: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
    created: float
    resource_name: str = "nvidia.com/gpu"
    oversubscribe: bool = False
    gpus: list[AllocatedGPU]


class ContainerMetadata(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Host-only metadata in `/var/lib/vgpu/containers/<id>/metadata.json`."""

    version: int = METADATA_VERSION
    container_id: str
    init_pid: int
    init_start_time: int = 0
    created: float
    token: str
    pod_namespace: str = ""
    pod_name: str = ""
    container_name: str = ""
    pod_uid: str = ""
    cgroup_path: str = ""
    gpus: list[AllocatedGPU] = msgspec.field(default_factory=list)


class ClaimDevice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One allocation result of the DRA driver in a claim: a share of one GPU."""

    request: str
    pool: str
    device: str
    share_id: str = ""
    uuid: str
    memory: int
    cores: int


class PodRef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    uid: str


class ClaimMetadata(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Host-only metadata of a prepared claim, `<state_dir>/claims/<claim-uid>/claim.json`
    (written by the DRA plugin; read by the monitor and vgpuctl)."""

    version: int = CLAIM_METADATA_VERSION
    claim_uid: str
    namespace: str
    name: str
    token: str
    created: float
    driver: str
    devices: list[ClaimDevice] = msgspec.field(default_factory=list)
    gpus: list[AllocatedGPU] = msgspec.field(default_factory=list)
    # The pods the claim was reserved for when it was prepared (status.reservedFor). The kubelet
    # prepares a claim once per node: pods that join a shared claim later are not listed.
    reserved_for: list[PodRef] = msgspec.field(default_factory=list)


_encoder = msgspec.json.Encoder()


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The process's umask, read once at import (daemons start single-threaded and never change it):
# a created file needs an fchmod only when the umask would strip bits of its mode.
UMASK = _current_umask()


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write a file atomically: temp file in the same directory (a leading dot and no extension:
    readers that list `*.json` never see it), then rename. `durable`: fsync of the file before the
    rename and of the directory after it; without, the file appears whole or not at all, but a
    machine crash may lose it (for files rebuilt from a durable source, e.g. the DRA checkpoint).

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
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
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


def write_new(path: str, data: bytes, mode: int) -> None:
    """Create `path` with `data` (O_EXCL, never through a link), in place and without fsync: for a
    directory made a moment ago that nothing reads yet."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if mode & UMASK:
            os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def read_record(path: str) -> AllocationRecord:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=AllocationRecord)


def read_metadata(path: str) -> ContainerMetadata:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=ContainerMetadata)


def read_claim_metadata(path: str) -> ClaimMetadata:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=ClaimMetadata)
