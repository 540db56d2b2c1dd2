"""The suspension ledger: every process the monitor stops, on disk, before the signal.

Format (text, append-only, compacted by an atomic rename now and then):

    vgpu-ledger 1
    + <pid> <start_time>        stopped (written before SIGSTOP)
    - <pid> <start_time>        resumed (written after SIGCONT)

A bare `<pid> <start_time>` line means `+`.  A key is suspended when its last
record is `+`.  Each batch of records is one write() on an O_APPEND fd, so the
death of the monitor never leaves half a batch; appending avoids a rename
(and ext4's flush-on-replace) per suspension.  No fsync: the ledger must
survive the death of the monitor process, which the page cache guarantees; if
the whole machine goes down the stopped processes go with it.

`resume_all` is the single recovery path used by the guardian, the replay on
start, and the monitor's own exit: SIGCONT every entry whose (pid, start time)
still names the same process, then empty the ledger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from monitor import signals
from monitor.procs import ProcKey
from vgpu.log import kv

log = logging.getLogger("vgpu.monitor.ledger")

HEADER = "vgpu-ledger 1"
MAX_ENTRIES = 65536


def parse(text: str) -> set[ProcKey]:
    """Suspended entries of a ledger; malformed lines are skipped (the file is ours, but never trust a crash)."""
    lines = text.splitlines()
    out: set[ProcKey] = set()
    if not lines or lines[0].strip() != HEADER:
        return out
    for ln in lines[1:]:
        f = ln.split()
        op = "+"
        if len(f) == 3 and f[0] in ("+", "-"):
            op, f = f[0], f[1:]
        if len(f) != 2 or not f[0].isdigit() or not f[1].isdigit():
            continue
        pid = int(f[0])
        if not 0 < pid < 1 << 31:
            continue
        k = ProcKey(pid, int(f[1]))
        if op == "+":
            if len(out) < MAX_ENTRIES:
                out.add(k)
        else:
            out.discard(k)
    return out


def render(keys: Iterable[ProcKey]) -> str:
    return HEADER + "\n" + "".join(f"+ {k.pid} {k.start_time}\n" for k in sorted(keys))


def records(op: str, keys: Iterable[ProcKey]) -> bytes:
    return "".join(f"{op} {k.pid} {k.start_time}\n" for k in keys).encode()


def read(path: str) -> set[ProcKey]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return parse(f.read(16 << 20))
    except FileNotFoundError:
        return set()


def write(path: str, keys: Iterable[ProcKey]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        data = render(keys).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.rename(tmp, path)


def resume_all(path: str) -> int:
    """SIGCONT every ledger entry that still names its process; empty the ledger. Returns how many resumed."""
    keys = read(path)
    n = 0
    for k in keys:
        if signals.cont(k):
            n += 1
    if keys or os.path.exists(path):
        write(path, ())
    if keys:
        log.warning(kv("resumed ledger entries", path=path, entries=len(keys), resumed=n))
    return n


class Ledger:
    """The monitor's in-memory view of its ledger; the file always holds a superset of what is stopped."""

    COMPACT_BYTES = 256 * 1024

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        self.keys: set[ProcKey] = set()
        self.fd = -1
        self.written = 0

    def _append(self, data: bytes) -> None:
        if self.fd < 0 or self.written > self.COMPACT_BYTES:
            self.reopen()
        n = os.write(self.fd, data)  # one write per batch: a regular file takes it whole
        self.written += n

    def reopen(self) -> None:
        """Compact: rewrite the file with what is suspended now (atomic rename), append from there."""
        self.close()
        write(self.path, self.keys)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.written = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def add(self, keys: Iterable[ProcKey]) -> None:
        new = [k for k in keys if k not in self.keys]
        if new:
            self._append(records("+", new))
            self.keys.update(new)

    def discard(self, keys: Iterable[ProcKey]) -> None:
        gone = [k for k in keys if k in self.keys]
        if gone:
            self.keys.difference_update(gone)
            self._append(records("-", gone))

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)
