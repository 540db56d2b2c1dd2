"""The simulated MIG node that the real `nvidia-ctk cdi generate` was run against.

One H200 in MIG mode split into 3g.71gb, 2g.35gb and two 1g.18gb instances (created in that order,
the driver choosing the placements), and a driver root as the toolkit reads it: the simulated
`libnvidia-ml.so.580.65.06` and `libcuda.so.580.65.06` with their `.so.1` links,
`dev/nvidia0` (c 195:0), `dev/nvidiactl` (c 195:255), and the MIG capability files
(`sim.fakegpu.mig.write_mig_files`: `proc/driver/nvidia-caps/mig-minors`,
`dev/nvidia-caps/nvidia-cap<N>`).  The toolkit reads mig-minors at its absolute path
(internal/nvcaps/nvcaps.go: `/proc/driver/nvidia-caps/mig-minors`), so the real program runs in a
mount namespace of its own with the driver root's `proc/driver` bind-mounted on `/proc/driver`.

The recording (tests/data/nvidia-ctk-mig/, its README) was made with `record()`; the replay test
(tests/sim/test_mig_toolkit.py) builds the same node and checks it against the recording, and
runs the real program again where it is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sim.fakegpu.harness import FakeGPU
from sim.fakegpu.mig import cap_minor, product, write_mig_files

__all__ = ["cap_minor", "make_node", "normalise", "record", "run_real"]

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "nvidia-ctk-mig"
REAL_CTK = Path(os.environ.get("VGPU_REAL_NVIDIA_CTK", "/work/realbuild/nvidia-ctk/bin/nvidia-ctk"))
RECORDED_ROOT = "/run/nvidia/driver"  # the driver root paths in the recording are normalised to it
GPU_UUID = "GPU-4a1e0b6c-8d3f-4c2a-9e7b-1f2d3c4b5a60"
LAYOUT = ("3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb")
DRIVER = "580.65.06"


def make_node(workdir: Path, build_dir: Path) -> tuple[FakeGPU, Path]:
    """The simulated node and its driver root (under workdir)."""
    gpu = FakeGPU(
        workdir / "node",
        build_dir,
        gpus=1,
        **product("h200-141gb", mig_mode=1, uuid=GPU_UUID, pci_bus_id="00000000:10:00.0"),
    )
    gpu.mig_create(0, *LAYOUT)
    drv = workdir / "driver"
    shutil.rmtree(drv, ignore_errors=True)
    lib = drv / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for name in ("libnvidia-ml", "libcuda"):
        shutil.copy(gpu.lib_dir / f"{name}.so.1", lib / f"{name}.so.{DRIVER}")
        os.symlink(f"{name}.so.{DRIVER}", lib / f"{name}.so.1")
    (drv / "dev").mkdir()
    os.mknod(drv / "dev/nvidia0", 0o20666, os.makedev(195, 0))
    os.mknod(drv / "dev/nvidiactl", 0o20666, os.makedev(195, 255))
    write_mig_files(drv, gpu.state())
    return gpu, drv


def argv(ctk: Path, drv: Path, output: Path) -> list[str]:
    return [
        str(ctk),
        "cdi",
        "generate",
        "--driver-root",
        str(drv),
        "--dev-root",
        str(drv),
        "--nvidia-cdi-hook-path",
        "/usr/bin/nvidia-cdi-hook",
        "--format",
        "yaml",
        "--output",
        str(output),
    ]


def run_real(
    gpu: FakeGPU, drv: Path, output: Path, ctk: Path = REAL_CTK, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs the real nvidia-ctk in a private mount namespace (root) with `<drv>/proc/driver` on /proc/driver."""
    cmd = " ".join(argv(ctk, drv, output))
    script = f"mount --bind {drv}/proc/driver /proc/driver && exec {cmd}"
    env = {**gpu.env, **(extra_env or {})}
    env.pop("LD_LIBRARY_PATH", None)  # the toolkit finds libnvidia-ml under the driver root, as on a node
    return subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)


def normalise(text: str, drv: Path) -> str:
    return text.replace(str(drv), RECORDED_ROOT)


def record(workdir: Path, build_dir: Path) -> None:  # pragma: no cover - run by hand, see the README
    gpu, drv = make_node(workdir, build_dir)
    out = workdir / "spec.yaml"
    proc = run_real(gpu, drv, out)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "nvidia.com-gpu.yaml").write_text(normalise(out.read_text(), drv))
    (DATA / "nvidia-ctk-cdi-generate.stderr.txt").write_text(normalise(proc.stderr, drv))
    bind = run_real(gpu, drv, workdir / "spec2.yaml", extra_env={"LD_DEBUG": "bindings"})
    names = sorted(
        {
            w.strip("`'")
            for line in bind.stderr.splitlines()
            if "libnvidia-ml" in line
            for w in line.split()
            if w.strip("`'").startswith("nvml")
        }
    )
    (DATA / "nvml-bound.txt").write_text("\n".join(names) + "\n")


if __name__ == "__main__":  # pragma: no cover
    record(Path(sys.argv[1]), REPO / "build")
