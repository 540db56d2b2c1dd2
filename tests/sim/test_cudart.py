"""NVIDIA's CUDA runtime (libcudart 12.9 and 13.x from PyPI) and CuPy run on the simulated driver.

The programs are unmodified: a C program linked against the wheel's libcudart (built here with the
C compiler) and CuPy's own code.  cudart initialises through the simulated driver's export tables
(sim/fakegpu/src/cuda_export.c) and entry points; the kernels it registers are read from the fatbin
it hands over.  Results of kernels are not computed (the simulator does not execute kernels), but
every copy, set and allocation has its real effect, checked byte for byte.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import py
from tests.support import cudart

MiB = 1 << 20
GiB = 1 << 30

needs_12 = pytest.mark.skipif(cudart.libcudart(12) is None, reason="nvidia-cuda-runtime-cu12 not installed")
MAJORS = [
    pytest.param(12, marks=needs_12),
    pytest.param(
        13, marks=pytest.mark.skipif(cudart.libcudart(13) is None, reason="nvidia-cuda-runtime not installed")
    ),
]


@pytest.fixture(scope="module")
def progdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cudart")


def run(gpu: FakeGPU, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env={**gpu.env, **(env or {})}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("major", MAJORS)
def test_cudart_program_runs_and_moves_real_bytes(fakegpu: FakeGPU, progdir: Path, major: int) -> None:
    prog = cudart.build_prog(progdir, major)
    p = run(fakegpu, [str(prog), "info", "roundtrip"], {"FAKEGPU_TRACE": "1"})
    out = cudart.parse(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    [info] = out["info"]
    assert (info["err"], info["devices"], info["driver"]) == ("0", "2", "13000")
    assert info["runtime"].startswith(str(major))
    [dev] = out["device"]
    assert (dev["sms"], dev["cc_major"], dev["total"]) == ("132", "9", str(16 * GiB))
    # every copy, set, pitched and managed round trip, stream-ordered allocation and the symbol copy
    for name in ("copy", "memset", "async", "pitch", "managed", "kernel"):
        for row in out[name]:
            assert all(v == "1" for k, v in row.items() if k.endswith("ok")), (name, row)
    assert out["pitch"][0]["pitch"] == "1024"  # rows padded to 512 bytes
    assert out["async"][1]["pool_used_after_free"] == "0"
    assert out["roundtrip"][0]["fails"] == "0"
    # cudart asked for its private tables and found them; no slot the simulator does not model was called
    assert "CUDART_INTERFACE" in p.stderr and "INTEGRITY_CHECK" in p.stderr
    assert "not modelled" not in p.stderr, p.stderr
    assert "module 0x" in p.stderr and "1 kernels, 1 variables" in p.stderr  # the registered fatbin was read


@needs_12
def test_cudart_out_of_memory_is_the_drivers(fakegpu: FakeGPU, progdir: Path) -> None:
    """Without a slice, cudaMalloc fails at the simulated GPU's physical memory with
    cudaErrorMemoryAllocation (2), mapped by cudart from CUDA_ERROR_OUT_OF_MEMORY."""
    fakegpu.configure([{"memory": 4 * GiB, "context_overhead": 0}])
    prog = cudart.build_prog(progdir, 12)
    for kind in ("malloc", "pitch", "async", "pool"):
        p = run(fakegpu, [str(prog), "fill", kind, str(512 * MiB)])
        [row] = cudart.parse(p.stdout)["fill"]
        assert (row["count"], row["err"], row["name"]) == ("8", "2", "cudaErrorMemoryAllocation"), (kind, p.stdout)
    # managed memory past the device spills to host memory (oversubscribed unified memory)
    p = run(fakegpu, [str(prog), "fill", "managed", str(512 * MiB), "12"])
    [row] = cudart.parse(p.stdout)["fill"]
    assert (row["count"], row["err"]) == ("12", "0")


# ---- the export tables, called as cudart calls them ----------------------------------------------

TABLES = """
import ctypes
from ctypes import POINTER, byref, c_int, c_uint, c_ulonglong, c_void_p, CFUNCTYPE
def table(uuid_hex):
    t = c_void_p()
    rc = cu.cuGetExportTable(byref(t), (ctypes.c_ubyte * 16)(*bytes.fromhex(uuid_hex)))
    return rc, t.value
def slot(t, i, restype, *argtypes):
    fp = ctypes.cast(t + 8 * i, POINTER(c_void_p))[0]
    return CFUNCTYPE(restype, *argtypes)(fp)
