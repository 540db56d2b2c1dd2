"""`mig_strategy = dynamic` on a simulated H200 in MIG mode (and an H100 not in it): the plugin
publishes the H200's profiles and placements (inventory version 3), makes the decided instance
in Allocate and gives the container its MIG device, publishes the instance with its pod, makes
nothing twice (a restarted plugin, a repeated or half-made creation), and destroys the instance
once its pod is gone and no process runs on it (device_plugin/dynmig.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from sim.fakegpu.mig import product
from sim.kubeapi import KubeAPI, node_object, pod_object
from sim.kubelet import FakeKubelet
from tests.device_plugin.conftest import NODE, PluginProcess
from tests.support.inventory import H200_PROFILES
from tests.support.poll import wait_for
from vgpu import scheduling as sc
from vgpu.schemas import TOKEN_ENV, read_record
from vgpu_scheduler import fit, snapshot
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.requests import ContainerRequest, PodOptions

pytestmark = [pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
H200 = "GPU-4a1e0b6c-8d3f-4c2a-9e7b-000000000000"
H100 = "GPU-4a1e0b6c-8d3f-4c2a-9e7b-000000000001"


@pytest.fixture
def node(fakegpu: Any) -> Any:
    fakegpu.configure(
        [product("h200-141gb", mig_mode=1, uuid=H200, context_overhead=0), product("h100-80gb", mig_mode=0, uuid=H100)]
    )
    return fakegpu


@pytest.fixture
def plugin(node: Any, kubelet: FakeKubelet, api: KubeAPI, tmp_path: Path) -> Iterator[Callable[..., PluginProcess]]:
    procs: list[PluginProcess] = []

    def start() -> PluginProcess:
        args = ["--config", str(tmp_path / "none.toml"), "--state-dir", str(tmp_path / "state"),
                "--kubelet-dir", str(kubelet.root), "--log-level", "info", "--mig-strategy", "dynamic",
                "--device-split-count", "7", "--inventory-heartbeat-s", "2"]  # fmt: skip
        env = {**node.env, "KUBECONFIG": os.environ["KUBECONFIG"], "NODE_NAME": NODE}
        p = PluginProcess(args, env, tmp_path / f"plugin{len(procs)}.log").start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc is not None and p.proc.poll() is None:
            p.stop(signal.SIGKILL)


def inventory(api: KubeAPI) -> sc.NodeInventory | None:
    text = api.get("nodes", NODE)["metadata"].get("annotations", {}).get(sc.INVENTORY_ANNOTATION)
    return sc.decode_inventory(text) if text else None


def usage(api: KubeAPI) -> sc.NodeUsage | None:
    text = api.get("nodes", NODE)["metadata"].get("annotations", {}).get(sc.USAGE_ANNOTATION)
    return sc.decode_usage(text) if text else None


def decide(inv: sc.NodeInventory, mib: int) -> sc.Decision:
    """What vgpu-scheduler's filter decides for a pod asking `mib` MiB with vgpu.k8s.io/mig."""
    n = node_object(NODE, {sc.INVENTORY_ANNOTATION: sc.encode(inv)}, gpus=14)
    view = snapshot.node_view(snapshot.node_info(n), time.time(), 120)
    p = fit.fit_node(view, {}, [ContainerRequest("main", False, 1, mib, None, None)],
                     PodOptions("binpack", "binpack", mig=True), SchedulerConfig())  # fmt: skip
    assert isinstance(p, fit.Placement), p
    return sc.Decision(node=NODE, time=time.time(), containers=p.containers)


def add_pod(api: KubeAPI, name: str, d: sc.Decision) -> dict[str, Any]:
    ann = {
        sc.DECISION_ANNOTATION: sc.encode(d),
        sc.BIND_PHASE_ANNOTATION: sc.PHASE_ALLOCATING,
        sc.BIND_TIME_ANNOTATION: str(int(time.time())),
        sc.MIG_ANNOTATION: "true",
    }
    api.create("pods", pod_object(name, [("main", {"nvidia.com/gpu": "1"})], annotations=ann))
    api.bind(name, "default", NODE)
    return api.get("pods", name, "default")


