"""The suspension ledger: every process the monitor stops, on disk, before the signal.

Format (text, replaced atomically by rename):

    vgpu-ledger 1
    <pid> <start_time>
    ...

Written before every SIGSTOP and after every SIGCONT, read by the guardian when
the monitor dies and by the monitor itself when it starts (replay).  No fsync:
the ledger must survive the death of the monitor process, which the page cache
guarantees; if the whole machine goes down the stopped processes go with it.

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
    """Entries of a ledger; malformed lines are skipped (the file is ours, but never trust a crash)."""
    lines = text.splitlines()
    out: set[ProcKey] = set()
    if not lines or lines[0].strip() != HEADER:
        return out
    for ln in lines[1 : MAX_ENTRIES + 1]:
        f = ln.split()
        if len(f) != 2 or not f[0].isdigit() or not f[1].isdigit():
            continue
        pid = int(f[0])
        if 0 < pid < 1 << 31:
            out.add(ProcKey(pid, int(f[1])))
    return out


def render(keys: Iterable[ProcKey]) -> str:
    return HEADER + "\n" + "".join(f"{k.pid} {k.start_time}\n" for k in sorted(keys))


def read(path: str) -> set[ProcKey]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return parse(f.read(4 << 20))
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

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        self.keys: set[ProcKey] = set()

    def add(self, keys: Iterable[ProcKey]) -> None:
        new = set(keys) - self.keys
        if new:
            self.keys |= new
            write(self.path, self.keys)

    def discard(self, keys: Iterable[ProcKey]) -> None:
        gone = self.keys & set(keys)
        if gone:
            self.keys -= gone
            write(self.path, self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)
