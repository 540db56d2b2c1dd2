"""Per-claim state: what the device-plugin path keeps per container, kept per claim.

On the DRA path the runtime applies our CDI edits before the container exists, so nothing can
be made per container: the files are made at NodePrepareResources, one set per claim, and every
container that uses the claim mounts the same ones. That is the point: they share one slice
(one region, so the library adds up their allocations against one limit).

`<state_dir>/claims/<claim-uid>/` (0700, root):

| file | mounted in the container as | mode |
| --- | --- | --- |
| `limits` | /run/vgpu/limits (ro) | 0644 |
| `region` | /run/vgpu/region (rw) | 0666 |
| `ld.so.preload` | /etc/ld.so.preload (ro) | 0644 |
| `claim.json` | - (host only: monitor, vgpuctl) | 0600 |

The limits and the region are the hook's (vgpu.limits.render, vgpu.region.initialise), from
the claim's allocation record. A region that exists is never rewritten: containers of the claim
may be running and accounting in it (a repeated Prepare, a plugin restart).
"""

from __future__ import annotations

import os
import shutil
import stat
import time

import msgspec

from vgpu import limits as vlimits
from vgpu import paths as vpaths
from vgpu import region as vregion
from vgpu.schemas import AllocatedGPU, AllocationRecord

CLAIM_METADATA = "claim.json"
CLAIM_METADATA_VERSION = 1


class ClaimDevice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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
    """Host-only metadata of a prepared claim (for the monitor and vgpuctl, phase 2)."""

    version: int = CLAIM_METADATA_VERSION
    claim_uid: str
    namespace: str
    name: str
    token: str
    created: float
    driver: str
    devices: list[ClaimDevice] = msgspec.field(default_factory=list)
    gpus: list[AllocatedGPU] = msgspec.field(default_factory=list)
    reserved_for: list[PodRef] = msgspec.field(default_factory=list)


def preload_text() -> str:
    """/etc/ld.so.preload of a claim's containers: our library only.

    Security: the device-plugin path keeps the image's own entries after ours, because its hook
    reads the image's file through the rootfs (openat2 RESOLVE_IN_ROOT) in the container's mount
    namespace. CDI edits are static: they are applied to the OCI spec before any rootfs exists
    and cannot read the image, and a CDI hook that did would run as root on the host against an
    untrusted rootfs, outside the checks of runtime_hook/. So the file is ours alone, written on
    the host, mounted read-only by the runtime (runc resolves the mount point inside the rootfs
    with its own symlink-safe join, as for every volume and for NVIDIA's CDI mounts): the image
    cannot widen it, and its own preload entries are not loaded (docs/dra.md says so).
    """
    return vpaths.CONTAINER_LIBRARY + "\n"


class ClaimState:
    """Creates, checks and removes per-claim directories under `claims_dir`."""

    def __init__(self, claims_dir: str) -> None:
        self.claims_dir = claims_dir

    def ensure_dir(self) -> None:
        os.makedirs(self.claims_dir, mode=0o700, exist_ok=True)
        os.chmod(self.claims_dir, 0o700)
        self._ensure_preload()

    @property
    def preload_path(self) -> str:
        # One file for every claim: its content is the same, and it is mounted read-only.
        return os.path.join(self.claims_dir, vpaths.PRELOAD_FILE)

    def _ensure_preload(self) -> None:
        want = preload_text().encode()
        try:
            with open(self.preload_path, "rb") as f:
                if f.read(4096) == want and not os.path.islink(self.preload_path):
                    return
        except OSError:
            pass
        _write(self.preload_path, want, 0o644)

    def path(self, claim_uid: str) -> str:
        # The UID was checked (claims.valid_uid) before it reaches here; refuse anything else.
        if not claim_uid or "/" in claim_uid or claim_uid in (".", ".."):
            raise ValueError(f"invalid claim uid {claim_uid[:64]!r}")
        return os.path.join(self.claims_dir, claim_uid)

    def files(self, claim_uid: str) -> dict[str, str]:
        d = self.path(claim_uid)
        return {
            "limits": os.path.join(d, vpaths.LIMITS_FILE),
            "region": os.path.join(d, vpaths.REGION_FILE),
            "preload": self.preload_path,
            "metadata": os.path.join(d, CLAIM_METADATA),
        }

    def complete(self, claim_uid: str) -> bool:
        """Every file is there (regular files, not links; the region of a region's size)."""
        for what, p in self.files(claim_uid).items():
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                return False
            if not stat.S_ISREG(st.st_mode) or (what == "region" and st.st_size != vregion.REGION_SIZE):
                return False
        return True

    def create(self, rec: AllocationRecord, meta: ClaimMetadata, *, keep_metadata: bool = False) -> None:
        """Make or complete the claim's directory (idempotent; an existing region is kept, and
        with `keep_metadata` an existing claim.json, which knows the pods the claim was for)."""
        d = self.path(meta.claim_uid)
        os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
        f = self.files(meta.claim_uid)
        lim = vlimits.from_record(rec)
        _write(f["limits"], vlimits.render(lim).encode(), 0o644)
        if not os.path.isfile(f["preload"]):
            self._ensure_preload()
        if not _is_region(f["region"]):
            write_region(f["region"], lim)
        if not (keep_metadata and os.path.isfile(f["metadata"]) and not os.path.islink(f["metadata"])):
            _write(f["metadata"], msgspec.json.encode(meta), 0o600)

    def remove(self, claim_uid: str) -> None:
        """Remove the claim's directory; a missing one is not an error."""
        p = self.path(claim_uid)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(p)
        else:
            os.unlink(p)

    def list(self) -> list[str]:
        """The claim directories (not the shared preload file)."""
        try:
            return sorted(n for n in os.listdir(self.claims_dir) if n != vpaths.PRELOAD_FILE)
        except FileNotFoundError:
            return []