def test_profiles_instance_made_published_and_destroyed(
    plugin, kubelet: FakeKubelet, api: KubeAPI, node, tmp_path: Path
) -> None:
    p = plugin()
    inv = wait_for(lambda: inventory(api), 60, "the node inventory", step=0.2)
    # 1. version 3: the H200's profiles as NVML gives them (the MIG user guide's H200 table), no
    #    instance yet; the H100 (not in MIG mode) is a plain GPU
    assert inv.version == 3
    by = {g.uuid: g for g in inv.gpus}
    assert by[H100].mig is msgspec.UNSET
    m = by[H200].mig
    assert isinstance(m, sc.MigGPU) and m.instances == () and m.compute_slices == 7
    assert {(q.name, q.id, q.memory // MiB, q.slices, q.memory_slices, q.placements) for q in m.profiles} == set(
        H200_PROFILES
    )
    assert all(q.free == q.placements for q in m.profiles)
    assert by[H200].split_count == 7

    # 2. the scheduler's decision for 20 GiB: 1g.35gb at 6; Allocate makes it
    d = decide(inv, 20 * 1024)
    [g] = d.containers[0].gpus
    assert isinstance(g.mig, sc.MigAssignment) and (g.uuid, g.mig.profile, g.mig.start) == (H200, "1g.35gb", 6)
    pod = add_pod(api, "train", d)
    ep = kubelet.wait_endpoint("nvidia.com/gpu", timeout=60)
    resp = ep.allocate([f"{H200}::0"])
    [made] = node.mig_devices()
    assert (made["gi_profile"], made["placement"]) == ("1g.35gb", (6, 2))
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == made["uuid"]
    state = tmp_path / "state"
    rec = read_record(str(state / "allocations" / f"{resp.envs[TOKEN_ENV]}.json"))
    assert [(x.uuid, x.memory_limit, x.core_percent) for x in rec.gpus] == [(made["uuid"], 33280 * MiB, 100)]
    ann = api.get("pods", "train", "default")["metadata"]["annotations"]
    assert ann[sc.BIND_PHASE_ANNOTATION] == sc.PHASE_SUCCESS

    # 3. published: the instance with its pod, its slices taken; the container's slice counts on
    #    the GPU in MIG mode with the instance's placement
    def published() -> bool:
        i = inventory(api)
        u = usage(api)
        return bool(i and u and isinstance(i.gpus[0].mig, sc.MigGPU) and i.gpus[0].mig.instances and u.slices)

    wait_for(published, 30, "the instance in the inventory and usage", step=0.2)
    m = next(x for x in inventory(api).gpus if x.uuid == H200).mig  # type: ignore[union-attr]
    assert isinstance(m, sc.MigGPU)
    assert [(i.profile, i.start, i.size, i.uuid, i.pod) for i in m.instances] == [
        ("1g.35gb", 6, 2, made["uuid"], pod["metadata"]["uid"])
    ]
    assert dict((q.name, q.free) for q in m.profiles)["1g.35gb"] == (0, 2, 4)
    [s] = usage(api).slices  # type: ignore[union-attr]
    assert (s.gpu, s.memory, s.cores, s.pod, s.mig) == (
        H200,
        33280 * MiB,
        14,
        pod["metadata"]["uid"],
        sc.MigAssignment(profile="1g.35gb", id=15, start=6, size=2),
    )

    # 4. a GPU in MIG mode gives nothing without a decision naming the instance
    with pytest.raises(grpc.RpcError) as e:
        ep.allocate([f"{H200}::1"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "is in MIG mode" in str(e.value.details())
    assert len(node.mig_devices()) == 1

    # 5. restarted: the instance is found, not made again, and still the pod's
    p.stop()
    p = plugin()
    wait_for(lambda: "registered with kubelet" in p.log(), 60, "the restarted plugin to register")
    time.sleep(1.0)
    assert [x["uuid"] for x in node.mig_devices()] == [made["uuid"]]

    # 6. a process on the instance keeps it after the pod is gone; then it is destroyed
    hog = node.popen([node.burn, "--alloc", "256m", "--seconds", "0", "--hold", "60"],
                     env={**node.env, "CUDA_VISIBLE_DEVICES": made["uuid"]}, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert hog.stdout is not None
        assert json.loads(hog.stdout.readline())["alloc_result"] == 0  # it holds 256 MiB of the instance
        api.delete("pods", "train", "default")
        wait_for(lambda: "still runs processes; kept" in p.log(), 30, "the busy instance to be kept", step=0.2)
        assert [x["uuid"] for x in node.mig_devices()] == [made["uuid"]]
    finally:
        hog.kill()
        hog.wait()
    wait_for(lambda: node.mig_devices() == [], 30, "the instance to be destroyed", step=0.2)
    assert "MIG instance destroyed" in p.log() and not os.listdir(state / "mig-instances")

    def gone() -> bool:
        i = inventory(api)
        m = next(x for x in i.gpus if x.uuid == H200).mig if i else None
        return isinstance(m, sc.MigGPU) and m.instances == ()

    wait_for(gone, 30, "the inventory without the instance", step=0.2)


# --- the manager itself, in a process of its own (NVML from the simulator) ---------------------
_CODE = """
import json, sys, time
import pynvml
from device_plugin.dynmig import DynamicMig
from vgpu import nvml, scheduling as sc
from vgpu.paths import Paths
nvml.init(attempts=1)
gpus = [g for g in nvml.inventory() if g.uuid == sys.argv[2]]
dm = DynamicMig(Paths(sys.argv[1]), gpus)
out = []
for step in json.loads(sys.argv[3]):
    op = step[0]
    if op == "ensure":
        a = sc.MigAssignment(**step[1])
        try:
            out.append(dm.ensure(gpus[0].uuid, a, step[2], step[3]).uuid)
        except Exception as e:
            out.append("error: " + str(e))
    elif op == "gi-only":  # a GPU instance without its compute instance (made halfway)
        h = pynvml.nvmlDeviceGetHandleByUUID(gpus[0].uuid)
        pl = pynvml.c_nvmlGpuInstancePlacement_t(); pl.start = step[2]; pl.size = step[3]
        import ctypes
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, step[1], ctypes.byref(pl))
        out.append("ok")
    elif op == "reap":
        out.append(dm.reap(set(step[1]), time.time() + 1))
print(json.dumps(out))
"""


def manager(node: Any, state: Path, *steps: Any) -> list[Any]:
    r = subprocess.run([sys.executable, "-c", _CODE, str(state), H200, json.dumps(steps)], cwd=ROOT,
                       env={**os.environ, **node.env}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out: list[Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


A35 = {"profile": "1g.35gb", "id": 15, "start": 2, "size": 2, "slices": 1}


def test_nothing_is_made_twice(node, tmp_path: Path) -> None:
    """The same container again (the kubelet's retry, a restarted plugin): the same instance; a
    half-made one (GPU instance, no compute instance) written down before a crash: completed; a
    placement held for another pod, or by an instance not made here: refused."""
    st = tmp_path / "state"
    first, again = manager(node, st, ("ensure", A35, "uid-1", "main"), ("ensure", A35, "uid-1", "main"))
    assert first.startswith("MIG-") and again == first and len(node.mig_devices()) == 1
    [other] = manager(node, st, ("ensure", A35, "uid-2", "main"))
    assert other.startswith("error: ") and "held by an instance made for pod uid-1" in other
    # an administrator's instance at 0: not taken over
    node.mig_create(0, "1g.35gb", start=0)
    [theirs] = manager(node, st, ("ensure", {**A35, "start": 0}, "uid-3", "main"))
    assert "holds an instance not made here" in theirs
    # half made: the file written, the GPU instance made, the plugin died before the compute instance
    rec = json.loads((st / "mig-instances" / f"{H200}_2.json").read_text())
    half = {**rec, "start": 4, "gi": -1, "ci": -1, "uuid": "", "pod": "uid-4"}
    (st / "mig-instances" / f"{H200}_4.json").write_text(json.dumps(half))
    manager(node, st, ("gi-only", 15, 4, 2))
    [done] = manager(node, st, ("ensure", {**A35, "start": 4}, "uid-4", "main"))
    assert done.startswith("MIG-")
    assert sorted(d["placement"][0] for d in node.mig_devices()) == [0, 2, 4]
    # reaped: the instances of pods not live; the administrator's stays
    [gone] = manager(node, st, ("reap", ["uid-4"]))
    assert gone == [first]
    assert sorted(d["placement"][0] for d in node.mig_devices()) == [0, 4]
