"""The CDI spec of a prepared claim, and the CDI device IDs NodePrepareResources returns.

A container that uses a claim gets two CDI devices per allocated GPU share:

- the GPU itself from the NVIDIA toolkit's spec on the node (`nvidia.com/gpu=<uuid>` or
  `=<index>`: device nodes, driver libraries, NVIDIA's hooks), never from us;
- `vgpu.k8s.io/claim=<claim-uid>` from a spec of ours, one file per claim,
  `<cdi_dir>/vgpu.k8s.io-claim_<claim-uid>.json` (the name CDI's GenerateTransientSpecName gives a
  spec tied to one object), whose edits mount the claim's files (claimstate.py):

  | container path | host path | options |
  | --- | --- | --- |
  | /run/vgpu/libvgpu.so | the installed library | ro, nosuid, nodev, bind |
  | /run/vgpu/limits | <claim>/limits | ro, nosuid, nodev, bind |
  | /run/vgpu/region | <claim>/region | rw, nosuid, nodev, bind |
  | /etc/ld.so.preload | <claim>/ld.so.preload | ro, nosuid, nodev, bind |

  and set `VGPU_CLAIM_UID` (informational: the limits come from the host files only) and, when the
  monitor has measured a CUDA context on the claim's GPUs, `VGPU_CONTEXT_RESERVE` (the largest of
  those sizes, vgpu/contextsizes.py; libvgpu.so charges it per process until the monitor has
  measured that process).

One device per claim, not per share: CDI's ContainerEdits.Apply (tags.cncf.io/container-device-
interface pkg/cdi/container-edits.go) replaces any earlier mount at the same container path, so
two devices mounting /run/vgpu/limits would leave only the last. The claim's files cover every
GPU of the claim, so every result lists the same device and the duplicates collapse to one set
of mounts.

Fail closed: a missing spec makes the runtime refuse the container ("unresolvable CDI devices",
pkg/cdi/cache.go InjectDevices), a missing host file makes runc refuse the mount. A runtime
without CDI injects neither our device nor NVIDIA's, so the container gets no GPU at all.

Version: "0.5.0", the lowest the content needs (specs-go/version.go: a device name that starts
with a digit needs 0.5.0; nothing else here is newer) and one every CDI-enabled runtime reads
(podman 4.3, containerd 1.7 and 2.x, CRI-O).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from vgpu import contextsizes
from vgpu import paths as vpaths
from vgpu.schemas import write_atomic

CDI_VERSION = "0.5.0"
VENDOR = "vgpu.k8s.io"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
CLAIM_ENV = "VGPU_CLAIM_UID"
_RO = ["ro", "nosuid", "nodev", "bind"]
_RW = ["rw", "nosuid", "nodev", "bind"]
# pkg/parser/parser.go ValidateDeviceName: letters, digits, '_', '-', '.', ':'; alphanumeric at
# both ends.
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class ClaimFiles:
    library: str
    limits: str
    region: str
    preload: str


def device_id(claim_uid: str) -> str:
    """Our CDI device ID for a claim (`vgpu.k8s.io/claim=<uid>`)."""
    if not _DEVICE_NAME.fullmatch(claim_uid):
        raise ValueError(f"not a CDI device name: {claim_uid[:64]!r}")
    return f"{KIND}={claim_uid}"


def nvidia_device_id(kind: str, naming: str, uuid: str, index: int, mig_index: int | None = None) -> str:
    """The GPU in the node's NVIDIA CDI spec (nvidia-ctk names devices by index and by UUID; a MIG
    device by `<gpu index>:<mig index>` and its MIG UUID, tests/data/nvidia-ctk-mig/)."""
    if naming == "uuid":
        return f"{kind}={uuid}"
    return f"{kind}={index}" if mig_index is None else f"{kind}={index}:{mig_index}"


def spec_file_name(claim_uid: str) -> str:
    # pkg/cdi/spec.go GenerateTransientSpecName(vendor, class, id) = vendor-class_id (+ ".json").
    return f"{VENDOR}-{CLASS}_{claim_uid}.json"


def spec(claim_uid: str, files: ClaimFiles, context_reserve: int = 0) -> dict[str, Any]:
    mounts = [
        {"hostPath": files.library, "containerPath": vpaths.CONTAINER_LIBRARY, "options": _RO},
        {"hostPath": files.limits, "containerPath": vpaths.CONTAINER_LIMITS, "options": _RO},
        {"hostPath": files.region, "containerPath": vpaths.CONTAINER_REGION, "options": _RW},
        {"hostPath": files.preload, "containerPath": vpaths.CONTAINER_PRELOAD, "options": _RO},
    ]
    env = [f"{CLAIM_ENV}={claim_uid}"]
    if context_reserve > 0:
        # Security: the container may override it; harmless, since libvgpu.so takes
        # max(compiled default, env) (state.c): the env can only make its own limit stricter, and
        # lowering it only risks the claim's own processes (the monitor's backstop remains).
        env.append(f"{contextsizes.RESERVE_ENV}={int(context_reserve)}")
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {
                "name": claim_uid,
                "containerEdits": {"env": env, "mounts": mounts},
            }
        ],
        "containerEdits": {},
    }


class SpecDir:
    """Our claim specs in one CDI spec directory."""

    def __init__(self, cdi_dir: str) -> None:
        self.cdi_dir = cdi_dir
        self._made = False

    def path(self, claim_uid: str) -> str:
        device_id(claim_uid)  # validates the name
        return os.path.join(self.cdi_dir, spec_file_name(claim_uid))

    def write(self, claim_uid: str, files: ClaimFiles, context_reserve: int = 0) -> str:
        """Write (replace) the claim's spec atomically; returns its path.

        The temporary file (vgpu.schemas.write_atomic) has a leading dot and no .json/.yaml
        extension, so a runtime's CDI cache, which loads only those extensions
        (pkg/cdi/spec-dirs.go scanSpecDirs), never reads a half-written spec; the rename makes the
        whole spec appear at once. No fsync: after a crash the plugin rewrites every spec of its
        checkpoint.
        """
        if not self._made:
            os.makedirs(self.cdi_dir, mode=0o755, exist_ok=True)
            self._made = True
        path = self.path(claim_uid)
        try:
            write_atomic(path, msgspec.json.encode(spec(claim_uid, files, context_reserve)), 0o644, durable=False)
        except FileNotFoundError:  # the directory was removed meanwhile: make it again, once
            os.makedirs(self.cdi_dir, mode=0o755, exist_ok=True)
            write_atomic(path, msgspec.json.encode(spec(claim_uid, files, context_reserve)), 0o644, durable=False)
        return path

    def exists(self, claim_uid: str) -> bool:
        return os.path.isfile(self.path(claim_uid))

    def remove(self, claim_uid: str) -> None:
        try:
            os.unlink(self.path(claim_uid))
        except FileNotFoundError:
            pass

    def claims(self) -> list[str]:
        """Claim UIDs of the specs of ours in the directory."""
        prefix, suffix = f"{VENDOR}-{CLASS}_", ".json"
        try:
            names = os.listdir(self.cdi_dir)
        except FileNotFoundError:
            return []
        return sorted(n[len(prefix) : -len(suffix)] for n in names if n.startswith(prefix) and n.endswith(suffix))
