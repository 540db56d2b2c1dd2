"""The simulator's unified memory and memory-bound kernels: managed pages populated on first touch,
advice and prefetches, host-located VMM handles, and the kernel "touch" whose run time is the
bytes it reads over where they live (device memory at the device's bandwidth, host memory at the
host link's). Judged by the simulator's own count (`fakegpu-ctl dump`) and executed time."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import py

pytestmark = pytest.mark.timeout(120)

GiB = 1 << 30
MB = 10**6

UM = """
import subprocess
from ctypes import byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p, sizeof, Structure, POINTER, c_ubyte, c_ushort
class Loc(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]
class Prop(Structure):
    _fields_ = [("type", c_int), ("handleTypes", c_int), ("loc", Loc), ("win32", c_void_p),
                ("compression", c_ubyte), ("rdma", c_ubyte), ("usage", c_ushort), ("reserved", c_ubyte * 4)]
cu.cuMemAdvise_v2.argtypes = [c_ulonglong, c_size_t, c_int, Loc]
cu.cuMemPrefetchAsync_v2.argtypes = [c_ulonglong, c_size_t, Loc, c_uint, c_void_p]
def me():
    st = json.loads(subprocess.check_output([CTL, "dump"]))
    return [q for q in st["processes"] if q["pid"] == os.getpid()][0]["devices"][0]
def managed(n):
    p = c_ulonglong()
    ck(cu.cuMemAllocManaged(byref(p), c_size_t(n), 1), "managed")
    return p.value
def touch_fn():
    m, f = c_void_p(), c_void_p()
    ptx = (b".version 7.0\\n.target sm_70\\n.address_size 64\\n"
           b".visible .entry touch(.param .u64 p, .param .u64 n)\\n{\\n ret;\\n}\\n")
    ck(cu.cuModuleLoadData(byref(m), ptx), "module")
    ck(cu.cuModuleGetFunction(byref(f), m, b"touch"), "touch")
    return f
def touch(f, ptr, n):
    a, b = c_ulonglong(ptr), c_ulonglong(n)
    args = (c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    return cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, None, args, None)
def timed_touch(f, ptr, n):
    before = me()["exec_ns"]
    rc = touch(f, ptr, n)
    ck(cu.cuCtxSynchronize(), "sync")
    return rc, me()["exec_ns"] - before
