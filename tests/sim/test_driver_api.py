"""The fake driver API: cuGetProcAddress semantics, memory kinds, copies, errors, device order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import py

pytestmark = pytest.mark.timeout(120)

GPA = """
from ctypes import byref, c_int, c_ulonglong, c_void_p, cast
def lookup(name, ver, flags=0):
    p, st = c_void_p(), c_int(-1)
    rc = cu.cuGetProcAddress_v2(name.encode(), byref(p), c_int(ver), c_ulonglong(flags), byref(st))
    return [rc, p.value, st.value]
def addr(sym):
    return cast(getattr(cu, sym), c_void_p).value
"""


def test_get_proc_address_resolves_base_name_version_and_flags(fakegpu: FakeGPU) -> None:
    out = py(
        fakegpu,
        GPA,
        """
        cases = {
            "alloc@3020": (lookup("cuMemAlloc", 3020), "cuMemAlloc_v2"),
            "alloc@12000": (lookup("cuMemAlloc", 12000), "cuMemAlloc_v2"),
            "launch@12000": (lookup("cuLaunchKernel", 12000), "cuLaunchKernel"),
            "launch@12000/1": (lookup("cuLaunchKernel", 12000, 1), "cuLaunchKernel"),
            "launch@12000/2": (lookup("cuLaunchKernel", 12000, 2), "cuLaunchKernel_ptsz"),
            "launch@6050/2": (lookup("cuLaunchKernel", 6050, 2), "cuLaunchKernel"),
            "launchex@11060/2": (lookup("cuLaunchKernelEx", 11060, 2), "cuLaunchKernelEx_ptsz"),
            "coop@9000/2": (lookup("cuLaunchCooperativeKernel", 9000, 2), "cuLaunchCooperativeKernel_ptsz"),
            "htod@12000/2": (lookup("cuMemcpyHtoD", 12000, 2), "cuMemcpyHtoD_v2_ptds"),
            "allocasync@11020/2": (lookup("cuMemAllocAsync", 11020, 2), "cuMemAllocAsync_ptsz"),
            "meminfo@3020/2": (lookup("cuMemGetInfo", 3020, 2), "cuMemGetInfo_v2"),
            "ctx@3020": (lookup("cuCtxCreate", 3020), "cuCtxCreate_v2"),
            "ctx@11040": (lookup("cuCtxCreate", 11040), "cuCtxCreate_v3"),
            "ctx@12000": (lookup("cuCtxCreate", 12000), "cuCtxCreate_v3"),
            "ctx@13000": (lookup("cuCtxCreate", 13000), "cuCtxCreate_v4"),
            "uuid@9020": (lookup("cuDeviceGetUuid", 9020), "cuDeviceGetUuid"),
            "uuid@11040": (lookup("cuDeviceGetUuid", 11040), "cuDeviceGetUuid_v2"),
            "release@11000": (lookup("cuDevicePrimaryCtxRelease", 11000), "cuDevicePrimaryCtxRelease_v2"),
            "sync@2000": (lookup("cuCtxSynchronize", 2000), "cuCtxSynchronize"),
            "sync@13000": (lookup("cuCtxSynchronize", 13000), "cuCtxSynchronize_v2"),
            "gpa@11030": (lookup("cuGetProcAddress", 11030), "cuGetProcAddress"),
            "gpa@12000": (lookup("cuGetProcAddress", 12000), "cuGetProcAddress_v2"),
        }
        res = {k: [v[0], v[1] == addr(sym), v[2]] for k, (v, sym) in cases.items()}
        res["old"] = lookup("cuMemAlloc", 2000)
        res["unknown"] = lookup("cuNoSuchFunction", 13000)
        res["probe"] = lookup("", 0)
        res["badflags"] = lookup("cuMemAlloc", 12000, 4)
        # the pointer handed out for cuGetProcAddress@12000 is a working cuGetProcAddress_v2
        import ctypes
        proto = ctypes.CFUNCTYPE(c_int, ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, c_ulonglong,
                                 ctypes.POINTER(c_int))
        again = proto(lookup("cuGetProcAddress", 12000)[1])
        p, st = c_void_p(), c_int(-1)
        res["via_returned"] = [again(b"cuMemFree", byref(p), 12000, 0, byref(st)), p.value == addr("cuMemFree_v2"),
                               st.value]
        v1 = cu.cuGetProcAddress
        p = c_void_p()
        res["v1"] = [v1(b"cuMemGetInfo", byref(p), c_int(3020), c_ulonglong(0)), p.value == addr("cuMemGetInfo_v2")]
        print(json.dumps(res))
        """,
    )
    for key, (rc, same, status) in ((k, v) for k, v in out.items() if "@" in k):
        assert (rc, same, status) == (0, True, 0), key
    assert out["old"] == [500, None, 2]  # CUDA_ERROR_NOT_FOUND, VERSION_NOT_SUFFICIENT
    assert out["unknown"] == [500, None, 1]  # SYMBOL_NOT_FOUND
    assert out["probe"][0] == 500 and out["probe"][1] is None
    assert out["badflags"][0] == 1  # CUDA_ERROR_INVALID_VALUE
    assert out["via_returned"] == [0, True, 0]
    assert out["v1"] == [0, True]


def test_per_thread_variant_uses_the_per_thread_default_stream(fakegpu: FakeGPU) -> None:
    out = py(
        fakegpu,
        GPA,
        """
        import ctypes
        from ctypes import c_uint
        ctx(0)
        mod, fn = c_void_p(), c_void_p()
        ck(cu.cuModuleLoadData(byref(mod), SPIN_PTX), "load")
        ck(cu.cuModuleGetFunction(byref(fn), mod, b"spin"), "func")
        launch_t = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                                    c_void_p, ctypes.POINTER(c_void_p), c_void_p)
        query_t = ctypes.CFUNCTYPE(c_int, c_void_p)
        launch_ptsz = launch_t(lookup("cuLaunchKernel", 12000, 2)[1])
        query_legacy = query_t(lookup("cuStreamQuery", 12000, 0)[1])
        query_ptsz = query_t(lookup("cuStreamQuery", 12000, 2)[1])
        ns = c_ulonglong(300_000_000)
        params = (c_void_p * 1)(ctypes.cast(byref(ns), c_void_p))
        ck(launch_ptsz(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None), "launch")
        res = {"legacy": query_legacy(None), "ptsz": query_ptsz(None)}
        ck(cu.cuCtxSynchronize(), "sync")
        res["after"] = query_ptsz(None)
        print(json.dumps(res))
        """,
    )
    # stream 0 through the _ptsz entry point is the per-thread default stream, not the legacy one
    assert out == {"legacy": 0, "ptsz": 600, "after": 0}


def test_errors_before_init_and_without_context(fakegpu: FakeGPU) -> None:
    out = py(
        fakegpu,
        """
        res = {"before_init": alloc(1 << 20)[0]}
        n = ctypes.c_int()
        res["count_before"] = cu.cuDeviceGetCount(ctypes.byref(n))
        ck(cu.cuInit(0), "init")
        res["no_ctx"] = alloc(1 << 20)[0]
        res["bad_device"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctypes.c_void_p()), 7)
        res["init_flags"] = cu.cuInit(1)
        ctx(0)
        res["zero"] = alloc(0)[0]
        res["free_unknown"] = cu.cuMemFree_v2(ctypes.c_ulonglong(0x1234))
        s = ctypes.c_char_p()
        cu.cuGetErrorName(2, ctypes.byref(s))
        res["name"] = s.value.decode()
        res["bogus"] = cu.cuGetErrorString(123456, ctypes.byref(s))
        print(json.dumps(res))
        """,
    )
    assert out == {
        "before_init": 3,  # CUDA_ERROR_NOT_INITIALIZED
        "count_before": 3,
        "no_ctx": 201,  # CUDA_ERROR_INVALID_CONTEXT
        "bad_device": 101,  # CUDA_ERROR_INVALID_DEVICE
        "init_flags": 1,
        "zero": 1,
        "free_unknown": 1,
        "name": "CUDA_ERROR_OUT_OF_MEMORY",
        "bogus": 1,
    }


MEMORY_KINDS = """
from ctypes import byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
import subprocess
def used():
    st = json.loads(subprocess.check_output([CTL, "dump"]))
    me = [p for p in st["processes"] if p["pid"] == os.getpid()][0]["devices"][0]
    return me
