"""What detection finds, as msgspec structs: the node's runtime handlers, the NVIDIA toolkit
config one of them reads, CDI specs, and the node type (`NodeFacts`)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from node_setup.nodetype.tomlmerge import V2_CRI

OPERATOR_TOOLKIT = "/usr/local/nvidia/toolkit"
HOST_TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
OPERATOR_TOOLKIT_CONFIG = OPERATOR_TOOLKIT + "/.config/nvidia-container-runtime/config.toml"
NVIDIA_BINARIES = ("nvidia-container-runtime", "nvidia-container-toolkit")
DEFAULT_CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]

NodeType = Literal["N1-legacy", "N1-jit-cdi", "N1-cdi", "N2", "N3", "none"]


class Handler(msgspec.Struct, kw_only=True):
    """One `containerd.runtimes.<name>` table of the effective config."""

    name: str
    runtime_type: str = ""
    binary_name: str = ""  # options.BinaryName ("" = runc on PATH)
    base_runtime_spec: str = ""
    container_annotations: list[str] = msgspec.field(default_factory=list)
    nvidia: bool = False  # reaches an NVIDIA runtime (name nvidia* or BinaryName nvidia-container-runtime*)
    binary_exists: bool = False
    table: dict[str, Any] = msgspec.field(default_factory=dict)  # the whole table, as configured


class ToolkitConfig(msgspec.Struct, kw_only=True):
    """The nvidia-container-runtime config.toml a handler's runtime reads."""

    path: str
    exists: bool = False
    error: str = ""
    mode: str = "auto"
    runtimes: list[str] = msgspec.field(default_factory=lambda: ["runc", "crun"])
    default_kind: str = "nvidia.com/gpu"
    annotation_prefixes: list[str] = msgspec.field(default_factory=lambda: ["cdi.k8s.io/"])
    spec_dirs: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_CDI_DIRS))
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False
    swarm_resource: str = ""  # env vars preferred over NVIDIA_VISIBLE_DEVICES ("" = none)
    skip_mode_detection: bool = False  # [nvidia-container-runtime-hook] skip-mode-detection

    def legacy_hook_accepts(self) -> bool:
        """Whether NVIDIA's legacy hook, reading this config, sets a GPU up for a container that
        names it by UUID (hook_config.go@v1.20.0: assertModeIsLegacy): with skip-mode-detection,
        or when the mode resolves to legacy - `legacy`, or `auto` (the hook's default is legacy;
        auto is cdi only when every request is a CDI name).  In `cdi` or `jit-cdi` mode it
        refuses: "invoking the NVIDIA Container Runtime Hook directly ... is not supported"."""
        return self.skip_mode_detection or self.mode in ("legacy", "auto")


class CDISpec(msgspec.Struct, kw_only=True):
    path: str
    kind: str = ""
    devices: list[str] = msgspec.field(default_factory=list)
    error: str = ""


class NodeFacts(msgspec.Struct, kw_only=True):
    root: str
    containerd_config: str  # host path of the main config
    config_exists: bool = False
    containerd_bin: str = ""  # host path, "" when none
    containerd_version: str = ""  # e.g. "1.6.20"; "" when unknown
    containerd_major: int = 1
    config_version: int = 2
    cri_plugin: str = V2_CRI
    source: str = "files"  # "config dump" or "files"
    source_note: str = ""  # why `config dump` was not used
    files: list[str] = msgspec.field(default_factory=list)  # merge order, host paths
    cri_file: str = ""  # 1.x: the file whose CRI section is the effective one
    default_runtime: str = "runc"
    handlers: list[Handler] = msgspec.field(default_factory=list)
    nvidia_handler: str = ""  # the handler install copies ("" = none)
    legacy_binary: str = ""  # `<BinaryName>.legacy` when it exists
    cri_error: str = ""  # why containerd's CRI plugin will not load with this config ("" = it loads)
    toolkit: ToolkitConfig | None = None
    toolkit_version: str = ""
    cdi_enabled: bool = False
    cdi_spec_dirs: list[str] = msgspec.field(default_factory=list)
    cdi_specs: list[CDISpec] = msgspec.field(default_factory=list)
    node_type: NodeType = "none"
    notes: list[str] = msgspec.field(default_factory=list)

    def handler(self, name: str) -> Handler | None:
        for h in self.handlers:
            if h.name == name:
                return h
        return None


def version_tuple(v: str) -> tuple[int, ...]:
    """The leading numeric components of a version string ("1.6.20~ds1" -> (1, 6, 20))."""
    out = []
    for p in v.split("."):
        digits = "".join(c for c in p if c.isdigit()) if p else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)
