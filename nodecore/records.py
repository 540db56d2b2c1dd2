"""Allocation records (contract 1): writing, listing and garbage collection; part of the node core.

Both front ends write the same `AllocationRecord` here: the device plugin one per container in
Allocate (durable: the hook reads it at once), the DRA plugin one per prepared claim (`RecordStore` with
`durable=False`: its own checkpoint, fsynced once per call, rebuilds a record that a machine
crash lost). Each front end's records carry its resource name (`nvidia.com/gpu`, the DRA driver
name), and each lists and collects only its own. The hook, the library and the monitor read
every record alike.

A device plugin record lives at `<state_dir>/allocations/<token>.json` from Allocate for as long as the kubelet
may hand its token to a container again: while its Allocate answer is in the kubelet's device
manager checkpoint (device_plugin/checkpoint.py says why that, and nothing else, tells), plus a
grace period. Records survive plugin restarts: they are files, and the in-memory bookkeeping here
only delays deletions.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vgpu.paths import Paths, valid_token
from vgpu.schemas import AllocatedGPU, AllocationRecord, SchemaError, encode, read_record, write_atomic

log = logging.getLogger(__name__)


def new_token() -> str:
    """128 random bits as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def ensure_dir(paths: Paths) -> None:
    # Root-only: records name the GPUs and limits of every container.
    os.makedirs(paths.allocations_dir, mode=0o700, exist_ok=True)
    os.chmod(paths.allocations_dir, 0o700)


class RecordStore:
    """The records of one front end (one resource name) under `<state_dir>/allocations/`."""

    def __init__(self, paths: Paths, resource_name: str, *, durable: bool = True) -> None:
        self.paths = paths
        self.resource_name = resource_name
        self.durable = durable

    def ensure_dir(self) -> None:
        ensure_dir(self.paths)

    def write(self, gpus: Sequence[AllocatedGPU], oversubscribe: bool) -> AllocationRecord:
        """A new record, with a fresh token, for these GPU slices."""
        rec = AllocationRecord(
            token=new_token(),
            created=time.time(),
            resource_name=self.resource_name,
            oversubscribe=oversubscribe,
            gpus=list(gpus),
        )
        self.restore(rec)
        return rec

    def restore(self, rec: AllocationRecord) -> None:
        """Write `rec` under its own token (again)."""
        write_atomic(self.paths.allocation_record(rec.token), encode(rec), 0o600, durable=self.durable)

    def remove(self, token: str) -> None:
        """Delete a record; a missing one is not an error."""
        try:
            os.unlink(self.paths.allocation_record(token))
        except FileNotFoundError:
            pass

    def has(self, token: str) -> bool:
        """The record exists and reads back as itself (a crash may leave an empty file)."""
        try:
            return read_record(self.paths.allocation_record(token)).token == token
        except (OSError, SchemaError):
            return False

    def list(self) -> list[AllocationRecord]:
        return [r for r in list_records(self.paths) if r.resource_name == self.resource_name]


def list_records(paths: Paths) -> list[AllocationRecord]:
    """Every readable record; unreadable or foreign files are skipped (and logged)."""
    out: list[AllocationRecord] = []
    try:
        names = os.listdir(paths.allocations_dir)
    except FileNotFoundError:
        return out
    for name in names:
        token, ext = os.path.splitext(name)
        if ext != ".json" or not valid_token(token):
            continue
        try:
            rec = read_record(paths.allocation_record(token))
        except (OSError, SchemaError) as e:
            log.warning("skipping unreadable allocation record %s: %s", name, e)
            continue
        out.append(rec)
    return out


@dataclass
class RecordCollector:
    """Deletes records that stayed stale for `grace_s` (and are older than it).

    Stale: the kubelet can no longer replay the token (not in `replayable`). The age condition
    covers the moment between our Allocate answer and the kubelet's checkpoint write.
    """

    paths: Paths
    resource_name: str
    grace_s: float
    _since: dict[str, float] | None = None

    def collect(self, replayable: set[str], now: float | None = None) -> list[str]:
        """One pass given the tokens the kubelet may still replay; returns deleted tokens."""
        now = time.time() if now is None else now
        if self._since is None:
            self._since = {}
        records = [r for r in list_records(self.paths) if r.resource_name == self.resource_name]
        stale = {r.token for r in records if r.token not in replayable}
        for tok in list(self._since):
            if tok not in stale:
                del self._since[tok]
        deleted = []
        created = {r.token: r.created for r in records}
        for tok in stale:
            first = self._since.setdefault(tok, now)
            if now - first >= self.grace_s and now - created[tok] >= self.grace_s:
                try:
                    os.unlink(self.paths.allocation_record(tok))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("cannot remove allocation record %s: %s", tok, e)
                    continue
                self._since.pop(tok, None)
                deleted.append(tok)
        return deleted
