"""The simulated GPU's MIG: profiles, placements and instance IDs as NVIDIA documents them, MIG
devices through NVML (pynvml) and CUDA, their memory judged by the simulator's own count, what
NVML does not offer on them, and who may see them (docs/developers/simulators.md "MIG")."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from sim.fakegpu.mig import cap_minor, mig_minors_text, product, write_mig_files

GIB = 1 << 30


def gonvlib_gb(total_bytes: int, mem_mib: int) -> int:
    """go-nvlib pkg/nvlib/device/mig_profile.go getMigMemorySizeGB: the `NNgb` of a profile name."""
    frac = math.ceil(mem_mib * (1 << 20) / total_bytes * 8) / 8
    total_gb = (total_bytes + GIB - 1) // GIB
    return math.floor(frac * total_gb + 0.5)  # math.Round: half away from zero


def py(gpu: FakeGPU, code: str, env: dict[str, str] | None = None) -> dict:
    """Runs code (which prints one JSON value) against the simulated node; returns the value."""
    r = gpu.run([sys.executable, "-c", textwrap.dedent(code)], env={**gpu.env, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


PROFILES = """
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
total = n.nvmlDeviceGetMemoryInfo(h).total
rows = []
for i in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
    try:
        p = n.nvmlDeviceGetGpuInstanceProfileInfo(h, i)
    except n.NVMLError_NotSupported:
        continue
    pl = (n.c_nvmlGpuInstancePlacement_t * 8)()
    c = n.c_uint(8)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, p.id, pl, n.byref(c))
    rows.append(dict(index=i, id=p.id, name=p.name, mib=p.memorySizeMB, sm=p.multiprocessorCount,
                     slices=p.sliceCount, count=p.instanceCount, ce=p.copyEngineCount, dec=p.decoderCount,
                     jpeg=p.jpegCount, ofa=p.ofaCount,
                     placements=[(pl[k].start, pl[k].size) for k in range(c.value)]))
