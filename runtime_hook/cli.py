"""vgpu-hook command line: prestart, poststop, containerd install|uninstall|print|detect, hooksd.

Reached from runtime_hook.fastpath once the cheap decision is made (or for
the containerd subcommands).  Exit codes: 0 ok / container left alone,
1 the container must not start (one line on stderr), 2 usage or config error.
"""

from __future__ import annotations

import os
import sys

from runtime_hook import hooklog, oci
from runtime_hook.hooklog import kv

TYPE_CHECKING = False  # `typing` (~3 ms) is not imported on the hook paths
if TYPE_CHECKING:
    import argparse
    from typing import Any

_FLAG_KEYS = {
    "--state-dir": "common.state_dir",
    "--log-level": "common.log_level",
    "--library-path": "hook.library_path",
    "--log-dir": "hook.log_dir",
    "--log-max-bytes": "hook.log_max_bytes",
}


def build_parser() -> argparse.ArgumentParser:
    import argparse

    from vgpu import __version__

    p = argparse.ArgumentParser(
        prog="vgpu-hook", description="k8s-vgpu OCI prestart/poststop hook and containerd configuration"
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config", default=None, help="node config (default: $VGPU_CONFIG or /etc/vgpu/config.toml)")
    p.add_argument("--state-dir", default=None, help="overrides common.state_dir")
    p.add_argument("--log-level", default=None, help="overrides common.log_level")
    p.add_argument("--library-path", default=None, help="overrides hook.library_path (the libvgpu.so to mount)")
    p.add_argument("--log-dir", default=None, help="overrides hook.log_dir")
    p.add_argument("--log-max-bytes", default=None, type=int, help="overrides hook.log_max_bytes")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prestart", help="OCI prestart hook (state JSON on stdin)")
    sub.add_parser("poststop", help="OCI poststop hook (state JSON on stdin)")
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


def _load(config: str | None, overrides: dict[str, Any]) -> Any:
    from vgpu import config as vconfig

    return vconfig.load_config(config or vconfig.config_path_from_env(), overrides)


def _setup_log(cfg: Any) -> None:
    hooklog.log = hooklog.HookLog(cfg.hook.log_dir, cfg.hook.log_max_bytes, cfg.common.log_level)


def _fatal(msg: str) -> int:
    line = "vgpu-hook: " + oci.oneline(msg, 2000)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    hooklog.log.error(line)
    return 1


def main(
    argv: list[str] | None = None,
    *,
    decision: oci.Proceed | oci.Skip | oci.Fail | None = None,
    poststop_stdin: bytes | None = None,
) -> int:
    from runtime_hook.fastpath import scan_argv

    args = sys.argv[1:] if argv is None else argv
    cmd, opts = scan_argv(args)
    if cmd in ("prestart", "poststop") and "-h" not in args and "--help" not in args:
        # The hook paths: no argparse (its import is a measurable part of a hook run).
        return hook_main(cmd, opts, decision, poststop_stdin)
    ns = build_parser().parse_args(args)
    if ns.cmd in ("prestart", "poststop"):  # pragma: no cover - handled above
        return 2
    from vgpu.config import ConfigError

    overrides = {k: getattr(ns, f[2:].replace("-", "_")) for f, k in _FLAG_KEYS.items()}
    try:
        root = getattr(ns, "root", "/") or "/"
        if os.path.realpath(root) == "/":
            cfg = _load(ns.config, overrides)
        else:  # the node config is a host file too: read it under --root
            from runtime_hook.nodetype import Root
            from vgpu import config as vconfig

            cfg = _load(Root(root).fs(ns.config or vconfig.config_path_from_env()), overrides)
    except ConfigError as e:
        sys.stderr.write(f"vgpu-hook: {e}\n")
        return 2
    from runtime_hook import containerd

    try:
        if ns.cmd == "hooksd":
            from runtime_hook import hooksd

            return hooksd.command(ns, cfg)
        return containerd.command(ns, cfg)
    except containerd.InstallError as e:
        sys.stderr.write(f"vgpu-hook {ns.cmd} {ns.action}: {e}\n")
        return 1


class _Section:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FlagConfig:
    """The hook's part of the node config, from flags and defaults (no config file to read)."""

    def __init__(self, opts: dict[str, str]) -> None:
        from runtime_hook import fastpath as paths  # the defaults of vgpu.paths, without its imports

        level = opts.get("--log-level", "warning")
        if level not in hooklog.LEVELS:
            raise ValueError(f"invalid option --log-level {level!r}: expected one of debug, info, warning, error")
        raw = opts.get("--log-max-bytes", str(4 * 1024 * 1024))
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"invalid option --log-max-bytes {raw[:20]!r}: expected an integer >= 1")
        self.common = _Section(state_dir=opts.get("--state-dir", paths.DEFAULT_STATE_DIR), log_level=level)
        self.hook = _Section(
            library_path=opts.get("--library-path", paths.DEFAULT_LIBRARY_PATH),
            log_dir=opts.get("--log-dir", paths.DEFAULT_LOG_DIR),
            log_max_bytes=int(raw),
        )
        prefix = opts.get("--cdi-annotation-prefix", oci.CDI_ANNOTATION_PREFIX)
        if not _valid_cdi_prefix(prefix):
            raise ValueError(f"invalid option --cdi-annotation-prefix {prefix[:40]!r}: expected e.g. 'cdi.k8s.io/'")
        self.device_plugin = _Section(cdi_annotation_prefix=prefix)