"""


def test_export_tables_behave_as_cudart_needs(fakegpu: FakeGPU) -> None:
    out = py(
        fakegpu,
        TABLES,
        """
        cu.cuInit(0)
        res = {}
        res["unknown"] = table("00" * 16)
        rc, rt = table("6bd5fb6c5bf4e74a8987d93912fd9df9")
        res["size"] = ctypes.cast(rt, POINTER(c_ulonglong))[0]
        # slot 2: the primary context's handle, not retained
        h = c_void_p()
        res["slot2"] = slot(rt, 2, c_int, POINTER(c_void_p), c_int)(byref(h), 0)
        flags, active = c_uint(), c_int()
        cu.cuDevicePrimaryCtxGetState(0, byref(flags), byref(active))
        res["active_before"] = active.value
        r = c_void_p()
        ck(cu.cuDevicePrimaryCtxRetain(byref(r), 0), "retain")
        res["same_handle"] = r.value == h.value
        # context-local storage: put/get/delete on the current context, destructor on reset
        ck(cu.cuCtxSetCurrent(r), "current")
        rc, cls = table("c693336e1121df11a8c368f355d89593")
        DTOR = CFUNCTYPE(None, c_void_p, c_void_p, c_void_p)
        calls = []
        dtor = DTOR(lambda c, k, v: calls.append((k, v)))
        put = slot(cls, 0, c_int, c_void_p, c_void_p, c_void_p, DTOR)
        get = slot(cls, 2, c_int, POINTER(c_void_p), c_void_p, c_void_p)
        delete = slot(cls, 1, c_int, c_void_p, c_void_p)
        v = c_void_p()
        res["get_absent"] = get(byref(v), None, 0x10)
        res["put"] = [put(None, 0x10, 0x1234, dtor), put(r, 0x20, 0x5678, dtor)]
        res["get"] = [get(byref(v), None, 0x10), v.value]
        res["delete"] = [delete(None, 0x10), get(byref(v), r, 0x10)]
        ck(cu.cuDevicePrimaryCtxReset_v2(0), "reset")
        res["dtor_calls"] = calls
        # the integrity check: constants for version % 10 in (0, 1), a keyed hash otherwise
        rc, ic = table("d4082055bde6704b8d34ba123c66e1f2")
        f = slot(ic, 1, c_int, c_uint, c_ulonglong, POINTER(c_ulonglong))
        o = (c_ulonglong * 2)()
        res["ic0"] = [f(13050, 1, o), hex(o[0]), hex(o[1])]
        f(12092, 1700000000, o); a = list(o)
        f(12092, 1700000001, o); b = list(o)
        res["ic2_depends_on_time"] = a != b
        # the tools' context table: slot 4 is the context's id, as cuCtxGetId
        rc, tc = table("21318c60971432488ca641ff7324c8f2")
        ck(cu.cuDevicePrimaryCtxRetain(byref(r), 0), "retain")
        i1, i2 = c_ulonglong(), c_ulonglong()
        res["ctx_id"] = [slot(tc, 4, c_int, c_void_p, POINTER(c_ulonglong))(r, byref(i1)),
                         cu.cuCtxGetId(r, byref(i2)), i1.value == i2.value and i1.value > 0]
        res["unmodelled_slot"] = slot(tc, 7, c_int)()
        print(json.dumps(res))
        """,
    )
    assert out["unknown"] == [1, None]  # CUDA_ERROR_INVALID_VALUE, NULL table
    assert out["size"] == 13 * 8
    assert (out["slot2"], out["active_before"], out["same_handle"]) == (0, 0, True)
    assert out["get_absent"] == 400  # CUDA_ERROR_INVALID_HANDLE
    assert out["put"] == [0, 0] and out["get"] == [0, 0x1234] and out["delete"] == [0, 400]
    assert out["dtor_calls"] == [[0x20, 0x5678]]  # only what was left, when the context went away
    assert out["ic0"] == [0, "0x3341181c03cb675c", "0x8ed383aa1f4cd1e8"]
    assert out["ic2_depends_on_time"] is True
    assert out["ctx_id"] == [0, 0, True]
    assert out["unmodelled_slot"] == 801  # CUDA_ERROR_NOT_SUPPORTED, reported, never a NULL jump


# ---- module images -------------------------------------------------------------------------------

KERNEL_CU = """
__device__ int counter[4];
__constant__ float coeff[2];
extern "C" __global__ void axpy(float *y, const float *x, int n)
{ int i = threadIdx.x; if (i < n) y[i] += coeff[0] * x[i] + counter[0]; }
template <typename T> __global__ void fill(T *p) { p[0] = 1; }
template __global__ void fill<int>(int *);
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("mode", ["default", "none", "speed", "size"])
def test_nvcc_fatbins_are_read_for_their_kernels_and_variables(fakegpu: FakeGPU, tmp_path: Path, mode: str) -> None:
    """What nvcc writes: a cubin and the PTX, compressed (zstd or LZ4) or not."""
    src = tmp_path / "k.cu"
    src.write_text(KERNEL_CU)
    fatbin = tmp_path / "k.fatbin"
    subprocess.run(
        ["nvcc", "-arch=sm_90", "-fatbin", f"--compress-mode={mode}", "-o", str(fatbin), str(src)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    out = py(
        fakegpu,
        f"""
        from ctypes import byref, c_void_p, c_ulonglong, c_size_t
        ctx(0)
        data = open({str(fatbin)!r}, "rb").read()
        buf = ctypes.create_string_buffer(data, len(data))
        m, f, d, n = c_void_p(), c_void_p(), c_ulonglong(), c_size_t()
        res = {{"load": cu.cuModuleLoadData(byref(m), buf)}}
        names = (b"axpy", b"_Z4fillIiEvPT_", b"fill", b"nope")
        res["kernels"] = [cu.cuModuleGetFunction(byref(f), m, k) for k in names]
        names = (b"counter", b"coeff", b"x")
        res["vars"] = [[cu.cuModuleGetGlobal_v2(byref(d), byref(n), m, v), n.value] for v in names]
        print(json.dumps(res))
        """,
    )
    assert out["load"] == 0
    assert out["kernels"] == [0, 0, 500, 500]
    assert out["vars"][:2] == [[0, 16], [0, 8]] and out["vars"][2][0] == 500


# ---- CuPy ------------------------------------------------------------------------------------------

needs_cupy = pytest.mark.skipif(not cudart.have_cupy(), reason="cupy-cuda12x not installed")

CUPY_ROUNDTRIP = r"""
import json, sys
import numpy as np
import cupy as cp
res = {"devices": cp.cuda.runtime.getDeviceCount()}
props = cp.cuda.runtime.getDeviceProperties(0)
res["name"] = props["name"].decode()
res["total"] = props["totalGlobalMem"]
x = (np.arange(1 << 16) % 251).astype(np.uint8)
g = cp.asarray(x)
res["roundtrip"] = bool(np.array_equal(cp.asnumpy(g), x))
g[:100] = 7  # a fill kernel: launched, not computed
k = cp.ElementwiseKernel("uint8 a", "uint8 b", "b = a + 1", "plus_one")
k(g, g)
res["kernels_launched"] = True
cp.cuda.Device(0).synchronize()
pool = cp.get_default_memory_pool()
res["pool_used"] = pool.used_bytes()
a = cp.cuda.MemoryAsyncPool()
cp.cuda.set_allocator(a.malloc)
y = cp.asarray(x)
res["async_roundtrip"] = bool(np.array_equal(cp.asnumpy(y), x))
print(json.dumps(res))
"""


@needs_cupy
def test_cupy_runs_on_the_simulated_gpu(fakegpu: FakeGPU, tmp_path: Path) -> None:
    env = {"CUPY_CACHE_DIR": str(tmp_path / "cupy-cache"), "FAKEGPU_TRACE": "1"}
    p = run(fakegpu, [sys.executable, "-c", CUPY_ROUNDTRIP], env)
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    res = json.loads(p.stdout.splitlines()[-1])
    assert res["devices"] == 2 and res["name"] == "NVIDIA Fake GPU" and res["total"] == 16 * GiB
    assert res["roundtrip"] and res["async_roundtrip"] and res["kernels_launched"]
    assert res["pool_used"] >= 1 << 16
    # NVRTC compiled the kernels on the CPU; the simulator loaded the results and found them
    assert "module 0x" in p.stderr and "not modelled" not in p.stderr


def test_cuda_runtime_wheels_are_what_the_tests_use() -> None:
    """make test installs the wheels: a missing one would silently skip the tests above."""
    if os.environ.get("VGPU_TEST_ALLOW_MISSING_WHEELS"):
        pytest.skip("VGPU_TEST_ALLOW_MISSING_WHEELS set")
    assert cudart.libcudart(12) is not None and cudart.libcudart(13) is not None and cudart.have_cupy()
    ctypes.CDLL(str(cudart.libcudart(12)))  # loads without a driver
