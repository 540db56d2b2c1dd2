"""MIG-capable products of the simulated GPU (sim/fakegpu/src/fg_mig.c has their profile tables).

`PRODUCTS` gives the device keys of FakeGPU for a GPU of that product: the name and total memory
`nvidia-smi` shows on the real GPU and its MIG profile table (config key `mig_profiles`).  The
memory totals are what real GPUs report (H200: 143771 MiB, H100 80GB HBM3: 81559 MiB,
A100-SXM4-40GB: 40537 MiB); docs/developers/simulators.md "MIG" cites them.
"""

from __future__ import annotations

from typing import Any

MIB = 1 << 20

PRODUCTS: dict[str, dict[str, Any]] = {
    "h200-141gb": {"name": "NVIDIA H200", "memory": 143771 * MIB, "mig_profiles": "h200-141gb", "sm_count": 132},
    "h100-80gb": {"name": "NVIDIA H100 80GB HBM3", "memory": 81559 * MIB, "mig_profiles": "h100-80gb", "sm_count": 132},
    "a100-40gb": {
        "name": "NVIDIA A100-SXM4-40GB",
        "memory": 40537 * MIB,
        "mig_profiles": "a100-40gb",
        "sm_count": 108,
        "cc_major": 8,
        "cc_minor": 0,
    },
}


def product(key: str, **overrides: Any) -> dict[str, Any]:
    """The device keys of a GPU of product `key`, with overrides (mig_mode=1, uuid=..., ...)."""
    return {**PRODUCTS[key], **overrides}


# --- the driver's MIG capability files --------------------------------------------------------
# MIG user guide, "Device Nodes and Capabilities": /proc/driver/nvidia-caps/mig-minors lists the
# minor of every possible capability ("config 1", "monitor 2", "gpu0/gi0/access 3", ...,
# "gpu31/gi14/ci7/access 4322"); /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access and
# .../ci<c>/access exist for the created instances ("DeviceFileMinor: N" ...); nvidia-modprobe makes
# /dev/nvidia-caps/nvidia-cap<N> (char, the nvidia-caps major).  NVIDIA's toolkit
# (internal/nvcaps/nvcaps.go) and device plugin (internal/rm/nvml_devices.go) read mig-minors to
# find a MIG device's two nodes.

CAPS_MAJOR = 508  # the nvidia-caps major is dynamic; the MIG user guide's example shows 508
MAX_GPU_MINORS = 32
MAX_GI = 15
MAX_CI = 8


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The minor of `gpu<minor>/gi<gi>/access` (ci None) or `.../ci<ci>/access` (fg_mig.c: fg_mig_cap_minor)."""
    return 3 + gpu_minor * (MAX_GI * (MAX_CI + 1)) + gi * (MAX_CI + 1) + (0 if ci is None else 1 + ci)


def mig_minors_text() -> str:
    lines = ["config 1", "monitor 2"]
    for g in range(MAX_GPU_MINORS):
        for gi in range(MAX_GI):
            lines.append(f"gpu{g}/gi{gi}/access {cap_minor(g, gi)}")
            for ci in range(MAX_CI):
                lines.append(f"gpu{g}/gi{gi}/ci{ci}/access {cap_minor(g, gi, ci)}")
    return "\n".join(lines) + "\n"


def _cap_file(minor: int, mode: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def _node(path: Any, minor: int, mode: int) -> None:
    import os

    try:
        os.mknod(path, 0o020000 | mode, os.makedev(CAPS_MAJOR, minor))
    except PermissionError:  # not root: a plain file stands in (only its existence is checked)
        path.touch(mode=mode)


def write_mig_files(root: Any, state: dict[str, Any], minors: dict[int, int] | None = None) -> None:
    """Writes the driver's MIG files for `state` (FakeGPU.state()) under `root`, replacing what an
    earlier call wrote: proc/driver/nvidia-caps/mig-minors, proc/driver/nvidia/capabilities/... and
    dev/nvidia-caps/nvidia-cap<N> of the instances that exist.  `minors`: GPU index -> minor number
    (default: the index)."""
    import shutil
    from pathlib import Path

    root = Path(root)
    caps_proc = root / "proc/driver/nvidia-caps"
    caps_proc.mkdir(parents=True, exist_ok=True)
    (caps_proc / "mig-minors").write_text(mig_minors_text())
    capdir = root / "proc/driver/nvidia/capabilities"
    if capdir.exists():
        shutil.rmtree(capdir)
    devdir = root / "dev/nvidia-caps"
    if devdir.exists():
        shutil.rmtree(devdir)
    devdir.mkdir(parents=True)
    (capdir / "mig").mkdir(parents=True)
    (capdir / "mig/config").write_text(_cap_file(1, 0o400))
    (capdir / "mig/monitor").write_text(_cap_file(2, 0o444))
    _node(devdir / "nvidia-cap1", 1, 0o400)
    _node(devdir / "nvidia-cap2", 2, 0o444)
    for g in state.get("mig", []):
        minor = (minors or {}).get(g["index"], g["index"])
        for gi in g["gpu_instances"]:
            gdir = capdir / f"gpu{minor}/mig/gi{gi['id']}"
            gdir.mkdir(parents=True, exist_ok=True)
            m = cap_minor(minor, gi["id"])
            (gdir / "access").write_text(_cap_file(m, 0o444))
            _node(devdir / f"nvidia-cap{m}", m, 0o444)
            for ci in gi["compute_instances"]:
                (gdir / f"ci{ci['id']}").mkdir(exist_ok=True)
                m = cap_minor(minor, gi["id"], ci["id"])
                (gdir / f"ci{ci['id']}/access").write_text(_cap_file(m, 0o444))
                _node(devdir / f"nvidia-cap{m}", m, 0o444)