ctx(0)
MiB = 1 << 20
res = {}
base = used()["allocated"]
# pitch: rows padded to 512 bytes, pitch * height charged
p, pitch = c_ulonglong(), c_size_t()
res["pitch_rc"] = cu.cuMemAllocPitch_v2(byref(p), byref(pitch), c_size_t(1000), c_size_t(10), c_uint(4))
res["pitch"] = pitch.value
res["pitch_charged"] = used()["allocated"] - base
res["pitch_bad_elem"] = cu.cuMemAllocPitch_v2(byref(c_ulonglong()), byref(pitch), c_size_t(8), c_size_t(8), c_uint(3))
ck(cu.cuMemFree_v2(p), "free pitch")
# arrays
class Desc(ctypes.Structure):
    _fields_ = [("Width", c_size_t), ("Height", c_size_t), ("Format", c_int), ("NumChannels", c_uint)]
arr = c_void_p()
res["array_rc"] = cu.cuArrayCreate_v2(byref(arr), byref(Desc(1024, 1024, 0x20, 4)))
res["array_charged"] = used()["allocated"] - base
ck(cu.cuArrayDestroy(arr), "array destroy")
res["array_after"] = used()["allocated"] - base
res["array_bad"] = cu.cuArrayCreate_v2(byref(arr), byref(Desc(16, 16, 0x77, 1)))
# stream-ordered allocation: 2 MiB reservation steps, released at synchronisation
q = c_ulonglong()
ck(cu.cuMemAllocAsync(byref(q), c_size_t(3 * MiB), None), "alloc async")
res["async_charged"] = used()["allocated"] - base
ck(cu.cuMemFreeAsync(q, None), "free async")
res["async_before_sync"] = used()["allocated"] - base
ck(cu.cuStreamSynchronize(None), "sync")
res["async_after_sync"] = used()["allocated"] - base
pool = c_void_p()
ck(cu.cuDeviceGetDefaultMemPool(byref(pool), 0), "default pool")
thr = c_ulonglong(64 * MiB)
ck(cu.cuMemPoolSetAttribute(pool, 4, byref(thr)), "threshold")
ck(cu.cuMemAllocFromPoolAsync(byref(q), c_size_t(8 * MiB), pool, None), "from pool")
ck(cu.cuMemFreeAsync(q, None), "free async 2")
ck(cu.cuCtxSynchronize(), "ctx sync")
reserved = c_ulonglong()
ck(cu.cuMemPoolGetAttribute(pool, 5, byref(reserved)), "reserved")
res["pool_kept"] = [reserved.value, used()["allocated"] - base]
ck(cu.cuMemPoolTrimTo(pool, c_size_t(0)), "trim")
res["pool_trimmed"] = used()["allocated"] - base
# virtual memory management
class Prop(ctypes.Structure):
    _fields_ = [("type", c_int), ("handleTypes", c_int), ("locType", c_int), ("locId", c_int),
                ("win32", c_void_p), ("flags", ctypes.c_ulonglong)]
