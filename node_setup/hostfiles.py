"""The installer commands' file operations on the host tree (`--root`): read, atomic write,
remove, each by host path resolved under the root (nodetype.root.Root).  Writes go through the
one atomic writer (vgpu.schemas.write_atomic: a temporary file in the same directory, fsync,
rename, fsync of the directory)."""

from __future__ import annotations

import os

from node_setup.nodetype.root import DetectError, Root
from vgpu.schemas import write_atomic


class InstallError(Exception):
    """What `vgpu-hook containerd|hooksd ...` cannot do, in one line (exit 1)."""


def read(root: Root, path: str) -> str | None:
    """Text of a host file, None when absent; InstallError when it cannot be read."""
    try:
        return root.read(path)
    except DetectError as e:
        raise InstallError(str(e)) from None


def write(root: Root, path: str, text: str, mode: int | None = None) -> None:
    """Atomic write under the root (parent directories made); an existing file keeps its mode
    unless one is given, a new one gets 0644."""
    real = root.fs(path)
    os.makedirs(os.path.dirname(real) or ".", exist_ok=True)
    if mode is None:
        try:
            mode = os.stat(real).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    write_atomic(real, text.encode("utf-8"), mode)


def unlink(root: Root, path: str) -> None:
    try:
        os.unlink(root.fs(path))
    except FileNotFoundError:
        pass
