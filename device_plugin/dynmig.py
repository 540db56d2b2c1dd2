"""Dynamic MIG on the node (`mig_strategy = dynamic`): a MIG instance created for each container
the scheduler placed on a GPU in MIG mode, before the container starts, and destroyed when its pod
is gone (docs/operators/mig.md, "Dynamic MIG"; the scheduler's side: vgpu_scheduler/mig.py).

- **Allocate** (`ensure`): the decision names the GPU, the GPU instance profile and its placement
  (`vgpu.scheduling.MigAssignment`); the instance is created at exactly that placement with a
  compute instance spanning it (nodecore/migops.py), and the container gets its MIG device (its
  UUID in NVIDIA_VISIBLE_DEVICES and the limits, the instance's memory as its memory limit).
- **What the node made** is written down before NVML is asked (`<state_dir>/mig-instances/`, one
  file per instance: GPU, placement, profile, pod UID and container, then the instance IDs and
  MIG UUID once made), so nothing is created twice: a kubelet that calls Allocate again for the
  container, or a plugin restarted after the instance was made or half made (a GPU instance
  without its compute instance), finds the instance by its placement and uses it. An instance at
  that placement the node did not make (an administrator's) is never taken over: Allocate fails.
- **Destroying** (`reap`): an instance whose pod is no longer on this node (the API's pod list of
  the node; Succeeded and Failed pods count as gone) and runs no process is destroyed (compute
  instance, then GPU instance) and its file removed. Without an API server nothing is destroyed.
- **Inventory** (`inventory`): per GPU in MIG mode its profiles, their placements and the free
  ones, and every GPU instance that exists (any: the administrator's too) with the pod it was made
  for: the node inventory's version 3 (vgpu.scheduling.MigGPU).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from nodecore import migops
from vgpu import scheduling as sc
from vgpu.log import kv
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths
from vgpu.schemas import write_atomic

log = logging.getLogger(__name__)

DIR = "mig-instances"
COMPUTE_SLICES = 7  # a GPU's compute slices: "one seventh of the total number of SMs" (MIG user guide)


class DynamicMigError(RuntimeError):
    """The decided instance cannot be given to the container (the Allocate fails)."""


class Made(msgspec.Struct, kw_only=True):
    """One instance this node made (or is making) for a container."""

    parent: str
    profile: str
    profile_id: int
    start: int
    size: int
    slices: int
    pod: str
    container: str
    created: float
    gi: int = -1  # -1: not made yet
    ci: int = -1
    uuid: str = ""
    memory: int = 0


@dataclass(frozen=True)
class Placed:
    """A MIG device this node made, as the scheduler counts it (device_plugin/usage.py)."""

    parent: str
    assignment: sc.MigAssignment
    cores: int  # the instance's compute in percent of the GPU


def _default_handle(uuid: str) -> Any:
    import pynvml

    return pynvml.nvmlDeviceGetHandleByUUID(uuid)


class DynamicMig:
    """The GPUs in MIG mode of a node whose instances are made per container; thread-safe."""

    def __init__(
        self,
        paths: Paths,
        gpus: Sequence[GPUInfo],
        *,
        handle_of: Callable[[str], Any] = _default_handle,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = os.path.join(paths.state_dir, DIR)
        self.gpus = {g.uuid: g for g in gpus}
        self.handle_of = handle_of
        self.clock = clock
        self._lock = threading.RLock()
        self._profiles: dict[str, list[migops.GIProfile]] = {}
        self._busy_warned: set[str] = set()

    def enabled(self, uuid: str) -> bool:
        return uuid in self.gpus

    # --- the files -------------------------------------------------------------------
    def _path(self, parent: str, start: int) -> str:
        return os.path.join(self.dir, f"{parent}_{start}.json")

    def records(self) -> list[Made]:
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if not n.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.dir, n), "rb") as f:
                    out.append(msgspec.json.decode(f.read(), type=Made))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning(kv("unreadable MIG instance file kept", file=n, error=e))
        return out

    def _read(self, parent: str, start: int) -> Made | None:
        try:
            with open(self._path(parent, start), "rb") as f:
                return msgspec.json.decode(f.read(), type=Made)
        except FileNotFoundError:
            return None

    def _write(self, rec: Made) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        write_atomic(self._path(rec.parent, rec.start), msgspec.json.encode(rec), 0o600)

    def _remove(self, rec: Made) -> None:
        try:
            os.unlink(self._path(rec.parent, rec.start))
        except FileNotFoundError:
            pass

    # --- NVML ------------------------------------------------------------------------
    def profiles(self, uuid: str) -> list[migops.GIProfile]:
        """The GPU's profiles (their `remaining` as of now)."""
        return migops.profiles(self.handle_of(uuid), self.gpus[uuid].memory_total)

    def _profile_ids(self, uuid: str) -> list[int]:
        ps = self._profiles.get(uuid)
        if ps is None:
            ps = self._profiles[uuid] = self.profiles(uuid)
        return [p.id for p in ps]

    # --- Allocate ----------------------------------------------------------------------
    def ensure(self, parent: str, a: sc.MigAssignment, pod: str, container: str) -> GPUInfo:
        """The MIG device of the decided instance, made now unless it exists already for this
        container (DynamicMigError when it cannot be)."""
        if parent not in self.gpus:
            raise DynamicMigError(f"GPU {parent} does not make MIG instances here")
        with self._lock:
            rec = self._read(parent, a.start)
            if rec is not None and (rec.pod, rec.container, rec.profile_id) != (pod, container, a.id):
                raise DynamicMigError(
                    f"MIG placement {a.start} of GPU {parent} is held by an instance made for pod {rec.pod} "
                    f"container {rec.container}"
                )
            h = self.handle_of(parent)
            ids = self._profile_ids(parent)
            at = next((g for g in migops.gpu_instances(h, ids) if g.start == a.start), None)
            fresh = rec is None
            if rec is None:
                if at is not None:
                    raise DynamicMigError(f"MIG placement {a.start} of GPU {parent} holds an instance not made here")
                rec = Made(
                    parent=parent,
                    profile=a.profile,
                    profile_id=a.id,
                    start=a.start,
                    size=a.size,
                    slices=a.slices,
                    pod=pod,
                    container=container,
                    created=self.clock(),
                )
                self._write(rec)  # first: a restart finds what it was making
            reuse: int | None = None
            if at is not None:
                if at.profile_id != a.id:
                    raise DynamicMigError(f"MIG placement {a.start} of GPU {parent} holds another profile's instance")
                reuse = at.id
            try:
                gi, ci = migops.create(h, a.id, a.start, a.size, a.slices, reuse)
            except migops.MigOpError as e:
                if fresh:
                    self._remove(rec)
                raise DynamicMigError(f"GPU {parent}: {e}") from None
            dev = migops.device_of(h, self.gpus[parent], gi, ci)
            if dev is None:
                raise DynamicMigError(f"GPU {parent}: no MIG device for GPU instance {gi} compute instance {ci}")
            made = reuse is None or rec.gi != gi or rec.ci != ci
            rec.gi, rec.ci, rec.uuid, rec.memory = gi, ci, dev.uuid, dev.memory_total
            self._write(rec)
        log.warning(
            kv(
                "MIG instance made" if made else "MIG instance reused",
                gpu=parent,
                profile=a.profile,
                start=a.start,
                gi=gi,
                ci=ci,
                uuid=dev.uuid,
                pod=pod,
                container=container,
            )
        )
        return dev

    # --- the pods are gone ---------------------------------------------------------------
    def reap(self, live: set[str], listed_at: float) -> list[str]:
        """Destroy the instances of pods not in `live` (the node's pods as listed at `listed_at`;
        an instance made since is kept) that run no process; their MIG UUIDs (or placements)."""
        out: list[str] = []
        with self._lock:
            for rec in self.records():
                if rec.pod in live or rec.created >= listed_at:
                    continue
                try:
                    h = self.handle_of(rec.parent)
                except Exception as e:  # the GPU is gone from NVML: nothing to destroy
                    log.warning(kv("MIG instance file of a GPU NVML does not know removed", gpu=rec.parent, error=e))
                    self._remove(rec)
                    continue
                gi = rec.gi
                if gi < 0:  # made halfway before a restart: the GPU instance at its placement, if any
                    at = [g for g in migops.gpu_instances(h, self._profile_ids(rec.parent)) if g.start == rec.start]
                    gi = at[0].id if at and at[0].profile_id == rec.profile_id else -1
                if gi >= 0:
                    n = migops.processes(h, gi)
                    if n:
                        if rec.uuid not in self._busy_warned:
                            log.warning(
                                kv(
                                    "MIG instance of a gone pod still runs processes; kept",
                                    uuid=rec.uuid,
                                    pod=rec.pod,
                                    processes=n,
                                )
                            )
                            self._busy_warned.add(rec.uuid)
                        continue
                    try:
                        migops.destroy(h, gi)
                    except migops.MigOpError as e:
                        log.warning(kv("cannot destroy MIG instance; retried", uuid=rec.uuid, error=e))
                        continue
                self._remove(rec)
                self._busy_warned.discard(rec.uuid)
                log.warning(
                    kv(
                        "MIG instance destroyed",
                        gpu=rec.parent,
                        profile=rec.profile,
                        start=rec.start,
                        uuid=rec.uuid,
                        pod=rec.pod,
                        reason="pod gone",
                    )
                )
                out.append(rec.uuid or f"{rec.parent}:{rec.start}")
        return out

    # --- what the scheduler sees ------------------------------------------------------------
    def placed(self) -> dict[str, Placed]:
        """MIG UUID -> the instance made for a container (the node's published usage)."""
        out = {}
        for rec in self.records():
            if rec.uuid:
                a = sc.MigAssignment(
                    profile=rec.profile, id=rec.profile_id, start=rec.start, size=rec.size, slices=rec.slices
                )
                cores = 100 if rec.slices >= COMPUTE_SLICES else 100 * rec.slices // COMPUTE_SLICES
                out[rec.uuid] = Placed(rec.parent, a, cores)
        return out

    def inventory(self) -> dict[str, sc.MigGPU]:
        """GPU UUID -> its profiles, placements (all and free) and instances, from NVML now."""
        out: dict[str, sc.MigGPU] = {}
        recs = {(r.parent, r.start): r for r in self.records()}
        for uuid in self.gpus:
            try:
                h = self.handle_of(uuid)
                profs = self.profiles(uuid)
                gis = migops.gpu_instances(h, [p.id for p in profs])
                uuids = {(d.mig_gi, d.mig_ci): d.uuid for d in migops.devices(h, self.gpus[uuid])}
            except Exception as e:  # NVML errors: the GPU is published without MIG data (takes no pod)
                log.warning(kv("cannot read the MIG instances", gpu=uuid, error=e))
                continue
            name = {p.id: p.name for p in profs}
            taken = 0
            for g in gis:
                taken |= ((1 << g.size) - 1) << g.start
            instances = []
            for g in gis:
                rec = recs.get((uuid, g.start))
                mine = rec is not None and rec.gi in (g.id, -1)
                mig_uuid = next((u for (gi, _ci), u in sorted(uuids.items()) if gi == g.id), "")
                instances.append(
                    sc.MigInstance(
                        profile=name.get(g.profile_id, str(g.profile_id)),
                        start=g.start,
                        size=g.size,
                        uuid=mig_uuid,
                        pod=rec.pod if mine and rec is not None else "",
                    )
                )
            profiles = []
            for p in profs:
                starts = tuple(s for s, _ in p.placements)
                size = p.placements[0][1] if p.placements else 1
                free = tuple(s for s in starts if not taken & (((1 << size) - 1) << s)) if p.remaining else ()
                profiles.append(
                    sc.MigProfile(
                        name=p.name,
                        id=p.id,
                        memory=p.memory,
                        slices=p.slices,
                        memory_slices=size,
                        placements=starts,
                        free=free,
                    )
                )
            out[uuid] = sc.MigGPU(
                profiles=tuple(profiles),
                instances=tuple(instances),
                compute_slices=max((p.slices for p in profs), default=COMPUTE_SLICES),
            )
        return out


