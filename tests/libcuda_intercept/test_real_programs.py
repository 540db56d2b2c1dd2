"""Programs as users run them, under libvgpu.so against a slice: a C program linked against
NVIDIA's libcudart (12.9 and 13.x from PyPI) allocating with cudaMalloc, cudaMallocPitch,
cudaMallocManaged, cudaMallocAsync and a pool, and CuPy with its default pool and its
stream-ordered pool, and a captured CUDA graph whose memory node allocates (where the simulated
driver models stream capture).  Each reaches the out-of-memory error of its API exactly at the slice and not
before.  The oracle is the simulated GPU's own count of the process's device memory (`fakegpu-ctl
dump`), never the library's region.  tests/e2e/test_real_programs.py runs the same programs in runc
containers through the hook's real mounts.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import FAKE, UUID0, Node
from tests.support import cudart

MiB = 1 << 20
CHUNK = 64 * MiB
LIMIT = 1024 * MiB + 33 * MiB  # 16 chunks fit, not a 17th; then 32 MiB do, and the last 1 MiB

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def progdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cudart")


def sim_used(node: Node, pid: int) -> int:
    """The simulated GPU's count of the process's memory on device 0: allocations, pool
    reservations, and managed memory wherever its pages are (contexts cost 0 on this node).
    Managed pages are populated on first touch (docs/developers/simulators.md, "Memory model"):
    until a kernel touches them the simulator counts them as not yet on the device."""
    for p in node.dump()["processes"]:
        if p["host_pid"] == pid:
            d = p["devices"][0]
            return int(d["used"]) + int(d["managed_host"])
    raise AssertionError(f"process {pid} not on the simulated GPU")


def run_holding(node: Node, argv: list[str], env: dict[str, str] | None = None) -> tuple[str, int]:
    """Runs argv under the library until it prints `holding`; returns its output and the
    simulated GPU's count of its memory at that moment, then lets it exit."""
    proc = subprocess.Popen(
        argv, env=node.env(True, env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        out = cudart.read_until_holding(proc)
        used = sim_used(node, proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return out, used


KINDS = ["malloc", "pitch", "managed", "async", "pool", "graph"]


def driver_has(name: str) -> bool:
    """Whether the simulated driver serves an entry point (cuGetProcAddress at CUDA 13.0)."""
    lib = ctypes.CDLL(str(FAKE / "libcuda.so.1"))
    fn, st = ctypes.c_void_p(), ctypes.c_int()
    lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), 13000, ctypes.c_ulonglong(0), ctypes.byref(st))
    return bool(fn.value)


@pytest.mark.parametrize(
    ("major", "kind"),
    [pytest.param(12, k, id=f"cudart12-{k}") for k in KINDS] + [pytest.param(13, "malloc", id="cudart13-malloc")],
)
def test_cudart_program_reaches_oom_exactly_at_the_slice(
    node_plain: Node, progdir: Path, major: int, kind: str
) -> None:
    if cudart.libcudart(major) is None:
        pytest.skip(f"libcudart.so.{major} wheel not installed")
    if kind == "graph" and not driver_has("cuStreamBeginCapture"):
        pytest.skip("the simulated driver does not model stream capture (cuStreamBeginCapture)")
    node = node_plain
    node.limit(LIMIT)
    prog = cudart.build_prog(progdir, major)
    argv = [str(prog), "fill", kind, str(CHUNK), "fill", kind, str(32 * MiB), "1"]
    if kind in ("async", "pool", "graph"):
        # pools (and the graph memory pool) reserve in 2 MiB steps: the last 1 MiB cannot hold one
        argv += ["fill", kind, str(2 * MiB), "1", "hold"]
        expect_used = 16 * CHUNK + 32 * MiB
    else:
        last = str(MiB) if kind == "pitch" else "1"  # pitch: rows of 1 MiB
        argv += ["fill", kind, str(MiB), "1", "fill", kind, last, "1", "hold"]
        expect_used = LIMIT
    out, used = run_holding(node, argv)
    rows = cudart.parse(out)["fill"]
    big, rest, *tail = rows
    # 16 chunks and no 17th; then 32 MiB; then the slice's last MiB, and not one byte more
    assert (big["count"], big["err"], big["name"]) == ("16", "2", "cudaErrorMemoryAllocation"), out
    assert (rest["count"], rest["err"]) == ("1", "0"), out
    if kind not in ("async", "pool", "graph"):
        assert (tail[0]["count"], tail[0]["err"]) == ("1", "0"), out
    assert (tail[-1]["count"], tail[-1]["err"]) == ("0", "2"), out
    # the simulated GPU holds exactly what was granted: the slice, and nothing past it
    assert used == expect_used
    assert LIMIT - used < 2 * MiB


@pytest.mark.parametrize("kind", ["default", "async"])
def test_cupy_reaches_out_of_memory_error_exactly_at_the_slice(node_plain: Node, tmp_path: Path, kind: str) -> None:
    if not cudart.have_cupy():
        pytest.skip("cupy-cuda12x not installed")
    node = node_plain
    node.limit(16 * CHUNK)
    env = {"CUPY_CACHE_DIR": str(tmp_path / "cupy-cache")}
    out, used = run_holding(node, [sys.executable, "-c", cudart.CUPY_FILL, kind, str(CHUNK)], env)
    [row] = cudart.parse(out)["fill"]
    assert (row["count"], row["err"]) == ("16", "OutOfMemoryError"), out
    assert used == 16 * CHUNK


def test_without_the_library_the_same_program_goes_past_the_slice(node_plain: Node, progdir: Path) -> None:
    """The control: the limit above is the library's doing, not the simulator's."""
    if cudart.libcudart(12) is None:
        pytest.skip("libcudart.so.12 wheel not installed")
    node = node_plain
    node.limit(LIMIT)
    prog = cudart.build_prog(progdir, 12)
    p = subprocess.run(
        [str(prog), "fill", "malloc", str(CHUNK), "20"], env=node.env(False), capture_output=True, text=True, timeout=60
    )
    [row] = cudart.parse(p.stdout)["fill"]
    assert (row["count"], row["err"]) == ("20", "0")
    assert UUID0  # the slice is on the first GPU
