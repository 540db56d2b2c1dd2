"""Host file placement: atomic writes, versioned files behind a symlink, a record of what was made.

Upgrades never expose a half-written file: every file is written to a temporary name in the
same directory, fsynced and renamed (vgpu.schemas.write_atomic); the library and the hook tree
are versioned by content (`libvgpu-<sha>.so`, `hook/<sha>/`) and the stable name (`libvgpu.so`,
`hook/current`) is a symlink replaced by rename(2).  A container that already mapped the old library keeps its
inode (its bind mount holds it); the previous version stays on disk so a hook that resolved
the old link a moment before the swap still finds its target.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from vgpu.schemas import write_atomic

TMP_SUFFIX = ".vgpu-node-setup.tmp"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_digest(files: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


class Recorder:
    """Directories created by the installer (removed by uninstall when empty), in creation order."""

    def __init__(self, created: list[str] | None = None) -> None:
        self.created: list[str] = list(created or [])

    def makedirs(self, path: Path, mode: int = 0o755) -> None:
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir(mode=mode)
            os.chmod(d, mode)  # not subject to the umask
            self.created.append(str(d))


def write_if_changed(path: Path, data: bytes, mode: int) -> bool:
    """Write `path` (vgpu.schemas.write_atomic) unless it already holds `data` with `mode`; True
    when something changed."""
    try:
        st = path.lstat()
        if not path.is_symlink() and (st.st_mode & 0o7777) == mode and path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    write_atomic(str(path), data, mode)
    return True


def is_temporary(name: str) -> bool:
    """A temporary name of ours a killed writer may leave: symlink_atomic's and the hook tree's
    (TMP_SUFFIX), write_atomic's (`.tmp-<name>.<pid>.<thread>`)."""
    return name.endswith(TMP_SUFFIX) or name.startswith(".tmp-")


def symlink_atomic(path: Path, target: str) -> bool:
    """Point `path` at `target` (relative) by renaming a new link over it; True when it changed."""
    if path.is_symlink() and os.readlink(path) == target:
        return False
    if path.exists() and not path.is_symlink():
        raise FileExistsError(f"{path} exists and is not a symlink: not replacing it")
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, path)
    return True


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def prune(directory: Path, keep: set[str], prefix: str) -> None:
    """Remove entries named `prefix*` in `directory` that are not in `keep`."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith(prefix) and p.name not in keep and not p.is_symlink():
            remove(p)


_KINDS = {
    stat.S_IFSOCK: "a socket",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _file_digest(path: str) -> str:
    """sha256 of a regular file's content, read without following links and without blocking."""
    # O_NONBLOCK: the entry may have become a FIFO since lstat; O_NOFOLLOW: or a link.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "no longer a regular file")
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def tree_state(directory: Path) -> tuple[dict[str, str], list[str]]:
    """What a directory tree holds, to tell whether something in it changed: path -> content
    digest (regular files) or link target (symlinks, never followed); plus one note per entry
    that could not be compared by content.

    A config directory may hold anything: a socket someone bound there, a FIFO, a device node,
    a file of a special filesystem bind-mounted in (stat says regular, read() fails with EINVAL).
    Those are never opened (sockets, FIFOs, devices) or are compared by size and mtime (files
    that cannot be read), each with a note; nothing in the tree can make the installer fail.
    """
    out: dict[str, str] = {}
    notes: list[str] = []
    if not directory.is_dir():
        return out, notes
    for top, dirs, names in os.walk(directory, followlinks=False, onerror=lambda e: notes.append(f"{e}")):
        dirs.sort()
        for name in [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            dirs.remove(name)  # a link to a directory: compared as a link, never entered
            names.append(name)
        for name in sorted(names):
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError as e:
                notes.append(f"cannot stat {path}: {e.strerror}")
                continue
            kind = stat.S_IFMT(st.st_mode)
            if kind == stat.S_IFLNK:
                try:
                    out[path] = "-> " + os.readlink(path)
                except OSError as e:
                    notes.append(f"cannot read link {path}: {e.strerror}")
                continue
            if kind != stat.S_IFREG:
                notes.append(f"skipped {path}: {_KINDS.get(kind, 'not a regular file')}, not a regular file")
                continue
            try:
                out[path] = _file_digest(path)
            except OSError as e:
                out[path] = f"size={st.st_size} mtime={st.st_mtime_ns}"
                notes.append(f"cannot read {path} ({e.strerror}): compared by size and time only")
    return out, notes
