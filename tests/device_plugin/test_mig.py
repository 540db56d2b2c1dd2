"""`device_plugin.mig_strategy` on a simulated H200 in MIG mode: what each strategy offers (the
resource names and counts NVIDIA's device plugin would offer for the same layout; recorded from
the real plugin in tests/data/nvidia-device-plugin-mig/), its refusals, and the vgpu strategy's
slices of a MIG device in the allocation record (docs/operators/mig.md)."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from device_plugin import mig
from nodecore.devices import Slicing
from sim.fakegpu.mig import product
from sim.kubelet import FakeKubelet
from tests.device_plugin.conftest import PluginProcess
from tests.support.mig import discover
from vgpu.schemas import TOKEN_ENV, read_record

pytestmark = [pytest.mark.timeout(180)]
RECORDED = Path(__file__).resolve().parents[1] / "data" / "nvidia-device-plugin-mig" / "recorded.json"

# the layouts of the recording (tests/data/nvidia-device-plugin-mig/README.md)
LAYOUTS: dict[str, list[tuple[str, list[str]]]] = {
    "h200-mixed": [("h200-141gb", ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"])],
    "h200-7x1g": [("h200-141gb", ["1g.18gb"] * 7)],
    "h200-empty": [("h200-141gb", [])],
    "h200-and-plain": [("h200-141gb", ["3g.71gb", "3g.71gb"]), ("h100-80gb", None)],  # type: ignore[list-item]
}


def build(fakegpu, name: str) -> None:
    """The layout `name` on the simulated node (fixed GPU UUIDs: the MIG UUIDs follow from them)."""
    devs = [
        product(key, mig_mode=1 if layout is not None else 0, uuid=f"GPU-4a1e0b6c-8d3f-4c2a-9e7b-{i:012x}")
        for i, (key, layout) in enumerate(LAYOUTS[name])
    ]
    fakegpu.configure(devs)
    for i, (_, layout) in enumerate(LAYOUTS[name]):
        if layout:
            fakegpu.mig_create(i, *layout)


def recorded() -> dict[str, dict[str, dict]]:
    data: dict[str, dict[str, dict]] = json.loads(RECORDED.read_text())
    return data


def plan(fakegpu, strategy: str, split: int = 1) -> dict[str, int] | str:
    try:
        res = mig.plan(strategy, discover(fakegpu.env), resource_name="nvidia.com/gpu", socket_name="vgpu.sock",
                       slicing=Slicing(split))  # fmt: skip
    except mig.MigConfigError as e:
        return f"error: {e}"
    return mig.offered(res)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_offers_what_nvidias_plugin_offers(layout: str, strategy: str, fakegpu) -> None:
    """With split count 1 the offer is the one the real NVIDIA device plugin v0.20.0 registered
    for the same simulated layout (recorded), refusals included."""
    build(fakegpu, layout)
    want = recorded()[layout][strategy]
    got = plan(fakegpu, strategy)
    if "error" in want:  # the real plugin refused to start: so do we, for the same reason
        assert isinstance(got, str) and want["error"].rsplit(": ", 1)[1] in got, (got, want)
    else:
        assert got == want["offer"]


def test_vgpu_strategy_splits_every_mig_device(fakegpu) -> None:
    build(fakegpu, "h200-mixed")
    assert plan(fakegpu, "vgpu", split=4) == {"nvidia.com/gpu": 16}
    build(fakegpu, "h200-and-plain")
    assert plan(fakegpu, "vgpu", split=3) == {"nvidia.com/gpu": 9}  # 2 MIG devices + the H100
    assert plan(fakegpu, "mixed", split=3) == {"nvidia.com/gpu": 3, "nvidia.com/mig-3g.71gb": 2}


def test_mixed_refuses_subdivided_gpu_instances(fakegpu) -> None:
    fakegpu.configure([product("a100-40gb", mig_mode=1)])
    code = """
import pynvml as n
n.nvmlInit()
gi = n.nvmlDeviceCreateGpuInstance(n.nvmlDeviceGetHandleByIndex(0), 9)
for _ in range(3):
    n.nvmlGpuInstanceCreateComputeInstance(gi, 0)