prop = Prop(1, 0, 1, 0, None, 0)
gran = c_size_t()
ck(cu.cuMemGetAllocationGranularity(byref(gran), byref(prop), 0), "granularity")
h = c_ulonglong()
res["vmm_odd"] = cu.cuMemCreate(byref(h), c_size_t(gran.value + 1), byref(prop), c_ulonglong(0))
ck(cu.cuMemCreate(byref(h), c_size_t(2 * gran.value), byref(prop), c_ulonglong(0)), "create")
res["vmm_charged"] = used()["allocated"] - base
va = c_ulonglong()
ck(cu.cuMemAddressReserve(byref(va), c_size_t(2 * gran.value), c_size_t(0), c_ulonglong(0), c_ulonglong(0)), "reserve")
ck(cu.cuMemMap(va, c_size_t(2 * gran.value), c_size_t(0), h, c_ulonglong(0)), "map")
access = (c_int * 3)(1, 0, 3)
ck(cu.cuMemSetAccess(va, c_size_t(2 * gran.value), access, c_size_t(1)), "access")
data = ctypes.create_string_buffer(b"vmm-bytes", 16)
ck(cu.cuMemcpyHtoD_v2(va, data, c_size_t(16)), "htod vmm")
ck(cu.cuMemRelease(h), "release")
res["vmm_mapped_after_release"] = used()["allocated"] - base
ck(cu.cuMemUnmap(va, c_size_t(2 * gran.value)), "unmap")
res["vmm_after_unmap"] = used()["allocated"] - base
res["vmm_copy_unmapped"] = cu.cuMemcpyHtoD_v2(va, data, c_size_t(16))
ck(cu.cuMemAddressFree(va, c_size_t(2 * gran.value)), "address free")
res["gran"] = gran.value
# copies are range-checked and move bytes
rc, d = alloc(4096)
src = ctypes.create_string_buffer(b"0123456789abcdef", 16)
dst = ctypes.create_string_buffer(16)
res["copy_in"] = cu.cuMemcpyHtoD_v2(c_ulonglong(d + 4080), src, c_size_t(16))
res["copy_out"] = cu.cuMemcpyDtoH_v2(dst, c_ulonglong(d + 4080), c_size_t(16))
res["roundtrip"] = dst.raw.decode()
res["copy_past_end"] = cu.cuMemcpyHtoD_v2(c_ulonglong(d + 4088), src, c_size_t(16))
res["copy_wild"] = cu.cuMemcpyDtoH_v2(dst, c_ulonglong(0x10), c_size_t(16))
res["free_inside"] = cu.cuMemFree_v2(c_ulonglong(d + 16))
ck(cu.cuMemFree_v2(c_ulonglong(d)), "free")
res["double_free"] = cu.cuMemFree_v2(c_ulonglong(d))
print(json.dumps(res))
"""


def test_memory_kinds_are_accounted_and_copies_checked(fakegpu: FakeGPU) -> None:
    out = py(fakegpu, f"CTL = {fakegpu.ctl_path!r}", MEMORY_KINDS)
    MiB = 1 << 20
    assert out["pitch_rc"] == 0 and out["pitch"] == 1024 and out["pitch_charged"] == 10 * 1024
    assert out["pitch_bad_elem"] == 1
    assert out["array_rc"] == 0 and out["array_charged"] == 1024 * 1024 * 4 * 4 and out["array_after"] == 0
    assert out["array_bad"] == 1
    assert out["async_charged"] == 4 * MiB
    assert out["async_before_sync"] == 4 * MiB  # stays reserved until a synchronisation
    assert out["async_after_sync"] == 0
    assert out["pool_kept"] == [8 * MiB, 8 * MiB]  # below the release threshold
    assert out["pool_trimmed"] == 0
    gran = out["gran"]
    assert gran == 2 * MiB
    assert out["vmm_odd"] == 1
    assert out["vmm_charged"] == 2 * gran
    assert out["vmm_mapped_after_release"] == 2 * gran  # a mapping keeps the memory
    assert out["vmm_after_unmap"] == 0
    assert out["vmm_copy_unmapped"] == 1
    assert out["copy_in"] == 0 and out["copy_out"] == 0 and out["roundtrip"] == "0123456789abcdef"
    assert out["copy_past_end"] == 1 and out["copy_wild"] == 1
    assert out["free_inside"] == 1 and out["double_free"] == 1


def test_cuda_visible_devices_selects_and_orders(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=3)
    code = """
        ck(cu.cuInit(0), "init")
        n = ctypes.c_int()
        ck(cu.cuDeviceGetCount(ctypes.byref(n)), "count")
        uuids = []
        for i in range(n.value):
            u = (ctypes.c_ubyte * 16)()
            ck(cu.cuDeviceGetUuid(u, i), "uuid")
            h = bytes(u).hex()
            uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
        print(json.dumps(uuids))
        """
    try:
        env = gpu.env
        cases = {
            "2,0": [gpu.uuids[2], gpu.uuids[0]],
            f"{gpu.uuids[1][:12]}": [gpu.uuids[1]],
            "1,7,0": [gpu.uuids[1]],
            "": [],
        }
        import sys
        import textwrap

        from tests.sim.helpers import CUDA_PRELUDE

        for value, expected in cases.items():
            env["CUDA_VISIBLE_DEVICES"] = value
            proc = gpu.run([sys.executable, "-c", CUDA_PRELUDE + textwrap.dedent(code)], env=env)
            assert proc.returncode == 0, proc.stderr
            assert __import__("json").loads(proc.stdout) == expected, value
    finally:
        gpu.close()


def test_fakegpu_visible_devices_restricts_cuda_and_nvml(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=3)
    code = """
        import pynvml
        ck(cu.cuInit(0), "init")
        n = ctypes.c_int()
        ck(cu.cuDeviceGetCount(ctypes.byref(n)), "count")
        pynvml.nvmlInit()
        hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        try:
            pynvml.nvmlDeviceGetHandleByUUID(HIDDEN)
            hidden = "found"
        except pynvml.NVMLError_NotFound:
            hidden = "not found"
        print(json.dumps(dict(cuda=n.value, nvml=[pynvml.nvmlDeviceGetUUID(h) for h in hs],
                              index=[pynvml.nvmlDeviceGetIndex(h) for h in hs], hidden=hidden)))
        """
    try:
        env = gpu.env
        env["FAKEGPU_VISIBLE_DEVICES"] = f"{gpu.uuids[2]},0"
        import sys
        import textwrap

        from tests.sim.helpers import CUDA_PRELUDE

        src = CUDA_PRELUDE + f"HIDDEN = {gpu.uuids[1]!r}\n" + textwrap.dedent(code)
        proc = gpu.run([sys.executable, "-c", src], env=env)
        assert proc.returncode == 0, proc.stderr
        out = __import__("json").loads(proc.stdout)
        assert out == {"cuda": 2, "nvml": [gpu.uuids[2], gpu.uuids[0]], "index": [0, 1], "hidden": "not found"}
    finally:
        gpu.close()


def test_a_forked_child_is_a_process_of_its_own(fakegpu: FakeGPU) -> None:
    out = py(
        fakegpu,
        f"CTL = {fakegpu.ctl_path!r}",
        """
        import subprocess
        ctx(0)
        rc, p = alloc(64 << 20)
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            # CUDA state does not survive fork: initialise again, as a process of its own
            cu.cuInit(0)
            c = ctypes.c_void_p()
            cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), 0)
            cu.cuCtxSetCurrent(c)
            q = ctypes.c_ulonglong()
            rc2 = cu.cuMemAlloc_v2(ctypes.byref(q), ctypes.c_size_t(32 << 20))
            os.write(w, str(rc2).encode())
            time.sleep(2)
            os._exit(0)
        child_rc = int(os.read(r, 16))
        st = json.loads(subprocess.check_output([CTL, "dump"]))
        during = {q["pid"]: q["devices"][0]["allocated"] for q in st["processes"]}
        os.waitpid(child, 0)
        st = json.loads(subprocess.check_output([CTL, "dump"]))
        after = {q["pid"]: q["devices"][0]["allocated"] for q in st["processes"]}
        print(json.dumps(dict(child_rc=child_rc, child=child, me=os.getpid(), during=during, after=after,
                              free=cu.cuMemFree_v2(ctypes.c_ulonglong(p)))))
        """,
    )
    me, child = str(out["me"]), str(out["child"])
    assert out["child_rc"] == 0
    assert out["during"] == {me: 64 << 20, child: 32 << 20}
    assert out["after"] == {me: 64 << 20}
    assert out["free"] == 0


CONTEXTS_AND_LAUNCHES = """
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p, cast, sizeof
import subprocess
def me():
    st = json.loads(subprocess.check_output([CTL, "dump"]))
    rows = [p for p in st["processes"] if p["pid"] == os.getpid()]
    return rows[0]["devices"][0] if rows and rows[0]["devices"] else {}
