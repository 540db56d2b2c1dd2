"""The simulated driver's model of stream capture, graph memory, sharing and host memory: the
error codes and accounting NVIDIA's driver API reference documents (docs/developers/simulators.md,
"Graphs and stream capture", "Memory shared between processes").  The accounting through libvgpu.so is tested in
tests/libcuda_intercept/test_alloc_paths.py."""

from __future__ import annotations

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import py

pytestmark = pytest.mark.timeout(120)

TYPES = """
from ctypes import Structure, byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p, c_ushort, c_char
MiB = 1 << 20
class PoolProps(Structure):
    _fields_ = [("allocType", c_int), ("handleTypes", c_int), ("locType", c_int), ("locId", c_int),
                ("win32", c_void_p), ("maxSize", c_size_t), ("usage", c_ushort), ("reserved", c_char * 54)]
class AllocNode(Structure):
    _fields_ = [("poolProps", PoolProps), ("accessDescs", c_void_p), ("accessDescCount", c_size_t),
                ("bytesize", c_size_t), ("dptr", c_ulonglong)]
class Prop(Structure):
    _fields_ = [("type", c_int), ("handleTypes", c_int), ("locType", c_int), ("locId", c_int),
                ("win32", c_void_p), ("flags", c_ulonglong)]
def used():
    import subprocess
    st = json.loads(subprocess.check_output([os.environ["CTL"], "dump"]))
    # allocations (without the contexts' overhead) of every process on device 0
    return sum(d["allocated"] for p in st["processes"] for d in p["devices"] if d["index"] == 0)
"""


def run(gpu: FakeGPU, code: str) -> dict:
    import os

    os.environ["CTL"] = gpu.ctl_path
    out = py(gpu, TYPES, code)
    assert isinstance(out, dict)
    return out


def test_capture_errors_follow_the_documentation(fakegpu: FakeGPU) -> None:
    out = run(
        fakegpu,
        """
        ctx(0)
        res = {}
        s = c_void_p()
        ck(cu.cuStreamCreate(byref(s), 1), "stream")
        res["legacy"] = cu.cuStreamBeginCapture_v2(None, 0)          # the legacy stream cannot capture
        res["end_idle"] = cu.cuStreamEndCapture(s, byref(c_void_p())) # not capturing
        ck(cu.cuStreamBeginCapture_v2(s, 0), "begin")
        res["again"] = cu.cuStreamBeginCapture_v2(s, 0)
        p = c_ulonglong()
        res["alloc"] = cu.cuMemAllocAsync(byref(p), c_size_t(8 * MiB), s)
        res["used_capturing"] = used()
        res["sync"] = cu.cuStreamSynchronize(s)                      # invalidates the capture
        res["alloc_after"] = cu.cuMemAllocAsync(byref(p), c_size_t(MiB), s)
        g = c_void_p(1)
        res["end"] = cu.cuStreamEndCapture(s, byref(g))
        res["graph"] = g.value
        st = c_int(-1)
        ck(cu.cuStreamIsCapturing(s, byref(st)), "is capturing")
        res["status"] = st.value
        print(json.dumps(res))
        """,
    )
    assert out == {
        "legacy": 900,  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        "end_idle": 401,  # CUDA_ERROR_ILLEGAL_STATE
        "again": 401,
        "alloc": 0,
        "used_capturing": 0,
        "sync": 900,
        "alloc_after": 901,  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        "end": 901,
        "graph": None,
        "status": 0,
    }