def region_image(lim: list[vlimits.DeviceLimit]) -> bytes:
    """The bytes `vgpu.region.initialise` writes for these limits, up to the process slots
    (all zero in a fresh region): its ctypes layout, filled in the same way."""
    if len(lim) > vregion.MAX_DEVICES:
        raise ValueError(f"too many devices ({len(lim)} > {vregion.MAX_DEVICES})")
    buf = bytearray(vregion.REGION_SIZE)
    r = vregion.Region.from_buffer(buf)
    r.magic = vregion.MAGIC
    r.version = vregion.VERSION
    r.size = vregion.REGION_SIZE
    r.num_devices = len(lim)
    r.num_slots = vregion.MAX_SLOTS
    r.created = int(time.time())
    for i, d in enumerate(lim):
        u = d.uuid.encode()
        if len(u) >= vregion.UUID_LEN:
            raise ValueError(f"uuid too long: {d.uuid[:40]!r}")
        r.devices[i].uuid = u
        r.devices[i].memory_limit = d.memory_limit
        r.devices[i].core_percent = d.core_percent
        r.devices[i].flags = vregion.DEV_OVERSUBSCRIBE if d.oversubscribe else 0
    del r  # releases the buffer export
    return bytes(buf[: vregion.SLOT_OFFSET])


def write_region(path: str, lim: list[vlimits.DeviceLimit]) -> None:
    """A fresh region with the content of `vgpu.region.initialise` (tests/dra/test_claimstate.py
    compares the files byte for byte), written for speed: the header and devices, then the
    zeroed slots as allocated space (posix_fallocate: reads as zeros, and the library's later
    writes through its mapping cannot fail for want of disk space), no fsync (a claim's region
    is rebuilt from the checkpoint after a crash; sixteen fsyncs of 584 KiB would dominate
    Prepare, `make bench-dra`), renamed into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        os.fchmod(fd, 0o666)
        os.write(fd, region_image(lim))
        os.posix_fallocate(fd, 0, vregion.REGION_SIZE)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


def _is_region(path: str) -> bool:
    """A regular file of a region's size (a plugin crash never leaves a partial one: regions
    appear by rename)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == vregion.REGION_SIZE


def _write(path: str, data: bytes, mode: int) -> None:
    """Atomic replace without fsync: these files are rebuilt from the checkpoint after a crash."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.rename(tmp, path)


def new_metadata(
    *,
    claim_uid: str,
    namespace: str,
    name: str,
    rec: AllocationRecord,
    driver: str,
    devices: list[ClaimDevice],
    reserved_for: list[PodRef],
) -> ClaimMetadata:
    return ClaimMetadata(
        claim_uid=claim_uid,
        namespace=namespace,
        name=name,
        token=rec.token,
        created=time.time(),
        driver=driver,
        devices=devices,
        gpus=rec.gpus,
        reserved_for=reserved_for,
    )
