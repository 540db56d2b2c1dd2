"""The slices of the node as the monitor sees them: per-container state made by the hook, and
per-claim state made by the DRA plugin (two front ends, one node core: docs/design.md).

`<state_dir>/containers/<id>/` holds `metadata.json` (host-only, written by the hook: trusted),
`limits` (trusted, written by the hook) and `region` (shared with the container: untrusted,
validated on every read). `<claims_dir>/<claim-uid>/` (the DRA plugin's, under the run dir when
there is one) holds `claim.json` (host-only: trusted), `limits` and `region` the same way; one
claim is one slice, shared by every container that uses the claim, so it is one entity here:
`claim:<uid>` (a colon: never a container id, never a cgroup path component). The scan is cheap: a
directory is re-read only when its metadata/limits mtime changes. Claim directories are the DRA
plugin's to remove (NodeUnprepareResources); the monitor never collects them.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from monitor import procs
from monitor.procs import ProcKey
from vgpu import limits as vlimits
from vgpu import paths as vpaths
from vgpu import region as vregion
from vgpu import schemas
from vgpu.log import kv

log = logging.getLogger("vgpu.monitor.containers")

FULL_PARSE_INTERVAL_S = 30.0
RECHECK_S = 10.0  # re-validate every slot at least this often, changed or not


CLAIM_PREFIX = "claim:"


@dataclass
class Container:
    id: str
    dir: str
    metadata: schemas.ContainerMetadata | None = None
    claim: schemas.ClaimMetadata | None = None  # set for a DRA claim (kind "claim")
    kind: str = "container"
    region_id: tuple[int, int] | None = None  # (st_dev, st_ino) of a claim's region file
    limits: dict[str, vlimits.DeviceLimit] = field(default_factory=dict)  # uuid -> limit
    stamp: tuple[float, float] = (0.0, 0.0)
    checked_at: float = 0.0
    dir_mtime: float = 0.0
    error: str = ""
    # region cache
    region: vregion.RegionSnapshot | None = None
    region_generation: int = -1
    region_error: str = ""
    region_corrupt_total: int = 0
    region_parsed_at: float = 0.0

    @property
    def region_path(self) -> str:
        return os.path.join(self.dir, vpaths.REGION_FILE)

    @property
    def init_key(self) -> ProcKey | None:
        m = self.metadata
        if m is None or m.init_pid <= 0:
            return None
        return ProcKey(m.init_pid, m.init_start_time)

    def labels(self) -> dict[str, str]:
        """container_id, namespace, pod, container, claim: a container of the device-plugin path
        has claim ""; a DRA claim has container_id `claim:<uid>`, its namespace and name, the pods
        it was reserved for when prepared (comma-separated), and container "" (it is shared by
        all of them)."""
        if self.kind == "claim":
            cm = self.claim
            return {
                "container_id": self.id,
                "namespace": cm.namespace if cm else "",
                "pod": ",".join(sorted({p.name for p in cm.reserved_for})) if cm else "",
                "container": "",
                "claim": cm.name if cm else "",
            }
        m = self.metadata
        return {
            "container_id": self.id,
            "namespace": m.pod_namespace if m else "",
            "pod": m.pod_name if m else "",
            "container": m.container_name if m else "",
            "claim": "",
        }

    def share(self, uuid: str) -> float | None:
        lim = self.limits.get(uuid)
        return float(lim.core_percent) if lim else None

    def memory_limit(self, uuid: str) -> int | None:
        """The slice: device- and host-resident bytes together."""
        lim = self.limits.get(uuid)
        return lim.memory_limit if lim else None

    def device_limit(self, uuid: str) -> int | None:
        """The physical share: what may be resident on the GPU (the slice without oversubscription)."""
        lim = self.limits.get(uuid)
        return lim.device_limit if lim else None

    def host_bytes(self, uuid: str) -> int:
        """Host-resident (oversubscribed) bytes the library charged on this GPU, from the region. The
        region is the container's to write: this is only reported, never acted on, and at most the
        slice (what the library would have let it charge)."""
        snap, lim = self.region, self.limits.get(uuid)
        if snap is None or lim is None:
            return 0
        for j, d in enumerate(snap.devices):
            if d.uuid.lower() == uuid.lower():
                return min(sum(s.host_bytes[j] for s in snap.slots if j < len(s.host_bytes)), lim.memory_limit)
        return 0


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _is_real_dir(path: str) -> bool:
    """A directory itself: never follow a symlink out of the state or claims dir."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _recheck(c: Container, metadata_file: str, loaded: bool, load: Callable[[Container], None]) -> None:
    """Metadata and limits are written once, at prestart or prepare (atomically: a rename, which
    changes the directory's mtime): re-check them when the directory changed, while they are
    incomplete, and every RECHECK_S anyway; `load` them again when either file changed."""
    now = time.monotonic()
    dir_mtime = _mtime(c.dir)
    if not loaded or not c.limits or dir_mtime != c.dir_mtime or now - c.checked_at >= RECHECK_S:
        c.checked_at = now
        c.dir_mtime = dir_mtime
        stamp = (_mtime(os.path.join(c.dir, metadata_file)), _mtime(os.path.join(c.dir, vpaths.LIMITS_FILE)))
        if stamp != c.stamp:
            load(c)
            c.stamp = stamp


