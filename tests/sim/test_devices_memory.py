"""The simulated node's devices and memory, seen through pynvml and the driver API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import popen_py, py, read_json_line

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
GiB = 1 << 30


def test_pynvml_reads_the_configured_devices(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=3, memory=8 * GiB, numa_node=1, name="NVIDIA Test 8GB")
    try:
        out = py(
            gpu,
            """
            import pynvml
            pynvml.nvmlInit()
            devs = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                pci = pynvml.nvmlDeviceGetPciInfo(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                mem2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                same = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                by_bus = pynvml.nvmlDeviceGetHandleByPciBusId(pci.busId)
                devs.append(dict(
                    uuid=uuid, name=pynvml.nvmlDeviceGetName(h), index=pynvml.nvmlDeviceGetIndex(h),
                    bus=pci.busId, total=mem.total, used=mem.used, total2=mem2.total, free2=mem2.free,
                    numa=pynvml.nvmlDeviceGetNumaNodeId(h),
                    by_uuid=pynvml.nvmlDeviceGetIndex(same), by_bus=pynvml.nvmlDeviceGetIndex(by_bus),
                    procs=len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
                ))
            try:
                pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
                missing = "found"
            except pynvml.NVMLError_NotFound:
                missing = "not found"
            print(json.dumps(dict(driver=pynvml.nvmlSystemGetDriverVersion(), devs=devs, missing=missing)))
            pynvml.nvmlShutdown()
            """,
        )
    finally:
        gpu.close()
    assert out["missing"] == "not found"
    assert out["driver"]
    assert [d["uuid"] for d in out["devs"]] == gpu.uuids
    for i, d in enumerate(out["devs"]):
        assert d["name"] == "NVIDIA Test 8GB"
        assert d["index"] == d["by_uuid"] == d["by_bus"] == i
        assert d["bus"] == f"00000000:{0x10 + i:02X}:00.0"
        assert d["total"] == d["total2"] == d["free2"] == 8 * GiB
        assert d["used"] == 0
        assert d["numa"] == 1
        assert d["procs"] == 0


def test_the_issue_one_liner_prints_the_count(fakegpu: FakeGPU) -> None:
    code = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    proc = fakegpu.run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2"


def test_two_processes_see_each_others_memory(tmp_path: Path, build_dir: Path) -> None:
    overhead = 100 * MiB
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, memory=16 * GiB, context_overhead=overhead)
    try:
        a = gpu.popen([gpu.burn, "--alloc", str(4 * GiB), "--hold", "60"], stdout=subprocess.PIPE, text=True)
        ra = read_json_line(a)
        assert ra["alloc_result"] == 0
        assert ra["mem_total"] == 16 * GiB
        assert ra["mem_free"] == 16 * GiB - 4 * GiB - overhead
        b = gpu.popen([gpu.burn, "--alloc", str(2 * GiB), "--hold", "60"], stdout=subprocess.PIPE, text=True)
        rb = read_json_line(b)
        assert rb["alloc_result"] == 0
        # B sees A's allocation and context besides its own
        assert rb["mem_free"] == 16 * GiB - 6 * GiB - 2 * overhead
        # and A sees B's, through cuMemGetInfo in another process
        seen = py(gpu, "ctx(0); print(json.dumps(meminfo()))")
        assert seen[0] == 16 * GiB - 6 * GiB - 3 * overhead
        procs = py(
            gpu,
            """
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            ps = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
            print(json.dumps(dict(procs={p.pid: p.usedGpuMemory for p in ps}, used=m.used, free=m.free)))
            """,
        )
        assert procs["procs"] == {str(a.pid): 4 * GiB + overhead, str(b.pid): 2 * GiB + overhead}
        assert procs["used"] == 6 * GiB + 2 * overhead
        assert procs["free"] == 16 * GiB - procs["used"]
        st = gpu.state()
        mine = {p["pid"]: p["devices"][0] for p in st["processes"]}
        assert mine[a.pid]["allocated"] == 4 * GiB and mine[a.pid]["contexts"] == 1
        assert mine[b.pid]["allocated"] == 2 * GiB
        assert st["devices"][0]["used"] == 6 * GiB + 2 * overhead
    finally:
        gpu.close()


def test_physical_exhaustion_is_out_of_memory(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, memory=16 * GiB, context_overhead=0)
    try:
        big = gpu.run([gpu.burn, "--alloc", str(20 * GiB)])
        assert big.returncode == 3
        assert json.loads(big.stdout)["alloc_result"] == 2  # CUDA_ERROR_OUT_OF_MEMORY
        holder = gpu.popen([gpu.burn, "--alloc", str(10 * GiB), "--hold", "60"], stdout=subprocess.PIPE, text=True)
        assert read_json_line(holder)["alloc_result"] == 0
        second = gpu.run([gpu.burn, "--alloc", str(10 * GiB)])
        out = json.loads(second.stdout)
        assert second.returncode == 3 and out["alloc_result"] == 2
        assert out["mem_free"] == 6 * GiB
        fits = gpu.run([gpu.burn, "--alloc", str(6 * GiB)])
        assert fits.returncode == 0, fits.stdout
    finally:
        gpu.close()


def test_memory_is_released_when_a_process_dies(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, memory=16 * GiB, context_overhead=50 * MiB)
    try:
        p = popen_py(gpu, "ctx(0); rc, ptr = alloc(8 << 30); print(json.dumps(rc)); time.sleep(60)")
        assert read_json_line(p) == 0
        assert gpu.state()["devices"][0]["used"] == 8 * GiB + 50 * MiB
        p.kill()
        p.wait()
        st = gpu.state()
        assert st["devices"][0]["used"] == 0
        assert st["processes"] == []
    finally:
        gpu.close()
