"""The real vgpu-device-plugin as a subprocess over the simulated NVML (sim/fakegpu),
talking to the kubelet stand-in over real unix sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sim.kubelet import FakeKubelet
from tests.device_plugin.conftest import ROOT, PluginProcess
from vgpu.schemas import TOKEN_ENV, read_record

pytestmark = [pytest.mark.timeout(180)]


def nvml_inventory(env: dict[str, str]) -> list[dict]:
    """The inventory as vgpu.nvml sees it under the simulated driver (own process)."""
    code = (
        "import json, dataclasses; from vgpu import nvml; nvml.init(attempts=1); "
        "print(json.dumps([dataclasses.asdict(g) for g in nvml.inventory()]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def node(fakegpu, tmp_path: Path) -> dict[str, str]:
    """fakegpu env plus a sysfs root of our own giving each GPU a NUMA node."""
    env = dict(fakegpu.env)
    sysfs = tmp_path / "sys"
    for i, g in enumerate(nvml_inventory(env)):
        bus = g["pci_bus_id"].lower()[4:]  # 00000000:10:00.0 -> 0000:10:00.0
        d = sysfs / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{i % 2}\n")
    env["VGPU_SYSFS_ROOT"] = str(sysfs)
    return env


@pytest.fixture
def plugin(node: dict[str, str], kubelet: FakeKubelet, tmp_path: Path) -> Iterator[Callable[..., PluginProcess]]:
    procs: list[PluginProcess] = []

    def start(*args: str) -> PluginProcess:
        base = [
            "--config", str(tmp_path / "none.toml"),
            "--state-dir", str(tmp_path / "state"),
            "--kubelet-dir", str(kubelet.root),
            "--log-level", "info",
        ]  # fmt: skip
        p = PluginProcess([*base, *args], node, tmp_path / f"plugin{len(procs)}.log").start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc is not None and p.proc.poll() is None:
            p.stop(signal.SIGKILL)


def test_inventory_ids_and_numa(plugin, kubelet: FakeKubelet, fakegpu, node: dict[str, str]) -> None:
    plugin("--device-split-count", "3")
    reg = kubelet.wait_registration(timeout=60)
    assert (reg.version, reg.endpoint, reg.resource_name) == ("v1beta1", "vgpu.sock", "nvidia.com/gpu")
    devs = kubelet.wait_endpoint(timeout=60).devices()
    inv = nvml_inventory(node)
    assert [g["uuid"] for g in inv] == list(fakegpu.uuids)
    assert [(g["index"], g["name"], g["memory_total"], g["pci_bus_id"]) for g in inv] == [
        (i, "NVIDIA Fake GPU", 16 << 30, f"00000000:{0x10 + i:02X}:00.0") for i in range(len(inv))
    ]
    assert sorted(devs) == sorted(f"{g['uuid']}::{i}" for g in inv for i in range(3))
    for i, g in enumerate(inv):
        assert all(devs[f"{g['uuid']}::{k}"].numa == (i % 2,) for k in range(3))


def test_xid_marks_unhealthy_then_recovers(plugin, kubelet: FakeKubelet, fakegpu) -> None:
    plugin("--device-split-count", "2", "--health-recovery-s", "4")
    ep = kubelet.wait_endpoint(timeout=60)
    u0, u1 = fakegpu.uuids[:2]
    # Only events after the health thread registered are delivered, and it does so
    # concurrently with start-up: inject until the effect shows (bounded).
    deadline = time.monotonic() + 60
    while True:
        fakegpu.inject_xid(0, 13)  # application error: ignored
        fakegpu.inject_xid(1, 79)  # GPU fell off the bus
        try:
            devs = ep.wait_devices(lambda d: not d[f"{u1}::0"].healthy, timeout=1)
            break
        except TimeoutError:
            assert time.monotonic() < deadline, "XID 79 never marked the GPU unhealthy"
    assert not devs[f"{u1}::1"].healthy
    assert devs[f"{u0}::0"].healthy and devs[f"{u0}::1"].healthy, "XID 13 must be ignored"
    with pytest.raises(Exception, match="unhealthy"):
        ep.allocate([f"{u1}::0"])
    ep.wait_devices(lambda d: all(x.healthy for x in d.values()), timeout=30)


def test_lost_gpu_is_unhealthy(plugin, kubelet: FakeKubelet, fakegpu) -> None:
    plugin("--device-split-count", "2", "--health-recovery-s", "1")
    ep = kubelet.wait_endpoint(timeout=60)
    u1 = fakegpu.uuids[1]
    fakegpu.set_lost(1)
    ep.wait_devices(lambda d: not d[f"{u1}::0"].healthy, timeout=30)
    time.sleep(2.5)  # longer than the recovery period: still lost, still unhealthy
    devs = ep.devices()
    assert not devs[f"{u1}::1"].healthy
    u0 = fakegpu.uuids[0]
    assert devs[f"{u0}::0"].healthy and devs[f"{u0}::1"].healthy, "the other GPU is not affected"
    fakegpu.set_lost(1, False)  # back (e.g. after a reset): healthy after the quiet period
    ep.wait_devices(lambda d: all(x.healthy for x in d.values()), timeout=30)


def test_signals_restart_and_stop(plugin, kubelet: FakeKubelet, tmp_path: Path) -> None:
    p = plugin()
    kubelet.wait_endpoint(timeout=60)
    a = kubelet.admit("default", "pod", "c", 1)
    record = tmp_path / "state" / "allocations" / f"{a.envs[TOKEN_ENV]}.json"
    before = record.read_bytes()
    p.send(signal.SIGHUP)
    kubelet.wait_registration(count=2, timeout=30)
    kubelet.wait_endpoint(timeout=30)
    assert p.proc is not None and p.proc.poll() is None
    assert p.stop(signal.SIGTERM) == 0
    log = p.log()
    assert log.count("registered with kubelet") == 2
    assert log.count("restarting plugin server reason=SIGHUP") == 1
    (line,) = [x for x in log.splitlines() if " allocated devices=" in x]
    assert a.device_ids[0] in line and f"token={a.envs[TOKEN_ENV][:8]}" in line
    assert a.envs[TOKEN_ENV] not in line, "the full token is a capability: never logged"
    sock = Path(kubelet.device_plugins_dir) / "vgpu.sock"
    assert not sock.exists(), "socket removed on SIGTERM"
    # a new plugin process: the record is still there, untouched
    p2 = plugin()
    kubelet.wait_registration(count=3, timeout=60)
    kubelet.wait_endpoint(timeout=30)
    assert record.read_bytes() == before
    assert read_record(str(record)).gpus[0].vgpu_ids == list(a.device_ids)
    assert p2.stop(signal.SIGINT) == 0
    assert not sock.exists()


def test_kubelet_restarts(plugin, kubelet: FakeKubelet) -> None:
    plugin()
    kubelet.wait_endpoint(timeout=60)
    for i in range(10):
        kubelet.restart()
        kubelet.wait_registration(count=i + 2, timeout=30)
        assert len(kubelet.wait_endpoint(timeout=30).devices()) == 4
    assert kubelet.admit("default", "p", "c", 2).envs["NVIDIA_VISIBLE_DEVICES"].count("GPU-") == 2


def test_node_inventory_follows_health(plugin, kubelet: FakeKubelet, fakegpu, apiserver) -> None:
    from device_plugin.inventory import ANNOTATION

    def docs() -> list[dict]:
        return [
            json.loads(b["metadata"]["annotations"][ANNOTATION])
            for path, _t, b, _a in list(apiserver.patches)
            # not the node-level totals (status subresource) nor a usage-only PATCH
            if not path.endswith("/status") and ANNOTATION in b["metadata"]["annotations"]
        ]

    plugin("--node-name", "gpu-node-1", "--device-split-count", "4", "--health-recovery-s", "300")
    kubelet.wait_endpoint(timeout=60)
    deadline = time.monotonic() + 60
    while not apiserver.patches:
        assert time.monotonic() < deadline, "no PATCH of the Node"
        time.sleep(0.1)
    path, _ctype, _body, _auth = apiserver.patches[0]
    assert path == "/api/v1/nodes/gpu-node-1"
    first = docs()[0]
    assert first["split_count"] == 4
    assert [g["uuid"] for g in first["gpus"]] == list(fakegpu.uuids)
    assert all(g["health"] is True and g["model"] == "NVIDIA Fake GPU" for g in first["gpus"])
    while not any(d["gpus"][0]["health"] is False for d in docs()):
        assert time.monotonic() < deadline, "health change never reached the Node annotation"
        fakegpu.inject_xid(0, 48)  # double-bit ECC error
        time.sleep(0.5)