# --- the plugin's use of it (device_plugin/daemon.py) ------------------------------------------
def preparer(dm: DynamicMig) -> Callable[[Any, Any], Any]:
    """The Allocate step (device_plugin/server.py `prepare`): each GPU of the slice that makes MIG
    instances becomes the MIG device made for the container (its memory the limit; its compute
    share 100 percent of the instance, which no one enforces: docs/operators/mig.md)."""
    from device_plugin.allocator import Slice
    from device_plugin.decisionpolicy import Claim, DecisionError
    from vgpu.schemas import AllocatedGPU

    def prepare(claim: Claim | None, sl: Slice) -> Slice:
        if not any(dm.enabled(g.uuid) for g in sl.gpus):
            return sl
        decided = {g.uuid: g.mig for g in claim.container.gpus} if claim is not None else {}
        out = []
        for g in sl.gpus:
            if not dm.enabled(g.uuid):
                out.append(g)
                continue
            a = decided.get(g.uuid)
            if claim is None or not isinstance(a, sc.MigAssignment):
                raise DecisionError(
                    f"GPU {g.uuid} is in MIG mode: its instances are made for scheduler decisions naming them "
                    f"(pod annotation {sc.MIG_ANNOTATION}, vgpu-scheduler)"
                )
            try:
                dev = dm.ensure(g.uuid, a, claim.pod.uid, claim.container.name)
            except DynamicMigError as e:
                raise DecisionError(f"container {claim.container.name}: {e}") from None
            out.append(
                AllocatedGPU(uuid=dev.uuid, memory_limit=dev.memory_total, core_percent=100, vgpu_ids=list(g.vgpu_ids))
            )
        return Slice(gpus=out)

    return prepare


