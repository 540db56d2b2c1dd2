"""The DRA plugin's settings: a view of the node configuration (vgpu.config.NodeConfig).

Its own settings are the `[dra]` section; the rest is the node's, shared with the device plugin
through the node core: `common.state_dir` and `common.run_dir` (the claims' files, rebuilt at
start-up: best a tmpfs), `hook.library_path`, and from `[device_plugin]` the
slicing (split count, scalings), `kubelet_dir`, `node_name`, `cdi_kind` (the NVIDIA CDI kind) and
`health_recovery_s`. `FIELDS` names each setting's place in the node config; the command line's
flags (`--driver-name`, `--device-split-count`, ...) override those places.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from nodecore.devices import Slicing
from vgpu.config import NodeConfig, load_config
from vgpu.paths import Paths

DRIVER_NAME = "gpu.vgpu.k8s.io"

# setting -> dotted field of the node config
FIELDS: dict[str, str] = {
    "driver_name": "dra.driver_name",
    "node_name": "device_plugin.node_name",
    "kubelet_dir": "device_plugin.kubelet_dir",
    "state_dir": "common.state_dir",
    "run_dir": "common.run_dir",
    "library_path": "hook.library_path",
    "cdi_dir": "dra.cdi_dir",
    "nvidia_cdi_kind": "device_plugin.cdi_kind",
    "nvidia_cdi_device": "dra.nvidia_cdi_device",
    "split_count": "device_plugin.device_split_count",
    "memory_scaling": "device_plugin.device_memory_scaling",
    "cores_scaling": "device_plugin.device_cores_scaling",
    "memory_step": "dra.memory_step",
    "memory_min": "dra.memory_min",
    "cores_step": "dra.cores_step",
    "cores_min": "dra.cores_min",
    "publish": "dra.publish",
    "resync_s": "dra.resync_s",
    "health_recovery_s": "device_plugin.health_recovery_s",
}


@dataclass(frozen=True)
class Settings:
    driver_name: str
    node_name: str
    kubelet_dir: str
    state_dir: str
    run_dir: str
    library_path: str
    cdi_dir: str
    nvidia_cdi_kind: str
    nvidia_cdi_device: str
    slicing: Slicing
    memory_step: int
    memory_min: int
    cores_step: int
    cores_min: int
    publish: bool
    resync_s: float
    health_recovery_s: float

    @classmethod
    def from_node_config(cls, cfg: NodeConfig) -> Settings:
        dp, dra = cfg.device_plugin, cfg.dra
        return cls(
            driver_name=dra.driver_name,
            node_name=dp.node_name,
            kubelet_dir=dp.kubelet_dir,
            state_dir=cfg.common.state_dir,
            run_dir=cfg.common.run_dir,
            library_path=cfg.hook.library_path,
            cdi_dir=dra.cdi_dir,
            nvidia_cdi_kind=dp.cdi_kind,
            nvidia_cdi_device=dra.nvidia_cdi_device,
            slicing=Slicing(dp.device_split_count, dp.device_memory_scaling, dp.device_cores_scaling),
            memory_step=dra.memory_step,
            memory_min=dra.memory_min,
            cores_step=dra.cores_step,
            cores_min=dra.cores_min,
            publish=dra.publish,
            resync_s=dra.resync_s,
            health_recovery_s=dp.health_recovery_s,
        )

    @property
    def paths(self) -> Paths:
        return Paths(self.state_dir, self.run_dir)

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
    def checkpoint_path(self) -> str:
        return self.paths.dra_checkpoint

    @property
    def claims_dir(self) -> str:
        return self.paths.claims_dir

    def node(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


def settings(config_path: str | None = None, **values: Any) -> Settings:
    """The settings of the node config at `config_path` (None: defaults) with `values` (by
    setting name; None = not given) in their places. ConfigError names the field."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown DRA settings: {', '.join(sorted(unknown))}")
    overrides = {FIELDS[k]: v for k, v in values.items() if v is not None}
    return Settings.from_node_config(load_config(config_path, overrides))
