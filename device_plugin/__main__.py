"""vgpu-device-plugin command line: flags → config → NVML inventory → Daemon."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import msgspec

from device_plugin import strategy
from device_plugin.registration import valid_resource_name
from nodecore.cli import Parser, finite_float
from vgpu import __version__, nvml
from vgpu.config import ConfigError, DevicePluginConfig, config_path_from_env, load_config
from vgpu.log import kv, setup_logging
from vgpu.paths import Paths

PROG = "vgpu-device-plugin"
log = logging.getLogger("device_plugin")

# Flags of the device_plugin config section: name → (type, help).
_FIELD_HELP: dict[str, str] = {
    "resource_name": "extended resource name advertised to the kubelet (default nvidia.com/gpu)",
    "device_split_count": "vGPUs per physical GPU, K (int >= 1, default 2)",
    "device_memory_scaling": "memory scaling S (float > 0, default 1; > 1 oversubscribes)",
    "device_cores_scaling": "compute scaling C (float > 0, default 1)",
    "kubelet_dir": "kubelet root directory (default /var/lib/kubelet)",
    "socket_name": "plugin socket name in <kubelet-dir>/device-plugins (default vgpu.sock)",
    "allocation_policy": "preferred allocation policy: spread (default) or binpack",
    "health_recovery_s": "seconds without a bad event after which an unhealthy GPU is healthy again",
    "record_gc_grace_s": "seconds a record must stay unassigned before it is removed",
    "record_gc_interval_s": "seconds between PodResources queries for record cleanup",
    "node_name": "Node to annotate with the inventory (default $NODE_NAME, else the host name)",
    "decisions": "scheduler decisions: auto (default; n x 1/K when the API is unreachable), required, off",
    "inventory_heartbeat_s": "seconds between refreshes of the inventory annotation's heartbeat (default 30)",
    "device_list_strategy": "how Allocate names the GPUs, a comma list of envvar (default), volume-mounts, "
    "cdi-annotations, cdi-cri",
    "cdi_kind": "CDI kind of the GPUs in cdi-annotations / cdi-cri names (default nvidia.com/gpu)",
    "cdi_annotation_prefix": "annotation key prefix of the cdi-annotations strategy (default cdi.k8s.io/)",
    "mig_strategy": "GPUs in MIG mode: none (default), single, mixed (NVIDIA's --mig-strategy), vgpu "
    "(each MIG device split into K vGPUs) or dynamic (a MIG instance made per scheduled container)",
}


_TYPES: dict[str, Any] = {
    "device_split_count": int,
    "device_memory_scaling": finite_float,
    "device_cores_scaling": finite_float,
    "health_recovery_s": finite_float,
    "record_gc_grace_s": finite_float,
    "record_gc_interval_s": finite_float,
    "inventory_heartbeat_s": finite_float,
    "device_list_strategy": strategy.parse_list,
}
assert set(_FIELD_HELP) == {f.name for f in msgspec.structs.fields(DevicePluginConfig)}, "flags out of date"


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="k8s-vgpu kubelet device plugin that splits GPUs into vGPUs")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config", default=None, help="config file (default $VGPU_CONFIG, else /etc/vgpu/config.toml)")
    p.add_argument("--state-dir", default=None, help="state directory (overrides common.state_dir)")
    p.add_argument("--log-level", default=None, help="debug, info, warning or error")
    for name, help_text in _FIELD_HELP.items():
        p.add_argument(_flag(name), dest=name, type=_TYPES.get(name, str), default=None, help=help_text)
    return p


def _field_to_option(msg: str) -> str:
    """Name the flag in a ConfigError about a device_plugin/common field."""
    for name in _FIELD_HELP:
        msg = msg.replace(f"`device_plugin.{name}`", f"`device_plugin.{name}` (option {_flag(name)})")
    msg = msg.replace("`common.state_dir`", "`common.state_dir` (option --state-dir)")
    msg = msg.replace("`common.log_level`", "`common.log_level` (option --log-level)")
    return msg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {f"device_plugin.{n}": getattr(args, n) for n in _FIELD_HELP}
    overrides["common.state_dir"] = args.state_dir
    overrides["common.log_level"] = args.log_level
    try:
        cfg = load_config(args.config or config_path_from_env(), overrides)
    except ConfigError as e:
        print(f"{PROG}: {_field_to_option(str(e))}", file=sys.stderr)
        return 2
    dp = cfg.device_plugin
    if not valid_resource_name(dp.resource_name):
        print(
            f"{PROG}: invalid --resource-name {dp.resource_name!r}: must be a domain-prefixed extended resource name",
            file=sys.stderr,
        )
        return 2
    if "/" in dp.socket_name or dp.socket_name in ("", ".", "..", "kubelet.sock"):
        print(f"{PROG}: invalid --socket-name {dp.socket_name!r}: a file name other than kubelet.sock", file=sys.stderr)
        return 2
    setup_logging(cfg.common.log_level)

    try:
        nvml.init()
        gpus = nvml.inventory()
    except nvml.NVMLUnavailable as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # NVMLError while listing devices
        print(f"{PROG}: cannot list GPUs through NVML: {e}", file=sys.stderr)
        return 1
    if not gpus:
        log.warning("NVML reports no GPU; registering with no devices")
    for g in gpus:
        log.info(
            "gpu %d %s %s memory=%d bus=%s numa=%s", g.index, g.uuid, g.name, g.memory_total, g.pci_bus_id, g.numa_node
        )

    from device_plugin import mig
    from device_plugin.daemon import Daemon
    from nodecore import mig as node_mig
    from nodecore.devices import Slicing

    try:
        layout = node_mig.discover(gpus)
        resources = mig.plan(
            dp.mig_strategy,
            layout,
            resource_name=dp.resource_name,
            socket_name=dp.socket_name,
            slicing=Slicing(dp.device_split_count, dp.device_memory_scaling, dp.device_cores_scaling),
        )
    except mig.MigConfigError as e:  # NVIDIA's plugin does not start either
        print(f"{PROG}: mig-strategy {dp.mig_strategy}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # NVMLError while reading the MIG devices
        print(f"{PROG}: cannot read the MIG devices through NVML: {e}", file=sys.stderr)
        return 1
    for d in layout.devices:
        log.info("mig device %s of gpu %d: %s gi=%d ci=%d memory=%d", d.uuid, d.parent.index, d.profile, d.gi, d.ci,
                 d.memory)  # fmt: skip
    for name, n in mig.offered(resources).items():
        log.warning(kv("offering", resource=name, devices=n, mig_strategy=dp.mig_strategy))

    daemon = Daemon(dp, Paths(cfg.common.state_dir), gpus, resources=resources)

    def _stop(signum: int, _frame: object) -> None:
        daemon.stop()

    def _hup(signum: int, _frame: object) -> None:
        daemon.request_restart()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGQUIT, _stop)
    signal.signal(signal.SIGHUP, _hup)
    try:
        return daemon.run()
    except OSError as e:  # state or kubelet directory not usable
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    finally:
        nvml.shutdown()


if __name__ == "__main__":
    sys.exit(main())
