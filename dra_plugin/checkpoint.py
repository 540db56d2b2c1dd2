"""The DRA plugin's checkpoint: the claims it has prepared, across restarts.

`<state_dir>/dra/checkpoint.json` (0600, root), written atomically with fsync (temp file,
rename, fsync of the directory: vgpu.schemas.write_atomic) before NodePrepareResources answers.
It is the one durable piece of the DRA front end: the kubelet keeps its own checkpoint and does
not prepare a claim it believes prepared again, even after a reboot, so at start-up the plugin
rebuilds from this file whatever is missing (record, claim directory, CDI spec on a tmpfs) and
removes whatever it does not list.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from vgpu.schemas import AllocatedGPU, ClaimDevice, Schema, write_atomic

CHECKPOINT_VERSION = 1


class PreparedDevice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One entry of the NodePrepareResources answer for the claim."""

    request_names: list[str]
    pool: str
    device: str
    share_id: str | None = None
    cdi_device_ids: list[str]


class PreparedClaim(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    uid: str
    namespace: str
    name: str
    token: str
    created: float
    oversubscribe: bool = False
    gpus: list[AllocatedGPU]
    devices: list[PreparedDevice]
    # Each allocation result of our driver, for rebuilding the claim's metadata.
    shares: list[ClaimDevice] = msgspec.field(default_factory=list)


class Checkpoint(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    version: int = CHECKPOINT_VERSION
    driver: str
    node: str
    claims: dict[str, PreparedClaim] = msgspec.field(default_factory=dict)


def _enc(obj: Any) -> Any:
    # The contract documents (vgpu.schemas) are written as their own JSON, and read back through
    # their own validation: one definition of each, here as in their files.
    if isinstance(obj, Schema):
        return obj.to_builtins()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec(cls: type, obj: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, Schema):
        return cls.from_builtins(obj)  # SchemaError (a ValueError): msgspec's ValidationError
    raise NotImplementedError(f"cannot decode {cls!r}")


class CheckpointError(RuntimeError):
    """The checkpoint exists but cannot be used; the plugin does not start over it."""


def load(path: str, driver: str, node: str) -> Checkpoint:
    """The checkpoint at `path`, or an empty one when there is none.

    A checkpoint that cannot be read is an error (the plugin must not forget prepared claims
    whose containers may be running); one of another driver or node is too.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return Checkpoint(driver=driver, node=node)
    except OSError as e:
        raise CheckpointError(f"cannot read DRA checkpoint {path}: {e.strerror}") from None
    try:
        cp = msgspec.json.decode(data, type=Checkpoint, dec_hook=_dec)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CheckpointError(f"malformed DRA checkpoint {path}: {e}; move it away to start afresh") from None
    if cp.version != CHECKPOINT_VERSION:
        raise CheckpointError(f"DRA checkpoint {path} has version {cp.version}, expected {CHECKPOINT_VERSION}")
    if cp.driver != driver or cp.node != node:
        raise CheckpointError(
            f"DRA checkpoint {path} belongs to driver {cp.driver!r} on node {cp.node!r}, not {driver!r} on {node!r}"
        )
    for uid, c in cp.claims.items():
        if c.uid != uid:
            raise CheckpointError(f"malformed DRA checkpoint {path}: entry {uid[:64]!r} names claim {c.uid[:64]!r}")
    return cp


def save(path: str, cp: Checkpoint) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_atomic(path, msgspec.json.encode(cp, enc_hook=_enc), 0o600)
