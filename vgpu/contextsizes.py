"""The node's measured CUDA context sizes: `<state_dir>/context-sizes.json`
(`Paths.context_sizes_path`), GPU or MIG device UUID -> bytes.

Written by the monitor (monitor/contextsizes.py) from the device memory NVML sees for a process
beyond what libvgpu.so charged it; read by the device plugin, which hands the largest size of a
container's GPUs to libvgpu.so as `VGPU_CONTEXT_RESERVE`, so that a process is charged for its
context from its first allocation on, before the monitor has measured that process.

    {"version": 1, "gpus": {"GPU-…": 314572800, "MIG-…": 157286400}}

Standard library only, like the other contract modules.  Reading never raises: a missing file is
"nothing measured yet", a bad one is logged and treated the same (the reserve only ever makes a
limit stricter, so unknown is the safe answer).  The file is bounded (MAX_FILE_BYTES, MAX_GPUS).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterable

from vgpu.schemas import write_atomic

log = logging.getLogger("vgpu.contextsizes")

# The environment variable libvgpu.so reads its context reserve from (libcuda_intercept/src/state.c).
RESERVE_ENV = "VGPU_CONTEXT_RESERVE"

VERSION = 1
MAX_FILE_BYTES = 64 * 1024
MAX_GPUS = 256
MAX_UUID_LEN = 96
MAX_BYTES = 1 << 40  # no context is a TiB: a larger value is a bad file, not a measurement


class ContextSizesError(ValueError):
    """The file's content is not a valid context-size table."""


def _valid_uuid(u: object) -> bool:
    return isinstance(u, str) and 0 < len(u) <= MAX_UUID_LEN and u.isprintable() and "/" not in u


def decode(data: bytes) -> dict[str, int]:
    """The table in `data`; raises ContextSizesError naming what is wrong."""
    if len(data) > MAX_FILE_BYTES:
        raise ContextSizesError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ContextSizesError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"version", "gpus"}:
        raise ContextSizesError('expected an object with exactly "version" and "gpus"')
    if doc["version"] != VERSION or isinstance(doc["version"], bool):
        raise ContextSizesError(f"unsupported version {str(doc['version'])[:20]!r}")
    gpus = doc["gpus"]
    if not isinstance(gpus, dict) or len(gpus) > MAX_GPUS:
        raise ContextSizesError(f'"gpus" must be an object of at most {MAX_GPUS} entries')
    out: dict[str, int] = {}
    for u, v in gpus.items():
        if not _valid_uuid(u):
            raise ContextSizesError(f"bad GPU UUID {str(u)[:40]!r}")
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_BYTES:
            raise ContextSizesError(f"bad size for {u}: expected an integer in 1..{MAX_BYTES}")
        out[u] = v
    return out


def encode(sizes: dict[str, int]) -> bytes:
    """The file's bytes for `sizes`; raises ContextSizesError for a table decode would refuse."""
    data = json.dumps({"version": VERSION, "gpus": dict(sorted(sizes.items()))}, separators=(",", ":")).encode()
    decode(data)  # one definition of valid: never write what readers refuse
    return data


def read(path: str) -> dict[str, int]:
    """The table at `path`; {} when it is missing or bad (a bad one is logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("cannot read context sizes %s: %s; treating them as unknown", path, e.strerror)
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        return decode(data)
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.warning("cannot read context sizes %s: %s; treating them as unknown", path, e.strerror)
        return {}
    except ContextSizesError as e:
        log.warning("ignoring bad context sizes file %s: %s; treating them as unknown", path, e)
        return {}


def reserve_for(path: str, uuids: Iterable[str]) -> int:
    """What a container on `uuids` gets as VGPU_CONTEXT_RESERVE: the largest measured size among
    them, 0 when none is measured.  A MIG device is looked up by its own UUID (the monitor
    measures it as a device of its own; its contexts are not its parent GPU's): unknown until a
    process has run on it."""
    sizes = read(path)
    return max((sizes.get(u, 0) for u in uuids), default=0)


def write(path: str, sizes: dict[str, int]) -> None:
    """Replace the table at `path` atomically (root-only, like every state file)."""
    write_atomic(path, encode(sizes), 0o600)
