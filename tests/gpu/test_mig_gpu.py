"""MIG on a real MIG-capable NVIDIA GPU (A100, H100, H200, ...): what the node reads of it, the
simulator's profile tables against the hardware's, a vGPU slice inside a MIG device, what NVML
does not sample there, and (opt-in) an instance made and destroyed by dynamic MIG.

Skipped without a real driver and GPU, and where no GPU is in MIG mode: these tests never change
the MIG mode (that needs a GPU reset). To run them, enable it beforehand (`nvidia-smi -i 0 -mig
1`, then reset the GPU or reboot) and create some instances (`nvidia-smi mig -cgi 1g.18gb -C`).
The test that makes and destroys an instance runs only with VGPU_GPU_MIG_CREATE=1 (as root, on a
GPU with a free placement), since it changes the GPU's layout for a moment.

`VGPU_GPU_MIG_ON_SIM=1` runs the same tests against the simulated H200 instead (a check of the
tests themselves on machines without such a GPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.test_real_gpu import _real_gpu

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
MiB = 1 << 20
ON_SIM = os.environ.get("VGPU_GPU_MIG_ON_SIM") == "1"
PRODUCTS = {"NVIDIA H200": "h200-141gb", "NVIDIA H100 80GB HBM3": "h100-80gb", "NVIDIA A100-SXM4-40GB": "a100-40gb"}

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _run(env: dict[str, str], code: str, *args: str) -> Any:
    """A Python child with this environment (NVML and CUDA as it gives them); its last line as JSON."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


