"""The host's `/` as an installer sees it: a directory (`--root DIR`, the host mounted into an
installer container), or `/` itself.  Paths named in the host's files are host paths, resolved
inside that directory, symlinks included (an absolute link target is the host's: it is
re-rooted, never followed into the installer's own filesystem)."""

from __future__ import annotations

import errno
import glob
import os
import subprocess

MAX_FILE = 4 << 20  # configs, wrappers and CDI specs larger than this are not read
MAX_LINKS = 40  # as the kernel (ELOOP)


class DetectError(Exception):
    """A host file that cannot be read or parsed (the message names it)."""


def resolve_in_root(root: str, host_path: str, *, must_exist: bool = False, limit: int = MAX_LINKS) -> str | None:
    """The host path `host_path` leads to, symlinks followed one component at a time inside `root`.

    An absolute link target names a host path (the walk restarts at the root), and `..` never
    climbs above the root.  must_exist=True (finding a file that must be there): None when a
    component is missing or the links loop.  must_exist=False (where a file may be created): a
    missing component is kept as named and the walk goes on; more than `limit` links raise
    OSError(ELOOP)."""
    parts = [p for p in host_path.split("/") if p and p != "."]
    done: list[str] = []
    links = 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            if done:
                done.pop()
            continue
        cur = os.path.join(root, *done, name)
        try:
            target = os.readlink(cur)
        except OSError:  # not a link, or absent
            if must_exist and not os.path.lexists(cur):
                return None
            done.append(name)
            continue
        links += 1
        if links > limit:
            if must_exist:
                return None
            raise OSError(errno.ELOOP, f"{host_path}: too many levels of symbolic links under {root}")
        if target.startswith("/"):
            done = []
        parts = [p for p in target.split("/") if p and p != "."] + parts
    return "/" + "/".join(done)


class Root:
    """Host paths resolved inside a directory that holds the host's `/`."""

    def __init__(self, root: str = "/") -> None:
        self.root = os.path.realpath(root or "/")

    @property
    def is_host(self) -> bool:
        return self.root == "/"

    def fs(self, host_path: str) -> str:
        """Where the host path `host_path` is on this filesystem (resolve_in_root; a missing
        component ends nothing: the path is where the file would be)."""
        if self.is_host:
            return host_path
        try:
            hp = resolve_in_root(self.root, host_path)
        except OSError as e:
            raise DetectError(e.strerror) from None
        assert hp is not None  # must_exist=False never answers None
        return self.root if hp == "/" else self.root + hp

    def exists(self, host_path: str) -> bool:
        return bool(host_path) and os.path.exists(self.fs(host_path))

    def read(self, host_path: str) -> str | None:
        """Text of a host file (None when absent); newlines kept exactly."""
        try:
            with open(self.fs(host_path), encoding="utf-8", newline="") as f:
                return f.read(MAX_FILE)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise DetectError(f"cannot read {host_path}: {e}") from None

    def glob(self, host_pattern: str) -> list[str]:
        """Host paths matching a host glob (sorted, as containerd's filepath.Glob)."""
        d, pat = os.path.split(host_pattern)
        base = self.fs(d or "/")
        out = sorted(glob.glob(os.path.join(glob.escape(base), pat)))
        return [os.path.join(d, os.path.basename(p)) for p in out]

    def command(self, host_exe: str, *args: str) -> list[str]:
        """argv running a host binary (under `chroot DIR` when DIR is not /)."""
        return [host_exe, *args] if self.is_host else ["chroot", self.root, host_exe, *args]

    def run(self, host_exe: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str] | None:
        # cwd /: as the daemon runs (systemd), so that `config dump` resolves a relative import
        # as containerd itself does (1.6 globs it from the working directory).
        try:
            return subprocess.run(
                self.command(host_exe, *args), capture_output=True, text=True, timeout=timeout, cwd="/"
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
