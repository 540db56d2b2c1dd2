"""vgpuctl: node-local inspection of k8s-vgpu, like nvidia-smi but vGPU-aware.

`vgpuctl status` reads the monitor's status file (<state_dir>/monitor/status.json,
rewritten every second by vgpu-monitor) and prints the GPUs, their vGPU
slices (pod/namespace), device memory used (NVML) against the physical share,
host-resident (oversubscribed) memory against the slice, SM use/share and
whether each is suspended.  No cluster access is needed.  A slice is a container of the
device-plugin path or a DRA claim (ID `claim:<uid>`, shared by the containers
of the pods named, CONTAINER shows `claim <name>`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from vgpu import __version__
from vgpu.config import ConfigError, config_path_from_env, load_config

STALE_S = 10.0
HEAD_MEM = "VRAM USED/SHARE GiB"
HEAD_HOST = "HOST/SLICE GiB"
HEAD_SM = "SM USE/SHARE %"


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / (1 << 30):.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _who(r: dict[str, Any]) -> str:
    """The CONTAINER column: the container's name, or the claim a DRA slice is."""
    if r.get("claim"):
        return f"claim {r['claim']}"
    return str(r.get("container") or "-")


def render(status: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    age = now - float(status.get("time", 0))
    state = "running" if status.get("running", True) else "stopped"
    if state == "running" and age > STALE_S:
        state = "not updating (stale)"
    lines = [
        f"vgpu-monitor: {state} (pid {status.get('pid', '?')}, policy {status.get('policy', '?')}, "
        f"updated {age:.1f}s ago, {status.get('suspended_processes', 0)} process(es) suspended)"
    ]
    containers = {c["container_id"]: c for c in status.get("containers", [])}
    shown: set[str] = set()
    for g in status.get("gpus", []):
        up = "" if g.get("up", True) else f"  DOWN: {g.get('error', '')}"
        if g.get("parent"):  # a MIG device: NVML has no utilisation for it
            note = "" if g.get("compute_enforced", True) else "  compute shares not enforced (MIG)"
            lines.append(
                f"MIG of GPU {g['index']}  {g['uuid']}  {g.get('name', '')}  "
                f"mem {_gib(g.get('memory_used'))}/{_gib(g.get('memory_total'))} GiB{note}{up}"
            )
        else:
            lines.append(
                f"GPU {g['index']}  {g['uuid']}  {g.get('name', '')}  "
                f"mem {_gib(g.get('memory_used'))}/{_gib(g.get('memory_total'))} GiB  util {g.get('util', 0)}%{up}"
            )
        rows = g.get("containers", [])
        if not rows:
            lines.append("  (no vGPU containers)")
            continue
        lines.append(
            f"  {'NAMESPACE/POD':<32} {'CONTAINER':<20} {'ID':<13} {HEAD_MEM:<19} {HEAD_HOST:<15} {HEAD_SM:<15} STATE"
        )
        for r in rows:
            shown.add(r["container_id"])
            c = containers.get(r["container_id"], {})
            pod = f"{r.get('namespace') or '-'}/{r.get('pod') or '-'}"
            st = "suspended" if r.get("suspended") else "running"
            if c.get("region_error"):
                st += " region-corrupt"
            # the physical share (a status from before it existed: the slice)
            share = r.get("memory_device_limit", r.get("memory_limit"))
            lines.append(
                f"  {pod:<32.32} {_who(r):<20.20} {r['container_id'][:12]:<13} "
                f"{_gib(r.get('memory_used')) + '/' + _gib(share):<19} "
                f"{_gib(r.get('memory_host', 0)) + '/' + _gib(r.get('memory_limit')):<15} "
                f"{_pct(r.get('sm_use')) + '/' + _pct(r.get('share')):<15} {st}"
            )
    idle = [c for cid, c in sorted(containers.items()) if cid not in shown]
    if idle:
        lines.append("vGPU containers without GPU processes:")
        for c in idle:
            pod = f"{c.get('namespace') or '-'}/{c.get('pod') or '-'}"
            extra = " region-corrupt" if c.get("region_error") else ""
            lines.append(f"  {pod:<32.32} {_who(c):<20.20} {c['container_id'][:12]}{extra}")
    return "\n".join(lines) + "\n"


def cmd_status(a: argparse.Namespace) -> int:
    try:
        cfg = load_config(a.config or config_path_from_env(), {"common.state_dir": a.state_dir})
    except ConfigError as e:
        print(f"vgpuctl: {e}", file=sys.stderr)
        return 2
    path = cfg.paths.status_path
    try:
        with open(path, encoding="utf-8") as f:
            status = json.load(f)
    except FileNotFoundError:
        print(f"vgpuctl: no monitor status at {path} (is vgpu-monitor running?)", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"vgpuctl: cannot read {path}: {e}", file=sys.stderr)
        return 1
    if a.json:
        json.dump(status, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(status))
    return 0


def cmd_slice(a: argparse.Namespace) -> int:
    from vgpuctl import probe

    view = probe.observe(a.cuda_library)
    print(probe.encode(view), flush=True)
    if a.expect_memory_mib is None and a.expect_gpus is None:
        return 0
    problems = probe.check(view, a.expect_memory_mib, a.expect_gpus)
    for p in problems:
        print(f"vgpuctl slice: {p}", file=sys.stderr)
    if not problems:
        print("vgpuctl slice: as expected", file=sys.stderr)
    return 1 if problems else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vgpuctl", description="inspect vGPU containers on this node")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("status", help="GPUs, vGPU containers, memory and SM use vs limits, suspensions")
    s.add_argument("--config", default=None, help="node config (default $VGPU_CONFIG, else /etc/vgpu/config.toml)")
    s.add_argument("--state-dir", default=None, help="overrides common.state_dir")
    s.add_argument("--json", action="store_true", help="print the monitor's raw status")
    c = sub.add_parser("cluster", help="vGPU nodes, GPUs, allocated/free memory and cores, pods per GPU (API server)")
    c.add_argument("--kubeconfig", default=None, help="kubeconfig (default $KUBECONFIG, ~/.kube/config, in-cluster)")
    c.add_argument("--context", default=None, help="kubeconfig context")
    c.add_argument("--stale-after-s", type=float, default=120.0, help="inventory heartbeat age that marks a node stale")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    sl = sub.add_parser(
        "slice",
        help="what this container sees of its GPUs (CUDA cuMemGetInfo, NVML memory), as JSON; "
        "with --expect-*: exit 1 unless it is that",
    )
    sl.add_argument("--expect-memory-mib", type=int, default=None, help="every visible GPU's total, in MiB")
    sl.add_argument("--expect-gpus", type=int, default=None, help="number of visible GPUs")
    sl.add_argument("--cuda-library", default="libcuda.so.1", help="the CUDA driver library to load")
    from vgpuctl import doctor

    doctor.add_arguments(sub.add_parser("doctor", help="node preflight: node type, containerd, NVIDIA runtime, hook"))
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.cmd == "status":
        return cmd_status(a)
    if a.cmd == "cluster":
        from vgpuctl import cluster  # the kubernetes client is imported only for this command

        rc, text = cluster.run(a.kubeconfig, a.context, a.json, a.stale_after_s)
        (sys.stdout if rc == 0 else sys.stderr).write(text)
        return rc
    if a.cmd == "doctor":
        from vgpuctl import doctor

        return doctor.main(a)
    if a.cmd == "slice":
        return cmd_slice(a)
    p.print_usage(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
