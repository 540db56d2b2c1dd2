"""Virtual device memory for programs as users run them: a C program linked against NVIDIA's
libcudart (12.9 and 13.x from PyPI: cudaMalloc, cudaMallocPitch, cudaMallocManaged,
cudaMallocAsync, the default pool) and CuPy (its default pool and its stream-ordered pool), under
libvgpu.so with K = 2 and memory scaling 2 on a simulated 16 GiB GPU: each fills its 16 GiB slice
and gets its API's out-of-memory error one GiB later; the simulated GPU's own count shows 8 GiB of
it on the device; a neighbour then gets its own 8 GiB of VRAM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import UUID0, GiB, Node
from tests.support import cudart

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def progdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cudart")


@pytest.fixture
def node16(node_plain: Node) -> Node:
    node_plain.write_config("[device]\nmemory = 17179869184\ncontext_overhead = 0\n")
    return node_plain


def container(node: Node, name: str) -> dict[str, str]:
    """A container's environment: a 16 GiB slice with an 8 GiB physical share."""
    lim = node.tmp / f"{name}.limits"
    lim.write_text(f"vgpu-limits 2\n{UUID0} {16 * GiB} 50 1 {8 * GiB}\n")
    return {"VGPU_LIMITS_FILE": str(lim), "VGPU_REGION_FILE": str(node.tmp / f"{name}.region")}


def device_resident(node: Node, pid: int) -> int:
    for p in node.dump()["processes"]:
        if p["host_pid"] == pid:
            return int(p["devices"][0]["used"])
    raise AssertionError(f"process {pid} not on the simulated GPU")


def fill_and_check_neighbour(
    node: Node, argv: list[str], env: dict[str, str], on_device: int = 8 * GiB
) -> dict[str, str]:
    """Runs the program in container A until it holds its memory; checks the device-resident part
    (`on_device`, never more than the share) and that container B gets 8 GiB of device memory
    meanwhile; returns A's `fill` row."""
    proc = subprocess.Popen(
        argv, env=node.env(True, {**env, **container(node, "a")}), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        out = cudart.read_until_holding(proc)
        assert device_resident(node, proc.pid) == on_device <= 8 * GiB, out
        b = node.popen("gpa", "init", *["alloc", GiB] * 8, "wait", env=container(node, "b"))
        assert b.stdout is not None and b.stdin is not None
        got = []
        for ln in b.stdout:
            if ln.startswith("waiting"):
                break
            got.append(ln)
        assert sum("rc=0" in ln for ln in got if ln.startswith("alloc")) == 8, got
        assert node.used() == on_device + 8 * GiB  # A's device part and B's share
        b.stdin.close()
        b.wait(timeout=60)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    [row] = cudart.parse(out)["fill"]
    return row


@pytest.mark.parametrize(
    ("major", "kind"),
    [pytest.param(12, k, id=f"cudart12-{k}") for k in ("malloc", "pitch", "managed", "async", "pool")]
    + [pytest.param(13, "malloc", id="cudart13-malloc")],
)
def test_cudart_program_fills_its_slice_half_on_the_device(node16: Node, progdir: Path, major: int, kind: str) -> None:
    if cudart.libcudart(major) is None:
        pytest.skip(f"libcudart.so.{major} wheel not installed")
    prog = cudart.build_prog(progdir, major)
    # managed memory is on the device only once touched, and this program touches none of it
    on_device = 0 if kind == "managed" else 8 * GiB
    row = fill_and_check_neighbour(node16, [str(prog), "fill", kind, str(GiB), "17", "hold"], {}, on_device)
    # 16 GiB granted, the 17th over the slice: the runtime's own out-of-memory error
    assert (row["count"], row["err"], row["name"]) == ("16", "2", "cudaErrorMemoryAllocation"), row


@pytest.mark.parametrize("kind", ["default", "async"])
def test_cupy_fills_its_slice_half_on_the_device(node16: Node, tmp_path: Path, kind: str) -> None:
    if not cudart.have_cupy():
        pytest.skip("cupy-cuda12x not installed")
    env = {"CUPY_CACHE_DIR": str(tmp_path / "cupy-cache")}
    row = fill_and_check_neighbour(node16, [sys.executable, "-c", cudart.CUPY_FILL, kind, str(GiB)], env)
    assert (row["count"], row["err"]) == ("16", "OutOfMemoryError"), row
