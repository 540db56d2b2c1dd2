"""Publishes the CUDA context size the monitor measured on each GPU (the smallest extra bytes of a
process on it, monitor/extrabytes.py) to the node file of vgpu/contextsizes.py, which the device
plugin hands to new containers as `VGPU_CONTEXT_RESERVE`.

The file is rewritten only when a GPU's value appears or moves by CHANGE_BYTES; a GPU without
processes keeps its last value (the size of a context on a GPU does not change while the node
runs), and a GPU no longer observed is dropped (dynamic MIG makes new device UUIDs).  Values
already in the file are kept across monitor restarts."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from vgpu import contextsizes
from vgpu.log import kv

log = logging.getLogger("vgpu.monitor")

CHANGE_BYTES = 1 << 20


class ContextSizes:
    def __init__(self, path: str) -> None:
        self.path = path
        self.known: dict[str, int] = contextsizes.read(path)
        self.dirty = False

    def update(self, measured: dict[str, int], observed: Iterable[str], errors: Counter[str]) -> None:
        """Take this pass's measurements (GPU uuid -> bytes) and write the file if anything changed.
        `observed`: the uuids of the devices in this observation, up or down (others are dropped;
        none: NVML gave nothing this pass, nothing is dropped)."""
        seen = set(observed)
        if seen:
            for u in [u for u in self.known if u not in seen]:
                del self.known[u]
                self.dirty = True
        for u, v in measured.items():
            old = self.known.get(u)
            if old is None or abs(v - old) >= CHANGE_BYTES:
                self.known[u] = v
                self.dirty = True
        if not self.dirty:
            return
        known = dict(list(self.known.items())[: contextsizes.MAX_GPUS])
        try:
            contextsizes.write(self.path, known)
        except (OSError, ValueError) as e:  # retried next pass
            errors["context_sizes"] += 1
            log.warning(kv("cannot write context sizes", path=self.path, error=e))
            return
        self.dirty = False
        log.info(kv("context sizes", **{u: v for u, v in known.items()}))
