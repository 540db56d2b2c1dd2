"""vgpu-monitor command line (stub until its issue lands)."""

from __future__ import annotations

import argparse
import sys

from vgpu import __version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vgpu-monitor", description="k8s-vgpu compute-share enforcer, memory backstop, metrics")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.parse_args(argv)
    p.print_usage(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
