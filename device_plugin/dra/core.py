"""The node core as the DRA front end sees it: allocation records (contract 1).

Both front ends write the same `vgpu.schemas.AllocationRecord`: the device plugin one per
container in Allocate, the DRA plugin one per prepared claim (all its shares, one entry per GPU;
shares of one GPU add up, as several vGPUs of one GPU in one container do). The hook, the
library and the monitor need not know which front end made a record; DRA records carry the
driver name as `resource_name`, so the device plugin's record collector, which only collects
its own resource name, never touches them.

`NodeCore` is the interface; `RecordCore` writes through the device plugin's record writer
(device_plugin/records.py); `MemoryCore` keeps records in memory (tests, benchmarks of the
front end alone). Phase 2 moves inventory, records and limits behind one node core shared by
both front ends (docs/dra.md, "Phase 2").
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from device_plugin import records
from device_plugin.allocator import Slice
from vgpu.paths import Paths
from vgpu.schemas import AllocatedGPU, AllocationRecord, encode, read_record, write_atomic


@dataclass(frozen=True)
class ShareSlice:
    """One share of one GPU, as a claim's allocation result gives it."""

    gpu_uuid: str
    memory_bytes: int
    cores_percent: int
    share_id: str  # "" for a whole-device allocation
    request: str


def share_id_of(claim_uid: str, s: ShareSlice) -> str:
    """The ID a share has in the record's `vgpu_ids` (`<GPU-UUID>::<rest>`, as device plugin IDs:
    the physical UUID is everything before the last `::`)."""
    return f"{s.gpu_uuid}::dra:{claim_uid}:{s.share_id or s.request}"


def merge(claim_uid: str, shares: Sequence[ShareSlice], cores_cap: int) -> list[AllocatedGPU]:
    """Per GPU, in order of first appearance: memory and cores of its shares added up (cores at
    most the GPU's whole compute), with one vGPU ID per share."""
    gpus: dict[str, AllocatedGPU] = {}
    for s in shares:
        g = gpus.get(s.gpu_uuid)
        vid = share_id_of(claim_uid, s)
        if g is None:
            gpus[s.gpu_uuid] = AllocatedGPU(
                uuid=s.gpu_uuid,
                memory_limit=s.memory_bytes,
                core_percent=min(s.cores_percent, cores_cap),
                vgpu_ids=[vid],
            )
        else:
            g.memory_limit += s.memory_bytes
            g.core_percent = min(g.core_percent + s.cores_percent, cores_cap)
            g.vgpu_ids.append(vid)
    return list(gpus.values())


class NodeCore(Protocol):
    """Allocation records of the DRA front end (resource_name = the driver name)."""

    def write_record(self, gpus: Sequence[AllocatedGPU], oversubscribe: bool) -> AllocationRecord:
        """A new record with a fresh token for these GPU slices."""
        ...

    def restore_record(self, rec: AllocationRecord) -> None:
        """Write `rec` again under its own token (recovery of a checkpointed claim)."""
        ...

    def remove_record(self, token: str) -> None:
        """Delete a record; a missing one is not an error."""
        ...

    def has_record(self, token: str) -> bool: ...

    def list_records(self) -> list[AllocationRecord]:
        """The records of this front end."""
        ...


class RecordCore:
    """Records under `<state_dir>/allocations/`: device_plugin.records' directory, tokens,
    schema and listing.

    `durable=True` writes through device_plugin.records.write_record (temp file, fsync, rename,
    fsync of the directory). The DRA plugin uses `durable=False`: the same bytes, atomically
    renamed into place, without the two fsyncs, because its checkpoint (fsynced once per
    NodePrepareResources, before the answer) holds every field of every record, and at start-up
    a record that is missing or unreadable is written again from it. No container needs the
    record on the DRA path before the node restarts: its slice comes from the claim's files.
    """

    def __init__(self, paths: Paths, resource_name: str, *, durable: bool = False) -> None:
        self.paths = paths
        self.resource_name = resource_name
        self.durable = durable

    def ensure_dir(self) -> None:
        records.ensure_dir(self.paths)

    def write_record(self, gpus: Sequence[AllocatedGPU], oversubscribe: bool) -> AllocationRecord:
        if self.durable:
            return records.write_record(self.paths, self.resource_name, oversubscribe, Slice(gpus=list(gpus)))
        rec = AllocationRecord(
            token=records.new_token(),
            created=time.time(),
            resource_name=self.resource_name,
            oversubscribe=oversubscribe,
            gpus=list(gpus),
        )
        self.restore_record(rec)
        return rec

    def restore_record(self, rec: AllocationRecord) -> None:
        path = self.paths.allocation_record(rec.token)
        if self.durable:
            write_atomic(path, encode(rec), 0o600)
            return
        tmp = os.path.join(os.path.dirname(path), f".tmp-{rec.token}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, encode(rec))
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def remove_record(self, token: str) -> None:
        try:
            os.unlink(self.paths.allocation_record(token))
        except FileNotFoundError:
            pass

    def has_record(self, token: str) -> bool:
        """The record exists and reads back as itself (a crash may leave an empty file)."""
        try:
            return read_record(self.paths.allocation_record(token)).token == token
        except (OSError, ValueError):  # msgspec errors are ValueErrors
            return False

    def list_records(self) -> list[AllocationRecord]:
        return [r for r in records.list_records(self.paths) if r.resource_name == self.resource_name]


class MemoryCore:
    """In-memory records (tests, benchmarks)."""

    def __init__(self, resource_name: str) -> None:
        self.resource_name = resource_name
        self.records: dict[str, AllocationRecord] = {}
        self._lock = threading.Lock()

    def write_record(self, gpus: Sequence[AllocatedGPU], oversubscribe: bool) -> AllocationRecord:
        rec = AllocationRecord(
            token=secrets.token_hex(16),
            created=time.time(),
            resource_name=self.resource_name,
            oversubscribe=oversubscribe,
            gpus=list(gpus),
        )
        with self._lock:
            self.records[rec.token] = rec
        return rec

    def restore_record(self, rec: AllocationRecord) -> None:
        with self._lock:
            self.records[rec.token] = rec

    def remove_record(self, token: str) -> None:
        with self._lock:
            self.records.pop(token, None)

    def has_record(self, token: str) -> bool:
        with self._lock:
            return token in self.records

    def list_records(self) -> list[AllocationRecord]:
        with self._lock:
            return list(self.records.values())