class Registry:
    def __init__(self, paths: vpaths.Paths) -> None:
        self.paths = paths
        self.containers: dict[str, Container] = {}

    def scan(self) -> dict[str, Container]:
        root = self.paths.containers_dir
        try:
            names = os.listdir(root)
        except OSError:
            names = []
        seen = set()
        for name in names:
            if not vpaths.valid_container_id(name):
                continue
            d = os.path.join(root, name)
            c = self.containers.get(name)
            if c is None:
                if not _is_real_dir(d):
                    continue
                c = self.containers[name] = Container(id=name, dir=d)
            seen.add(name)
            _recheck(c, vpaths.METADATA_FILE, c.metadata is not None, self._load)
        self._scan_claims(seen)
        for name in list(self.containers):
            if name not in seen:
                del self.containers[name]
        return self.containers

    def _scan_claims(self, seen: set[str]) -> None:
        """The DRA plugin's prepared claims: entities `claim:<uid>` once their claim.json is
        readable (a claim being made is picked up by the next scan)."""
        root = self.paths.claims_dir
        try:
            names = os.listdir(root)
        except OSError:
            return
        for name in names:
            if not vpaths.valid_claim_uid(name):
                continue
            cid = CLAIM_PREFIX + name
            d = os.path.join(root, name)
            c = self.containers.get(cid)
            if c is None:
                if not _is_real_dir(d):
                    continue
                c = Container(id=cid, dir=d, kind="claim")
            _recheck(c, vpaths.CLAIM_METADATA_FILE, c.claim is not None, self._load_claim)
            if c.claim is None:
                continue  # not made yet (or unreadable: logged)
            self.containers[cid] = c
            seen.add(cid)

    def _load_claim(self, c: Container) -> None:
        c.error = ""
        try:
            c.claim = schemas.read_claim_metadata(os.path.join(c.dir, vpaths.CLAIM_METADATA_FILE))
        except FileNotFoundError:
            c.claim = None
            return
        except (OSError, schemas.SchemaError) as e:
            c.claim = None
            log.warning(kv("unreadable claim metadata", claim=c.id, error=e))
            return
        lim: dict[str, vlimits.DeviceLimit] = {}
        try:
            with open(os.path.join(c.dir, vpaths.LIMITS_FILE), encoding="ascii", errors="replace") as f:
                for d in vlimits.parse(f.read(65536)):
                    lim[d.uuid] = d
        except (OSError, vlimits.LimitsError) as e:
            c.error = f"limits: {e}"
            log.warning(kv("unreadable claim limits", claim=c.id, error=e))
        c.limits = lim
        try:
            st = os.lstat(c.region_path)
            c.region_id = (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
        except OSError:
            c.region_id = None

    def _load(self, c: Container) -> None:
        c.error = ""
        try:
            c.metadata = schemas.read_metadata(os.path.join(c.dir, vpaths.METADATA_FILE))
        except FileNotFoundError:
            c.metadata = None
            c.error = "no metadata"
        except (OSError, schemas.SchemaError) as e:
            c.metadata = None
            c.error = f"metadata: {e}"
            log.warning(kv("unreadable container metadata", container=c.id, error=e))
        lim: dict[str, vlimits.DeviceLimit] = {}
        try:
            with open(os.path.join(c.dir, vpaths.LIMITS_FILE), encoding="ascii", errors="replace") as f:
                for d in vlimits.parse(f.read(65536)):
                    lim[d.uuid] = d
        except FileNotFoundError:
            if c.metadata is not None:  # fall back to the GPUs of the metadata
                for g in c.metadata.gpus:
                    lim[g.uuid] = vlimits.DeviceLimit(
                        uuid=g.uuid,
                        memory_limit=g.memory_limit,
                        core_percent=g.core_percent,
                        oversubscribe=False,
                        device_limit=g.device_limit,
                    )
        except (OSError, vlimits.LimitsError) as e:
            c.error = f"limits: {e}"
            log.warning(kv("unreadable container limits", container=c.id, error=e))
        c.limits = lim

    def read_region(self, c: Container) -> vregion.RegionSnapshot | None:
        """The container's region, re-parsed only when its generation changed; None if absent/corrupt.

        The region is untrusted: every failure becomes `region_error` (and a
        count), never an exception."""
        try:
            fd = os.open(c.region_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            c.region, c.region_error = None, ""
            return None
        except OSError as e:
            return self._corrupt(c, f"open: {e.strerror}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._corrupt(c, "not a regular file")
            if st.st_size < vregion.REGION_SIZE:
                return self._corrupt(c, f"short region ({st.st_size} < {vregion.REGION_SIZE} bytes)")
            head = os.pread(fd, vregion.HEADER.size, 0)
        finally:
            os.close(fd)
        if len(head) < vregion.HEADER.size:
            return self._corrupt(c, f"short region ({len(head)} bytes)")
        magic, version, size, ndev, nslots, _created, generation, *_ = vregion.HEADER.unpack(head)
        now = time.monotonic()
        if (
            c.region is not None
            and generation == c.region_generation
            and not c.region_error
            and now - c.region_parsed_at < FULL_PARSE_INTERVAL_S
            and (magic, version, size, nslots)
            == (vregion.MAGIC, vregion.VERSION, vregion.REGION_SIZE, vregion.MAX_SLOTS)
            and ndev == len(c.region.devices)
        ):
            return c.region  # header intact and nothing changed: the cached parse stands
        try:
            snap = vregion.read_region(c.region_path)
        except vregion.RegionCorrupt as e:
            return self._corrupt(c, str(e))
        except OSError as e:
            return self._corrupt(c, f"read: {e.strerror}")
        c.region, c.region_generation, c.region_error = snap, generation, ""
        c.region_parsed_at = now
        return snap

    def invalidate_region(self, c: Container) -> None:
        c.region_generation = -1

    def _corrupt(self, c: Container, why: str) -> vregion.RegionSnapshot | None:
        if c.region_error != why:
            log.warning(kv("corrupt region", container=c.id, reason=why))
            c.region_corrupt_total += 1
        c.region, c.region_error, c.region_generation = None, why, -1
        return None


def init_alive(c: Container) -> bool:
    k = c.init_key
    if k is None:
        return False
    st = procs.read_stat(k.pid)
    if st is None or st.state in ("Z", "X"):
        return False
    return k.start_time == 0 or st.start_time == k.start_time
