"""`vgpu-hook`, the command: the OCI hook (prestart, poststop) and its installers (containerd, hooksd).

prestart and poststop go straight to the hook (runtime_hook.main), before anything else is
imported; `containerd install|uninstall|print|detect` wires the hook into containerd
(node_setup.containerd) and `hooksd install|uninstall|print` writes OCI hooks.d entries for CRI-O
and podman (node_setup.hooksd): the flags become their options here, the packages plan and apply.
Exit codes: 0 ok, 1 failed (one line on stderr), 2 usage or config error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from runtime_hook import main as hook
from runtime_hook import settings

if TYPE_CHECKING:
    from node_setup.containerd.plan import Options as ContainerdOptions
    from node_setup.hooksd.plan import Options as HooksdOptions
    from node_setup.hookspec import HookOptions

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


def hook_options(ns: argparse.Namespace, cfg: Any) -> HookOptions:
    """How the runtime is to start the hook: flags, else this interpreter and this installation."""
    from node_setup.hookspec import HookOptions, hook_args

    return HookOptions(
        python=os.path.abspath(ns.python or sys.executable),
        hook_path=ns.hook_path,
        timeout=ns.hook_timeout,
        filter_state_dir=None if ns.no_shell_filter else os.path.abspath(cfg.common.state_dir),
        args=tuple(hook_args(ns.config or os.environ.get("VGPU_CONFIG"), cfg)),
    )


def containerd_options(ns: argparse.Namespace, cfg: Any) -> ContainerdOptions:
    from node_setup.containerd.plan import Options
    from node_setup.hostfiles import InstallError

    major = ns.containerd_version
    if major and major not in ("1", "2"):
        raise InstallError(f"--containerd-version must be 1 or 2, not {major!r}")
    return Options(
        containerd_config=os.path.abspath(ns.containerd_config),
        root=ns.root,
        major=int(major) if major else None,
        containerd_bin=ns.containerd_bin,
        toolkit_config=ns.toolkit_config,
        handler=ns.handler,
        make_default=ns.default,
        base_spec=os.path.abspath(ns.base_spec) if ns.base_spec else "",
        base_spec_source=ns.base_spec_source,
        conf_d=os.path.abspath(ns.conf_d) if ns.conf_d else "",
        nvidia_runtime=ns.nvidia_runtime,
        without_nvidia_runtime=ns.without_nvidia_runtime,
        hook=hook_options(ns, cfg) if ns.action in ("install", "print") else None,
    )


def hooksd_options(ns: argparse.Namespace, cfg: Any) -> HooksdOptions:
    from node_setup.hooksd.plan import DEFAULT_DIR, Options

    return Options(hook=hook_options(ns, cfg), directory=os.path.abspath(ns.dir or DEFAULT_DIR), root=ns.root)


def run_installer(ns: argparse.Namespace, cfg: Any) -> int:
    """`containerd ...` or `hooksd ...`: options from the flags, the action, its output."""
    out: list[str] | str
    if ns.cmd == "hooksd":
        from node_setup.hooksd import apply as hooksd

        hopts = hooksd_options(ns, cfg)
        if ns.action == "install":
            out = hooksd.install(hopts)
        elif ns.action == "uninstall":
            out, warnings = hooksd.uninstall(hopts)
            sys.stderr.writelines(w + "\n" for w in warnings)
        else:
            out = hooksd.show(hopts)
    else:
        from node_setup.containerd import apply as containerd

        copts = containerd_options(ns, cfg)
        if ns.action == "install":
            out = containerd.install(copts)
        elif ns.action == "uninstall":
            out = containerd.uninstall(copts)
        elif ns.action == "detect":
            out = containerd.describe(copts, ns.json)
        else:
            out = containerd.show(copts)
    sys.stdout.write(out if isinstance(out, str) else "".join(line + "\n" for line in out))
    return 0


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
            from node_setup.nodetype.root import Root
            from vgpu import config as vconfig

            cfg = load_config(Root(root).fs(ns.config or vconfig.config_path_from_env()), overrides)
    except ConfigError as e:
        sys.stderr.write(f"vgpu-hook: {e}\n")
        return 2
    from node_setup.hostfiles import InstallError

    try:
        return run_installer(ns, cfg)
    except InstallError as e:
        sys.stderr.write(f"vgpu-hook {ns.cmd} {ns.action}: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
