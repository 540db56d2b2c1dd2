"""Thin ctypes wrappers for the Linux syscalls the hook needs and Python lacks.

openat2 (437), open_tree (428), move_mount (429), mount_setattr (442) and
setns.  x86-64 and aarch64 share these numbers (the "new" syscalls were
allocated in the unified table).  libc is opened by its soname: no
ctypes.util.find_library, which imports subprocess and costs ~10 ms.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

_ARCH = os.uname().machine  # not `platform`: it imports re, subprocess...
if _ARCH not in ("x86_64", "aarch64"):  # pragma: no cover - numbers differ elsewhere
    raise ImportError(f"vgpu-hook: unsupported architecture {_ARCH}")

SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_OPENAT2 = 437
SYS_MOUNT_SETATTR = 442

# openat2 resolve flags
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x01
MOUNT_ATTR_NOSUID = 0x02
MOUNT_ATTR_NODEV = 0x04
CLONE_NEWNS = 0x00020000


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str, path: str = "") -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path or None)
    return ret


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2); raises OSError (ENOSYS on kernels before 5.6)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    ret = _syscall(
        ctypes.c_long(SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    return _check(ret, "openat2", path)


def open_tree(dirfd: int, path: str, flags: int) -> int:
    ret = _syscall(
        ctypes.c_long(SYS_OPEN_TREE), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)), ctypes.c_uint(flags)
    )
    return _check(ret, "open_tree", path)


def move_mount(from_fd: int, to_fd: int) -> None:
    """Attach the detached tree `from_fd` onto the object `to_fd` refers to (both by fd)."""
    ret = _syscall(
        ctypes.c_long(SYS_MOVE_MOUNT),
        ctypes.c_int(from_fd),
        ctypes.c_char_p(b""),
        ctypes.c_int(to_fd),
        ctypes.c_char_p(b""),
        ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH),
    )
    _check(ret, "move_mount")


def mount_setattr(fd: int, attr_set: int) -> None:
    attr = _MountAttr(attr_set, 0, 0, 0)
    ret = _syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.c_uint(AT_EMPTY_PATH),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, "mount_setattr")


def setns(fd: int, nstype: int) -> None:
    """setns(2).  CLONE_NEWNS fails with EINVAL in a multi-threaded process: call it in a forked child."""
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, nstype)
        return
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")
