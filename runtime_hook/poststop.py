"""`vgpu-hook poststop`: remove the container's state directory.  Never fails the deletion.

Kept apart from prestart so that deleting a container imports nothing but
the standard library's os (this runs for every vGPU container's deletion).
"""

from __future__ import annotations

import os

from runtime_hook import hooklog
from vgpu import paths as vpaths
from vgpu import statedir
from vgpu.log import kv


def remove_state(cid: str, state_dir: str) -> None:
    if not vpaths.valid_container_id(cid):
        hooklog.log.warning(kv("poststop: invalid container id", id=cid[:80]))
        return
    try:
        if statedir.remove(os.path.join(state_dir, "containers", cid)):
            hooklog.log.info(kv("vgpu container state removed", id=cid))
    except OSError as e:
        hooklog.log.warning(kv("poststop: cannot remove state dir", id=cid, error=e.strerror))
