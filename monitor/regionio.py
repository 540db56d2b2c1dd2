"""Writing `extra_bytes` into a container's region without ever blocking on it.

`vgpu.region.write_extra_bytes` waits for the region's write lock
(F_OFD_SETLKW).  The region is shared with the container, so a hostile
process could hold that lock forever and hang a blocking monitor.  This
writer uses the same lock and offsets but only tries F_OFD_SETLK (non-
blocking) a few times; if the lock stays busy the value is written next
round.  The path is opened O_NOFOLLOW and must be a regular file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time

from vgpu import region as vregion


def extra_offset(slot_index: int, device_index: int) -> int:
    return (
        vregion.SLOT_OFFSET
        + slot_index * vregion.SLOT_SIZE
        + vregion.SLOT_DEV_OFFSET
        + device_index * vregion.SLOT_DEV_SIZE
        + vregion.SlotDevice.extra_bytes.offset
    )


def write_extra_bytes(path: str, values: dict[tuple[int, int], int], attempts: int = 3) -> bool:
    """Write {(slot, device): bytes} under the region lock; False if the lock stayed busy."""
    for (slot, dev), v in values.items():
        if not (0 <= slot < vregion.MAX_SLOTS and 0 <= dev < vregion.MAX_DEVICES) or v < 0:
            raise ValueError("slot/device/value out of range")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < vregion.REGION_SIZE:
            return False
        lock = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, vregion.LOCK_BYTE, 1, 0)
        for i in range(attempts):
            try:
                fcntl.fcntl(fd, vregion.F_OFD_SETLK, lock)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if i == attempts - 1:
                    return False
                time.sleep(0.001)
        try:
            for (slot, dev), v in values.items():
                os.pwrite(fd, struct.pack("<Q", min(v, (1 << 64) - 1)), extra_offset(slot, dev))
        finally:
            unlock = struct.pack("hhqqi", fcntl.F_UNLCK, os.SEEK_SET, vregion.LOCK_BYTE, 1, 0)
            fcntl.fcntl(fd, vregion.F_OFD_SETLK, unlock)
        return True
    finally:
        os.close(fd)
