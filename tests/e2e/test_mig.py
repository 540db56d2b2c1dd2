"""End to end on a MIG device: vGPU pods inside a 3g.71gb instance of a simulated H200.

The demo's node stack (packaging/demo/vgpu_demo) with `mig_profile`: the simulated H200 in MIG
mode with one 3g.71gb instance, the real `vgpu-device-plugin` with `--mig-strategy vgpu` (the
instance split into 10 vGPUs), the kubelet stand-in admitting 3 and 7 of them, both containers
under runc through the simulated NVIDIA runtime (jit-cdi: the MIG UUID becomes `/dev/nvidia0`
and the instance's two `/dev/nvidia-caps` nodes) with our prestart hook.  Each container sees
its slice of the instance (cuMemGetInfo, NVML's MIG device), is refused past it although the
instance has room, and the simulator's own count of the instance shows what they hold.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "packaging" / "demo"
if str(DEMO_DIR) not in sys.path:
    sys.path.insert(0, str(DEMO_DIR))

from vgpu_demo import scenario  # noqa: E402

from sim.fakegpu.mig import cap_minor  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20

pytestmark = [
    pytest.mark.slow,
    pytest.mark.root,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runc") is None or not os.path.exists("/bin/busybox"),
        reason="needs root, runc and busybox-static",
    ),
    pytest.mark.timeout(300),
]


def test_vgpu_pods_inside_a_3g_instance(build_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    with scenario.Demo(build_dir, workdir=tmp_path / "demo", log=lines.append, mig_profile="3g.71gb") as demo:
        gpu = demo.start_gpu()
        assert gpu["uuid"].startswith("MIG-") and gpu["memory"] == 71680 * MiB
        vgpu = gpu["memory"] // scenario.SPLIT
        ids = demo.start_plugin()
        assert sorted(ids) == sorted(f"{gpu['uuid']}::{i}" for i in range(scenario.SPLIT))
        pods = {p.name: p for p in demo.admit()}
        a, b = pods["pod-a"], pods["pod-b"]
        assert (a.uuid, a.memory_limit, a.core_percent) == (gpu["uuid"], 3 * vgpu, 30)
        assert (b.uuid, b.memory_limit, b.core_percent) == (gpu["uuid"], 7 * vgpu, 70)
        assert a.alloc is not None and a.alloc.envs["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]

        demo.run_containers()
        made = next(d for d in demo.gpu.mig_devices() if d["uuid"] == gpu["uuid"])
        caps = [f"/dev/nvidia-caps/nvidia-cap{cap_minor(0, made['gi'])}",
                f"/dev/nvidia-caps/nvidia-cap{cap_minor(0, made['gi'], made['ci'])}"]  # fmt: skip
        for p in (a, b):
            assert p.container is not None
            spec = json.loads((p.container.bundle / "config.json").read_text())
            nodes = [d["path"] for d in spec["linux"]["devices"]]
            assert sorted(nodes) == sorted(["/dev/nvidia0", "/dev/nvidiactl", *caps])  # the MIG device's nodes
            cdir = demo.state_dir / "containers" / p.container.cid
            assert (cdir / "limits").read_text().splitlines()[1].split()[:2] == [gpu["uuid"], str(p.memory_limit)]

        demo.isolation()  # raises unless each sees exactly its slice and is refused past it
        for p in (a, b):
            s = p.seen
            assert [(d["uuid"], d["total"]) for d in s["nvml"]["json"]] == [(gpu["uuid"], p.memory_limit)]
            assert s["info"]["json"]["mem_total"] == p.memory_limit
            assert s["over"]["json"]["alloc_bytes"] < gpu["memory"]  # the instance had room: the slice refused
            assert s["over"]["rc"] == 3 and s["fit"]["rc"] == 0

        # hold 40 % of each slice: the simulator's count of the instance is what the two hold
        for p in (a, b):
            assert p.container is not None
            p.container.file("go").write_text("1")
        hold = sum(int(p.memory_limit * 0.4) // MiB * MiB for p in (a, b))
        overhead = 2 * 256 * MiB  # one context each (the simulated context overhead)
        deadline = time.monotonic() + 60
        used = 0
        while time.monotonic() < deadline:
            used = next(d["used"] for d in demo.gpu.mig_devices() if d["uuid"] == gpu["uuid"])
            if used >= hold + overhead:
                break
            time.sleep(0.2)
        assert used == hold + overhead
        assert all(d["used"] == 0 for d in demo.gpu.mig_devices() if d["uuid"] != gpu["uuid"])
