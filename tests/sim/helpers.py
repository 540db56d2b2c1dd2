"""Helpers for the simulator tests: run Python snippets against the fake driver in a child."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from sim.fakegpu.harness import FakeGPU

# A ctypes prelude for child processes: `cu` is the fake libcuda, `nv` pynvml.
CUDA_PRELUDE = """
import ctypes, json, os, sys, time
cu = ctypes.CDLL("libcuda.so.1")
def ck(rc, what=""):
    if rc != 0:
        raise SystemExit(f"CUDA error {rc} in {what}")
def ctx(dev=0):
    ck(cu.cuInit(0), "cuInit")
    c = ctypes.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "retain")
    ck(cu.cuCtxSetCurrent(c), "set current")
    return c
def alloc(n):
    p = ctypes.c_ulonglong()
    rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    return rc, p.value
# A module image with the simulator's built-in kernels (spin: u64 ns, spin_us: u64 µs, noop):
# the simulated driver reads images for the kernels they define, as the real one does.
SPIN_PTX = (b".version 6.0\\n.target sm_50\\n.address_size 64\\n"
            b".visible .entry spin(.param .u64 a)\\n{\\n ret;\\n}\\n"
            b".visible .entry spin_us(.param .u64 a)\\n{\\n ret;\\n}\\n"
            b".visible .entry noop()\\n{\\n ret;\\n}\\n")
def meminfo():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    ck(cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "meminfo")
    return f.value, t.value
"""


def py(gpu: FakeGPU, *parts: str, timeout: float = 60) -> Any:
    """Runs the code parts (each dedented, after CUDA_PRELUDE) in a child Python; returns the JSON
    it prints last."""
    src = CUDA_PRELUDE + "\n".join(textwrap.dedent(p) for p in parts)
    proc = gpu.run([sys.executable, "-c", src], timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def popen_py(gpu: FakeGPU, code: str) -> subprocess.Popen[str]:
    src = CUDA_PRELUDE + textwrap.dedent(code)
    return gpu.popen([sys.executable, "-u", "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_json_line(proc: subprocess.Popen[str]) -> Any:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"child ended without output: {err}")
    return json.loads(line)