res = {}
ck(cu.cuInit(0), "init")
a, b = c_void_p(), c_void_p()
ck(cu.cuCtxCreate_v2(byref(a), 0, 0), "create a")
ck(cu.cuCtxCreate_v2(byref(b), 0, 0), "create b")  # b is current now
res["contexts"] = me()["contexts"]
rc, p = alloc(1 << 20)
ck(cu.cuCtxPopCurrent_v2(None), "pop b")  # a is current
res["current_is_a"] = (lambda c: (cu.cuCtxGetCurrent(byref(c)), c.value == a.value)[1])(c_void_p())
ck(cu.cuCtxDestroy_v2(b), "destroy b")  # frees b's allocation and its overhead
d = me()
res["after_destroy"] = [d["contexts"], d["allocated"]]
res["destroy_twice"] = cu.cuCtxDestroy_v2(b)
mod, fn, bad = c_void_p(), c_void_p(), c_void_p()
res["garbage_image"] = cu.cuModuleLoadData(byref(mod), b"\\x7fELF whatever")
ck(cu.cuModuleLoadData(byref(mod), SPIN_PTX), "module")
ck(cu.cuModuleGetFunction(byref(fn), mod, b"spin_us"), "spin_us")
res["unknown_kernel"] = cu.cuModuleGetFunction(byref(bad), mod, b"matmul")
us = c_ulonglong(20000)
params = (c_void_p * 1)(cast(byref(us), c_void_p))
s = c_void_p()
ck(cu.cuStreamCreate(byref(s), 0), "stream")
ev0, ev1 = c_void_p(), c_void_p()
ck(cu.cuEventCreate(byref(ev0), 0), "event")
ck(cu.cuEventCreate(byref(ev1), 0), "event")
ck(cu.cuEventRecord(ev0, s), "record")
ck(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, params, None), "launch")
class Cfg(Structure):
    _fields_ = [("g", c_uint * 3), ("b", c_uint * 3), ("shm", c_uint), ("stream", c_void_p), ("attrs", c_void_p),
                ("nattrs", c_uint)]
