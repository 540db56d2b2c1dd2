"""Process identity and /proc helpers.

A process is identified by `ProcKey(pid, start_time)` everywhere: `start_time`
is field 22 of /proc/<pid>/stat (clock ticks since boot), so a reused pid never
matches an old key.  Every reader returns None instead of raising when the
process is gone (or is a zombie whose fields are gone): processes exit at any
moment and the monitor must not care.
"""

from __future__ import annotations

import os
import stat
from typing import NamedTuple

PROC = "/proc"


class ProcKey(NamedTuple):
    pid: int
    start_time: int


class ProcStat(NamedTuple):
    pid: int
    state: str
    ppid: int
    start_time: int


def parse_stat(text: str) -> ProcStat | None:
    """Parse the text of /proc/<pid>/stat.  comm may hold spaces and parentheses: split at the last ')'."""
    try:
        head, _, rest = text.rpartition(")")
        pid = int(head.split("(", 1)[0])
        f = rest.split()
        # rest starts at field 3 (state); starttime is field 22 -> index 19
        return ProcStat(pid=pid, state=f[0], ppid=int(f[1]), start_time=int(f[19]))
    except (ValueError, IndexError):
        return None


def read_stat(pid: int, proc: str = PROC) -> ProcStat | None:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    return parse_stat(data.decode("ascii", "replace"))


def start_time(pid: int, proc: str = PROC) -> int | None:
    st = read_stat(pid, proc)
    return st.start_time if st else None


def key_of(pid: int, proc: str = PROC) -> ProcKey | None:
    st = read_stat(pid, proc)
    return ProcKey(pid, st.start_time) if st else None


def alive(key: ProcKey, proc: str = PROC) -> bool:
    """True while `key` names a live (not zombie) process."""
    st = read_stat(key.pid, proc)
    return st is not None and st.start_time == key.start_time and st.state not in ("Z", "X")


def nspids(pid: int, proc: str = PROC) -> list[int] | None:
    """NSpid of /proc/<pid>/status: host pid first, innermost namespace's pid last."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            data = f.read(8192).decode("ascii", "replace")
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith("NSpid:"):
            try:
                return [int(x) for x in line.split()[1:]]
            except ValueError:
                return None
    return None


def pid_ns(pid: int, proc: str = PROC) -> str | None:
    try:
        return os.readlink(f"{proc}/{pid}/ns/pid")
    except OSError:
        return None


def read_cgroup(pid: int, proc: str = PROC) -> str | None:
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as f:
            return f.read(65536).decode("utf-8", "replace")
    except OSError:
        return None


def file_in_root(pid: int, rel: str, proc: str = PROC) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the regular file at `rel` (e.g. "run/vgpu/region") inside the process's
    root, without following any link on the way (O_PATH|O_NOFOLLOW per component, the last one
    lstat'ed): resolving /proc/<pid>/root/<path> the ordinary way would follow an absolute link
    of the container's to the host's own files. None when any part is missing or a link."""
    try:
        fd = os.open(f"{proc}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        *dirs, last = [p for p in rel.split("/") if p]
        for name in dirs:
            if name in (".", ".."):
                return None
            nfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        st = os.stat(last, dir_fd=fd, follow_symlinks=False)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def mapped_files(pid: int, proc: str = PROC, limit: int = 8 << 20) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file the process has mapped (/proc/<pid>/maps: the kernel's
    record of the device and inode of each mapping, whatever names the process sees)."""
    out: set[tuple[int, int]] = set()
    try:
        with open(f"{proc}/{pid}/maps", "rb") as fh:
            data = fh.read(limit)
    except OSError:
        return out
    for line in data.split(b"\n"):
        f = line.split(None, 5)
        if len(f) < 5 or f[4] == b"0":
            continue
        major, _, minor = f[3].partition(b":")
        try:
            out.add((os.makedev(int(major, 16), int(minor, 16)), int(f[4])))
        except ValueError:
            continue
    return out


def ancestors(pid: int, proc: str = PROC, limit: int = 64) -> list[ProcKey]:
    """The chain of parents of `pid` (nearest first), up to pid 1 or `limit` steps."""
    out: list[ProcKey] = []
    st = read_stat(pid, proc)
    while st is not None and st.ppid > 0 and len(out) < limit:
        parent = read_stat(st.ppid, proc)
        if parent is None:
            break
        out.append(ProcKey(parent.pid, parent.start_time))
        st = parent
    return out


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def boot_time() -> float:
    try:
        with open(f"{PROC}/stat", "rb") as f:
            for line in f.read().decode().splitlines():
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0
