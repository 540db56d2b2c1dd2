"""vgpu-monitor command line: compute shares, memory backstop, metrics, cleanup."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import msgspec

from vgpu import __version__
from vgpu.config import ConfigError, MonitorConfig, config_path_from_env, load_config
from vgpu.log import kv, setup_logging

log = logging.getLogger("vgpu.monitor")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vgpu-monitor", description="k8s-vgpu compute-share enforcer, memory backstop, metrics"
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config", default=None, help="node config (default $VGPU_CONFIG, else /etc/vgpu/config.toml)")
    p.add_argument("--state-dir", default=None, help="overrides common.state_dir")
    p.add_argument("--run-dir", default=None, help="overrides common.run_dir (where the DRA claims' files are)")
    p.add_argument("--log-level", default=None, help="debug, info, warning, error")
    for f in msgspec.structs.fields(MonitorConfig):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f"monitor__{f.name}",
            default=None,
            metavar="VALUE",
            help=f"monitor.{f.name} (default {f.default})",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {
        "common.state_dir": a.state_dir,
        "common.run_dir": a.run_dir,
        "common.log_level": a.log_level,
    }
    for k, v in vars(a).items():
        if k.startswith("monitor__"):
            overrides["monitor." + k[len("monitor__") :]] = v
    try:
        cfg = load_config(a.config or config_path_from_env(), overrides)
    except ConfigError as e:
        print(f"vgpu-monitor: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.common.log_level)

    from monitor.daemon import Monitor
    from monitor.metrics import serve

    mon = Monitor(cfg.monitor, cfg.paths, log_level=cfg.common.log_level)

    def on_signal(signum: int, frame: object) -> None:
        mon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        mon.start()
        try:
            mon.metrics_port = serve(mon, cfg.monitor.metrics_address, cfg.monitor.metrics_port)
        except OSError as e:
            print(
                f"vgpu-monitor: cannot serve metrics on {cfg.monitor.metrics_address}:{cfg.monitor.metrics_port}: {e}",
                file=sys.stderr,
            )
            return 1
        log.info(kv("vgpu-monitor running", policy=cfg.monitor.policy, metrics_port=mon.metrics_port))
        mon.run()
    finally:
        mon.close()  # resumes everything we suspended, stops the guardian
    return 0


if __name__ == "__main__":
    sys.exit(main())
