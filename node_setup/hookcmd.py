"""`vgpu-hook`, the command: the OCI hook (prestart, poststop) and its installers (containerd, hooksd).

prestart and poststop go straight to the hook (runtime_hook.main), before anything else is
imported; `containerd install|uninstall|print|detect` wires the hook into containerd
(node_setup.containerd) and `hooksd install|uninstall|print` writes OCI hooks.d entries for CRI-O
and podman (node_setup.hooksd). Exit codes: 0 ok, 1 failed (one line on stderr), 2 usage or
config error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from runtime_hook import main as hook
from runtime_hook import settings

_HOOK_COMMANDS = ("prestart", "poststop")


def build_parser() -> argparse.ArgumentParser:
    from vgpu import __version__

    p = argparse.ArgumentParser(
        prog="vgpu-hook", description="k8s-vgpu OCI prestart/poststop hook and containerd configuration"
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config", default=None, help="node config (default: $VGPU_CONFIG or /etc/vgpu/config.toml)")
    p.add_argument("--state-dir", default=None, help="overrides common.state_dir")
    p.add_argument("--log-level", default=None, help="overrides common.log_level")
    p.add_argument("--cdi-annotation-prefix", default=None, help=argparse.SUPPRESS)
    p.add_argument("--library-path", default=None, help="overrides hook.library_path (the libvgpu.so to mount)")
    p.add_argument("--log-dir", default=None, help="overrides hook.log_dir")
    p.add_argument("--log-max-bytes", default=None, type=int, help="overrides hook.log_max_bytes")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prestart", help="OCI prestart hook (state JSON on stdin; runtime_hook.main)")
    sub.add_parser("poststop", help="OCI poststop hook (state JSON on stdin; runtime_hook.main)")
    c = sub.add_parser("containerd", help="wire the hook into containerd")
    c.add_argument("action", choices=["install", "uninstall", "print", "detect"])
    c.add_argument("--containerd-config", default="/etc/containerd/config.toml", help="host path of the main config")
    c.add_argument(
        "--containerd-version", default=None, help="1 or 2 (default: config version, `containerd --version`)"
    )
    c.add_argument("--handler", default="vgpu", help="runtime handler name (RuntimeClass.handler)")
    c.add_argument("--default", action="store_true", help="also make the handler containerd's default runtime")
    c.add_argument("--base-spec", default=None, help="host path of the base runtime spec to write (JSON)")
    c.add_argument("--base-spec-source", default=None, help="start from this spec instead of `ctr oci spec`")
    c.add_argument("--conf-d", default=None, help="containerd 2.x drop-in directory (default: <config dir>/conf.d)")
    c.add_argument("--python", default=None, help="host path of the interpreter that runs the hook (default: this one)")
    c.add_argument("--hook-path", default=None, help="host path of runtime_hook/fastpath.py (default: this package's)")
    c.add_argument("--hook-timeout", type=int, default=30, help="seconds runc allows each hook")
    c.add_argument("--no-shell-filter", action="store_true", help="run the Python hook for every container")
    c.add_argument("--root", default="/", help="the host's / (read and write every file under it; default /)")
    c.add_argument("--containerd-bin", default=None, help="host path of containerd for `config dump` (chrooted)")
    c.add_argument("--toolkit-config", default=None, help="the NVIDIA runtime's config.toml (default: detected)")
    c.add_argument("--nvidia-runtime", default=None, help="BinaryName for the vgpu handler (overrides detection)")
    c.add_argument(
        "--without-nvidia-runtime", action="store_true", help="allow a node without NVIDIA runtime (simulator, tests)"
    )
    c.add_argument("--json", action="store_true", help="detect: print the facts as JSON")
    h = sub.add_parser("hooksd", help="OCI hooks.d entries for CRI-O and podman")
    h.add_argument("action", choices=["install", "uninstall", "print"])
    h.add_argument("--dir", default=None, help="hooks.d directory (default /usr/share/containers/oci/hooks.d)")
    h.add_argument("--root", default="/", help="the host's / (files are written under it)")
    h.add_argument("--python", default=None, help="host path of the interpreter that runs the hook (default: this one)")
    h.add_argument("--hook-path", default=None, help="host path of runtime_hook/fastpath.py (default: this package's)")
    h.add_argument("--hook-timeout", type=int, default=30, help="seconds the runtime allows each hook")
    h.add_argument("--no-shell-filter", action="store_true", help="run Python directly (no sh filter)")
    return p


def load_config(path: str | None, overrides: dict[str, Any]) -> Any:
    from vgpu import config as vconfig

    return vconfig.load_config(path or vconfig.config_path_from_env(), overrides)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd, opts = settings.scan_argv(args)
    if cmd in _HOOK_COMMANDS and "-h" not in args and "--help" not in args:
        return hook.run(args, cmd, opts)
    ns = build_parser().parse_args(args)
    if ns.cmd in _HOOK_COMMANDS:  # --help was handled by argparse
        return 2
    from vgpu.config import ConfigError

    overrides = {k: getattr(ns, f[2:].replace("-", "_")) for f, k in settings.FLAG_KEYS.items()}
    try:
        root = getattr(ns, "root", "/") or "/"
        if os.path.realpath(root) == "/":
            cfg = load_config(ns.config, overrides)
        else:  # the node config is a host file too: read it under --root
            from node_setup.nodetype import Root
            from vgpu import config as vconfig

            cfg = load_config(Root(root).fs(ns.config or vconfig.config_path_from_env()), overrides)
    except ConfigError as e:
        sys.stderr.write(f"vgpu-hook: {e}\n")
        return 2
    from node_setup import containerd

    try:
        if ns.cmd == "hooksd":
            from node_setup import hooksd

            return hooksd.command(ns, cfg)
        return containerd.command(ns, cfg)
    except containerd.InstallError as e:
        sys.stderr.write(f"vgpu-hook {ns.cmd} {ns.action}: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
