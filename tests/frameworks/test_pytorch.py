"""PyTorch with CUDA (2.14.1 from PyPI, with NVIDIA's CUDA 13 runtime) on the simulated GPU under
libvgpu.so, against a slice: its caching allocator (default, `expandable_segments:True`,
`backend:cudaMallocAsync`) raises torch.cuda.OutOfMemoryError at the slice and not before, and its
statistics agree with the simulated GPU's own count of the process's memory (the oracle, never
libvgpu.so's region); CUDA-graph capture (torch.cuda.graph) allocates inside the slice; an
oversubscribed slice (virtual device memory) holds at most its physical share on the device.

Run by `make test-frameworks` (not part of `make test`).  tests/gpu/test_frameworks_gpu.py runs the
same child scripts against a real GPU.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import FAKE, UUID0, Node
from tests.support import cudart, frameworks

MiB = 1 << 20
CHUNK = 256 * MiB
LIMIT = 16 * CHUNK + 100 * MiB
# The caching allocator rounds requests between 1 and 10 MiB up to a 20 MiB segment
# (c10/cuda/CUDACachingAllocator.cpp, kLargeBuffer): what is left when it gives up is below that.
SLACK = 20 * MiB

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture
def py() -> str:
    p = frameworks.torch_python()
    if p is None:
        pytest.fail(f"torch not importable from {frameworks.VENV}: run `make test-frameworks`")
    return p


def driver_has(name: str) -> bool:
    """Whether the simulated driver serves an entry point (cuGetProcAddress at CUDA 13.0)."""
    lib = ctypes.CDLL(str(FAKE / "libcuda.so.1"))
    fn = ctypes.c_void_p()
    st = ctypes.c_int()
    lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), 13000, ctypes.c_ulonglong(0), ctypes.byref(st))
    return bool(fn.value)


def run_holding(node: Node, argv: list[str], env: dict[str, str]) -> tuple[dict[str, list[dict[str, str]]], int]:
    proc = subprocess.Popen(
        argv, env=node.env(True, env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        out = cudart.read_until_holding(proc)
        [p] = [p for p in node.dump()["processes"] if p["host_pid"] == proc.pid]
        used = int(p["devices"][0]["used"])
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    return cudart.parse(out), used


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "backend:cudaMallocAsync"])
def test_caching_allocator_stops_at_the_slice(node_plain: Node, py: str, conf: str) -> None:
    node = node_plain
    node.limit(LIMIT)
    out, used = run_holding(node, [py, "-c", frameworks.TORCH_FILL, str(CHUNK)], {"PYTORCH_CUDA_ALLOC_CONF": conf})
    [row] = out["fill"]
    # torch.cuda.OutOfMemoryError at the 17th chunk, and when no smaller request fits any more
    assert row["big"] == "16" and int(row["ooms"]) >= 1, row
    # the simulated GPU holds the slice, all but what the allocator's rounding cannot use
    assert used <= LIMIT and LIMIT - used < SLACK, (used, row)
    # torch sees the slice as the device (cudaMemGetInfo through the library)
    assert int(row["total"]) == LIMIT
    if row["reserved"] == "-1":
        # backend:cudaMallocAsync reads its statistics with cudaDeviceGetGraphMemAttribute
        assert not driver_has("cuDeviceGetGraphMemAttribute"), out
        pytest.skip("the simulated driver does not serve cuDeviceGetGraphMemAttribute (graph memory)")
    # torch's statistics are the simulated GPU's count
    assert int(row["reserved"]) == int(row["stat_reserved"]) == used
    assert int(row["allocated"]) == int(row["bytes"])


def test_cuda_graph_capture_allocates_inside_the_slice(node_plain: Node, py: str) -> None:
    if not driver_has("cuStreamBeginCapture"):
        pytest.skip("the simulated driver does not model stream capture (cuStreamBeginCapture)")
    node = node_plain
    node.limit(LIMIT)
    out, used = run_holding(node, [py, "-c", frameworks.TORCH_GRAPH, str(CHUNK)], {})
    assert out["graph"][0]["replayed"] == "1"
    [row] = out["graphs"]
    assert row["err"] == "OutOfMemoryError", row
    assert used <= LIMIT and LIMIT - used < CHUNK + SLACK
    assert int(row["reserved"]) == used


def test_pytorch_runs_on_the_simulated_gpu_without_a_slice(tmp_path: Path, py: str, build_dir: Path) -> None:
    """Without libvgpu.so: copies round-trip and the device is the simulated one."""
    from sim.fakegpu.harness import FakeGPU

    gpu = FakeGPU(tmp_path / "gpu", build_dir, gpus=1, memory=8 << 30)
    try:
        code = (
            "import torch\n"
            "x = torch.arange(1 << 16, dtype=torch.float32)\n"
            "g = x.cuda(); y = g * 2; torch.cuda.synchronize()\n"
            "print('ok', torch.cuda.is_available(), torch.cuda.device_count(), torch.equal(g.cpu(), x),"
            " torch.cuda.get_device_name(0).replace(' ', '_'), torch.cuda.mem_get_info()[1])\n"
        )
        p = gpu.run([py, "-c", code], timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.split()[-6:] == ["ok", "True", "1", "True", "NVIDIA_Fake_GPU", str(8 << 30)]
    finally:
        gpu.close()


@pytest.mark.parametrize("kind", ["default", "async"])
def test_cupy_for_cuda_13_stops_at_the_slice(node_plain: Node, py: str, tmp_path: Path, kind: str) -> None:
    """cupy-cuda13x (its own CUDA 13 runtime, NVRTC 13) in the frameworks venv."""
    node = node_plain
    node.limit(16 * CHUNK)
    env = {"CUPY_CACHE_DIR": str(tmp_path / "cupy-cache")}
    out, used = run_holding(node, [py, "-c", cudart.CUPY_FILL, kind, str(CHUNK)], env)
    [row] = out["fill"]
    assert (row["count"], row["err"]) == ("16", "OutOfMemoryError"), out
    assert used == 16 * CHUNK


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "backend:cudaMallocAsync"])
def test_oversubscribed_pytorch_keeps_to_its_physical_share(node_plain: Node, py: str, conf: str) -> None:
    """Virtual device memory (docs/operators/virtual-memory.md): an 8 GiB GPU, two slices of 8 GiB
    with 4 GiB physical shares (K = 2, S = 2; half that for expandable segments).  PyTorch fills
    its slice through each allocator — cudaMalloc, cuMemCreate (expandable segments),
    cudaMallocAsync — and the simulated GPU holds at most the share of it on the device; the
    neighbour then gets its whole share of VRAM."""
    node = node_plain
    gpu = 32 * CHUNK
    if conf == "expandable_segments:True":
        # every 20 MiB segment is a handle exportable as a descriptor, and the simulated node has
        # 256 entries for those (FG_MAX_SHARED, sim/fakegpu/src/fg_state.h): a 4 GiB GPU here
        gpu = 16 * CHUNK
    share = gpu // 2
    node.write_config(f"[device]\nmemory = {gpu}\ncontext_overhead = 0\n")
    node.limit(gpu, oversub=True, device=share)
    argv = [py, "-c", frameworks.TORCH_FILL, str(CHUNK)]
    proc = subprocess.Popen(
        argv,
        env=node.env(True, {"PYTORCH_CUDA_ALLOC_CONF": conf}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        out = cudart.read_until_holding(proc)
        [row] = cudart.parse(out)["fill"]
        [me] = [p for p in node.dump()["processes"] if p["host_pid"] == proc.pid]
        resident, host = int(me["devices"][0]["used"]), int(me["devices"][0]["managed_host"])
        # the whole slice is usable (less the allocator's rounding), at most the share on the device
        assert int(row["big"]) >= gpu // CHUNK - 1 and int(row["bytes"]) > gpu - SLACK - CHUNK, row
        assert resident <= share, (resident, row)
        if conf != "expandable_segments:True":  # host-NUMA handles are not managed memory
            assert host >= gpu - share - CHUNK, (host, row)
        assert int(row["total"]) == gpu  # the slice, here equal to the hardware
        # the neighbour (another container, its own region): its whole share of VRAM, now
        other = node.tmp / "other.limits"
        other.write_text(f"vgpu-limits 2\n{UUID0} {gpu} 50 1 {share}\n")
        env = {"VGPU_LIMITS_FILE": str(other), "VGPU_REGION_FILE": str(node.tmp / "other.region")}
        r = node.cutest("gpa", "init", *["alloc", CHUNK] * (share // CHUNK), env=env)
        assert [x["rc"] for x in r.all("alloc")] == ["0"] * (share // CHUNK), r.out
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
