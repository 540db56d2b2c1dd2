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
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

from device_plugin.dra import apiclient, cdi, claims, core, slices
from device_plugin.dra import checkpoint as ckpt
from device_plugin.dra.claimstate import ClaimDevice, ClaimState, PodRef, new_metadata
from device_plugin.dra.config import DRAConfig
from device_plugin.dra.inventory import GPU
from vgpu.log import kv
from vgpu.schemas import AllocationRecord

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


class Driver:
    def __init__(
        self,
        cfg: DRAConfig,
        node: str,
        gpus: Sequence[GPU],
        node_core: core.NodeCore,
        api: apiclient.ResourceAPI | None,
        *,
        state: ClaimState | None = None,
        specs: cdi.SpecDir | None = None,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.gpus = {g.uuid: g for g in gpus}
        self.capacities = slices.capacities(gpus, cfg)
        self.cores_cap = slices.cores_policy(cfg).capacity
        self.core = node_core
        self.api = api
        self.state = state or ClaimState(cfg.claims_dir)
        self.specs = specs or cdi.SpecDir(cfg.cdi_dir)
        self.unhealthy: set[str] = set()
        self._lock = threading.Lock()
        self._readers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="claim-read")
        self._workers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="claim-make")
        self.cp = ckpt.Checkpoint(driver=cfg.driver_name, node=node)

    def close(self) -> None:
        self._readers.shutdown(wait=False)
        self._workers.shutdown(wait=False)

    # --- start-up ------------------------------------------------------------------------------
    def recover(self) -> None:
        """Load the checkpoint, rebuild what it lists, remove what it does not."""
        with self._lock:
            self.cp = ckpt.load(self.cfg.checkpoint_path, self.cfg.driver_name, self.node)
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

    def _ensure(self, pc: ckpt.PreparedClaim) -> None:
        """Rebuild the record, directory and spec of a checkpointed claim where missing."""
        rec = self._record_of(pc)
        if not self.core.has_record(pc.token):
            self.core.restore_record(rec)
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
            self.specs.write(pc.uid, self._files(pc.uid))
            log.warning(kv("CDI spec rebuilt", claim=f"{pc.namespace}/{pc.name}", uid=pc.uid))

    def _sweep_orphans(self) -> None:
        known = set(self.cp.claims)
        tokens = {c.token for c in self.cp.claims.values()}
        for rec in self.core.list_records():
            if rec.token not in tokens:
                self.core.remove_record(rec.token)
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
        out: dict[str, PrepareResult] = {}
        to_read: dict[str, ClaimRef] = {}
        for ref in refs:
            if not claims.valid_uid(ref.uid):
                out[ref.uid] = PrepareResult([], f"invalid ResourceClaim UID {ref.uid[:64]!r}")
                continue
            if not ref.namespace or not ref.name:
                out[ref.uid] = PrepareResult([], f"claim {ref.uid} without namespace or name")
                continue
            with self._lock:
                done = self.cp.claims.get(ref.uid)
            if done is None:
                to_read[ref.uid] = ref
        # The API reads of one call overlap (the kubelet sends all claims of a pod at once).
        refs_to_read = list(to_read.values())
        if len(refs_to_read) > 1:
            got_all = list(self._readers.map(self._read, refs_to_read))
        else:
            got_all = [self._read(r) for r in refs_to_read]
        wanted = {r.uid: (r, *got) for r, got in zip(refs_to_read, got_all, strict=True)}
        new: list[str] = []
        to_make: list[tuple[ClaimRef, list[claims.Share], claims.ResourceClaim | None]] = []
        with self._lock:
            for ref in refs:
                if ref.uid in out:
                    continue
                pc = self.cp.claims.get(ref.uid)
                if pc is not None:  # prepared earlier, or by a concurrent call meanwhile
                    out[ref.uid] = self._answer(pc)
                    continue
                entry = wanted.get(ref.uid)
                if entry is None:  # was prepared when we looked, unprepared since
                    msg = f"ResourceClaim {ref.namespace}/{ref.name} changed meanwhile; retry"
                    out[ref.uid] = PrepareResult([], msg)
                    continue
                _, got, claim = entry
                if isinstance(got, str):
                    out[ref.uid] = PrepareResult([], got)
                    continue
                if all(m[0].uid != ref.uid for m in to_make):
                    to_make.append((ref, got, claim))
            # The files of different claims are independent: made in parallel, the file
            # system's latencies overlap (the driver lock keeps other calls out meanwhile).
            if len(to_make) > 1:
                made = list(self._workers.map(lambda m: self._try_make(*m), to_make))
            else:
                made = [self._try_make(*m) for m in to_make]
            for (ref, _, _), result in zip(to_make, made, strict=True):
                if isinstance(result, str):
                    out[ref.uid] = PrepareResult([], result)
                    continue
                self.cp.claims[ref.uid] = result
                new.append(ref.uid)
                out[ref.uid] = PrepareResult(list(result.devices))
            if new:
                try:
                    ckpt.save(self.cfg.checkpoint_path, self.cp)
                except OSError as e:
                    log.error(kv("cannot write the DRA checkpoint", error=e.strerror or e))
                    for uid in new:
                        pc = self.cp.claims.pop(uid)
                        self._undo(uid, pc.token)
                        out[uid] = PrepareResult([], f"cannot write the DRA checkpoint: {e.strerror or e}")
        return out

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
        bad = [s.device for s in got if s.uuid in self.unhealthy]
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
        gpus = core.merge(
            ref.uid,
            [core.ShareSlice(s.uuid, s.memory, s.cores, s.share_id or "", s.request) for s in shares],
            self.cores_cap,
        )
        # Fail closed with a clear message rather than a runc mount error at container start.
        try:
            lib = os.stat(self.cfg.library_path)
        except OSError as e:
            raise OSError(f"vGPU library {self.cfg.library_path}: {e.strerror}") from None
        if not stat.S_ISREG(lib.st_mode):
            raise OSError(f"vGPU library {self.cfg.library_path} is not a regular file")
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
        rec = self.core.write_record(gpus, self.cfg.memory_scaling > 1.0)
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
            self.state.create(rec, meta)
            self.specs.write(ref.uid, self._files(ref.uid))
        except BaseException:
            self.core.remove_record(rec.token)
            raise
        ours = cdi.device_id(ref.uid)
        devices = []
        for s in shares:
            g = self.gpus[s.uuid]
            gpu_id = cdi.nvidia_device_id(self.cfg.nvidia_cdi_kind, self.cfg.nvidia_cdi_device, g.uuid, g.index)
            devices.append(
                ckpt.PreparedDevice(
                    request_names=claims.request_names([s]),
                    pool=s.pool,
                    device=s.device,
                    share_id=s.share_id,
                    cdi_device_ids=[gpu_id, ours],
                )
            )
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
            for r in self.core.list_records() if not token else []:
                if any(marker in v for g in r.gpus for v in g.vgpu_ids):
                    tokens.add(r.token)
        except OSError as e:
            log.error(kv("cannot list allocation records", error=e.strerror or e))
        for t in tokens:
            try:
                self.core.remove_record(t)
            except OSError as e:
                log.error(kv("cannot remove allocation record", uid=uid, error=e.strerror or e))

    # --- unprepare -------------------------------------------------------------------------------
    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        out: dict[str, str] = {}
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

    def set_unhealthy(self, uuids: set[str]) -> None:
        with self._lock:
            self.unhealthy = set(uuids)
