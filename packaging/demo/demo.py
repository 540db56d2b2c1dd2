"""`make demo`: the whole k8s-vgpu node stack on one GPU, with real runc (root needed).

    python packaging/demo/demo.py [--gpu auto|simulated|real] [--keep] [--device-list-strategy S]

On a machine without an NVIDIA GPU it runs on the simulated driver (sim/fakegpu); with one
(device nodes + nvidia-smi), `--gpu auto` uses the real GPU and its libcuda.  The containers
are created through nvidia-container-runtime: the simulated toolkit's stand-in, or on a GPU node
the installed one (`VGPU_DEMO_RUNTIME=<path>` picks another binary; `runc` makes the demo mount
the driver itself).  Prints each step
and a report table; exits non-zero on the first failing step.  Everything it started is
stopped and removed at the end, on failure and on Ctrl-C (`--keep` keeps the work directory).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # the kubelet stand-in's gRPC core stays quiet

from vgpu_demo import scenario  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=["auto", "simulated", "real"], default=os.environ.get("VGPU_DEMO_GPU", "auto"))
    p.add_argument("--build-dir", default=str(ROOT / "build"))
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, bundles, state)")
    p.add_argument(
        "--device-list-strategy",
        choices=["envvar", "volume-mounts", "cdi-annotations"],
        default="envvar",
        help="how the device plugin names the GPU for the NVIDIA runtime (default envvar)",
    )
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("make demo: runs containers with runc: run it as root", file=sys.stderr)
        return 2
    real = a.gpu == "real" or (a.gpu == "auto" and scenario.real_gpu_present())
    # Ctrl-C and SIGTERM end the demo through the clean-up below (SIGINT explicitly: a shell
    # that started us in the background leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.monotonic()
    workdir = None
    if a.keep:
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="vgpu-demo-"))
    demo = scenario.Demo(
        Path(a.build_dir),
        real_gpu=real,
        workdir=workdir,
        log=lambda s: print(s, flush=True),
        device_list_strategy=a.device_list_strategy,
    )
    try:
        with demo:
            demo.start_gpu()
            demo.start_plugin()
            demo.admit()
            demo.run_containers()
            demo.isolation()
            demo.compute()
            demo.scrape()
            status = demo.ctl_status()
            print()
            print(demo.report())
            print()
            print("$ vgpuctl status")
            print(status)
            print("cleaning up: containers (poststop hook), monitor (resumes everything), plugin, kubelet, GPU")
    except scenario.StepFailed as e:
        print(f"make demo: FAILED: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("make demo: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    if workdir is not None:
        print(f"work directory kept: {workdir}")
    print(f"make demo: OK in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
