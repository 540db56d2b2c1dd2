"""The real `nvidia-ctk cdi generate` (NVIDIA Container Toolkit 1.20.0) on the simulated H200 in
MIG mode, recorded in tests/data/nvidia-ctk-mig/ (its README: node, command, normalisation), and
replayed here: the simulator, built as it was then (tests/support/ctk_mig.py), has exactly the MIG
devices the recording names, with the capability nodes it gives them, and the simulated toolkit
(`fakegpu-cdi`) writes the same devices.  Where the real program is installed (root), it is run
again and must write the recording."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from sim.fakegpu import toolkit as tk
from tests.support import ctk_mig

RECORDED = ctk_mig.DATA / "nvidia.com-gpu.yaml"

MIG_INDEX = """
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
out = []
for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
    try:
        m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
    except n.NVMLError_NotFound:
        continue
    out.append([k, n.nvmlDeviceGetUUID(m), n.nvmlDeviceGetGpuInstanceId(m), n.nvmlDeviceGetComputeInstanceId(m)])
print(json.dumps(out))
"""


def nodes(dev: dict) -> list[str]:
    return [n["path"] for n in dev["containerEdits"]["deviceNodes"]]


@pytest.fixture
def node(tmp_path: Path, build_dir: Path):
    if os.geteuid() != 0:
        pytest.skip("the driver root's device nodes need root (mknod)")
    gpu, drv = ctk_mig.make_node(tmp_path, build_dir)
    yield gpu, drv
    gpu.close()


def test_the_simulator_has_the_recorded_mig_devices(node) -> None:
    gpu, drv = node
    spec = yaml.safe_load(RECORDED.read_text())
    recorded = {d["name"]: nodes(d) for d in spec["devices"]}
    r = gpu.run([sys.executable, "-c", MIG_INDEX])
    assert r.returncode == 0, r.stderr
    migs = json.loads(r.stdout)
    want: dict[str, list[str]] = {}
    for k, uuid, gi, ci in migs:
        caps = [
            f"/dev/nvidia-caps/nvidia-cap{ctk_mig.cap_minor(0, gi)}",
            f"/dev/nvidia-caps/nvidia-cap{ctk_mig.cap_minor(0, gi, ci)}",
        ]
        want[f"0:{k}"] = want[uuid] = ["/dev/nvidia0", *caps]
    want["all"] = ["/dev/nvidia0", *sorted({p for v in want.values() for p in v[1:]})]
    assert recorded == want
    # every node the recording names exists under the driver root with the numbers it recorded
    for dev in spec["devices"]:
        for n in dev["containerEdits"]["deviceNodes"]:
            st = os.stat(n["hostPath"].replace(ctk_mig.RECORDED_ROOT, str(drv)))
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (n["major"], n.get("minor", 0))
    # and it was a full answer: no GPU entry for the GPU in MIG mode
    assert "0" not in recorded and ctk_mig.GPU_UUID not in recorded


def test_the_simulated_toolkit_writes_the_recorded_devices(node) -> None:
    gpu, _ = node
    recorded = {d["name"]: nodes(d) for d in yaml.safe_load(RECORDED.read_text())["devices"]}
    spec = tk.generate_cdi_spec(gpu)
    assert [d["name"] for d in spec["devices"]] == list(recorded)  # the same names in the same order
    assert {d["name"]: nodes(d) for d in spec["devices"]} == recorded


def test_the_recording_names_the_nvml_calls_the_simulator_implements() -> None:
    """Every NVML symbol the real program bound is exported, and the MIG ones are implemented
    (not NOT_SUPPORTED stubs: the simulated library defines them in nvml_*.c)."""
    bound = ctk_mig.DATA.joinpath("nvml-bound.txt").read_text().split()
    src = "".join(p.read_text() for p in (ctk_mig.REPO / "sim/fakegpu/src").glob("nvml_*.c"))
    mig = [
        n
        for n in bound
        if "Vgpu" not in n and any(k in n for k in ("Mig", "GpuInstance", "ComputeInstance", "Attributes"))
    ]
    assert len(mig) >= 10
    for name in mig:
        assert f"nvmlReturn_t {name}(" in src, name


@pytest.mark.skipif(
    not ctk_mig.REAL_CTK.exists() or shutil.which("unshare") is None,
    reason="the real nvidia-ctk is not installed beside the project",
)
def test_the_real_program_writes_the_recording_again(node, tmp_path: Path) -> None:
    gpu, drv = node
    out = tmp_path / "spec.yaml"
    proc = ctk_mig.run_real(gpu, drv, out)
    assert proc.returncode == 0, proc.stderr
    assert ctk_mig.normalise(out.read_text(), drv) == RECORDED.read_text()
