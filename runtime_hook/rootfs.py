"""Resolving paths inside an untrusted container rootfs, by file descriptor.

Every path is resolved as if the rootfs were `/`: absolute symlinks and `..`
stay inside it (openat2 RESOLVE_IN_ROOT; on kernels without openat2, a
component walk with O_NOFOLLOW that follows symlinks itself, against the
rootfs fd, and never climbs above it).  Callers get file descriptors, never
strings: a mount then targets the object that was checked, not a path the
image could swap in between (the CVE-2024-0132 TOCTOU).

Policy for the final component of a mount point (docs/developers/hook.md): it is used
when it is absent (we create it, O_EXCL|O_NOFOLLOW) or already of the right
type; a symlink, a directory where a file is expected, a FIFO, socket or
device node is refused.  Intermediate directories may be symlinks: they are
followed inside the root, which is what the container itself would see.
"""

from __future__ import annotations

import errno
import os
import stat

from runtime_hook import syscalls

MAX_SYMLINKS = 40
_RESOLVE = syscalls.RESOLVE_IN_ROOT | syscalls.RESOLVE_NO_MAGICLINKS

# Tests flip this to exercise the userspace walk on kernels that have openat2.
force_walk = False
_have_openat2: bool | None = None


class HostileRootfs(Exception):
    """The rootfs holds something we refuse to mount over or through."""


def _components(path: str) -> list[str]:
    return [c for c in path.split("/") if c and c != "."]


def open_in_root(rootfd: int, path: str, flags: int, mode: int = 0) -> int:
    """open(2) `path` relative to `rootfd` with RESOLVE_IN_ROOT semantics.

    O_NOFOLLOW in `flags` applies to the final component only (as with openat2).
    """
    global _have_openat2
    if not force_walk and _have_openat2 is not False:
        try:
            return syscalls.openat2(rootfd, path.lstrip("/") or ".", flags, _RESOLVE, mode)
        except OSError as e:
            if e.errno != errno.ENOSYS:
                raise
            _have_openat2 = False
    return _walk(rootfd, path, flags, mode)


def _walk(rootfd: int, path: str, flags: int, mode: int) -> int:
    """Userspace RESOLVE_IN_ROOT: follow symlinks ourselves, one component at a time."""
    stack = [os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=rootfd)]
    # "." and "" (a trailing or doubled slash) stay in the list: a name followed
    # by them must be a directory, as in the kernel's walk.
    todo = path.split("/")
    links = 0
    try:
        if not todo:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=stack[-1])
        while todo:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            last = not todo
            if last and flags & os.O_NOFOLLOW:
                return os.open(name, flags | os.O_CLOEXEC, mode, dir_fd=stack[-1])
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
            except FileNotFoundError:
                if last and flags & os.O_CREAT:
                    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=stack[-1])
                raise
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    os.close(fd)
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink("", dir_fd=fd)
                os.close(fd)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                todo = target.split("/") + todo
                continue
            if last:
                os.close(fd)
                # Re-open the checked name in the same directory fd; it was not a symlink
                # and O_NOFOLLOW keeps a swapped-in symlink from being followed.
                return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=stack[-1])
            if not stat.S_ISDIR(st.st_mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            stack.append(fd)
        # Path ended in ".." or similar: open the directory we are in.
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def ensure_dir(rootfd: int, path: str, mode: int = 0o755) -> int:
    """O_PATH fd of directory `path` inside the root, creating missing components."""
    try:
        return open_in_root(rootfd, path, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        pass
    except OSError as e:  # ENOTDIR, ELOOP (loops, magic links), EXDEV...
        raise HostileRootfs(f"/{path.strip('/')} is not a directory ({os.strerror(e.errno or 0)})") from None
    comps = _components(path)
    if not comps or comps[-1] == "..":
        raise HostileRootfs(f"cannot create /{path.lstrip('/')}")
    parent = ensure_dir(rootfd, "/".join(comps[:-1]), mode)
    try:
        name = comps[-1]
        try:
            os.mkdir(name, mode, dir_fd=parent)
        except FileExistsError:
            pass  # a dangling symlink or a racing creator: the open below decides
        try:
            # One component, no symlink following, relative to a directory already
            # resolved inside the root: the result is inside the root.
            return os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError as e:
            raise HostileRootfs(f"/{'/'.join(comps)} is not a directory ({os.strerror(e.errno or 0)})") from None
    finally:
        os.close(parent)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file"


def file_mountpoint(rootfd: int, path: str) -> int:
    """O_PATH fd of a regular file at `path` inside the root, created (empty) when absent."""
    comps = _components(path)
    if not comps or ".." in comps:
        raise HostileRootfs(f"invalid mount point {path!r}")
    parent = ensure_dir(rootfd, "/".join(comps[:-1]))
    name = comps[-1]
    shown = "/" + "/".join(comps)
    try:
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except FileNotFoundError:
            try:
                wfd = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=parent
                )
                os.close(wfd)
            except FileExistsError:
                pass
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise HostileRootfs(f"{shown} in the image is {_kind(st.st_mode)}; refusing to mount over it")
        return fd
    finally:
        os.close(parent)


def read_file(rootfd: int, path: str, limit: int = 64 * 1024) -> bytes | None:
    """Contents of a regular file inside the root, None when absent.

    Never opens a FIFO or a device node for reading (that could block or
    touch a host device); raises HostileRootfs for anything but a regular file.
    """
    try:
        pfd = open_in_root(rootfd, path, os.O_PATH | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            raise HostileRootfs(f"/{path.lstrip('/')} in the image is {_kind(st.st_mode)}")
        # Re-open the very inode through the O_PATH fd's magic link in our own
        # /proc (trusted: the hook's procfs, not the container's).
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st2 = os.fstat(fd)
            if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
                raise HostileRootfs(f"/{path.lstrip('/')} changed while being read")
            return os.read(fd, limit)
        finally:
            os.close(fd)
    finally:
        os.close(pfd)