cfg = Cfg((c_uint * 3)(1, 1, 1), (c_uint * 3)(64, 1, 1), 0, s, None, 0)
ck(cu.cuLaunchKernelEx(byref(cfg), fn, params, None), "launch ex")
buf = c_ulonglong(20000)
size = c_size_t(8)
extra = (c_void_p * 5)(c_void_p(1), cast(byref(buf), c_void_p), c_void_p(2), cast(byref(size), c_void_p), None)
ck(cu.cuLaunchCooperativeKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, params), "cooperative")
ck(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, None, extra), "extra form")
ck(cu.cuEventRecord(ev1, s), "record")
res["query_busy"] = cu.cuStreamQuery(s)
res["bad_grid"] = cu.cuLaunchKernel(fn, 0, 1, 1, 1, 1, 1, 0, s, params, None)
res["bad_block"] = cu.cuLaunchKernel(fn, 1, 1, 1, 2048, 1, 1, 0, s, params, None)
res["no_params"] = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, None, None)
ck(cu.cuStreamSynchronize(s), "sync")
res["query_done"] = cu.cuStreamQuery(s)
ms = ctypes.c_float()
ck(cu.cuEventElapsedTime(byref(ms), ev0, ev1), "elapsed")
res["elapsed_ms"] = ms.value
d = me()
res["launched"] = [d["launched"], d["completed"], d["exec_ns"]]
ck(cu.cuStreamDestroy_v2(s), "stream destroy")
print(json.dumps(res))
"""


def test_contexts_streams_events_and_launch_forms(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1, context_overhead=10 << 20)
    try:
        out = py(gpu, f"CTL = {gpu.ctl_path!r}", CONTEXTS_AND_LAUNCHES)
    finally:
        gpu.close()
    assert out["contexts"] == 2
    assert out["current_is_a"] is True
    assert out["after_destroy"] == [1, 0]
    assert out["destroy_twice"] == 201
    assert out["unknown_kernel"] == 500
    assert out["garbage_image"] == 200  # CUDA_ERROR_INVALID_IMAGE
    assert out["query_busy"] == 600
    assert out["bad_grid"] == 1 and out["bad_block"] == 1 and out["no_params"] == 1
    assert out["query_done"] == 0
    assert out["launched"] == [4, 4, 4 * 20_000_000]
    assert out["elapsed_ms"] >= 4 * 20 * 0.9


def test_invalid_configuration_is_reported(tmp_path: Path, build_dir: Path) -> None:
    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=1)
    try:
        gpu.config_path.write_text("[device]\nmemory = lots\n")
        gpu.state_path.unlink()
        with pytest.raises(RuntimeError, match=r"fakegpu.conf:2: invalid value for key `memory`"):
            gpu.ctl("init")
        r = gpu.run([gpu.burn])
        assert r.returncode == 1
        assert "invalid value for key `memory`" in r.stderr
        assert json.loads(r.stdout)["init_result"] == 100  # CUDA_ERROR_NO_DEVICE
        gpu.config_path.write_text("colour = blue\n")
        with pytest.raises(RuntimeError, match="unknown key `colour`"):
            gpu.ctl("init")
    finally:
        gpu.close()
