"""Bind-mounting the vGPU files into a container's mount namespace.

Runs in a forked, single-threaded child (setns(CLONE_NEWNS) refuses a
multi-threaded caller; Python < 3.12 has no os.setns):

1. host ns: open the container's mount ns and our own, by fd;
2. container ns: open the rootfs (the path runc bind-mounted before pivot_root)
   and read the image's /etc/ld.so.preload through rootfs.read_file;
3. host ns: write the merged ld.so.preload into the state dir, then clone
   every source with open_tree(OPEN_TREE_CLONE) and set its attributes with
   mount_setattr (read-only binds are really read-only: RDONLY|NOSUID|NODEV
   on the mount itself, before it is attached anywhere);
4. container ns: resolve each mount point inside the rootfs by fd
   (rootfs.file_mountpoint) and move_mount the detached tree onto that fd.

Nothing is ever mounted by path string, and nothing is mounted in the host
namespace (the mounts live and die with the container's namespace).
"""

from __future__ import annotations

import os
import select
import time

from runtime_hook import rootfs, syscalls

SIGKILL = 9  # signal.SIGKILL on Linux; the `signal` module imports enum (~5 ms on the hook's path)


class MountError(Exception):
    pass


class BindSpec:
    __slots__ = ("readonly", "source", "target")

    def __init__(self, source: str, target: str, readonly: bool) -> None:
        self.source = source
        self.target = target
        self.readonly = readonly


PRELOAD_MAX_ENTRIES = 64


def merge_preload(library: str, image_preload: bytes | None) -> tuple[str, list[str]]:
    """Our library line first, then the image's own entries (glibc syntax: whitespace or ':' separated, '#' comments).

    Returns (file text, dropped entries).  Entries that are not plain printable
    ASCII paths are dropped: the file is ours and is mounted read-only.
    """
    keep: list[str] = []
    dropped: list[str] = []
    if image_preload:
        text = image_preload.decode("latin-1")
        for line in text.splitlines():
            line = line.split("#", 1)[0]
            for item in line.replace(":", " ").split():
                if item == library or item in keep:
                    continue
                if len(keep) >= PRELOAD_MAX_ENTRIES or len(item) > 4096 or not all(33 <= ord(c) < 127 for c in item):
                    dropped.append(item[:64])
                    continue
                keep.append(item)
    return "\n".join([library, *keep]) + "\n", dropped


def _child(
    pid: int, root: str, binds: list[BindSpec], preload_out: str | None, preload_target: str, library: str
) -> str:
    """The child's work; returns '' on success or the error line."""
    host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        ctr_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"container init (pid {pid}) is gone"
    if os.fstat(host_ns).st_ino == os.fstat(ctr_ns).st_ino:
        return "the container shares the host mount namespace; refusing to mount into it"
    syscalls.setns(ctr_ns, syscalls.CLONE_NEWNS)
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    if preload_out is not None:
        image = rootfs.read_file(rootfd, preload_target)
        text, _dropped = merge_preload(library, image)
        syscalls.setns(host_ns, syscalls.CLONE_NEWNS)
        fd = os.open(preload_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    else:
        syscalls.setns(host_ns, syscalls.CLONE_NEWNS)
    trees: list[int] = []
    for b in binds:
        t = syscalls.open_tree(syscalls.AT_FDCWD, b.source, syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC)
        attrs = syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV
        if b.readonly:
            attrs |= syscalls.MOUNT_ATTR_RDONLY
        syscalls.mount_setattr(t, attrs)
        trees.append(t)
    syscalls.setns(ctr_ns, syscalls.CLONE_NEWNS)
    for b, t in zip(binds, trees, strict=True):
        tgt = rootfs.file_mountpoint(rootfd, b.target)
        try:
            syscalls.move_mount(t, tgt)
        finally:
            os.close(tgt)
        # Check: the path, resolved again inside the root, now shows the source.
        chk = rootfs.open_in_root(rootfd, b.target, os.O_PATH | os.O_NOFOLLOW)
        try:
            st = os.fstat(chk)
            src = os.fstat(t)
            if (st.st_dev, st.st_ino) != (src.st_dev, src.st_ino):
                return f"mount on {b.target} is not visible at that path after mounting"
        finally:
            os.close(chk)
    return ""


def mount_into_container(
    pid: int,
    root: str,
    binds: list[BindSpec],
    *,
    preload_out: str | None = None,
    preload_target: str = "etc/ld.so.preload",
    library: str = "",
    timeout: float = 20.0,
) -> None:
    """Do the mounts in a forked child; raise MountError with the child's one-line reason."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child, reported through the pipe
        code = 1
        try:
            os.close(r)
            msg = _child(pid, root, binds, preload_out, preload_target, library)
            code = 1 if msg else 0
        except rootfs.HostileRootfs as e:
            msg = str(e)
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            msg = f"{os.strerror(e.errno) if e.errno else e}{where}"
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}"
        try:
            os.write(w, msg.encode("utf-8", "replace")[:4000])
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    out = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(child, SIGKILL)
                raise MountError(f"mounting into the container timed out after {timeout:.0f}s")
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            b = os.read(r, 4096)
            if not b:
                break
            out += b
    finally:
        os.close(r)
        _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise MountError(out.decode("utf-8", "replace").strip() or f"mount helper failed (status {status})")
