"""vgpu-scheduler command line: flags → SchedulerConfig → Service → HTTP(S) server."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

import msgspec

from vgpu import __version__
from vgpu.log import setup_logging
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import Kube, load_api_client
from vgpu_scheduler.server import Service, make_server

PROG = "vgpu-scheduler"
log = logging.getLogger("vgpu_scheduler")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="kube-scheduler extender and mutating webhook for vGPUs")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--bind", default="127.0.0.1:8090", help="address:port to serve on (default 127.0.0.1:8090)")
    p.add_argument("--cert-file", default="", help="TLS certificate (PEM); the webhook needs TLS")
    p.add_argument("--key-file", default="", help="TLS private key (PEM)")
    p.add_argument("--kubeconfig", default="", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    for f in msgspec.structs.fields(SchedulerConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or isinstance(f.default, bool):  # not `in (True, False)`: 0 == False, 1 == True
            p.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction)
        else:
            p.add_argument(flag, dest=f.name, default=None, type=type(f.default), help=f"default {f.default!r}")
    return p


def config_from(ns: argparse.Namespace) -> SchedulerConfig:
    given: dict[str, Any] = {
        f.name: getattr(ns, f.name) for f in msgspec.structs.fields(SchedulerConfig) if getattr(ns, f.name) is not None
    }
    return msgspec.convert(given, SchedulerConfig)


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    setup_logging(ns.log_level)
    try:
        cfg = config_from(ns)
    except msgspec.ValidationError as e:
        print(f"{PROG}: invalid configuration: {e}", file=sys.stderr)
        return 2
    host, _, port = ns.bind.rpartition(":")
    try:
        kube = Kube(load_api_client(ns.kubeconfig), cfg.api_timeout_s)
    except Exception as e:  # ConfigException, missing files
        print(f"{PROG}: no Kubernetes API configuration: {e}", file=sys.stderr)
        return 2
    service = Service(cfg, kube)
    try:
        srv = make_server(service, host or "0.0.0.0", int(port), ns.cert_file, ns.key_file)
    except (OSError, ValueError) as e:
        print(f"{PROG}: cannot serve on {ns.bind}: {e}", file=sys.stderr)
        return 2
    done = threading.Event()

    def stop(*_: object) -> None:
        done.set()
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service.start()
    log.info("serving on %s (tls=%s)", ns.bind, bool(ns.cert_file))
    print(f"{PROG}: serving on {host or '0.0.0.0'}:{srv.server_address[1]}", flush=True)
    srv.serve_forever()
    service.stop()
    srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
