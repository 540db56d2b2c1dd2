"""`vgpu-node-setup install|uninstall|status`: thin CLI over node_setup.setup."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from node_setup import hostpython, setup
from vgpu import __version__


def build_parser() -> argparse.ArgumentParser:
    d = setup.Options()
    p = argparse.ArgumentParser(
        prog="vgpu-node-setup",
        description="install k8s-vgpu's host parts (libvgpu.so, the OCI hook, containerd's handler) on a node",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("action", choices=["install", "uninstall", "status", "wait-daemonset"])
    p.add_argument("--host-root", default=d.host_root, help="where the host's / is mounted (default %(default)s)")
    p.add_argument("--prefix", default=d.prefix, help="host directory for the files (default %(default)s)")
    p.add_argument("--python", default=None, help="host python3 for the hook (default: detected, >= 3.9)")
    p.add_argument("--library-source", default=d.library_source, help="libvgpu.so to copy (default %(default)s)")
    p.add_argument("--node-config", default=d.node_config, help="host node config read for the hook's settings")
    p.add_argument(
        "--state-dir",
        default=None,
        help="host state directory of the hook (default: the node config's common.state_dir); "
        "the device plugin's --state-dir",
    )
    p.add_argument("--containerd-config", default=d.containerd_config, help="host containerd config")
    p.add_argument("--handler", default=d.handler, help="runtime handler name (RuntimeClass.handler)")
    p.add_argument("--without-nvidia-runtime", action="store_true", help="passed to vgpu-hook containerd install")
    p.add_argument(
        "--containerd-arg", action="append", default=[], metavar="ARG", help="extra `vgpu-hook containerd install` arg"
    )
    p.add_argument(
        "--restart-containerd",
        action="store_true",
        help="restart containerd (host systemd) when its configuration changed",
    )
    p.add_argument(
        "--library-only",
        action="store_true",
        help="DRA nodes: only the library under the prefix (no hook, no containerd handler, no host python3)",
    )
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.add_argument("--namespace", default="kube-system", help="wait-daemonset: the DaemonSet's namespace")
    p.add_argument("--name", default="", help="wait-daemonset: the DaemonSet (its pods ran uninstall)")
    p.add_argument("--timeout", type=float, default=600, help="wait-daemonset: seconds")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def options(a: argparse.Namespace) -> setup.Options:
    return setup.Options(
        host_root=a.host_root,
        prefix=a.prefix.rstrip("/") or "/",
        python=a.python,
        library_source=a.library_source,
        node_config=a.node_config,
        state_dir=a.state_dir,
        containerd_config=a.containerd_config,
        handler=a.handler,
        without_nvidia_runtime=a.without_nvidia_runtime,
        containerd_args=a.containerd_arg,
        restart_containerd=a.restart_containerd,
        library_only=a.library_only,
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING, format="%(name)s: %(message)s")
    opts = options(a)
    if a.action == "wait-daemonset":
        from node_setup import waitds

        if waitds.wait(a.namespace, a.name, a.timeout):
            print(f"vgpu-node-setup: every pod of daemonset {a.namespace}/{a.name} is ready")
            return 0
        print(f"vgpu-node-setup: daemonset {a.namespace}/{a.name} not ready after {a.timeout:.0f}s", file=sys.stderr)
        return 1
    try:
        if a.action == "status":
            rc, report = setup.status(opts)
            if a.json:
                print(json.dumps(report, indent=2, sort_keys=True))
            else:
                for k, v in report.items():
                    print(f"{k}: {v}")
            return rc
        lines = setup.install(opts) if a.action == "install" else setup.uninstall(opts)
    except (setup.SetupError, hostpython.NoHostPython) as e:
        print(f"vgpu-node-setup {a.action}: {e}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
