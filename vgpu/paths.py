"""Host paths of DESIGN.md, in one place.

Every daemon derives its paths from one `state_dir` (default /var/lib/vgpu) so
tests and demos can run the whole stack under a temporary directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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

_TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")
# Container ids: containerd/CRI use 64 hex chars; runc accepts [\w+-.]; we
# accept that set, bounded, and never a path separator or a dot-only name.
_CONTAINER_ID_RE = re.compile(r"^[A-Za-z0-9_+.-]{1,128}$")


class InvalidName(ValueError):
    """A token or container id that must not be used as a path component."""


def valid_token(token: str) -> bool:
    """A token is exactly 128 bits as 32 lowercase hex digits."""
    return bool(_TOKEN_RE.fullmatch(token))


def valid_container_id(cid: str) -> bool:
    return bool(_CONTAINER_ID_RE.fullmatch(cid)) and cid not in (".", "..")


@dataclass(frozen=True)
class Paths:
    """All host paths derived from the state directory."""

    state_dir: str = DEFAULT_STATE_DIR

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

    def allocation_record(self, token: str) -> str:
        if not valid_token(token):
            raise InvalidName(f"invalid allocation token {token[:40]!r}")
        return os.path.join(self.allocations_dir, token + ".json")

    def container_dir(self, container_id: str) -> str:
        if not valid_container_id(container_id):
            raise InvalidName(f"invalid container id {container_id[:40]!r}")
        return os.path.join(self.containers_dir, container_id)
