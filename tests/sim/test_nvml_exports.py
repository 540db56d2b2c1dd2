"""The simulated libnvidia-ml.so.1 exports every NVML entry point NVIDIA Container Toolkit 1.20
links (the trace `nvidia-toolkit/nvml/`: `nm -D --undefined-only` of nvidia-ctk and the runtimes,
413 names, the go-nvml binding's set): the real `nvidia-ctk cdi generate` and the runtime in
jit-cdi mode resolve their NVML symbols lazily, and one missing symbol they happen to call ends the
process (`symbol lookup error`), so the toolkit runs on the simulated GPU only when all exist.

Implemented where the simulation has the data; `NVML_ERROR_NOT_SUPPORTED` (a weak stub generated
from sim/fakegpu/nvml-entry-points.txt) otherwise, as the real library answers for a feature the
GPU lacks; MIG: a MIG-capable GPU with MIG disabled.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.sim.helpers import py
from tests.support import traces

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TRACE = "nvidia-toolkit/nvml/nvml-undefined-in-toolkit-binaries.txt"
LIST = ROOT / "sim" / "fakegpu" / "nvml-entry-points.txt"
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6

# Versioned entry points the real library exports beside the unversioned name (nvml.h's
# backwards-compatibility block): the simulation implements every version of these.
VERSIONED = {
    "nvmlInit": ("nvmlInit", "nvmlInit_v2"),
    "nvmlDeviceGetCount": ("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2"),
    "nvmlDeviceGetHandleByIndex": ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2"),
    "nvmlDeviceGetHandleByPciBusId": ("nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2"),
    "nvmlDeviceGetPciInfo": ("nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3"),
    "nvmlDeviceGetMemoryInfo": ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"),
    "nvmlEventSetWait": ("nvmlEventSetWait", "nvmlEventSetWait_v2"),
    "nvmlSystemGetCudaDriverVersion": ("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2"),
    "ComputeRunningProcesses": tuple(f"nvmlDeviceGetComputeRunningProcesses{v}" for v in ("", "_v2", "_v3")),
    "GraphicsRunningProcesses": tuple(f"nvmlDeviceGetGraphicsRunningProcesses{v}" for v in ("", "_v2", "_v3")),
    "MPSComputeRunningProcesses": tuple(f"nvmlDeviceGetMPSComputeRunningProcesses{v}" for v in ("", "_v2", "_v3")),
}


def _exports(build_dir: Path) -> dict[str, str]:
    """nvml* name -> nm's symbol type (T: defined by nvml_*.c, W: a generated weak stub)."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(build_dir / "fakegpu" / "libnvidia-ml.so.1")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    syms = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2].startswith("nvml"):
            syms[parts[2]] = parts[1]
    return syms


def _names(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_list_in_the_repo_is_the_recorded_set() -> None:
    recorded = _names(traces.text(TRACE))
    assert len(recorded) == 413
    assert _names(LIST.read_text()) == recorded


def test_exports_exactly_what_the_toolkit_links(build_dir: Path) -> None:
    exported = _exports(build_dir)
    recorded = set(_names(traces.text(TRACE)))
    assert sorted(recorded - set(exported)) == [], "entry points the toolkit links but the simulation lacks"
    assert sorted(set(exported) - recorded) == [], "exports outside the recorded set: add them to the list"


def test_every_version_of_the_implemented_entry_points_is_implemented(build_dir: Path) -> None:
    exported = _exports(build_dir)
    for names in VERSIONED.values():
        for n in names:
            assert exported.get(n) == "T", f"{n} is {exported.get(n)!r}, want an implementation"
    assert exported["nvmlErrorString"] == "T"  # the one entry point not returning nvmlReturn_t


def test_every_stub_answers_not_supported(build_dir: Path, fakegpu: FakeGPU) -> None:
    stubs = sorted(n for n, t in _exports(build_dir).items() if t == "W")
    assert len(stubs) > 300
    out = py(
        fakegpu,
        f"""
        nv = ctypes.CDLL("libnvidia-ml.so.1")
        assert nv.nvmlInit_v2() == 0
        print(json.dumps({{n: getattr(nv, n)() for n in {stubs!r}}}))
        """,
    )
    assert {n: rc for n, rc in out.items() if rc != NVML_ERROR_NOT_SUPPORTED} == {}


def test_mig_is_disabled_as_on_a_real_gpu_without_mig(fakegpu: FakeGPU) -> None:
    """go-nvlib (pkg/nvlib/device/device.go): IsMigCapable = GetMigMode succeeds; IsMigEnabled =
    current mode is ENABLE; VisitMigDevices needs GetMaxMigDeviceCount to succeed (nvml.h:
    "Returns zero if MIG is not supported or enabled")."""
    out = py(
        fakegpu,
        """
        nv = ctypes.CDLL("libnvidia-ml.so.1")
        assert nv.nvmlInit_v2() == 0
        h = ctypes.c_void_p()
        assert nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
        a, b = ctypes.c_uint(7), ctypes.c_uint(7)
        r = {"mode": [nv.nvmlDeviceGetMigMode(h, ctypes.byref(a), ctypes.byref(b)), a.value, b.value]}
        a.value = 7
        r["max"] = [nv.nvmlDeviceGetMaxMigDeviceCount(h, ctypes.byref(a)), a.value]
        a.value = 7
        r["is_mig"] = [nv.nvmlDeviceIsMigDeviceHandle(h, ctypes.byref(a)), a.value]
        m = ctypes.c_void_p()
        r["by_index"] = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0, ctypes.byref(m))
        procs = {}
        for v in ("", "_v2", "_v3"):
            for kind in ("Graphics", "MPSCompute"):
                a.value = 7
                fn = getattr(nv, f"nvmlDeviceGet{kind}RunningProcesses{v}")
                procs[kind + v] = [fn(h, ctypes.byref(a), None), a.value]
        r["procs"] = procs
        print(json.dumps(r))
        """,
    )
    assert out["mode"] == [0, 0, 0]  # NVML_SUCCESS, NVML_DEVICE_MIG_DISABLE twice
    assert out["max"] == [0, 0]
    assert out["is_mig"] == [0, 0]
    assert out["by_index"] == NVML_ERROR_NOT_FOUND
    assert set(map(tuple, out["procs"].values())) == {(0, 0)}
