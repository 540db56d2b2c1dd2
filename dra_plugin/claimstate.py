"""Per-claim state: what the device-plugin path keeps per container, kept per claim.

On the DRA path the runtime applies our CDI edits before the container exists, so nothing can
be made per container: the files are made at NodePrepareResources, one set per claim, and every
container that uses the claim mounts the same ones. That is the point: they share one slice
(one region, so the library adds up their allocations against one limit).

`<state_dir>/claims/<claim-uid>/` (vgpu.paths `claim_dir`; 0700, root):

| file | mounted in the container as | mode |
| --- | --- | --- |
| `limits` | /run/vgpu/limits (ro) | 0644 |
| `region` | /run/vgpu/region (rw) | 0666 |
| `claim.json` | - (host only: monitor, vgpuctl; vgpu.schemas.ClaimMetadata) | 0600 |

and `<state_dir>/claims/ld.so.preload`, shared by every claim, at /etc/ld.so.preload (ro, 0644).

The directory is made as the hook makes a container's (vgpu.statedir), from the claim's
allocation record. A region that exists is never rewritten: containers of the claim
may be running and accounting in it (a repeated Prepare, a plugin restart). Nothing here is
fsynced: the plugin's checkpoint (fsynced once per call) rebuilds whatever a crash lost.
"""

from __future__ import annotations

import os
import stat
import time

from vgpu import limits as vlimits
from vgpu import paths as vpaths
from vgpu import region as vregion
from vgpu import statedir
from vgpu.schemas import UMASK, AllocationRecord, ClaimDevice, ClaimMetadata, PodRef, write_atomic


def preload_text() -> str:
    """/etc/ld.so.preload of a claim's containers: our library only.

    Security: the device-plugin path keeps the image's own entries after ours, because its hook
    reads the image's file through the rootfs (openat2 RESOLVE_IN_ROOT) in the container's mount
    namespace. CDI edits are static: they are applied to the OCI spec before any rootfs exists
    and cannot read the image, and a CDI hook that did would run as root on the host against an
    untrusted rootfs, outside the checks of runtime_hook/. So the file is ours alone, written on
    the host, mounted read-only by the runtime (runc resolves the mount point inside the rootfs
    with its own symlink-safe join, as for every volume and for NVIDIA's CDI mounts): the image
    cannot widen it, and its own preload entries are not loaded (docs/developers/dra-plugin.md says so).
    """
    return vpaths.CONTAINER_LIBRARY + "\n"


class ClaimState:
    """Creates, checks and removes per-claim directories under the state dir's claims dir."""

    def __init__(self, paths: vpaths.Paths) -> None:
        self.paths = paths
        self.claims_dir = paths.claims_dir

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
        write_atomic(self.preload_path, want, 0o644, durable=False)

    def path(self, claim_uid: str) -> str:
        # The UID was checked (claims.valid_uid) before it reaches here; refuse anything else.
        return self.paths.claim_dir(claim_uid)

    def files(self, claim_uid: str) -> dict[str, str]:
        d = self.path(claim_uid)
        return {
            "limits": os.path.join(d, vpaths.LIMITS_FILE),
            "region": os.path.join(d, vpaths.REGION_FILE),
            "preload": self.preload_path,
            "metadata": os.path.join(d, vpaths.CLAIM_METADATA_FILE),
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
        write_atomic(f["limits"], vlimits.render(lim).encode(), 0o644, durable=False)
        if not os.path.isfile(f["preload"]):
            self._ensure_preload()
        if not statedir.is_region(f["region"]):
            vregion.initialise(f["region"], lim, sparse=True)
        if not (keep_metadata and os.path.isfile(f["metadata"]) and not os.path.islink(f["metadata"])):
            write_atomic(f["metadata"], meta.encode(), 0o600, durable=False)

    def create_new(self, rec: AllocationRecord, meta: ClaimMetadata) -> None:
        """The directory of a claim seen for the first time, in few system calls (one Prepare of
        16 claims makes 16 of them: make bench-dra): a fresh directory nothing reads yet, its files
        created in place; claim.json last, renamed into place (the monitor takes a claim whose
        claim.json it cannot read yet for one still being made). Leftovers of an interrupted
        attempt are completed by `create` instead."""
        d = self.path(meta.claim_uid)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            self.create(rec, meta)
            return
        try:
            if UMASK & 0o700:
                os.chmod(d, 0o700)
            statedir.populate(
                d, vlimits.from_record(rec), vpaths.CLAIM_METADATA_FILE, meta.encode(), sparse_region=True
            )
        except BaseException:
            statedir.remove(d)
            raise

    def preload_ok(self) -> bool:
        return os.path.isfile(self.preload_path) and not os.path.islink(self.preload_path)

    def remove(self, claim_uid: str) -> None:
        """Remove the claim's directory; a missing one is not an error."""
        statedir.remove(self.path(claim_uid))

    def list(self) -> list[str]:
        """The claim directories (not the shared preload file)."""
        try:
            return sorted(n for n in os.listdir(self.claims_dir) if vpaths.valid_claim_uid(n))
        except FileNotFoundError:
            return []


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
