"""`vgpu-hook poststop`: remove the container's state directory.  Never fails the deletion.

Kept apart from prestart so that deleting a container imports nothing but
the standard library's os (this runs for every vGPU container's deletion).
"""

from __future__ import annotations

import os
import stat

from runtime_hook import hooklog
from runtime_hook.hooklog import kv

_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+.-")


def valid_container_id(cid: str) -> bool:
    """Same rule as vgpu.paths.valid_container_id (checked by tests/hook/test_records.py)."""
    return 1 <= len(cid) <= 128 and _ID_CHARS.issuperset(cid) and cid not in (".", "..")


def rmtree(path: str) -> None:
    """Remove a per-container state dir (files only in practice; no symlink is followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)
            except IsADirectoryError:
                rmtree(os.path.join(path, name))
    finally:
        os.close(fd)
    os.rmdir(path)


def remove_state(cid: str, state_dir: str) -> None:
    if not valid_container_id(cid):
        hooklog.log.warning(kv("poststop: invalid container id", id=cid[:80]))
        return
    cdir = os.path.join(state_dir, "containers", cid)
    try:
        st = os.lstat(cdir)
    except FileNotFoundError:
        return
    except OSError as e:
        hooklog.log.warning(kv("poststop: cannot stat state dir", id=cid, error=e.strerror))
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            rmtree(cdir)
        else:
            os.unlink(cdir)
        hooklog.log.info(kv("vgpu container state removed", id=cid))
    except OSError as e:
        hooklog.log.warning(kv("poststop: cannot remove state dir", id=cid, error=e.strerror))
