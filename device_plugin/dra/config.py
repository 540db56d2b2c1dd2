"""Settings of the DRA plugin.

Phase 1 keeps `vgpu.config.NodeConfig` as it is (its sections refuse unknown fields, so a
`[dra]` section would stop the other daemons): the plugin takes the node-wide settings from the
node config (`common.state_dir`, `hook.library_path`, the `device_plugin` split count, scalings,
kubelet dir, node name and CDI kind) and its own from flags. `from_node_config` is that mapping.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Annotated, Literal

import msgspec

from vgpu.config import NodeConfig

DRIVER_NAME = "gpu.vgpu.k8s.io"
MIB = 1 << 20

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
# A DRA driver name: a lowercase DNS subdomain of at most 63 characters (ValidateCSIDriverName).
DriverName = Annotated[
    str, msgspec.Meta(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
]
# A CDI kind `<vendor>/<class>` (container-device-interface pkg/parser/parser.go).
_CDI_NAME = r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]"
CdiKind = Annotated[str, msgspec.Meta(pattern=f"^{_CDI_NAME}/{_CDI_NAME}$")]


class DRAConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    driver_name: DriverName = DRIVER_NAME
    node_name: str = ""
    kubelet_dir: str = "/var/lib/kubelet"
    state_dir: str = "/var/lib/vgpu"
    library_path: str = "/usr/lib/vgpu/libvgpu.so"
    # Where our per-claim CDI specs go: /var/run/cdi is for specs with a lifetime (CDI's
    # dynamic dir, read after /etc/cdi by every runtime's default spec-dirs).
    cdi_dir: str = "/var/run/cdi"
    # How the node's NVIDIA CDI spec names a GPU: `<kind>=<uuid>` or `<kind>=<index>` (nvidia-ctk
    # cdi generate writes both, and `all`).
    nvidia_cdi_kind: CdiKind = "nvidia.com/gpu"
    nvidia_cdi_device: Literal["uuid", "index"] = "uuid"
    # The default share of a GPU (a request without capacity) is 1/K.
    split_count: PositiveInt = 2
    memory_scaling: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cores_scaling: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # requestPolicy.validRange of the capacities (bytes and percent): min, step; max = the
    # capacity rounded down to a step.
    memory_step: PositiveInt = 256 * MIB
    memory_min: PositiveInt = 256 * MIB
    cores_step: PositiveInt = 1
    cores_min: NonNegInt = 1
    publish: bool = True
    # Seconds between re-checks of the published ResourceSlice (and of NVML health).
    resync_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0

    @property
    def registry_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins_registry")

    @property
    def registration_socket(self) -> str:
        # kubeletplugin draplugin.go Start: "<driver name>-reg.sock" in KubeletRegistryDir.
        return os.path.join(self.registry_dir, f"{self.driver_name}-reg.sock")

    @property
    def plugin_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins", self.driver_name)

    @property
    def endpoint(self) -> str:
        # kubeletplugin draplugin.go Start: "dra.sock" in <KubeletPluginsDir>/<driver name>.
        return os.path.join(self.plugin_dir, "dra.sock")

    @property
    def dra_state_dir(self) -> str:
        return os.path.join(self.state_dir, "dra")

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.dra_state_dir, "checkpoint.json")

    @property
    def claims_dir(self) -> str:
        return os.path.join(self.state_dir, "claims")

    def node(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


class DRAConfigError(ValueError):
    pass


def from_node_config(cfg: NodeConfig, **overrides: object) -> DRAConfig:
    """The DRA settings the node config implies, with `overrides` (flags; None = not given)."""
    dp = cfg.device_plugin
    tree: dict[str, object] = {
        "node_name": dp.node_name,
        "kubelet_dir": dp.kubelet_dir,
        "state_dir": cfg.common.state_dir,
        "library_path": cfg.hook.library_path,
        "nvidia_cdi_kind": dp.cdi_kind,
        "split_count": dp.device_split_count,
        "memory_scaling": dp.device_memory_scaling,
        "cores_scaling": dp.device_cores_scaling,
    }
    tree.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(tree, DRAConfig)
    except msgspec.ValidationError as e:
        raise DRAConfigError(f"invalid DRA plugin setting: {_explain(str(e))}") from None


_AT = re.compile(r" - at `\$\.([^`]*)`")


def _explain(text: str) -> str:
    m = _AT.search(text)
    return f"`{m.group(1)}`: {_AT.sub('', text)}" if m else text