class Reaper:
    """Destroys the instances of gone pods every `interval_s` (the housekeeping thread): lists
    the node's pods through the API server (none configured or unreachable: nothing is destroyed,
    said once)."""

    def __init__(
        self, dm: DynamicMig, node: str, interval_s: float = 5.0, api_factory: Callable[[], Any] | None = None
    ) -> None:
        self.dm = dm
        self.node = node
        self.interval_s = interval_s
        self._factory = api_factory
        self._api: Any | None = None
        self._next = 0.0
        self._warned = False

    def _client(self) -> Any | None:
        if self._api is None:
            if self._factory is None:
                from device_plugin.inventory import load_client

                self._factory = load_client
            try:
                self._api = self._factory()
            except Exception as e:
                self._warn(f"no Kubernetes client: {e}")
        return self._api

    def _warn(self, why: str) -> None:
        if not self._warned:
            log.warning(kv("MIG instances of gone pods cannot be found; none destroyed", reason=why))
            self._warned = True

    def tick(self, now: float) -> bool:
        """Reap when due; True when an instance was destroyed (the inventory is due)."""
        if now < self._next:
            return False
        self._next = now + self.interval_s
        if not self.dm.records():
            return False
        api = self._client()
        if api is None:
            self._warn("no API server configured")
            return False
        from device_plugin.usage import list_node_pods

        listed_at = self.dm.clock()
        try:
            pods = list_node_pods(api, self.node)
        except Exception as e:  # ApiException, connection errors
            self._warn(str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            return False
        self._warned = False
        live = {
            str((p.get("metadata") or {}).get("uid") or "")
            for p in pods
            if (p.get("status") or {}).get("phase") not in sc.TERMINATED_PHASES
        }
        return bool(self.dm.reap(live, listed_at))
