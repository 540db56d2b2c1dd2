"""Node configuration: one msgspec schema for all daemons (contract 5).

Loaded from /etc/vgpu/config.toml (a missing file means all defaults); every
field can be overridden by a daemon flag through `load_config(overrides=...)`,
where overrides are keyed by dotted field path ("device_plugin.device_split_count").
Invalid values raise ConfigError whose message names the field.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

import msgspec

from vgpu import paths

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
LogLevel = Literal["debug", "info", "warning", "error"]


class CommonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    state_dir: str = paths.DEFAULT_STATE_DIR
    log_level: LogLevel = "warning"
    # Files rebuilt at start-up that must not outlive a reboot (the DRA claims' limits and
    # regions) go here when set, best a tmpfs such as /run/vgpu; empty: under state_dir.
    run_dir: str = ""


class HookConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    library_path: str = paths.DEFAULT_LIBRARY_PATH
    log_dir: str = paths.DEFAULT_LOG_DIR
    log_max_bytes: PositiveInt = 4 * 1024 * 1024


class DevicePluginConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    resource_name: str = "nvidia.com/gpu"
    device_split_count: PositiveInt = 2
    device_memory_scaling: PositiveFloat = 1.0
    device_cores_scaling: PositiveFloat = 1.0
    kubelet_dir: str = "/var/lib/kubelet"
    socket_name: str = "vgpu.sock"
    allocation_policy: Literal["spread", "binpack"] = "spread"
    health_recovery_s: NonNegFloat = 300.0
    record_gc_grace_s: NonNegFloat = 300.0
    record_gc_interval_s: PositiveFloat = 60.0
    node_name: str = ""
    # Scheduler decisions (vgpu/scheduling.py): "auto" honours a pod's decision when the API
    # server answers and falls back to n x 1/K when it does not; "required" fails Allocate when
    # the API server cannot be asked; "off" never asks.
    decisions: Literal["auto", "required", "off"] = "auto"
    inventory_heartbeat_s: PositiveFloat = 30.0
    # How Allocate names the GPUs for NVIDIA's runtime / a CDI engine (device_plugin/strategy.py):
    # any of envvar, volume-mounts, cdi-annotations, cdi-cri, as NVIDIA's --device-list-strategy.
    device_list_strategy: Annotated[
        list[Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]], msgspec.Meta(min_length=1)
    ] = msgspec.field(default_factory=lambda: ["envvar"])
    cdi_kind: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*$")] = (
        "nvidia.com/gpu"
    )
    cdi_annotation_prefix: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9.-]*/$")] = "cdi.k8s.io/"
    # GPUs in MIG mode (device_plugin/mig.py, docs/operators/mig.md): NVIDIA's --mig-strategy none,
    # single, mixed, vgpu (each MIG device split into K vGPUs like a GPU) or dynamic (an instance
    # made per container the scheduler placed, device_plugin/dynmig.py).
    mig_strategy: Literal["none", "single", "mixed", "vgpu", "dynamic"] = "none"


class MonitorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    period_ms: Annotated[int, msgspec.Meta(ge=10, le=10_000)] = 100
    policy: Literal["contended", "strict", "off"] = "contended"
    metrics_address: str = "0.0.0.0"
    metrics_port: Port = 9394
    max_suspend_ms: Annotated[int, msgspec.Meta(ge=10)] = 1000
    window_s: PositiveFloat = 0.5
    backstop_action: Literal["kill", "log"] = "kill"
    backstop_tolerance_bytes: Annotated[int, msgspec.Meta(ge=0)] = 64 * 1024 * 1024
    backstop_grace_s: NonNegFloat = 2.0
    gc_grace_s: NonNegFloat = 30.0
    duty_period_ms: Annotated[int, msgspec.Meta(ge=50, le=10_000)] = 500


MIB = 1 << 20
# A DRA driver name: a lowercase DNS subdomain of at most 63 characters (ValidateCSIDriverName).
DriverName = Annotated[
    str, msgspec.Meta(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
]


class DRAConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The DRA front end's own settings (`vgpu-dra-plugin`, docs/developers/dra-plugin.md). The node's slicing
    (split count, scalings), kubelet dir, node name and NVIDIA CDI kind are the `device_plugin`
    section's, the library `hook.library_path`, the state dir `common.state_dir`: one node core
    serves both front ends, with one set of node settings."""

    driver_name: DriverName = "gpu.vgpu.k8s.io"
    # Where the per-claim CDI specs go: /var/run/cdi is CDI's dynamic dir (specs with a lifetime),
    # read after /etc/cdi by every runtime's default spec dirs.
    cdi_dir: str = "/var/run/cdi"
    # How the node's NVIDIA CDI spec names a GPU: `<kind>=<uuid>` or `<kind>=<index>` (nvidia-ctk
    # cdi generate writes both).
    nvidia_cdi_device: Literal["uuid", "index"] = "uuid"
    # requestPolicy.validRange of the capacities: min and step (bytes, percent); max is the
    # capacity rounded down to a step; the default is the 1/K share rounded down to a step.
    memory_step: PositiveInt = 256 * MIB
    memory_min: PositiveInt = 256 * MIB
    cores_step: PositiveInt = 1
    cores_min: Annotated[int, msgspec.Meta(ge=0)] = 1
    # Publish the node's ResourceSlices (off: another component does, or tests).
    publish: bool = True
    # Seconds between re-checks of the published ResourceSlices.
    resync_s: PositiveFloat = 60.0


class NodeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    common: CommonConfig = msgspec.field(default_factory=CommonConfig)
    hook: HookConfig = msgspec.field(default_factory=HookConfig)
    device_plugin: DevicePluginConfig = msgspec.field(default_factory=DevicePluginConfig)
    monitor: MonitorConfig = msgspec.field(default_factory=MonitorConfig)
    dra: DRAConfig = msgspec.field(default_factory=DRAConfig)

    @property
    def paths(self) -> paths.Paths:
        return paths.Paths(self.common.state_dir, self.common.run_dir)


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending field."""


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")


def _explain(err: msgspec.MsgspecError, source: str) -> ConfigError:
    text = str(err)
    m = _PATH_RE.search(text)
    field = m.group(1) if m else ""
    reason = _PATH_RE.sub("", text).rstrip(" -")
    where = f" field `{field}`" if field else ""
    return ConfigError(f"invalid configuration ({source}){where}: {reason}")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"invalid override `{dotted}`: `{p}` is not a section")
        node = child
    node[parts[-1]] = value


def load_config(
    path: str | None = paths.DEFAULT_CONFIG_PATH,
    overrides: dict[str, Any] | None = None,
    *,
    missing_ok: bool = True,
) -> NodeConfig:
    """Load the node config file and apply flag overrides (dotted keys).

    Overrides whose value is None are ignored (flags the user did not give).
    """
    tree: dict[str, Any] = {}
    source = path or "defaults"
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if not missing_ok:
                raise ConfigError(f"configuration file {path} does not exist") from None
            data = b""
        except OSError as e:
            raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from None
        if data.strip():
            try:
                tree = msgspec.toml.decode(data)
            except msgspec.DecodeError as e:
                raise ConfigError(f"invalid configuration ({path}): {e}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
            source = f"{path or 'defaults'} + flags"
    try:
        return msgspec.convert(tree, NodeConfig, strict=False)
    except msgspec.ValidationError as e:
        raise _explain(e, source) from None


def config_path_from_env() -> str:
    """The config path: $VGPU_CONFIG when set (tests, demos), else the default."""
    return os.environ.get("VGPU_CONFIG", paths.DEFAULT_CONFIG_PATH)
