"""NodePrepareResources / NodeUnprepareResources: from a claim's allocation to the slice files.

Prepare, per claim the kubelet names (namespace, name, UID):

1. already in the checkpoint: the same answer again, after rebuilding any missing file
   (idempotent; the kubelet retries, and pods that share a claim each ask);
2. else GET the ResourceClaim (outside the lock, so claims of concurrent calls are read in
   parallel) and take our driver's results from it (claims.shares: UID check, pool, device,
   consumedCapacity as the scheduler recorded it);
3. under the lock: the allocation record (node core), the claim's directory (limits, region,
   ld.so.preload, claim.json), the CDI spec; then one checkpoint write for the whole call
   before answering. A claim that fails gets an error in its own entry and leaves nothing
   behind; the others go on.

Unprepare removes the claim from the checkpoint first (durable), then its spec, directory and
record; an unknown claim is already unprepared (after a best-effort sweep of leftovers).

Start-up (`recover`): rebuild what the checkpoint lists and is missing (a reboot empties
/var/run/cdi; the kubelet does not prepare a claim again that its own checkpoint lists), and
remove records, directories and specs of ours that it does not list (a crash between the first
write and the checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

from dra_plugin import apiclient, cdi, claims, slices
from dra_plugin import checkpoint as ckpt
from dra_plugin.claimstate import ClaimState, new_metadata
from dra_plugin.config import Settings
from nodecore.core import NodeCore
from nodecore.devices import Slicing
from nodecore.records import RecordStore
from vgpu import contextsizes
from vgpu.log import kv
from vgpu.schemas import AllocatedGPU, AllocationRecord, ClaimDevice, PodRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


@dataclass
class PrepareResult:
    devices: list[ckpt.PreparedDevice]
    error: str = ""


def share_vgpu_id(claim_uid: str, s: claims.Share) -> str:
    """The ID a share has in the record's `vgpu_ids` (`<GPU-UUID>::<rest>`, as device plugin IDs:
    the physical UUID is everything before the last `::`)."""
    return f"{s.uuid}::dra:{claim_uid}:{s.share_id or s.request}"


def merge(
    claim_uid: str, shares: Sequence[claims.Share], cores_cap: int, slicing: Slicing | None = None
) -> list[AllocatedGPU]:
    """A claim's entries of its allocation record: per GPU, in order of first appearance, the
    memory and cores of its shares added up (cores at most the GPU's whole compute; as several
    vGPUs of one GPU in one container on the device-plugin path), one vGPU ID per share. The
    physical share (`device_limit`) is the sum of each share's (`Slicing.device_share`: the
    consumed `memory` over the memory scaling), so the shares placed on a GPU of capacity S*M
    never hold more than M of it on the device."""
    gpus: dict[str, AllocatedGPU] = {}
    for s in shares:
        g = gpus.get(s.uuid)
        vid = share_vgpu_id(claim_uid, s)
        dev = slicing.device_share(s.memory) if slicing is not None else s.memory
        if g is None:
            gpus[s.uuid] = AllocatedGPU(
                uuid=s.uuid,
                memory_limit=s.memory,
                core_percent=min(s.cores, cores_cap),
                vgpu_ids=[vid],
                device_limit=dev,
            )
        else:
            g.memory_limit += s.memory
            g.device_limit = (g.device_limit or 0) + dev
            g.core_percent = min(g.core_percent + s.cores, cores_cap)
            g.vgpu_ids.append(vid)
    return list(gpus.values())


class Driver:
    """The DRA front end's claim handling over the node core: its GPUs and health, and its
    allocation records (resource name = the driver name, written without fsync: the checkpoint
    is the durable piece)."""

    def __init__(
        self,
        cfg: Settings,
        node: str,
        node_core: NodeCore,
        api: apiclient.ResourceAPI | None,
        *,
        records: RecordStore | None = None,
        state: ClaimState | None = None,
        specs: cdi.SpecDir | None = None,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.node_core = node_core
        self.gpus = {g.uuid: g for g in node_core.gpus}
        self.capacities = slices.capacities(node_core.gpus, cfg)
        self.cores_cap = slices.cores_policy(cfg).capacity
        self.records = records or node_core.records(cfg.driver_name, durable=False)
        self.api = api
        self.state = state or ClaimState(cfg.paths)
        self.specs = specs or cdi.SpecDir(cfg.cdi_dir)
        self._lock = threading.Lock()
        # New claims of one call are read and made in parallel (the API server's latency overlaps
        # the file work); calls preparing the same claim at once share one preparation.
        self._workers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="claim")
        self._inflight: dict[str, futures.Future[PrepareResult]] = {}
        self.cp = ckpt.Checkpoint(driver=cfg.driver_name, node=node)

    def close(self) -> None:
        self._workers.shutdown(wait=False)

    # --- start-up ------------------------------------------------------------------------------
    def recover(self) -> None:
        """Load the checkpoint, rebuild what it lists, remove what it does not."""
        with self._lock:
            self.cp = ckpt.load(self.cfg.checkpoint_path, self.cfg.driver_name, self.node)
            self.records.ensure_dir()
            self.state.ensure_dir()
            for pc in self.cp.claims.values():
                self._ensure(pc)
            self._sweep_orphans()
            if self.cp.claims:
                log.warning(kv("prepared claims restored", claims=len(self.cp.claims)))

    def _record_of(self, pc: ckpt.PreparedClaim) -> AllocationRecord:
        return AllocationRecord(
            token=pc.token,
            created=pc.created,
            resource_name=self.cfg.driver_name,
            oversubscribe=pc.oversubscribe,
            gpus=pc.gpus,
        )

    def _files(self, uid: str) -> cdi.ClaimFiles:
        f = self.state.files(uid)
        return cdi.ClaimFiles(
            library=self.cfg.library_path, limits=f["limits"], region=f["region"], preload=f["preload"]
        )

    def _context_reserve(self, gpus: Sequence[AllocatedGPU]) -> int:
        """The context size the monitor measured on the claim's GPUs (0: none yet), for the spec."""
        return contextsizes.reserve_for(self.cfg.paths.context_sizes_path, [g.uuid for g in gpus])

    def _ensure(self, pc: ckpt.PreparedClaim) -> None:
        """Rebuild the record, directory and spec of a checkpointed claim where missing."""
        rec = self._record_of(pc)
        if not self.records.has(pc.token):
            self.records.restore(rec)
            log.warning(kv("allocation record rebuilt", claim=f"{pc.namespace}/{pc.name}", uid=pc.uid))
        if not self.state.complete(pc.uid):
            meta = new_metadata(
                claim_uid=pc.uid,
                namespace=pc.namespace,
                name=pc.name,
                rec=rec,
                driver=self.cfg.driver_name,
                devices=list(pc.shares),
                reserved_for=[],
            )
            self.state.create(rec, meta, keep_metadata=True)
        if not self.specs.exists(pc.uid):
            self.specs.write(pc.uid, self._files(pc.uid), self._context_reserve(pc.gpus))
            log.warning(kv("CDI spec rebuilt", claim=f"{pc.namespace}/{pc.name}", uid=pc.uid))

    def _sweep_orphans(self) -> None:
        known = set(self.cp.claims)
        tokens = {c.token for c in self.cp.claims.values()}
        for rec in self.records.list():
            if rec.token not in tokens:
                self.records.remove(rec.token)
                log.warning(kv("orphan allocation record removed", token=rec.token[:8] + "…"))
        for uid in self.state.list():
            if uid not in known and claims.valid_uid(uid):
                self.state.remove(uid)
                log.warning(kv("orphan claim directory removed", uid=uid))
        for uid in self.specs.claims():
            if uid not in known and self._spec_is_ours(uid):
                self.specs.remove(uid)
                log.warning(kv("orphan CDI spec removed", uid=uid))

    def _spec_is_ours(self, uid: str) -> bool:
        """A claim spec whose files live in our claims dir (another instance's specs, e.g. with
        another state dir on the same host, are left alone)."""
        try:
            with open(self.specs.path(uid), "rb") as f:
                spec = json.loads(f.read(1 << 20))
            mounts = spec["devices"][0]["containerEdits"]["mounts"]
            return any(str(m.get("hostPath", "")).startswith(self.state.claims_dir + os.sep) for m in mounts)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return False

    # --- prepare ---------------------------------------------------------------------------------
    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Every claim named gets an entry; new claims are read and made in parallel, each as soon
        as its own read is back (API latency overlaps file work), then checkpointed together."""
        t0 = time.perf_counter()
        out: dict[str, PrepareResult] = {}
        mine: list[ClaimRef] = []
        waits: dict[str, futures.Future[PrepareResult]] = {}
        prepared: list[ckpt.PreparedClaim] = []
        with self._lock:
            for ref in refs:
                if ref.uid in out or ref.uid in waits or any(m.uid == ref.uid for m in mine):
                    continue
                if not claims.valid_uid(ref.uid):
                    out[ref.uid] = PrepareResult([], f"invalid ResourceClaim UID {ref.uid[:64]!r}")
                elif not ref.namespace or not ref.name:
                    out[ref.uid] = PrepareResult([], f"claim {ref.uid} without namespace or name")
                elif (pc := self.cp.claims.get(ref.uid)) is not None:
                    prepared.append(pc)
                elif (f := self._inflight.get(ref.uid)) is not None:
                    waits[ref.uid] = f  # a concurrent call is preparing it: its answer is ours
                else:
                    self._inflight[ref.uid] = futures.Future()
                    mine.append(ref)
        for pc in prepared:  # prepared earlier: the same answer (files restored where missing)
            out[pc.uid] = self._answer(pc)
        made: list[ckpt.PreparedClaim | str] = []
        try:
            made = self._read_and_make(mine)
            t1 = time.perf_counter()
            new = [m for m in made if not isinstance(m, str)]
            saved = ""
            with self._lock:
                for pc in new:
                    self.cp.claims[pc.uid] = pc
                if new:
                    try:
                        ckpt.save(self.cfg.checkpoint_path, self.cp)
                    except OSError as e:
                        log.error(kv("cannot write the DRA checkpoint", error=e.strerror or e))
                        saved = f"cannot write the DRA checkpoint: {e.strerror or e}"
                        for pc in new:
                            self.cp.claims.pop(pc.uid, None)
                            self._undo(pc.uid, pc.token)
                for ref, m in zip(mine, made, strict=True):
                    if isinstance(m, str):
                        out[ref.uid] = PrepareResult([], m)
                    else:
                        out[ref.uid] = PrepareResult([], saved) if saved else PrepareResult(list(m.devices))
            if mine and log.isEnabledFor(logging.DEBUG):
                t2 = time.perf_counter()
                log.debug(
                    kv(
                        "prepare",
                        claims=len(mine),
                        make_ms=round((t1 - t0) * 1000, 2),
                        checkpoint_ms=round((t2 - t1) * 1000, 2),
                    )
                )
        finally:
            with self._lock:
                for ref in mine:
                    f = self._inflight.pop(ref.uid)
                    f.set_result(out.get(ref.uid) or PrepareResult([], "prepare interrupted; retry"))
        for uid, f in waits.items():
            out[uid] = f.result()
        return out

    def _read_and_make(self, refs: list[ClaimRef]) -> list[ckpt.PreparedClaim | str]:
        """Per claim its preparation or the error text. The claims are read in parallel (the API
        server's latency overlaps); each is made in this thread as soon as its read is back (one
        thread doing the file work: the other threads only wait on sockets, so the interpreter's
        lock is not passed around at every system call)."""
        if not refs:
            return []
        problem = self._library_problem()
        if problem:
            return [f"cannot prepare ResourceClaim {r.namespace}/{r.name}: {problem}" for r in refs]
        if not self.state.preload_ok():
            self.state.ensure_dir()
        if len(refs) == 1:
            return [self._make_read(refs[0], self._safe_read(refs[0]))]
        pending = {self._workers.submit(self._safe_read, r): r for r in refs}
        done: dict[str, ckpt.PreparedClaim | str] = {}
        for f in futures.as_completed(pending):
            ref = pending[f]
            done[ref.uid] = self._make_read(ref, f.result())
        return [done[r.uid] for r in refs]

    def _library_problem(self) -> str:
        # Fail closed with a clear message rather than a runc mount error at container start.
        try:
            lib = os.stat(self.cfg.library_path)
        except OSError as e:
            return f"vGPU library {self.cfg.library_path}: {e.strerror}"
        if not stat.S_ISREG(lib.st_mode):
            return f"vGPU library {self.cfg.library_path} is not a regular file"
        return ""

    def _safe_read(self, ref: ClaimRef) -> tuple[list[claims.Share] | str, claims.ResourceClaim | None]:
        try:
            return self._read(ref)
        except Exception as e:  # a bug must fail this claim, not the call
            log.exception(kv("reading a claim failed", claim=f"{ref.namespace}/{ref.name}"))
            return f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {e}", None

    def _make_read(
        self, ref: ClaimRef, read: tuple[list[claims.Share] | str, claims.ResourceClaim | None]
    ) -> ckpt.PreparedClaim | str:
        got, claim = read
        if isinstance(got, str):
            return got
        return self._try_make(ref, got, claim)

    def _read(self, ref: ClaimRef) -> tuple[list[claims.Share] | str, claims.ResourceClaim | None]:
        """Our shares of the claim, or the error text for the kubelet."""
        if self.api is None:
            return "no Kubernetes API server configured: cannot read the ResourceClaim", None
        try:
            data = self.api.get_claim(ref.namespace, ref.name)
        except apiclient.ApiError as e:
            what = "not found" if e.status == 404 else f"cannot be read ({e.status or 'no answer'}: {e.message})"
            return f"ResourceClaim {ref.namespace}/{ref.name} {what}", None
        try:
            claim = claims.decode(data)
            got = claims.shares(
                claim,
                namespace=ref.namespace,
                name=ref.name,
                uid=ref.uid,
                driver=self.cfg.driver_name,
                pool=self.node,
                devices=self.capacities,
            )
        except claims.ClaimError as e:
            return str(e), None
        bad = [s.device for s in got if not self.node_core.is_healthy(s.uuid)]
        if bad:
            return f"ResourceClaim {ref.namespace}/{ref.name}: unhealthy device {', '.join(bad)}", None
        return got, claim

    def _try_make(
        self, ref: ClaimRef, shares: list[claims.Share], claim: claims.ResourceClaim | None
    ) -> ckpt.PreparedClaim | str:
        """The claim's record and files, or the error text (nothing of it left behind)."""
        try:
            return self._make(ref, shares, claim)
        except Exception as e:  # OSError, a bad record: this claim only
            log.error(kv("prepare failed", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid, error=e))
            self._undo(ref.uid, None)
            return f"cannot prepare ResourceClaim {ref.namespace}/{ref.name}: {e}"

    def _make(
        self, ref: ClaimRef, shares: list[claims.Share], claim: claims.ResourceClaim | None
    ) -> ckpt.PreparedClaim:
        gpus = merge(ref.uid, shares, self.cores_cap, self.cfg.slicing)
        share_list = [
            ClaimDevice(
                request=s.request,
                pool=s.pool,
                device=s.device,
                share_id=s.share_id or "",
                uuid=s.uuid,
                memory=s.memory,
                cores=s.cores,
            )
            for s in shares
        ]
        rec = self.records.write(gpus, self.cfg.slicing.oversubscribe)
        try:
            pods = [PodRef(name=p.name, uid=p.uid) for p in claims.reserved_pods(claim)] if claim else []
            meta = new_metadata(
                claim_uid=ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                rec=rec,
                driver=self.cfg.driver_name,
                devices=share_list,
                reserved_for=pods,
            )
            self.state.create_new(rec, meta)
            self.specs.write(ref.uid, self._files(ref.uid), self._context_reserve(gpus))
        except BaseException:
            self.records.remove(rec.token)
            raise
        ours = cdi.device_id(ref.uid)
        devices = []
        for s in shares:
            g = self.gpus[s.uuid]
            gpu_id = cdi.nvidia_device_id(
                self.cfg.nvidia_cdi_kind, self.cfg.nvidia_cdi_device, g.uuid, g.index, g.mig_index
            )
            devices.append(
                ckpt.PreparedDevice(
                    request_names=claims.request_names([s]),
                    pool=s.pool,
                    device=s.device,
                    share_id=s.share_id,
                    cdi_device_ids=[gpu_id, ours],
                )
            )
        if log.isEnabledFor(logging.INFO):  # the line is built only when it is wanted
            log.info(
                kv(
                    "claim prepared",
                    claim=f"{ref.namespace}/{ref.name}",
                    uid=ref.uid,
                    gpus=";".join(f"{g.uuid}:{g.memory_limit}B:{g.core_percent}%" for g in gpus),
                    token=rec.token[:8] + "…",
                )
            )
        return ckpt.PreparedClaim(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            token=rec.token,
            created=rec.created,
            oversubscribe=rec.oversubscribe,
            gpus=rec.gpus,
            devices=devices,
            shares=share_list,
        )

    def _answer(self, pc: ckpt.PreparedClaim) -> PrepareResult:
        # A prepared claim whose files went missing (deleted by hand, a tmpfs emptied) gets
        # them back before the runtime looks for them.
        try:
            self._ensure(pc)
        except Exception as e:
            return PrepareResult([], f"cannot restore prepared ResourceClaim {pc.namespace}/{pc.name}: {e}")
        return PrepareResult(list(pc.devices))

    def _undo(self, uid: str, token: str | None) -> None:
        """Remove whatever of a claim exists (best effort: failures are logged). Without the
        token, the records are searched for the claim's share IDs."""
        for what, fn in (
            ("CDI spec", lambda: self.specs.remove(uid)),
            ("claim directory", lambda: self.state.remove(uid)),
        ):
            try:
                fn()
            except OSError as e:
                log.error(kv(f"cannot remove {what}", uid=uid, error=e.strerror or e))
        tokens = {token} if token else set()
        marker = f"::dra:{uid}:"
        try:
            for r in self.records.list() if not token else []:
                if any(marker in v for g in r.gpus for v in g.vgpu_ids):
                    tokens.add(r.token)
        except OSError as e:
            log.error(kv("cannot list allocation records", error=e.strerror or e))
        for t in tokens:
            try:
                self.records.remove(t)
            except OSError as e:
                log.error(kv("cannot remove allocation record", uid=uid, error=e.strerror or e))

    # --- unprepare -------------------------------------------------------------------------------
    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        out: dict[str, str] = {}
        with self._lock:
            busy = [f for r in refs if (f := self._inflight.get(r.uid)) is not None]
        for f in busy:  # a preparation of it in flight ends (checkpointed) before it is undone
            f.result()
        with self._lock:
            gone: list[ckpt.PreparedClaim] = []
            for ref in refs:
                pc = self.cp.claims.pop(ref.uid, None)
                if pc is not None:
                    gone.append(pc)
                out[ref.uid] = ""
            if gone:
                try:
                    ckpt.save(self.cfg.checkpoint_path, self.cp)
                except OSError as e:
                    for pc in gone:
                        self.cp.claims[pc.uid] = pc
                        out[pc.uid] = f"cannot write the DRA checkpoint: {e.strerror or e}"
                    return out
            for ref in refs:
                if not claims.valid_uid(ref.uid):
                    continue
                pc_token = next((pc.token for pc in gone if pc.uid == ref.uid), None)
                self._undo(ref.uid, pc_token)
                if pc_token:
                    log.info(kv("claim unprepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid))
        return out

    # --- state ---------------------------------------------------------------------------------
    def prepared(self) -> dict[str, ckpt.PreparedClaim]:
        with self._lock:
            return dict(self.cp.claims)