"""
    r = fakegpu.run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert plan(fakegpu, "mixed") == "error: MIG profile '1c.3g.20gb' does not match any resource patterns"
    assert plan(fakegpu, "single") == {"nvidia.com/gpu": 3}  # uniform: three 1c.3g.20gb


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    # a short root: the mixed strategy's socket names (vgpu-mig-1g.18gb.sock) must stay within
    # the 107 characters of a unix socket path
    root = Path(tempfile.mkdtemp(prefix="kl", dir="/tmp"))
    k = FakeKubelet(root)
    k.start()
    try:
        yield k
    finally:
        k.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def plugin(fakegpu, kubelet: FakeKubelet, tmp_path: Path) -> Iterator[Callable[..., PluginProcess]]:
    procs: list[PluginProcess] = []

    def start(*args: str) -> PluginProcess:
        base = ["--config", str(tmp_path / "none.toml"), "--state-dir", str(tmp_path / "state"),
                "--kubelet-dir", str(kubelet.root), "--log-level", "info"]  # fmt: skip
        p = PluginProcess([*base, *args], dict(fakegpu.env), tmp_path / f"plugin{len(procs)}.log").start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc is not None and p.proc.poll() is None:
            p.stop(signal.SIGKILL)


def test_mixed_registers_one_resource_per_profile(plugin, kubelet: FakeKubelet, fakegpu) -> None:
    build(fakegpu, "h200-mixed")
    p = plugin("--mig-strategy", "mixed", "--device-split-count", "1")
    want = recorded()["h200-mixed"]["mixed"]
    for name, count in want["offer"].items():
        ep = kubelet.wait_endpoint(name, timeout=60)
        # the same device IDs (the MIG UUIDs) and the same NVIDIA_VISIBLE_DEVICES as the real plugin
        assert sorted(ep.devices()) == want["allocate"][name]["ids"] and len(ep.devices()) == count
        resp = ep.allocate(want["allocate"][name]["request"])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == want["allocate"][name]["envs"]["NVIDIA_VISIBLE_DEVICES"]
    time.sleep(0.5)
    assert kubelet.capacity("nvidia.com/gpu") is None  # no resource without devices, as NVIDIA's
    migs = {d["uuid"]: d for d in fakegpu.mig_devices()}
    ep = kubelet.endpoint("nvidia.com/mig-1g.18gb")
    resp = ep.allocate([sorted(ep.devices())[1]])
    uuid = resp.envs["NVIDIA_VISIBLE_DEVICES"]
    assert migs[uuid]["gi_profile"] == "1g.18gb"
    rec = read_record(p.args[p.args.index("--state-dir") + 1] + f"/allocations/{resp.envs[TOKEN_ENV]}.json")
    assert [(g.uuid, g.memory_limit, g.core_percent) for g in rec.gpus] == [(uuid, 16384 << 20, 100)]
    assert rec.resource_name == "nvidia.com/mig-1g.18gb"


def test_mig_strategy_refusal_stops_the_plugin(plugin, fakegpu) -> None:
    build(fakegpu, "h200-mixed")
    p = plugin("--mig-strategy", "single")
    assert p.proc is not None and p.proc.wait(60) == 1
    assert "more than one MIG device type present on node" in p.log()


def test_vgpu_strategy_slices_a_mig_device(plugin, kubelet: FakeKubelet, fakegpu) -> None:
    """vgpu: a 3g.71gb instance split in 4: a vGPU is a quarter of the instance's memory (S = 1),
    named by the MIG UUID in the record (the limits are keyed by it, contract 4)."""
    build(fakegpu, "h200-mixed")
    p = plugin("--mig-strategy", "vgpu", "--device-split-count", "4")
    ep = kubelet.wait_endpoint("nvidia.com/gpu", timeout=60)
    migs = {d["uuid"]: d for d in fakegpu.mig_devices()}
    assert sorted(ep.devices()) == sorted(f"{u}::{i}" for u in migs for i in range(4))
    big = next(u for u, d in migs.items() if d["gi_profile"] == "3g.71gb")
    resp = ep.allocate([f"{big}::0", f"{big}::1"])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == big
    rec = read_record(p.args[p.args.index("--state-dir") + 1] + f"/allocations/{resp.envs[TOKEN_ENV]}.json")
    assert [(g.uuid, g.memory_limit, g.core_percent) for g in rec.gpus] == [(big, 2 * ((71680 << 20) // 4), 50)]


def test_health_per_mig_device(plugin, kubelet: FakeKubelet, fakegpu) -> None:
    """An XID attributed to one MIG instance marks that MIG device unhealthy, not its neighbours
    (NVIDIA's plugin: the event's GPU and compute instance IDs); an application XID (43) none; one
    of the whole GPU every MIG device of it."""
    build(fakegpu, "h200-7x1g")
    plugin("--mig-strategy", "mixed", "--device-split-count", "1", "--health-recovery-s", "3600")
    ep = kubelet.wait_endpoint("nvidia.com/mig-1g.18gb", timeout=60)
    migs = fakegpu.mig_devices()
    victim = migs[2]
    time.sleep(1.0)  # the health thread registers for events after the first list
    fakegpu.inject_mig_xid(0, 43, victim["gi"], victim["ci"])
    fakegpu.inject_mig_xid(0, 48, victim["gi"], victim["ci"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ep.devices()[victim["uuid"]].healthy:
        time.sleep(0.1)
    assert [u for u, d in ep.devices().items() if not d.healthy] == [victim["uuid"]]
    fakegpu.inject_xid(0, 79)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(d.healthy for d in ep.devices().values()):
        time.sleep(0.1)
    assert not any(d.healthy for d in ep.devices().values())