"""


def _gpu(tmp: Path, build_dir: Path, **kw: object) -> FakeGPU:
    return FakeGPU(tmp / "node", build_dir, gpus=1, context_overhead=0, **kw)


def test_managed_memory_is_populated_on_first_touch_where_it_fits(tmp_path: Path, build_dir: Path) -> None:
    gpu = _gpu(tmp_path, build_dir, memory=2 * GiB)
    try:
        out = py(
            gpu,
            f"CTL = {gpu.ctl_path!r}",
            UM,
            """
            ctx(0)
            rc, held = alloc(1 << 30)
            p = managed(3 << 29)
            res = {"after_alloc": me(), "free_after_alloc": meminfo()[0]}
            f = touch_fn()
            res["touch"] = touch(f, p, 3 << 29)
            ck(cu.cuCtxSynchronize(), "sync")
            res["after_touch"] = me()
            res["plain_oom"] = alloc(1 << 20)[0]
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            res["nvml"] = [q.usedGpuMemory for q in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            ck(cu.cuMemFree_v2(c_ulonglong(p)), "free")
            res["after_free"] = me()
            print(json.dumps(res))
            """,
        )
    finally:
        gpu.close()
    a = out["after_alloc"]
    assert (a["allocated"], a["managed_device"], a["managed_host"]) == (GiB, 0, 3 << 29)  # nothing resident yet
    assert out["free_after_alloc"] == GiB
    t = out["after_touch"]
    assert out["touch"] == 0
    assert (t["managed_device"], t["managed_host"]) == (GiB, (3 << 29) - GiB)  # what was free, the rest in host
    assert out["plain_oom"] == 2 and out["nvml"] == [2 * GiB]
    assert (out["after_free"]["managed_device"], out["after_free"]["managed_host"]) == (0, 0)


def test_advice_and_prefetch_decide_where_managed_memory_lives(tmp_path: Path, build_dir: Path) -> None:
    # round figures: device memory at 100 GB/s, the host link at 1 GB/s
    gpu = _gpu(tmp_path, build_dir, memory=2 * GiB, memory_bandwidth=100 * 10**9, host_link_bandwidth=10**9)
    n = 100 * MB
    try:
        out = py(
            gpu,
            f"CTL = {gpu.ctl_path!r}\nN = {n}",
            UM,
            """
            ctx(0)
            f = touch_fn()
            res = {}
            rc, d = alloc(N)
            res["device"] = timed_touch(f, d, N)
            h = managed(N)
            res["advise_host"] = cu.cuMemAdvise_v2(h, N, 3, Loc(2, 0))   # preferred location: host
            res["advise_acc"] = cu.cuMemAdvise_v2(h, N, 5, Loc(1, 0))    # accessed by device 0
            res["host"] = timed_touch(f, h, N)
            res["host_after"] = me()
            res["prefetch"] = cu.cuMemPrefetchAsync_v2(h, N, Loc(1, 0), 0, None)
            res["prefetched"] = me()
            res["host_prefetched"] = timed_touch(f, h, N)
            res["back"] = cu.cuMemPrefetchAsync_v2(h, N, Loc(2, 0), 0, None)
            res["back_after"] = me()
            r = managed(N)
            cu.cuMemAdvise_v2(r, N, 3, Loc(2, 0))
            res["read_mostly"] = cu.cuMemAdvise_v2(r, N, 1, Loc(1, 0))
            res["rm_touch"] = timed_touch(f, r, N)
            res["rm_after"] = me()
            res["advise_plain"] = cu.cuMemAdvise_v2(d, N, 3, Loc(2, 0))   # not managed memory
            res["outside"] = touch(f, d + N, 1)
            print(json.dumps(res))
            """,
        )
    finally:
        gpu.close()
    assert out["device"][0] == 0 and out["device"][1] == pytest.approx(1_000_000, rel=0.01)  # 100 MB / 100 GB/s
    assert out["advise_host"] == 0 and out["advise_acc"] == 0
    assert out["host"][0] == 0 and out["host"][1] == pytest.approx(100_000_000, rel=0.01)  # 100 MB / 1 GB/s
    assert (out["host_after"]["managed_device"], out["host_after"]["managed_host"]) == (0, n)  # never migrated
    assert out["prefetch"] == 0 and out["prefetched"]["managed_device"] == n  # a prefetch overrides the preference
    assert out["host_prefetched"][1] == pytest.approx(1_000_000, rel=0.01)
    assert out["back"] == 0 and (out["back_after"]["managed_device"], out["back_after"]["managed_host"]) == (0, n)
    # read-mostly: a read-only copy on the device although the host is preferred
    assert out["read_mostly"] == 0 and out["rm_after"]["managed_device"] == n
    assert out["rm_after"]["managed_host"] == 2 * n
    assert out["advise_plain"] == 1  # CUDA_ERROR_INVALID_VALUE
    assert out["outside"] == 1


def test_host_numa_vmm_handles_are_host_memory(tmp_path: Path, build_dir: Path) -> None:
    gpu = _gpu(tmp_path, build_dir, memory=2 * GiB, memory_bandwidth=100 * 10**9, host_link_bandwidth=10**9)
    try:
        out = py(
            gpu,
            f"CTL = {gpu.ctl_path!r}",
            UM,
            """
            ctx(0)
            f = touch_fn()
            res = {}
            v = c_int()
            cu.cuDeviceGetAttribute(byref(v), 141, 0)
            res["supported"] = v.value
            cu.cuDeviceGetAttribute(byref(v), 134, 0)
            res["numa"] = v.value
            N = 4 << 30  # twice the device: host memory is not the device's
            prop = Prop(1, 0, Loc(3, res["numa"]))
            h = c_ulonglong()
            res["create"] = cu.cuMemCreate(byref(h), c_size_t(N), byref(prop), c_ulonglong(0))
            res["used"] = me()["used"]
            va = c_ulonglong()
            ck(cu.cuMemAddressReserve(byref(va), c_size_t(N), c_size_t(0), c_ulonglong(0), c_ulonglong(0)), "reserve")
            ck(cu.cuMemMap(va, c_size_t(N), c_size_t(0), h, c_ulonglong(0)), "map")
            desc = (c_int * 3)(1, 0, 3)
            res["access"] = cu.cuMemSetAccess(va, c_size_t(N), desc, c_size_t(1))
            res["touch"] = timed_touch(f, va.value, 100 * 1000 * 1000)
            print(json.dumps(res))
            """,
        )
    finally:
        gpu.close()
    assert out["supported"] == 1 and out["numa"] == 0
    assert out["create"] == 0 and out["used"] == 0 and out["access"] == 0
    assert out["touch"][0] == 0 and out["touch"][1] == pytest.approx(100_000_000, rel=0.01)
