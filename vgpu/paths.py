"""Host paths of DESIGN.md, in one place.

Every daemon derives its paths from one `state_dir` (default /var/lib/vgpu) so
tests and demos can run the whole stack under a temporary directory; files that
are rebuilt at start-up and must not outlive a reboot (the DRA claims' limits
and regions) may live under a `run_dir` instead (a tmpfs such as /run/vgpu;
`common.run_dir`, empty: the state dir).
"""

from __future__ import annotations

import os

DEFAULT_STATE_DIR = "/var/lib/vgpu"
DEFAULT_CONFIG_PATH = "/etc/vgpu/config.toml"
DEFAULT_LOG_DIR = "/var/log/vgpu"
DEFAULT_LIBRARY_PATH = "/usr/lib/vgpu/libvgpu.so"

# Paths inside a vGPU container (contract 2 of docs/design.md).
CONTAINER_RUN_DIR = "/run/vgpu"
CONTAINER_LIBRARY = "/run/vgpu/libvgpu.so"
CONTAINER_LIMITS = "/run/vgpu/limits"
CONTAINER_REGION = "/run/vgpu/region"
CONTAINER_PRELOAD = "/etc/ld.so.preload"

# Names of files inside a per-container state directory.
LIMITS_FILE = "limits"
REGION_FILE = "region"
PRELOAD_FILE = "ld.so.preload"
METADATA_FILE = "metadata.json"
# The host-only metadata of a prepared DRA claim, in its directory under claims_dir.
CLAIM_METADATA_FILE = "claim.json"

# Plain character sets, not `re` (nor `dataclasses` below): the OCI hook
# imports this module on every vGPU container start, and those two imports
# cost it more than all its own work (docs/developers/hook.md).
_TOKEN_CHARS = frozenset("0123456789abcdef")
# Container ids: containerd/CRI use 64 hex chars; runc accepts [\w+-.]; we
# accept that set, bounded, and never a path separator or a dot-only name.
_CONTAINER_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+.-")


_HEX_LOWER = frozenset("0123456789abcdef")
_UID_DASHES = (8, 13, 18, 23)


class InvalidName(ValueError):
    """A token or container id that must not be used as a path component."""


def valid_token(token: str) -> bool:
    """A token is exactly 128 bits as 32 lowercase hex digits."""
    if not isinstance(token, str):
        raise TypeError(f"expected str, got {type(token).__name__}")
    return len(token) == 32 and _TOKEN_CHARS.issuperset(token)


def valid_claim_uid(uid: str) -> bool:
    """A ResourceClaim UID as the API server makes them (lowercase RFC 4122: validation.go
    validateUID, 8-4-4-4-12 hex digits): a path component and a CDI device name here."""
    if not isinstance(uid, str) or len(uid) != 36:
        return False
    return all(uid[i] == "-" for i in _UID_DASHES) and _HEX_LOWER.issuperset(uid.replace("-", ""))


def valid_container_id(cid: str) -> bool:
    if not isinstance(cid, str):
        raise TypeError(f"expected str, got {type(cid).__name__}")
    return 1 <= len(cid) <= 128 and _CONTAINER_ID_CHARS.issuperset(cid) and cid not in (".", "..")


class Paths:
    """All host paths derived from the state directory.

    Behaves as `@dataclass(frozen=True)` with fields `state_dir` and `run_dir` would
    (init, repr, eq, hash, match, FrozenInstanceError), written out by hand
    so that importing this module does not import dataclasses.
    """

    __match_args__ = ("state_dir", "run_dir")
    state_dir: str
    run_dir: str

    def __init__(self, state_dir: str = DEFAULT_STATE_DIR, run_dir: str = "") -> None:
        object.__setattr__(self, "state_dir", state_dir)
        object.__setattr__(self, "run_dir", run_dir)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(state_dir={self.state_dir!r}, run_dir={self.run_dir!r})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return (self.state_dir, self.run_dir) == (other.state_dir, other.run_dir)  # type: ignore[attr-defined]
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.state_dir, self.run_dir))

    def __setattr__(self, name: str, value: object) -> None:
        from dataclasses import FrozenInstanceError  # only on misuse

        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        from dataclasses import FrozenInstanceError

        raise FrozenInstanceError(f"cannot delete field {name!r}")

    @property
    def allocations_dir(self) -> str:
        return os.path.join(self.state_dir, "allocations")

    @property
    def containers_dir(self) -> str:
        return os.path.join(self.state_dir, "containers")

    @property
    def monitor_dir(self) -> str:
        """Monitor-owned files: suspension ledger, status snapshot."""
        return os.path.join(self.state_dir, "monitor")

    @property
    def ledger_path(self) -> str:
        return os.path.join(self.monitor_dir, "ledger")

    @property
    def status_path(self) -> str:
        return os.path.join(self.monitor_dir, "status.json")

    @property
    def context_sizes_path(self) -> str:
        """The monitor's measured CUDA context size per GPU (vgpu/contextsizes.py), read by the device plugin."""
        return os.path.join(self.state_dir, "context-sizes.json")

    @property
    def claims_dir(self) -> str:
        """Per-claim state of the DRA front end (docs/developers/dra-plugin.md): `<uid>/` and the shared ld.so.preload.
        Under the run dir when there is one: the DRA plugin rebuilds it from its checkpoint."""
        return os.path.join(self.run_dir or self.state_dir, "claims")

    @property
    def dra_dir(self) -> str:
        """The DRA plugin's own files (its checkpoint)."""
        return os.path.join(self.state_dir, "dra")

    @property
    def dra_checkpoint(self) -> str:
        return os.path.join(self.dra_dir, "checkpoint.json")

    def claim_dir(self, uid: str) -> str:
        if not valid_claim_uid(uid):
            raise InvalidName(f"invalid claim uid {str(uid)[:40]!r}")
        return os.path.join(self.claims_dir, uid)

    def allocation_record(self, token: str) -> str:
        if not valid_token(token):
            raise InvalidName(f"invalid allocation token {token[:40]!r}")
        return os.path.join(self.allocations_dir, token + ".json")

    def container_dir(self, container_id: str) -> str:
        if not valid_container_id(container_id):
            raise InvalidName(f"invalid container id {container_id[:40]!r}")
        return os.path.join(self.containers_dir, container_id)