def _valid_cdi_prefix(p: str) -> bool:
    """vgpu.config's pattern for cdi_annotation_prefix, without `re` on the hook's path."""
    head = p[:-1]
    return (
        p.endswith("/")
        and bool(head)
        and head[0].isascii()
        and head[0].isalnum()
        and all(c.isascii() and (c.islower() or c.isdigit() or c in ".-") for c in head)
    )


def hook_config(opts: dict[str, str]) -> Any:
    """Flags only when they give every hook setting or there is no config file; else vgpu.config (msgspec)."""
    path = opts.get("--config") or os.environ.get("VGPU_CONFIG") or "/etc/vgpu/config.toml"
    if all(f in opts for f in _FLAG_KEYS) or not os.path.exists(path):
        return FlagConfig(opts)
    overrides = {key: opts.get(flag) for flag, key in _FLAG_KEYS.items()}
    from runtime_hook.hotpath import _enable_site_packages

    _enable_site_packages()  # vgpu.config needs msgspec and a TOML parser
    return _load(path, overrides)


def hook_main(
    cmd: str, opts: dict[str, str], decision: oci.Proceed | oci.Skip | oci.Fail | None, data: bytes | None
) -> int:
    try:
        cfg = hook_config(opts)
    except ValueError as e:  # vgpu.config.ConfigError is a ValueError
        if cmd == "prestart" and not isinstance(decision, oci.Skip):
            return _fatal(str(e))  # a vGPU container cannot be set up without its config
        try:
            sys.stderr.write(f"vgpu-hook: {oci.oneline(str(e))}\n")
        except (OSError, ValueError):
            pass
        return 0  # a broken node config never blocks containers without a vGPU, nor deletion
    _setup_log(cfg)
    if cmd == "prestart":
        return cmd_prestart(cfg, decision)
    return cmd_poststop(cfg, data)


def cmd_prestart(cfg: Any, decision: oci.Proceed | oci.Skip | oci.Fail | None) -> int:
    if decision is None:
        decision = oci.decide_prestart(sys.stdin.buffer.read(oci.MAX_STATE_BYTES + 1))
    if isinstance(decision, oci.Skip):
        if decision.log:
            hooklog.log.warning(kv("prestart: container left alone", reason=decision.log))
        return 0
    if isinstance(decision, oci.Fail):
        return _fatal(decision.message)
    from runtime_hook import prestart

    try:
        prefixes = tuple(dict.fromkeys((oci.CDI_ANNOTATION_PREFIX, cfg.device_plugin.cdi_annotation_prefix)))
        prestart.run(decision, cfg.common.state_dir, cfg.hook.library_path, prefixes)
    except oci.HookError as e:
        return _fatal(str(e))
    except Exception as e:  # a bug must still fail closed with one line, never only a traceback
        hooklog.log.error(kv("prestart failed", error=repr(e)))
        return _fatal(f"internal error setting up vGPU container: {type(e).__name__}: {e}")
    return 0


def cmd_poststop(cfg: Any, data: bytes | None) -> int:
    if data is None:
        data = sys.stdin.buffer.read(oci.MAX_STATE_BYTES + 1)
    try:
        cid = oci.parse_poststop_id(data)
    except ValueError as e:
        hooklog.log.warning(kv("poststop: malformed OCI state", reason=str(e)))
        return 0
    from runtime_hook import poststop

    try:
        poststop.remove_state(cid, cfg.common.state_dir)
    except Exception as e:
        hooklog.log.error(kv("poststop failed", error=repr(e)))
    return 0