def test_graph_memory_nodes_and_the_graph_pool(fakegpu: FakeGPU) -> None:
    out = run(
        fakegpu,
        """
        ctx(0)
        res = {}
        g = c_void_p()
        ck(cu.cuGraphCreate(byref(g), 0), "graph")
        a = AllocNode()
        a.poolProps.allocType, a.poolProps.locType, a.bytesize = 1, 1, 3 * MiB
        n = c_void_p()
        ck(cu.cuGraphAddMemAllocNode(byref(n), g, None, c_size_t(0), byref(a)), "alloc node")
        res["dptr"] = a.dptr != 0
        res["free_bad"] = cu.cuGraphAddMemFreeNode(byref(n), g, None, c_size_t(0), c_ulonglong(12345))
        x = c_void_p()
        ck(cu.cuGraphInstantiateWithFlags(byref(x), g, c_ulonglong(0)), "instantiate")
        res["second_exec"] = cu.cuGraphInstantiateWithFlags(byref(c_void_p()), g, c_ulonglong(0))
        res["before"] = used()
        ck(cu.cuGraphLaunch(x, None), "launch")
        res["launched"] = used()
        res["relaunch"] = cu.cuGraphLaunch(x, None)   # its allocation is unfreed
        v = c_ulonglong()
        attrs = []
        for k in range(4):
            ck(cu.cuDeviceGetGraphMemAttribute(0, k, byref(v)), "attr")
            attrs.append(v.value)
        res["attrs"] = attrs
        res["set_current"] = cu.cuDeviceSetGraphMemAttribute(0, 2, byref(c_ulonglong(0)))
        ck(cu.cuMemFree_v2(c_ulonglong(a.dptr)), "free outside")
        res["freed"] = used()
        ck(cu.cuDeviceGraphMemTrim(0), "trim")
        res["trimmed"] = used()
        ck(cu.cuGraphExecDestroy(x), "exec destroy")
        ck(cu.cuGraphDestroy(g), "destroy")
        print(json.dumps(res))
        """,
    )
    assert out == {
        "dptr": True,
        "free_bad": 1,  # "an address that was not returned by an allocation node"
        "second_exec": 1,  # one executable graph at a time
        "before": 0,
        "launched": 4 << 20,  # 3 MiB in 2 MiB granules
        "relaunch": 1,
        "attrs": [4 << 20, 4 << 20, 4 << 20, 4 << 20],
        "set_current": 1,
        "freed": 4 << 20,  # freed, still in the graph pool
        "trimmed": 0,
    }


def test_host_memory_and_handle_type_errors(fakegpu: FakeGPU) -> None:
    out = run(
        fakegpu,
        """
        ctx(0)
        res = {}
        h = c_ulonglong()
        for name, loc, ht in (("host", 2, 0), ("numa", 3, 0), ("numa_current", 4, 0), ("bad_loc", 9, 0),
                              ("fabric", 1, 8)):
            res[name] = cu.cuMemCreate(byref(h), c_size_t(2 * MiB), byref(Prop(1, ht, loc, 0, None, 0)), c_ulonglong(0))
            if res[name] == 0:
                ck(cu.cuMemRelease(h), "release")
        res["used"] = used()
        buf = ctypes.create_string_buffer(1 << 16)
        res["reg"] = cu.cuMemHostRegister_v2(buf, c_size_t(1 << 16), c_uint(0))
        res["reg_again"] = cu.cuMemHostRegister_v2(buf, c_size_t(1 << 16), c_uint(0))
        res["unreg"] = cu.cuMemHostUnregister(buf)
        res["unreg_again"] = cu.cuMemHostUnregister(buf)
        pool = c_void_p()
        pp = PoolProps()
        pp.allocType, pp.locType = 1, 2
        ck(cu.cuMemPoolCreate(byref(pool), byref(pp)), "host pool")
        p = c_ulonglong()
        ck(cu.cuMemAllocFromPoolAsync(byref(p), c_size_t(64 * MiB), pool, None), "host pool alloc")
        res["used_host_pool"] = used()
        fd = c_int(-1)
        res["export_unrequested"] = cu.cuMemPoolExportToShareableHandle(byref(fd), pool, 1, c_ulonglong(0))
        print(json.dumps(res))
        """,
    )
    assert out == {
        "host": 0,
        "numa": 0,
        "numa_current": 0,
        "bad_loc": 1,
        "fabric": 801,  # CUDA_ERROR_NOT_SUPPORTED
        "used": 0,
        "reg": 0,
        "reg_again": 712,  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        "unreg": 0,
        "unreg_again": 713,  # CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        "used_host_pool": 0,
        "export_unrequested": 1,
    }
