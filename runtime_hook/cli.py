"""vgpu-hook command line: prestart, poststop, containerd install|uninstall|print.

Reached from runtime_hook.fastpath once the cheap decision is made (or for
the containerd subcommands).  Exit codes: 0 ok / container left alone,
1 the container must not start (one line on stderr), 2 usage or config error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from runtime_hook import oci
from vgpu import __version__
from vgpu.log import kv

log = logging.getLogger("vgpu.hook")


def build_parser() -> argparse.ArgumentParser:
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
    c.add_argument("action", choices=["install", "uninstall", "print"])
    c.add_argument("--containerd-config", default="/etc/containerd/config.toml")
    c.add_argument("--containerd-version", default=None, help="1 or 2 (default: `containerd --version`)")
    c.add_argument("--handler", default="vgpu", help="runtime handler name (RuntimeClass.handler)")
    c.add_argument("--default", action="store_true", help="also make the handler containerd's default runtime")
    c.add_argument("--base-spec", default=None, help="where to write the base runtime spec (JSON)")
    c.add_argument("--base-spec-source", default=None, help="start from this spec instead of `ctr oci spec`")
    c.add_argument("--conf-d", default=None, help="containerd 2.x drop-in directory (default: <config dir>/conf.d)")
    c.add_argument("--python", default=None, help="interpreter that runs the hook (default: this one)")
    c.add_argument("--hook-timeout", type=int, default=30, help="seconds runc allows each hook")
    return p


def _load(args: argparse.Namespace) -> object:
    from vgpu import config as vconfig

    overrides = {
        "common.state_dir": args.state_dir,
        "common.log_level": args.log_level,
        "hook.library_path": args.library_path,
        "hook.log_dir": args.log_dir,
        "hook.log_max_bytes": args.log_max_bytes,
    }
    return vconfig.load_config(args.config or vconfig.config_path_from_env(), overrides)


def _setup_logging(cfg: object) -> None:
    from vgpu.log import setup_logging

    try:
        setup_logging(
            cfg.common.log_level,  # type: ignore[attr-defined]
            file=os.path.join(cfg.hook.log_dir, "hook.log"),  # type: ignore[attr-defined]
            max_bytes=cfg.hook.log_max_bytes,  # type: ignore[attr-defined]
        )
    except OSError:
        logging.getLogger().addHandler(logging.NullHandler())  # no log dir: never a reason to fail


def _fatal(msg: str) -> int:
    line = "vgpu-hook: " + oci.oneline(msg, 2000)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    log.error(line)
    return 1


def main(
    argv: list[str] | None = None,
    *,
    decision: oci.Proceed | oci.Skip | oci.Fail | None = None,
    poststop_stdin: bytes | None = None,
) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from vgpu.config import ConfigError

    try:
        cfg = _load(args)
    except ConfigError as e:
        if args.cmd == "prestart" and isinstance(decision, oci.Skip):
            return 0  # a broken node config never blocks containers without a vGPU
        if args.cmd == "poststop":
            sys.stderr.write(f"vgpu-hook: {e}\n")
            return 0
        sys.stderr.write(f"vgpu-hook: {e}\n")
        return 2
    if args.cmd in ("prestart", "poststop"):
        _setup_logging(cfg)
    if args.cmd == "prestart":
        return cmd_prestart(cfg, decision)
    if args.cmd == "poststop":
        return cmd_poststop(cfg, poststop_stdin)
    from runtime_hook import containerd

    try:
        return containerd.command(args, cfg)
    except containerd.InstallError as e:
        sys.stderr.write(f"vgpu-hook containerd {args.action}: {e}\n")
        return 1


def cmd_prestart(cfg: object, decision: oci.Proceed | oci.Skip | oci.Fail | None) -> int:
    if decision is None:
        decision = oci.decide_prestart(sys.stdin.buffer.read(oci.MAX_STATE_BYTES + 1))
    if isinstance(decision, oci.Skip):
        if decision.log:
            log.warning(kv("prestart: container left alone", reason=decision.log))
        return 0
    if isinstance(decision, oci.Fail):
        return _fatal(decision.message)
    from runtime_hook import prestart

    try:
        prestart.run(decision, cfg.common.state_dir, cfg.hook.library_path)  # type: ignore[attr-defined]
    except oci.HookError as e:
        return _fatal(str(e))
    except Exception as e:  # a bug must still fail closed with one line, never only a traceback
        log.exception("prestart failed")
        return _fatal(f"internal error setting up vGPU container: {type(e).__name__}: {e}")
    return 0


def cmd_poststop(cfg: object, data: bytes | None) -> int:
    if data is None:
        data = sys.stdin.buffer.read(oci.MAX_STATE_BYTES + 1)
    try:
        cid = oci.parse_poststop_id(data)
    except ValueError as e:
        log.warning(kv("poststop: malformed OCI state", reason=str(e)))
        return 0
    from runtime_hook import prestart

    try:
        prestart.poststop(cid, cfg.common.state_dir)  # type: ignore[attr-defined]
    except Exception:
        log.exception("poststop failed")
    return 0
