"""vgpu-dra-plugin command line: node config + flags → Settings → NVML inventory → daemon.

Every flag overrides one field of the node config (dra_plugin/config.py FIELDS): the DRA
front end's own in `[dra]`, the node's (slicing, kubelet dir, node name, library, state dir) where
the device plugin reads them too. An invalid value exits 2 naming the field and the flag.

vgpu-dra-plugin [run]          serve the kubelet (registration + DRA v1) and publish slices
vgpu-dra-plugin unpublish      delete this node's ResourceSlices of the driver (uninstall)
vgpu-dra-plugin print          the ResourceSlices and the DeviceClass it would publish (JSON)
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any

from dra_plugin import apiclient, slices
from dra_plugin.config import DRIVER_NAME, FIELDS, Settings
from nodecore.cli import Parser, finite_float
from vgpu import __version__, nvml
from vgpu.config import ConfigError, config_path_from_env, load_config
from vgpu.log import setup_logging
from vgpu.nvml import GPUInfo

PROG = "vgpu-dra-plugin"
log = logging.getLogger("dra_plugin")


# flag -> (setting, type, help); the setting's place in the node config is FIELDS[setting]
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--driver-name": ("driver_name", str, f"DRA driver name (default {DRIVER_NAME})"),
    "--node-name": ("node_name", str, "this Node's name, the pool name (default $NODE_NAME, else the host name)"),
    "--kubelet-dir": ("kubelet_dir", str, "kubelet root directory (default device_plugin.kubelet_dir)"),
    "--state-dir": ("state_dir", str, "state directory (default common.state_dir)"),
    "--run-dir": ("run_dir", str, "directory of the claims' files, best a tmpfs (default common.run_dir)"),
    "--library-path": ("library_path", str, "libvgpu.so on the host (default hook.library_path)"),
    "--cdi-dir": ("cdi_dir", str, "directory for the per-claim CDI specs (default /var/run/cdi)"),
    "--nvidia-cdi-kind": ("nvidia_cdi_kind", str, "CDI kind of the NVIDIA spec (default device_plugin.cdi_kind)"),
    "--nvidia-cdi-device": ("nvidia_cdi_device", str, "how the NVIDIA spec names a GPU: uuid (default) or index"),
    "--device-split-count": ("split_count", int, "K: the default share of a GPU is 1/K"),
    "--device-memory-scaling": ("memory_scaling", finite_float, "memory scaling S: the memory capacity is S x M"),
    "--device-cores-scaling": ("cores_scaling", finite_float, "compute scaling C: the cores capacity is 100 x C"),
    "--memory-step": ("memory_step", int, "requestPolicy step of memory, bytes (default 256 MiB)"),
    "--memory-min": ("memory_min", int, "requestPolicy minimum of memory, bytes (default 256 MiB)"),
    "--cores-step": ("cores_step", int, "requestPolicy step of cores, percent (default 1)"),
    "--cores-min": ("cores_min", int, "requestPolicy minimum of cores, percent (default 1)"),
    "--resync-s": ("resync_s", finite_float, "seconds between ResourceSlice checks (default 60)"),
    "--health-recovery-s": (
        "health_recovery_s",
        finite_float,
        "seconds without a bad event before a GPU is healthy again",
    ),
}
assert {f for f, _, _ in _FLAGS.values()} | {"publish"} == set(FIELDS), "flags out of date"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="k8s-vgpu kubelet DRA plugin: claims for a share of a GPU, enforced")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("command", nargs="?", default="run", choices=["run", "unpublish", "print"])
    p.add_argument("--config", default=None, help="node config (default $VGPU_CONFIG, else /etc/vgpu/config.toml)")
    p.add_argument("--log-level", default=None, help="debug, info, warning or error")
    p.add_argument("--no-publish", action="store_true", help="do not publish ResourceSlices")
    p.add_argument("--extended-resource-name", default=None, help="print: the DeviceClass's extendedResourceName")
    for flag, (field, typ, help_text) in _FLAGS.items():
        p.add_argument(flag, dest=field, type=typ, default=None, help=help_text)
    return p


def load(args: argparse.Namespace) -> tuple[Settings, str]:
    overrides: dict[str, Any] = {FIELDS[field]: getattr(args, field) for field, _, _ in _FLAGS.values()}
    if args.log_level is not None:
        overrides["common.log_level"] = args.log_level
    if args.no_publish:
        overrides[FIELDS["publish"]] = False
    node_cfg = load_config(args.config or config_path_from_env(), overrides)
    return Settings.from_node_config(node_cfg), node_cfg.common.log_level


def _field_to_option(msg: str) -> str:
    """Name the flag in a ConfigError about a field a flag sets."""
    for flag, (field, _, _) in _FLAGS.items():
        msg = msg.replace(f"`{FIELDS[field]}`", f"`{FIELDS[field]}` (option {flag})")
    return msg.replace("`common.log_level`", "`common.log_level` (option --log-level)")


def _gpus() -> list[GPUInfo]:
    """The devices: the GPUs, a GPU in MIG mode as its MIG devices (static MIG: the instances the
    admin made; nodecore/mig.py); NVML stays initialised (the health monitor waits on its XID events)."""
    from nodecore import mig

    nvml.init()
    return mig.discover(nvml.inventory()).devices_as_gpus()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, level = load(args)
    except ConfigError as e:
        print(f"{PROG}: {_field_to_option(str(e))}", file=sys.stderr)
        return 2
    setup_logging(level)
    try:
        gpus = _gpus() if args.command != "unpublish" else []
    except nvml.NVMLUnavailable as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # NVMLError while listing
        print(f"{PROG}: cannot list GPUs through NVML: {e}", file=sys.stderr)
        return 1
    try:
        if args.command == "print":
            objs = slices.build(cfg.node(), gpus, cfg, generation=1)
            objs.append(slices.device_class(cfg.driver_name, args.extended_resource_name))
            print(json.dumps(objs, indent=1))
            return 0
    except slices.PolicyError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    api = apiclient.load()
    if args.command == "unpublish":
        return _unpublish(cfg, api)
    from dra_plugin.daemon import DRADaemon

    try:
        daemon = DRADaemon(cfg, gpus, api)
    except (slices.PolicyError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2 if isinstance(e, slices.PolicyError) else 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, lambda _s, _f: daemon.stop())
    try:
        return daemon.run()
    except (OSError, RuntimeError) as e:  # state dir, kubelet dir, a checkpoint it cannot use
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    finally:
        nvml.shutdown()


def _unpublish(cfg: Settings, api: apiclient.ResourceAPI | None) -> int:
    if api is None:
        print(f"{PROG}: no Kubernetes API server configured", file=sys.stderr)
        return 1
    from dra_plugin.publisher import Publisher

    try:
        n = Publisher(api, cfg, cfg.node(), list).remove()
    except apiclient.ApiError as e:
        print(f"{PROG}: cannot delete ResourceSlices: {e.status} {e.message}", file=sys.stderr)
        return 1
    print(f"{PROG}: deleted {n} ResourceSlice(s) of {cfg.driver_name} on {cfg.node()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
