"""The bypass matrix (build/intercept/matrix, tests/libcuda_intercept/c/matrix.c): processes of one
container run a seeded random mix of every allocation path against one limit; the simulated
GPU's own high-water marks are the oracle.  1,000 seeds through libvgpu.so, a share of them
through its ASan + UBSan build, and a control run without the library that must fail.  A failing
seed is printed as "FAIL seed=N ..." and reproduces with the same command line (the interleaving
of the processes varies; MATRIX_TRACE=1 traces every operation)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import BUILD, FAKE, UUID0, GiB, MiB, asan_runtime, have_fake

LIMIT = 256 * MiB
HW = 1 * GiB
CTX = 2 * MiB  # the simulated context overhead, and the library's per-context reserve

# (first seed, last seed, processes, operations per process): 1,000 seeds in all
BATCHES = [(0, 249, 3, 50), (250, 499, 3, 50), (500, 749, 4, 40), (750, 999, 6, 30)]


def _env(tmp: Path, preload: str | None) -> dict[str, str]:
    (tmp / "conf").write_text(f"[device]\nmemory = {HW}\ncontext_overhead = {CTX}\n")
    (tmp / "limits").write_text(f"vgpu-limits 1\n{UUID0} {LIMIT} 50 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "FAKEGPU_", "LD_", "ASAN", "UBSAN"))}
    env.update(
        FAKEGPU_STATE=str(tmp / "state"),
        FAKEGPU_CONFIG=str(tmp / "conf"),
        LD_LIBRARY_PATH=str(FAKE),
        VGPU_LIMITS_FILE=str(tmp / "limits"),
        VGPU_REGION_FILE=str(tmp / "region"),
        VGPU_CONTEXT_RESERVE=str(CTX),
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:exitcode=99:verify_asan_link_order=0",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=99",
    )
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _matrix(tmp: Path, preload: str | None, first: int, last: int, procs: int, ops: int) -> subprocess.CompletedProcess:
    if not have_fake() or not (BUILD / "intercept" / "matrix").exists():
        pytest.skip("build/intercept/matrix or the simulated driver not built")
    argv = [str(BUILD / "intercept" / "matrix"), "gpa", str(first), str(last), str(procs), str(ops)]
    argv += [str(LIMIT), str(HW), str(CTX), str(FAKE / "fakegpu-ctl")]
    return subprocess.run(argv, env=_env(tmp, preload), capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("first,last,procs,ops", BATCHES)
def test_no_seed_takes_the_container_past_its_slice(
    tmp_path: Path, first: int, last: int, procs: int, ops: int
) -> None:
    p = _matrix(tmp_path, str(BUILD / "libvgpu.so"), first, last, procs, ops)
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    assert f"matrix seeds={first}-{last} procs={procs} ops={ops} ok" in p.stdout


@pytest.mark.timeout(900)
def test_no_seed_fails_under_asan_and_ubsan(tmp_path: Path) -> None:
    rt = asan_runtime()
    if not rt or not (BUILD / "intercept" / "libvgpu-asan.so").exists():
        pytest.skip("ASan runtime not installed")
    p = _matrix(tmp_path, f"{rt}:{BUILD / 'intercept' / 'libvgpu-asan.so'}", 2000, 2079, 3, 40)
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "Sanitizer" not in p.stderr and "runtime error" not in p.stderr, p.stderr[-3000:]


def test_without_the_library_the_matrix_fails(tmp_path: Path) -> None:
    """The control: the same workload unlimited takes the device past the slice, and the oracle
    says so (with the seed)."""
    p = _matrix(tmp_path, None, 0, 9, 3, 50)
    assert p.returncode == 1
    assert "FAIL seed=0 " in p.stdout