LAYOUT = """
import dataclasses, json, pynvml
from nodecore import mig, migops
from vgpu import nvml
nvml.init(attempts=1)
gpus = nvml.inventory()
lay = mig.discover(gpus)
out = []
for g in gpus:
    h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
    profs = []
    if lay.mode.get(g.uuid) == 1:
        profs = [dataclasses.asdict(p) for p in migops.profiles(h, g.memory_total)]
    out.append({"uuid": g.uuid, "index": g.index, "name": g.name, "mode": lay.mode.get(g.uuid), "profiles": profs,
                "devices": [{"uuid": d.uuid, "profile": d.profile, "gi": d.gi, "ci": d.ci, "memory": d.memory,
                             "placement": list(d.placement)} for d in lay.of(g.uuid)]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """{env, gpus: the node's GPUs as nodecore reads them}, with at least one GPU in MIG mode."""
    if ON_SIM:
        subprocess.run(["make", "-s", "-C", str(ROOT), "build-all"], check=True)
        from sim.fakegpu.harness import FakeGPU
        from sim.fakegpu.mig import product

        fake = FakeGPU(tmp_path_factory.mktemp("fakegpu"), BUILD)
        fake.configure([product("h200-141gb", mig_mode=1, context_overhead=0)])
        fake.mig_create(0, "3g.71gb", "1g.18gb")
        env = {**os.environ, **fake.env}
    else:
        if not _real_gpu():
            pytest.skip("no NVIDIA driver/GPU on this machine")
        fake = None
        env = dict(os.environ)
    try:
        gpus = _run(env, LAYOUT)
        if not any(g["mode"] is not None for g in gpus):
            pytest.skip("no MIG-capable GPU (nvmlDeviceGetMigMode is NOT_SUPPORTED on every GPU)")
        if not any(g["mode"] == 1 for g in gpus):
            pytest.skip("no GPU in MIG mode (enable it with nvidia-smi -i N -mig 1 and a GPU reset to run these)")
        yield {"env": env, "gpus": gpus, "fake": fake}
    finally:
        if fake is not None:
            fake.close()


def _migs(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for g in node["gpus"] for d in g["devices"]]


def test_mig_devices_are_what_nvidia_smi_lists(node: dict[str, Any]) -> None:
    """nodecore.mig.discover (go-nvlib's walk and profile names) finds the MIG devices and the
    profile names `nvidia-smi -L` prints: `MIG 1g.18gb Device 0: (UUID: MIG-...)`."""
    if ON_SIM or not shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi of a real driver needed")
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    listed = dict((u, p) for p, u in re.findall(r"MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)]+)\)", out))
    assert {d["uuid"]: d["profile"] for d in _migs(node)} == listed


SIM_PROFILES = """
import dataclasses, json, pynvml
from nodecore import migops
from vgpu import nvml
nvml.init(attempts=1)
[g] = nvml.inventory()
h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
print(json.dumps([dataclasses.asdict(p) for p in migops.profiles(h, g.memory_total)]))
"""


def test_the_simulators_profile_table_is_the_hardwares(node: dict[str, Any], tmp_path: Path) -> None:
    """Profile by profile (NVML's GPU instance profile info and possible placements, as the
    device plugin publishes them for dynamic MIG): name, ID, memory, compute slices, instance
    count, placements. The simulator's H200 rows 1g.35gb, 3g.71gb and 4g.71gb are derived, not
    recorded (docs/developers/simulators.md "MIG"): this is where they are checked."""
    gpu = next(g for g in node["gpus"] if g["mode"] == 1)
    key = PRODUCTS.get(gpu["name"])
    if key is None:
        pytest.skip(f"the simulator has no profile table of {gpu['name']}")
    from sim.fakegpu.harness import FakeGPU
    from sim.fakegpu.mig import product

    subprocess.run(["make", "-s", "-C", str(ROOT), "build-all"], check=True)
    fake = FakeGPU(tmp_path / "fakegpu", BUILD)
    try:
        fake.configure([product(key, mig_mode=1)])
        sim = _run({**os.environ, **fake.env}, SIM_PROFILES)
    finally:
        fake.close()

    def table(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted(
            (r["name"], r["id"], r["memory"] // MiB, r["slices"], r["count"], tuple(map(tuple, r["placements"])))
            for r in rows
        )

    assert table(gpu["profiles"]) == table(sim)


PROBE = """
import ctypes, json, sys
cu = ctypes.CDLL("libcuda.so.1")
def ok(rc, what):
    if rc:
        raise SystemExit(f"{what}: CUresult {rc}")
ok(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
def uuid(fn):
    b = (ctypes.c_ubyte * 16)()
    rc = getattr(cu, fn)(b, dev)
    h = bytes(b).hex()
    return rc, f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
ctx = ctypes.c_void_p()
ok(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
ok(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
out = {"v1": uuid("cuDeviceGetUuid"), "v2": uuid("cuDeviceGetUuid_v2"), "total": total.value, "allocs": []}
for n in map(int, sys.argv[1:]):
    p = ctypes.c_uint64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    out["allocs"].append(rc)
    if rc == 0:
        cu.cuMemFree_v2(p)
print(json.dumps(out))
"""
CUDA_ERROR_OUT_OF_MEMORY = 2


def test_a_vgpu_slice_inside_a_mig_device(node: dict[str, Any], tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES=MIG-...: cuDeviceGetUuid_v2 gives the MIG device's UUID (what the limits
    line is keyed by, contract 4) and cuDeviceGetUuid its GPU's (as the simulator models it);
    libvgpu.so with a slice of the instance: cuMemGetInfo shows the slice, one MiB past it is
    CUDA_ERROR_OUT_OF_MEMORY although the instance has room, the slice itself fits."""
    if not (BUILD / "libvgpu.so").exists():
        subprocess.run(["make", "-s", "-C", str(ROOT), "build-all"], check=True)
    mig = _migs(node)[0]
    parent = next(g for g in node["gpus"] if any(d["uuid"] == mig["uuid"] for d in g["devices"]))
    limit = min(1024 * MiB, mig["memory"] // 2)
    limits = tmp_path / "limits"
    limits.write_text(f"vgpu-limits 1\n{mig['uuid']} {limit} 100 0\n")
    env = {k: v for k, v in node["env"].items() if not k.startswith("VGPU_")}
    env.update(CUDA_VISIBLE_DEVICES=mig["uuid"], VGPU_LIMITS_FILE=str(limits), VGPU_REGION_FILE=str(tmp_path / "r"))
    bare = _run(env, PROBE)
    assert bare["v2"] == [0, mig["uuid"].removeprefix("MIG-")]
    assert bare["v1"] == [0, parent["uuid"].removeprefix("GPU-")]
    env["LD_PRELOAD"] = str(BUILD / "libvgpu.so")
    got = _run(env, PROBE, str(limit + MiB), str(limit - 64 * MiB))
    assert got["total"] == limit
    assert got["allocs"] == [CUDA_ERROR_OUT_OF_MEMORY, 0]


UTIL = """
import json, sys, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByUUID(sys.argv[1])
out = {}
for name, fn in (("utilization", lambda: n.nvmlDeviceGetUtilizationRates(h)),
                 ("process_utilization", lambda: n.nvmlDeviceGetProcessUtilization(h, 0))):
    try:
        fn()
        out[name] = "supported"
    except n.NVMLError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_nvml_samples_no_utilisation_on_a_mig_device(node: dict[str, Any]) -> None:
    """What the monitor relies on to say compute shares are not enforced inside a MIG device:
    NVML's device and per-process utilisation are NOT_SUPPORTED on a MIG device handle (nvml.h:
    "On MIG-enabled GPUs, querying ... utilization is not currently supported")."""
    got = _run(node["env"], UTIL, _migs(node)[0]["uuid"])
    assert got == {"utilization": "Not Supported", "process_utilization": "Not Supported"}


MAKE = """
import json, sys, time
from device_plugin.dynmig import DynamicMig
from nodecore import mig
from vgpu import nvml, scheduling as sc
from vgpu.paths import Paths
from vgpu_scheduler import mig as smig
nvml.init(attempts=1)
[g] = [g for g in nvml.inventory() if g.uuid == sys.argv[2]]
dm = DynamicMig(Paths(sys.argv[1]), [g])
inv = dm.inventory()[g.uuid]
p = smig.smallest(inv, int(sys.argv[3]), 0)
taken = smig.taken_slices(inv, 0)
start = smig.place(inv, p, taken) if p else None
if start is None:
    print(json.dumps({"skip": "no free placement of the smallest profile"}))
    raise SystemExit(0)
a = sc.MigAssignment(profile=p.name, id=p.id, start=start, size=p.memory_slices, slices=p.slices)
dev = dm.ensure(g.uuid, a, "test-pod", "main")
again = dm.ensure(g.uuid, a, "test-pod", "main")
made = {"uuid": dev.uuid, "again": again.uuid, "memory": dev.memory_total, "profile": p.name,
        "listed": [d.uuid for d in mig.discover([g]).devices]}
made["reaped"] = dm.reap(set(), time.time() + 1)
made["after"] = [d.uuid for d in mig.discover([g]).devices]
print(json.dumps(made))
"""


def test_dynamic_mig_makes_and_destroys_an_instance(node: dict[str, Any], tmp_path: Path) -> None:
    """The device plugin's dynamic MIG on the hardware: the smallest profile holding 10 GiB made
    at a free placement (GPU instance and compute instance), found again rather than made twice,
    listed as a MIG device, and destroyed when its pod is gone."""
    if not ON_SIM and os.environ.get("VGPU_GPU_MIG_CREATE") != "1":
        pytest.skip("changes the GPU's MIG layout for a moment: set VGPU_GPU_MIG_CREATE=1 to run it")
    if not ON_SIM and os.geteuid() != 0:
        pytest.skip("creating MIG instances needs root")
    gpu = next(g for g in node["gpus"] if g["mode"] == 1)
    got = _run(node["env"], MAKE, str(tmp_path / "state"), gpu["uuid"], str(10 * 1024 * MiB))
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["uuid"].startswith("MIG-") and got["again"] == got["uuid"]
    assert got["uuid"] in got["listed"] and got["memory"] >= 10 * 1024 * MiB
    assert got["reaped"] == [got["uuid"]] and got["uuid"] not in got["after"]
