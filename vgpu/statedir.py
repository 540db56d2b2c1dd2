"""Per-slice state directories (contract 2): the files libvgpu.so and the monitor read for one slice.

One directory per container on the device-plugin path (`<state_dir>/containers/<id>/`, made by
the hook at prestart, removed at poststop) and one per prepared claim on the DRA path
(`<claims_dir>/<claim-uid>/`, made by the DRA plugin at NodePrepareResources). Both are made here:

| file | mode | mounted in the container as |
| --- | --- | --- |
| `limits` (vgpu.limits) | 0644 | /run/vgpu/limits (ro) |
| `region` (vgpu.region) | 0666 | /run/vgpu/region (rw) |
| `metadata.json` / `claim.json` (vgpu.schemas) | 0600 | - (host only) |

The metadata file is written last, by rename: a directory without it is still being made.
Nothing is fsynced: a slice's files mean nothing after a reboot, and their makers rebuild them.
The directory itself is 0700 and root's. `remove` and `rmtree` import nothing but `os` and
`stat` (the hook's poststop runs for every vGPU container's deletion).
"""

from __future__ import annotations

import os
import stat

from vgpu import paths as vpaths

TYPE_CHECKING = False
if TYPE_CHECKING:
    from vgpu.limits import DeviceLimit


def rmtree(path: str) -> None:
    """Remove a slice directory (files only in practice); no symlink is ever followed."""
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


def remove(path: str) -> bool:
    """Remove a slice directory, or whatever stands at its name; False when there was none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        rmtree(path)
    else:
        os.unlink(path)
    return True


def make(path: str) -> None:
    """A new, empty slice directory at `path` (0700); a stale one of the same name (an earlier
    container whose poststop never ran) is removed first. The parent is made 0700 if missing."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    remove(path)
    os.mkdir(path, 0o700)


def populate(
    path: str, limits: list[DeviceLimit], metadata_file: str, metadata: bytes, *, sparse_region: bool = False
) -> None:
    """Write a new slice directory's files: limits, region, then the metadata (by rename).
    `sparse_region`: vgpu.region.initialise says when that is safe."""
    from vgpu import limits as vlimits
    from vgpu import region as vregion
    from vgpu.schemas import write_atomic, write_new

    write_new(os.path.join(path, vpaths.LIMITS_FILE), vlimits.render(limits).encode(), 0o644)
    vregion.initialise(os.path.join(path, vpaths.REGION_FILE), limits, 0o666, sparse=sparse_region, atomic=False)
    write_atomic(os.path.join(path, metadata_file), metadata, 0o600, durable=False)


def is_region(path: str) -> bool:
    """A regular file of a region's size (regions appear whole: created before the metadata, or
    by rename)."""
    from vgpu.region import REGION_SIZE

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == REGION_SIZE
