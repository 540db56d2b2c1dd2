"""Records what NVIDIA's real device plugin (k8s-device-plugin v0.20.0, built beside the project,
never in it) registers with a kubelet for simulated MIG layouts: tests/data/nvidia-device-plugin-mig/.

Run by hand (root): `python -m tests.support.nvdp_mig <nvidia-device-plugin> <workdir>`.  For each
layout of tests/device_plugin/test_mig.py and each `--mig-strategy`, a simulated node (sim/fakegpu,
a driver root with its libnvidia-ml and the MIG capability files), the kubelet stand-in
(sim/kubelet.py) and the plugin in a mount namespace of its own: the plugin's socket directory is
fixed (`/var/lib/kubelet/device-plugins`, k8s.io/kubelet pluginapi.DevicePluginPath) and the
toolkit code it shares reads `/proc/driver/nvidia-caps/mig-minors` at its absolute path, so both
are bind-mounted from the test's directories.  The offer is each registered resource's device
count after the first ListAndWatch; a plugin that exits is a refusal, recorded with its error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "nvidia-device-plugin-mig"
STRATEGIES = ("none", "single", "mixed")


def _driver_root(gpu: Any, drv: Path) -> None:
    from sim.fakegpu.mig import write_mig_files

    lib = drv / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True, exist_ok=True)
    for name in ("libnvidia-ml", "libcuda"):
        shutil.copy(gpu.lib_dir / f"{name}.so.1", lib / f"{name}.so.580.65.06")
        if not (lib / f"{name}.so.1").exists():
            os.symlink(f"{name}.so.580.65.06", lib / f"{name}.so.1")
    write_mig_files(drv, gpu.state())


def run_plugin(binary: str, gpu: Any, workdir: Path, strategy: str, wait_s: float = 12.0) -> dict[str, Any]:
    from sim.kubelet import FakeKubelet

    drv = workdir / "driver"
    _driver_root(gpu, drv)
    kubelet = FakeKubelet(workdir / "kubelet")
    kubelet.start()
    log = workdir / f"plugin-{strategy}.log"
    script = (
        "mount -t tmpfs tmpfs /var/lib && mkdir -p /var/lib/kubelet/device-plugins && "
        f"mount --bind {kubelet.root}/device-plugins /var/lib/kubelet/device-plugins && "
        f"mount --bind {drv}/proc/driver /proc/driver && "
        f"exec {binary} --mig-strategy {strategy} --fail-on-init-error=true --device-discovery-strategy nvml "
        f"--driver-root-ctr-path {drv}"
    )
    env = {**gpu.env}
    env.pop("LD_LIBRARY_PATH", None)  # the plugin loads libnvidia-ml from the driver root
    with open(log, "w") as out:
        proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        offer: dict[str, int] = {}
        allocate: dict[str, Any] = {}
        for reg in kubelet.registrations:
            try:
                ep = kubelet.wait_endpoint(reg.resource_name, timeout=8)
            except TimeoutError:
                offer[reg.resource_name] = 0
                continue
            ids = sorted(ep.devices())
            offer[reg.resource_name] = len(ids)
            if ids:  # what Allocate answers for the first device (envvar strategy)
                resp = ep.allocate([ids[0]])
                allocate[reg.resource_name] = {"ids": ids, "request": [ids[0]], "envs": dict(resp.envs)}
        exited = proc.poll()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        try:
            kubelet.stop()
        except OSError:  # the plugin's namespace went away with its mounts first
            pass
    text = log.read_text(errors="replace")
    if exited is not None and not offer:
        err = [line for line in text.splitlines() if "error" in line.lower()]
        return {"exit": exited, "error": err[-1] if err else text[-300:]}
    return {"offer": offer, "allocate": allocate}


def record(binary: str, workdir: Path) -> None:  # pragma: no cover - run by hand
    from sim.fakegpu.harness import FakeGPU
    from tests.device_plugin.test_mig import LAYOUTS, build

    out: dict[str, Any] = {}
    for name in LAYOUTS:
        out[name] = {}
        for strategy in STRATEGIES:
            wd = workdir / name / strategy
            shutil.rmtree(wd, ignore_errors=True)
            gpu = FakeGPU(wd / "node", REPO / "build")
            build(gpu, name)
            out[name][strategy] = run_plugin(binary, gpu, wd, strategy)
            gpu.close()
            print(name, strategy, out[name][strategy], flush=True)
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "recorded.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":  # pragma: no cover
    record(sys.argv[1], Path(sys.argv[2]))
