"""Static MIG with the DRA plugin: a simulated H200 in MIG mode publishes its MIG devices (not the
GPU) with their memory and a `profile` attribute; a claim selects a profile by CEL (evaluated by
cel-python in the allocator stand-in, sim/draallocator.py); a claim for a 1g.18gb device is
prepared and a container runs on it through podman's CDI (the real libvgpu.so holding it to the
claimed memory of that MIG device, the simulator's count of the instance as the judge)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dra_plugin import slices
from dra_plugin.config import Settings
from sim import draallocator, kubeapi
from sim.drakubelet import DRAKubelet, cdi_devices
from sim.fakegpu import toolkit as tk
from sim.fakegpu.harness import FakeGPU
from sim.fakegpu.mig import product
from tests.dra_plugin.conftest import GIB, NODE, make_cfg
from tests.dra_plugin.support import Claims, start_plugin
from tests.support import hook as support
from tests.support.mig import discover
from tests.support.podman import Podman, needs_podman
from vgpu import quantity
from vgpu.nvml import GPUInfo

DRIVER = "gpu.vgpu.k8s.io"
PICK_1G = f'device.attributes["{DRIVER}"].profile == "1g.18gb"'


@pytest.fixture
def h200(fakegpu: FakeGPU) -> tuple[FakeGPU, list[GPUInfo]]:
    fakegpu.configure([product("h200-141gb", mig_mode=1, context_overhead=0)])
    fakegpu.mig_create(0, "3g.71gb", "1g.18gb")
    return fakegpu, discover(fakegpu.env).devices_as_gpus()


def test_mig_devices_are_published_with_their_profile(h200, tmp_path: Path) -> None:
    gpu, devices = h200
    cfg = make_cfg(tmp_path)
    [sl] = slices.build(NODE, devices, cfg, generation=1)
    by_name = {d["name"]: d for d in sl["spec"]["devices"]}
    migs = {d["uuid"]: d for d in gpu.mig_devices()}
    assert sorted(by_name) == sorted(f"gpu-0-mig-{d['gi']}-{d['ci']}" for d in migs.values())  # not gpu-0
    for d in by_name.values():
        a = d["attributes"]
        m = migs[a["uuid"]["string"]]
        assert a["type"] == {"string": "mig"} and a["profile"] == {"string": m["gi_profile"]}
        assert a["parentUUID"] == {"string": gpu.uuids[0]} and a["parentIndex"] == {"int": 0}
        assert a["productName"] == {"string": f"NVIDIA H200 MIG {m['gi_profile']}"}
        assert quantity.value(d["capacity"]["memory"]["value"]) == m["memory"]


def test_a_claim_selects_a_profile_by_cel(h200, tmp_path: Path) -> None:
    gpu, devices = h200
    alloc = draallocator.Allocator(slices.build(NODE, devices, make_cfg(tmp_path), generation=1))
    one = next(d for d in gpu.mig_devices() if d["gi_profile"] == "1g.18gb")
    got = alloc.allocate("gpu", {"memory": "8Gi"}, [PICK_1G])
    assert got["device"] == f"gpu-0-mig-{one['gi']}-{one['ci']}"
    got = alloc.allocate("gpu", {"memory": "8Gi"}, [PICK_1G])  # the second half of it
    assert got["device"] == f"gpu-0-mig-{one['gi']}-{one['ci']}"
    with pytest.raises(draallocator.NoFit):  # 16 GiB of the 1g.18gb device are taken
        alloc.allocate("gpu", {"memory": "8Gi"}, [PICK_1G])
    with pytest.raises(draallocator.NoFit):  # no such profile on the node
        alloc.allocate("gpu", {}, [f'device.attributes["{DRIVER}"].profile == "7g.141gb"'])


@pytest.mark.root
@pytest.mark.timeout(240)
@needs_podman
def test_a_claim_for_a_1g_18gb_device_runs(h200, tmp_path: Path, podman: Podman, build_dir: Path) -> None:
    gpu, devices = h200
    lib_dir, burn = "/usr/local/nvidia/lib64", "/opt/fakegpu/fakegpu-burn"
    (podman.cdi / "fakegpu.json").write_text(json.dumps(tk.generate_cdi_spec(gpu, container_lib_dir=lib_dir)))
    cfg: Settings = make_cfg(tmp_path, cdi_dir=str(podman.cdi), library_path=str(build_dir / "libvgpu.so"))
    rootfs = support.make_cdi_rootfs(tmp_path / "rootfs")
    one = next(d for d in gpu.mig_devices() if d["gi_profile"] == "1g.18gb")
    with kubeapi.running() as kube:
        kube.create("nodes", kubeapi.node_object(NODE))
        plugin = start_plugin(cfg, devices, kube)
        claims = Claims(kube, cfg, devices)
        try:
            with DRAKubelet(cfg.kubelet_dir) as kubelet:
                kubelet.wait_registered(DRIVER)
                result = claims.alloc.allocate("gpu", {"memory": "8Gi", "cores": "50"}, [PICK_1G])
                c = claims.store(draallocator.claim_object("mig-claim", "default", [result], pods=("pod-a",)))
                prepared = kubelet.prepare(DRIVER, [c])
                ids = cdi_devices(prepared[c.uid], "gpu")
                assert ids[0] == f"nvidia.com/gpu={one['uuid']}"  # NVIDIA's spec names the MIG device so
                run = ["-v", "/usr/lib:/usr/lib:ro", "-v", "/usr/lib64:/usr/lib64:ro", "-v", f"{gpu.burn}:{burn}:ro",
                       "-e", f"LD_LIBRARY_PATH={lib_dir}", *[x for i in ids for x in ("--device", i)]]  # fmt: skip
                r = podman.run(rootfs, *run, f"cat /run/vgpu/limits; {burn} --alloc 7g --seconds 0")
                assert r.returncode == 0, (r.stdout, r.stderr)
                assert f"{one['uuid']} {8 * GIB} 50 0" in r.stdout
                line = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith('{"pid"')))
                assert line["mem_total"] == 8 * GIB and line["alloc_result"] == 0
                r = podman.run(rootfs, *run, f"{burn} --alloc 9g --seconds 0")
                assert r.returncode == 3, (r.stdout, r.stderr)  # past the claim, inside the instance's 16 GiB
                kubelet.unprepare(DRIVER, [c])
        finally:
            plugin.stop()
