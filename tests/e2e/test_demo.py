"""End to end: the `make demo` scenario with assertions on every step.

The simulated GPU (one 10 GiB device), the real `vgpu-device-plugin` registered with the kubelet
stand-in, two containers under the distribution's runc with the hooks `vgpu-hook containerd
install` writes, created through the simulated toolkit's nvidia-container-runtime (the GPU
arrives only through it, selected by the Allocate response), the real `vgpu-monitor`, its
/metrics over HTTP.  Timing-dependent checks (compute shares) have generous tolerances;
`make bench-shares` measures precisely.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "packaging" / "demo"
if str(DEMO_DIR) not in sys.path:
    sys.path.insert(0, str(DEMO_DIR))

from vgpu_demo import scenario  # noqa: E402

from tests.support.hook import have_runc  # noqa: E402

GiB = 1 << 30

pytestmark = [
    pytest.mark.slow,
    pytest.mark.root,
    pytest.mark.skipif(not have_runc(), reason="needs root, runc and busybox-static"),
    pytest.mark.timeout(300),
]


@pytest.mark.parametrize(
    "real",
    [
        pytest.param(False, id="simulated"),
        pytest.param(
            True,
            id="real-gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not scenario.real_gpu_present(), reason="no NVIDIA GPU with its driver"),
            ],
        ),
    ],
)
def test_node_stack_end_to_end(build_dir: Path, tmp_path: Path, real: bool) -> None:
    lines: list[str] = []
    with scenario.Demo(build_dir, real_gpu=real, workdir=tmp_path / "demo", log=lines.append) as demo:
        # 1. one GPU (simulated: 10 GiB)
        gpu = demo.start_gpu()
        assert gpu["simulated"] is not real
        if not real:
            assert gpu["memory"] == 10 * GiB
        vgpu = gpu["memory"] // scenario.SPLIT

        # 2. the device plugin offers 10 vGPUs of it; the kubelet admits 3 + 7
        ids = demo.start_plugin()
        assert len(ids) == scenario.SPLIT and all(i.startswith(gpu["uuid"] + "::") for i in ids)
        pods = {p.name: p for p in demo.admit()}
        a, b = pods["pod-a"], pods["pod-b"]
        assert (a.memory_limit, a.core_percent) == (3 * vgpu, 30)
        assert (b.memory_limit, b.core_percent) == (7 * vgpu, 70)
        assert a.token != b.token and len(a.token) == 32

        # 3. runc + the prestart hook: per-container state made from the allocation records
        demo.run_containers()
        for p in (a, b):
            assert p.container is not None and p.container.pid > 0
            cdir = demo.state_dir / "containers" / p.container.cid
            assert (cdir / "limits").read_text().splitlines()[1].split()[:3] == [
                p.uuid,
                str(p.memory_limit),
                str(p.core_percent),
            ]
            meta = json.loads((cdir / "metadata.json").read_text())
            assert meta["token"] == p.token
        if not real:  # the GPU came only through the (stand-in) NVIDIA runtime, in its default mode
            for p in (a, b):  # (toolkit 1.20: auto = jit-cdi, CDI edits generated for the named GPU)
                assert p.container is not None
                spec = json.loads((p.container.bundle / "config.json").read_text())
                hooks = [h["path"] for h in spec["hooks"]["prestart"]]
                assert len(hooks) == 1  # ours; no NVIDIA hook in jit-cdi mode
                env = spec["process"]["env"]
                asked = env.index(f"NVIDIA_VISIBLE_DEVICES={p.uuid}")  # from the Allocate response
                # the driver's env arrives with the runtime's CDI edits, appended after it, void last
                assert all(i > asked for i, e in enumerate(env) if e.startswith("FAKEGPU_"))
                assert env[-1] == "NVIDIA_VISIBLE_DEVICES=void"
                assert [d["path"] for d in spec["linux"]["devices"] if d["path"].startswith("/dev/nvidia")] == [
                    "/dev/nvidia0", "/dev/nvidiactl"]  # fmt: skip
        demo.isolation()
        for p in (a, b):
            s = p.seen
            assert [d["total"] for d in s["nvml"]["json"]] == [p.memory_limit]  # pynvml in the container
            assert s["info"]["json"]["mem_total"] == p.memory_limit  # cuMemGetInfo
            assert s["over"]["rc"] == 3 and s["over"]["json"]["alloc_result"] == scenario.CUDA_ERROR_OUT_OF_MEMORY
            assert s["fit"]["rc"] == 0 and s["fit"]["json"]["alloc_result"] == 0
        # pod-b's successful allocation is larger than pod-a's whole slice: its own slice, unaffected
        assert b.seen["fit"]["json"]["alloc_bytes"] > a.memory_limit

        # 4. compute: about even without the monitor, held to 30/70 with it
        demo.compute(settle_timeout=60.0, tolerance_pp=10.0)
        if not real:  # the simulator's ground truth (a real GPU is measured through the monitor)
            assert abs(a.share_before - b.share_before) < 30, (a.share_before, b.share_before)
        assert abs(a.share_after - 30) <= 10 and abs(b.share_after - 70) <= 10, (a.share_after, b.share_after)

        # the metrics endpoint, scraped over HTTP, labels the containers by pod
        demo.scrape()
        for p in (a, b):
            m = p.metrics
            assert m["vgpu_container_memory_limit_bytes"] == p.memory_limit
            assert m["vgpu_container_sm_share_percent"] == p.core_percent
            assert m["vgpu_container_memory_used_bytes"] >= int(p.memory_limit * 0.4) // (1 << 20) * (1 << 20)
            assert 0 < m["vgpu_container_duty_ratio"] <= 1
        assert a.metrics["vgpu_container_duty_ratio"] < b.metrics["vgpu_container_duty_ratio"]

        # vgpuctl status reads the monitor's status file
        status = demo.ctl_status()
        assert "default/pod-a" in status and "default/pod-b" in status and "running" in status.splitlines()[0]

        # 5. the report names both containers
        table = demo.report()
        assert "default/pod-a/main" in table and "default/pod-b/main" in table
        cids = [p.container.cid for p in (a, b) if p.container is not None]
        runc_root = demo.runc_root
    # clean-up: containers deleted (the poststop hook removed their state), daemons gone
    listed = subprocess.run(["runc", "--root", str(runc_root), "list", "-q"], capture_output=True, text=True)
    assert not set(listed.stdout.split()) & set(cids)
    assert not any((tmp_path / "demo" / "state" / "containers").iterdir())
    assert demo.plugin is not None and demo.plugin.poll() is not None
    assert demo.monitor is not None and demo.monitor.poll() is not None
    assert any(line.startswith("[5]") for line in lines)


def test_ctrl_c_cleans_up_everything(build_dir: Path) -> None:
    """`make demo` interrupted half way stops and removes everything it started."""
    p = subprocess.Popen(
        [sys.executable, str(DEMO_DIR / "demo.py"), "--gpu", "simulated"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    out: list[str] = []
    work = None
    try:
        assert p.stdout is not None
        for line in p.stdout:
            out.append(line)
            m = re.search(r"state (/\S+)/fakegpu/fakegpu\.state", line)
            if m:
                work = Path(m.group(1))
            if line.startswith("[3] runc started pod-b"):
                p.send_signal(signal.SIGINT)
                break
        rest, _ = p.communicate(timeout=120)
        out.append(rest)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "".join(out)
    assert p.returncode == 130, text
    assert "interrupted" in text
    assert work is not None and not work.exists(), text
    # nothing of it keeps running: no process has the work directory on its command line
    leftovers = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(work) in cmd:
                leftovers.append(cmd.replace("\0", " "))
    assert leftovers == []


@pytest.mark.parametrize("strategy", ["volume-mounts", "cdi-annotations"])
def test_gpu_selection_strategies(build_dir: Path, tmp_path: Path, strategy: str) -> None:
    """The Allocate response of each strategy selects the GPU through the stand-in NVIDIA runtime
    (volume mounts with the secure toolkit flags; CDI annotations, so the runtime runs in cdi
    mode): each container sees exactly its slice of that GPU."""
    lines: list[str] = []
    with scenario.Demo(build_dir, workdir=tmp_path / "demo", log=lines.append, device_list_strategy=strategy) as demo:
        demo.start_gpu()
        demo.start_plugin()
        pods = demo.admit()
        for p in pods:
            # no GPU from the env: volume mounts name them; with CDI only the env is void
            assert p.alloc.envs["NVIDIA_VISIBLE_DEVICES"] == (
                "/var/run/nvidia-container-devices" if strategy == "volume-mounts" else "void"
            )
        demo.run_containers()
        for p in pods:
            assert p.container is not None
            spec = json.loads((p.container.bundle / "config.json").read_text())
            env = spec["process"]["env"]
            hooks = [h["path"] for h in spec["hooks"]["prestart"]]
            if strategy == "cdi-annotations":  # cdi mode: edits applied, no NVIDIA hook
                assert "NVIDIA_VISIBLE_DEVICES=void" in env and len(hooks) == 1
                assert [d["path"] for d in spec["linux"]["devices"]] == ["/dev/nvidiactl", "/dev/nvidia0"]
            else:  # auto = jit-cdi (toolkit 1.20): the mounted device name becomes a generated CDI device
                assert "NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices" in env and len(hooks) == 1
                assert env[-1] == "NVIDIA_VISIBLE_DEVICES=void"
                assert [d["path"] for d in spec["linux"]["devices"]] == ["/dev/nvidia0", "/dev/nvidiactl"]
        demo.isolation()
        for p in pods:
            assert [d["total"] for d in p.seen["nvml"]["json"]] == [p.memory_limit]
            assert p.seen["info"]["json"]["mem_total"] == p.memory_limit