print(json.dumps(dict(total=total, rows=rows)))
"""

LGIPP = {  # MIG user guide, `nvidia-smi mig -lgipp`: profile ID -> {starts}:size
    19: [(s, 1) for s in range(7)],
    20: [(s, 1) for s in range(7)],
    15: [(0, 2), (2, 2), (4, 2), (6, 2)],
    14: [(0, 2), (2, 2), (4, 2)],
    9: [(0, 4), (4, 4)],
    5: [(0, 4)],
    0: [(0, 8)],
}


@pytest.mark.parametrize(
    ("key", "names", "sms"),
    [
        (
            "a100-40gb",
            ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb", "1g.5gb+me", "1g.10gb"],
            [14, 28, 42, 56, 98, 14, 14],
        ),
        (
            "h100-80gb",
            ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.10gb+me", "1g.20gb"],
            [16, 32, 60, 64, 132, 16, 26],
        ),
        (
            "h200-141gb",
            ["1g.18gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb", "1g.18gb+me", "1g.35gb"],
            [16, 32, 60, 64, 132, 16, 26],
        ),
    ],
)
def test_profile_tables(key: str, names: list[str], sms: list[int], fakegpu: FakeGPU) -> None:
    """Each product's GPU instance profiles as NVML reports them: the names go-nvlib derives from
    their memory (the profile names of the MIG user guide's tables), the profile IDs, counts and
    SMs of `nvidia-smi mig -lgip`, and the placements of `-lgipp`."""
    fakegpu.configure([product(key, mig_mode=1)])
    out = py(fakegpu, PROFILES)
    got = []
    for r in out["rows"]:
        gb = gonvlib_gb(out["total"], r["mib"])
        suffix = "+me" if r["index"] == 7 else ""  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: go-nvlib's "+me"
        got.append(f"{r['slices']}g.{gb}gb{suffix}")
        assert r["name"] == f"MIG {got[-1]}"  # the -lgip "Name" column
        assert [tuple(p) for p in r["placements"]] == LGIPP[r["id"]]
    assert got == names
    assert [r["sm"] for r in out["rows"]] == sms
    ids = {r["index"]: r["id"] for r in out["rows"]}
    assert ids == {0: 19, 1: 14, 2: 9, 3: 5, 4: 0, 7: 20, 9: 15}
    counts = {r["id"]: r["count"] for r in out["rows"]}
    assert counts == {19: 7, 14: 3, 9: 2, 5: 1, 0: 1, 20: 1, 15: 4}


@pytest.mark.parametrize(
    ("order", "expect"),
    [
        # MIG user guide, "Creating GPU Instances" (A100): -cgi 9,19,14,19
        (["9", "19", "14", "19"], [(2, 4, 4), (7, 0, 1), (4, 2, 2), (8, 1, 1)]),
        # -cgi 14,19,19,19,19,19
        (["14", "19", "19", "19", "19", "19"], [(5, 4, 2), (13, 6, 1), (7, 0, 1), (8, 1, 1), (9, 2, 1), (10, 3, 1)]),
        # nvidia-smi mig -cgi 19,14,5
        (["19", "14", "5"], [(13, 6, 1), (5, 4, 2), (1, 0, 4)]),
    ],
)
def test_driver_placements_and_instance_ids(
    order: list[str], expect: list[tuple[int, int, int]], fakegpu: FakeGPU
) -> None:
    """Without a placement the driver chooses one; the simulator's choice and GPU instance IDs give
    exactly those of the MIG user guide's examples."""
    fakegpu.configure([product("a100-40gb", mig_mode=1)])
    got = [(r["gi"], r["start"], r["size"]) for p in order for r in fakegpu.mig_create(0, p)]
    assert got == expect


def test_insufficient_resources_as_in_the_guide(fakegpu: FakeGPU) -> None:
    """`nvidia-smi mig -cgi 19,19,14,9`: GI 13, 11, 3, then "Unable to create a GPU instance on GPU 0
    using profile 9: Insufficient Resources"."""
    fakegpu.configure([product("a100-40gb", mig_mode=1)])
    assert [r["gi"] for p in ("19", "19", "14") for r in fakegpu.mig_create(0, p)] == [13, 11, 3]
    with pytest.raises(RuntimeError, match="profile 9: Insufficient Resources"):
        fakegpu.mig_create(0, "9")
    with pytest.raises(RuntimeError, match="Insufficient Resources"):
        fakegpu.mig_create(0, "1g.5gb", start=6)  # taken
    with pytest.raises(RuntimeError, match="Invalid Argument"):
        fakegpu.mig_create(0, "2g.10gb", start=1)  # not a placement of the profile


COMPUTE = """
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
gi = n.nvmlDeviceCreateGpuInstance(h, 9)
prof = []
for j in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
    try:
        p = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, j, 0)
    except n.NVMLError_NotSupported:
        continue
    prof.append([p.id, p.name, p.instanceCount, p.multiprocessorCount, p.sliceCount])
cis = [n.nvmlGpuInstanceCreateComputeInstance(gi, 0) for _ in range(3)]
ids = [n.nvmlComputeInstanceGetInfo(c).id for c in cis]
try:
    n.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    extra = "created"
except n.NVMLError as e:
    extra = str(e)
try:
    n.nvmlGpuInstanceDestroy(gi)
    gone = "destroyed"
except n.NVMLError as e:
    gone = str(e)
migs = []
for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
    try:
        m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
    except n.NVMLError_NotFound:
        continue
    a = n.nvmlDeviceGetAttributes(m)
    migs.append([n.nvmlDeviceGetName(m), n.nvmlDeviceGetComputeInstanceId(m), a.multiprocessorCount,
                 a.gpuInstanceSliceCount, a.computeInstanceSliceCount, a.memorySizeMB])
print(json.dumps(dict(prof=prof, ids=ids, extra=extra, gone=gone, migs=migs)))
"""


def test_compute_instances(fakegpu: FakeGPU) -> None:
    """A 3g.20gb GPU instance's compute instance profiles as `nvidia-smi mig -lcip` lists them
    (1c x3 14 SMs, 2c x1 28, 3g x1 42), three 1c compute instances (IDs 0, 1, 2, as `-cci 0,0,0`),
    a fourth refused, and the GPU instance not destroyed while they exist."""
    fakegpu.configure([product("a100-40gb", mig_mode=1)])
    out = py(fakegpu, COMPUTE)
    assert out["prof"] == [
        [0, "MIG 1c.3g.20gb", 3, 14, 1],
        [1, "MIG 2c.3g.20gb", 1, 28, 2],
        [2, "MIG 3g.20gb", 1, 42, 3],
    ]
    assert out["ids"] == [0, 1, 2]
    assert out["extra"] == "Insufficient Resources"
    assert out["gone"] == "In use by another client"
    assert out["migs"] == [["NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", ci, 14, 3, 1, 19968] for ci in range(3)]


CUDA = """
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
n = ctypes.c_int()
cu.cuDeviceGetCount(ctypes.byref(n))
out = []
for i in range(n.value):
    d = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(d), i)
    name = ctypes.create_string_buffer(128)
    cu.cuDeviceGetName(name, 128, d)
    u1, u2 = (ctypes.c_ubyte * 16)(), (ctypes.c_ubyte * 16)()
    cu.cuDeviceGetUuid(u1, d)
    cu.cuDeviceGetUuid_v2(u2, d)
    mem = ctypes.c_size_t()
    cu.cuDeviceTotalMem_v2(ctypes.byref(mem), d)
    out.append([name.value.decode(), bytes(u1).hex(), bytes(u2).hex(), mem.value])
print(json.dumps(out))
"""


def hexid(uuid: str) -> str:
    return uuid.split("-", 1)[1].replace("-", "")


def test_cuda_enumerates_mig_devices(fakegpu: FakeGPU) -> None:
    """CUDA sees a GPU in MIG mode as one MIG device per GPU instance ("If CUDA_VISIBLE_DEVICES is
    not set, CUDA will pick one from each GPU instance"), `CUDA_VISIBLE_DEVICES=MIG-<uuid>` selects
    one; cuDeviceGetUuid_v2 gives the MIG UUID (cuda.h), the device memory is the instance's."""
    fakegpu.configure([product("h200-141gb", mig_mode=1), product("h100-80gb")])
    made = fakegpu.mig_create(0, "3g.71gb", "1g.18gb")
    devs = {d["uuid"]: d for d in fakegpu.mig_devices()}
    out = py(fakegpu, CUDA)
    assert [o[0] for o in out] == ["NVIDIA H200 MIG 3g.71gb", "NVIDIA H200 MIG 1g.18gb", "NVIDIA H100 80GB HBM3"]
    assert [o[2] for o in out] == [hexid(made[0]["uuid"]), hexid(made[1]["uuid"]), hexid(fakegpu.uuids[1])]
    assert out[0][1] == hexid(fakegpu.uuids[0])  # the old entry point: the GPU's UUID
    assert [o[3] for o in out] == [71680 << 20, 16384 << 20, 81559 << 20]
    one = py(fakegpu, CUDA, env={"CUDA_VISIBLE_DEVICES": made[1]["uuid"]})
    assert [o[2] for o in one] == [hexid(made[1]["uuid"])] and devs[made[1]["uuid"]]["memory"] == 16384 << 20


def test_memory_of_a_mig_device_is_its_instance(fakegpu: FakeGPU) -> None:
    """An allocation past a 1g.18gb instance's memory is out of memory although the GPU has 140 GiB
    free; the simulator's own count shows what the instance holds."""
    fakegpu.configure([product("h200-141gb", mig_mode=1, context_overhead=0)])
    small, big = fakegpu.mig_create(0, "1g.18gb", "3g.71gb")
    env = {**fakegpu.env, "CUDA_VISIBLE_DEVICES": small["uuid"]}
    over = fakegpu.run([fakegpu.burn, "--alloc", "17g"], env=env)
    assert over.returncode == 3, over.stdout + over.stderr
    hold = fakegpu.popen([fakegpu.burn, "--alloc", "15g", "--hold", "30"], env=env, stdout=-1, text=True)
    line = json.loads(hold.stdout.readline())
    assert line["alloc_result"] == 0 and line["mem_total"] == 16384 << 20
    used = {d["uuid"]: d["used"] for d in fakegpu.mig_devices()}
    assert used[small["uuid"]] == 15 * GIB and used[big["uuid"]] == 0
    again = fakegpu.run([fakegpu.burn, "--alloc", "2g"], env=env)
    assert again.returncode == 3  # 15 + 2 > 16 GiB
    hold.kill()


NVML_MIG = """
import json, os, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
def call(f, *a):
    try:
        return f(*a)
    except n.NVMLError as e:
        return str(e)
m = n.nvmlDeviceGetHandleByUUID(os.environ["MIG"])
def procs(d):
    rows = n.nvmlDeviceGetComputeRunningProcesses(d)
    return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in rows]
mem = lambda d: n.nvmlDeviceGetMemoryInfo(d)
print(json.dumps(dict(
    util_parent=call(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
    util_mig=call(lambda: n.nvmlDeviceGetUtilizationRates(m).gpu),
    putil_parent=call(n.nvmlDeviceGetProcessUtilization, h, 0),
    putil_mig=call(n.nvmlDeviceGetProcessUtilization, m, 0),
    procs_parent=procs(h), procs_mig=procs(m),
    mem_parent=mem(h).used, mem_mig=[mem(m).total, mem(m).used],
    is_mig=[n.nvmlDeviceIsMigDeviceHandle(h).value, n.nvmlDeviceIsMigDeviceHandle(m).value],
    parent=n.nvmlDeviceGetUUID(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),
    mode_mig=call(n.nvmlDeviceGetMigMode, m),
    events_mig=call(n.nvmlDeviceRegisterEvents, m, n.nvmlEventTypeXidCriticalError, n.nvmlEventSetCreate()),
    count=n.nvmlDeviceGetCount())))
"""


def test_what_nvml_offers_on_mig_devices(fakegpu: FakeGPU) -> None:
    """nvml.h: utilization rates and process utilization are not supported on MIG-enabled GPUs
    (GPU or MIG device handle), events not per MIG device; processes and memory are, per MIG
    device, and aggregated on the GPU's handle with their GPU and compute instance IDs."""
    fakegpu.configure([product("h200-141gb", mig_mode=1, context_overhead=0)])
    a, b = fakegpu.mig_create(0, "2g.35gb", "2g.35gb")
    hold = fakegpu.popen(
        [fakegpu.burn, "--alloc", "1g", "--hold", "30"],
        env={**fakegpu.env, "CUDA_VISIBLE_DEVICES": b["uuid"]},
        stdout=-1,
        text=True,
    )
    assert json.loads(hold.stdout.readline())["alloc_result"] == 0
    out = py(fakegpu, NVML_MIG, env={"MIG": b["uuid"]})
    assert out["util_parent"] == out["util_mig"] == out["putil_parent"] == out["putil_mig"] == "Not Supported"
    assert out["procs_parent"] == out["procs_mig"] == [[hold.pid, GIB, b["gi"], b["ci"]]]
    assert out["mem_parent"] == GIB and out["mem_mig"] == [33280 << 20, GIB]
    assert out["is_mig"] == [0, 1] and out["parent"] == fakegpu.uuids[0]
    assert out["mode_mig"] == out["events_mig"] == "Not Supported"
    assert out["count"] == 1
    with pytest.raises(RuntimeError, match="In use by another client"):
        fakegpu.mig_destroy(0, b["gi"])
    hold.kill()
    hold.wait()
    fakegpu.mig_destroy(0, b["gi"])
    again = fakegpu.mig_create(0, "2g.35gb", start=b["start"])[0]
    assert (again["gi"], again["ci"]) == (b["gi"], b["ci"]) and again["uuid"] not in (a["uuid"], b["uuid"])


VISIBLE = """
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
migs = []
for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
    try:
        migs.append(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)))
    except n.NVMLError_NotFound:
        pass
print(json.dumps(dict(count=n.nvmlDeviceGetCount(), migs=migs)))
"""


def test_who_sees_a_mig_device(fakegpu: FakeGPU, tmp_path: Path) -> None:
    """A process sees the MIG devices whose capabilities it has: by MIG UUID, or (the toolkit's way)
    through `/dev/nvidia<minor>` and the two `/dev/nvidia-caps/nvidia-cap<N>` nodes of the device."""
    fakegpu.configure([product("h200-141gb", mig_mode=1)])
    a, b, c = fakegpu.mig_create(0, "3g.71gb", "2g.35gb", "1g.18gb")
    assert py(fakegpu, VISIBLE)["migs"] == [d["uuid"] for d in sorted((a, b, c), key=lambda d: d["gi"])]
    assert py(fakegpu, VISIBLE, env={"FAKEGPU_VISIBLE_DEVICES": b["uuid"]}) == {"count": 1, "migs": [b["uuid"]]}
    assert py(fakegpu, VISIBLE, env={"FAKEGPU_VISIBLE_DEVICES": fakegpu.uuids[0]})["migs"] == []
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    (dev / "nvidia0").touch()
    for minor in (cap_minor(0, c["gi"]), cap_minor(0, c["gi"], c["ci"]), cap_minor(0, a["gi"])):
        (dev / "nvidia-caps" / f"nvidia-cap{minor}").touch()
    assert py(fakegpu, VISIBLE, env={"FAKEGPU_VISIBLE_DEVICES": str(dev)})["migs"] == [c["uuid"]]
    cuda = py(fakegpu, CUDA, env={"FAKEGPU_VISIBLE_DEVICES": str(dev)})
    assert [o[2] for o in cuda] == [hexid(c["uuid"])]


def test_capability_files(fakegpu: FakeGPU, tmp_path: Path) -> None:
    """The driver's files the toolkit and NVIDIA's device plugin read: mig-minors with every
    possible capability (the guide's first and last lines), and the capability files and device
    nodes of the instances that exist, replaced when they change."""
    text = mig_minors_text()
    assert text.startswith("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n")
    assert text.endswith("gpu31/gi14/ci6/access 4321\ngpu31/gi14/ci7/access 4322\n")
    fakegpu.configure([product("h200-141gb", mig_mode=1)])
    (x,) = fakegpu.mig_create(0, "7g.141gb")
    write_mig_files(tmp_path, fakegpu.state())
    access = tmp_path / f"proc/driver/nvidia/capabilities/gpu0/mig/gi{x['gi']}/ci0/access"
    assert access.read_text().startswith(f"DeviceFileMinor: {cap_minor(0, x['gi'], 0)}\n")
    assert sorted(p.name for p in (tmp_path / "dev/nvidia-caps").iterdir()) == [
        "nvidia-cap1",
        "nvidia-cap2",
        f"nvidia-cap{cap_minor(0, 0)}",
        f"nvidia-cap{cap_minor(0, 0, 0)}",
    ]
    fakegpu.mig_destroy(0)
    write_mig_files(tmp_path, fakegpu.state())
    assert not access.exists()


def test_mig_mode(fakegpu: FakeGPU) -> None:
    """MIG mode: applied at once on an idle GPU (Hopper needs no reset), pending while a process
    uses the GPU; a GPU without MIG support answers NOT_SUPPORTED; instances need MIG mode."""
    fakegpu.configure([product("h100-80gb"), {"mig_profiles": "none"}])
    with pytest.raises(RuntimeError, match="Not Supported"):
        fakegpu.mig_create(0, "1g.10gb")
    hold = fakegpu.popen([fakegpu.burn, "--device", "0", "--hold", "30"], stdout=-1, text=True)
    hold.stdout.readline()
    assert fakegpu.mig_mode(0, True) == "pending: In use by another client"
    st = fakegpu.state()["mig"][0]
    assert (st["mode"], st["pending"]) == (0, 1)
    hold.kill()
    hold.wait()
    assert fakegpu.mig_mode(0, True) == ""
    assert fakegpu.state()["mig"][0]["mode"] == 1
    with pytest.raises(RuntimeError, match="Not Supported"):
        fakegpu.mig_mode(1, True)
    out = py(
        fakegpu,
        """
        import json, pynvml as n
        n.nvmlInit()
        try:
            n.nvmlDeviceGetMigMode(n.nvmlDeviceGetHandleByIndex(1)); r = "supported"
        except n.NVMLError as e:
            r = str(e)
        print(json.dumps(r))
    """,
    )
    assert out == "Not Supported"


def test_xid_attributed_to_a_mig_device(fakegpu: FakeGPU) -> None:
    """An XID event of a MIG instance reaches a set registered on the GPU with its GPU and compute
    instance IDs (NVIDIA's device plugin marks that MIG device unhealthy); one of the whole GPU
    has 0xFFFFFFFF."""
    fakegpu.configure([product("h200-141gb", mig_mode=1)])
    (x,) = fakegpu.mig_create(0, "1g.18gb")
    waiter = fakegpu.popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import json, sys, pynvml as n
        n.nvmlInit()
        s = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(0), n.nvmlEventTypeXidCriticalError, s)
        print("ready", flush=True)
        for _ in range(2):
            e = n.nvmlEventSetWait_v2(s, 10000)
            print(json.dumps([e.eventData, e.gpuInstanceId, e.computeInstanceId]), flush=True)
    """),
        ],
        stdout=-1,
        text=True,
    )
    assert waiter.stdout.readline().strip() == "ready"
    fakegpu.inject_mig_xid(0, 48, x["gi"], x["ci"])
    fakegpu.inject_xid(0, 79)
    assert json.loads(waiter.stdout.readline()) == [48, x["gi"], x["ci"]]
    assert json.loads(waiter.stdout.readline()) == [79, 0xFFFFFFFF, 0xFFFFFFFF]
