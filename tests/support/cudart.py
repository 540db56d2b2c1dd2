"""NVIDIA's CUDA runtime and CuPy from PyPI, as the tests run them.

`make test` installs the wheels into the venv (pyproject's dev extras): `nvidia-cuda-runtime-cu12`
(libcudart.so.12), `nvidia-cuda-runtime` (13.x: nvidia/cu13/lib/libcudart.so.13),
`nvidia-cuda-nvrtc-cu12` and `cupy-cuda12x`.  The C test program (tests/sim/c/cudart_prog.c) is
built here with the C compiler against the wheel's library, with an rpath to it, so it runs as an
unmodified program linked against cudart does.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROG_SRC = ROOT / "tests" / "sim" / "c" / "cudart_prog.c"

# CuPy code run in child processes: `fill(kind, chunk)` allocates with CuPy's default pool
# ("default") or its stream-ordered pool ("async") until OutOfMemoryError, prints one line
# `fill kind=... chunk=... count=... err=...`, then `holding` and waits for stdin to close.
CUPY_FILL = r"""
import sys, cupy
kind, chunk = sys.argv[1], int(sys.argv[2])
if kind == "async":
    cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
held, err = [], "none"
try:
    while True:
        held.append(cupy.empty(chunk, dtype=cupy.uint8))
except cupy.cuda.memory.OutOfMemoryError as e:
    err = "OutOfMemoryError"
print(f"fill kind={kind} chunk={chunk} count={len(held)} err={err}", flush=True)
print("holding", flush=True)
sys.stdin.read()
"""


def _nvidia_dir() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def libcudart(major: int) -> Path | None:
    """The wheel's libcudart.so.<major>, or None when the wheel is not installed."""
    base = _nvidia_dir()
    if base is None:
        return None
    p = base / ("cuda_runtime/lib/libcudart.so.12" if major == 12 else f"cu{major}/lib/libcudart.so.{major}")
    return p if p.exists() else None


def have_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None


def cc() -> str:
    return os.environ.get("CC") or shutil.which("cc") or "gcc"


def build_prog(out_dir: Path, major: int) -> Path:
    """tests/sim/c/cudart_prog.c linked against the wheel's libcudart.so.<major>."""
    lib = libcudart(major)
    assert lib is not None, f"libcudart.so.{major} wheel not installed"
    out = out_dir / f"cudart_prog{major}"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                cc(),
                "-std=c11",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-O1",
                "-o",
                str(out),
                str(PROG_SRC),
                str(lib),
                f"-Wl,-rpath,{lib.parent}",
            ],
            check=True,
            timeout=120,
        )
    return out


def parse(out: str) -> dict[str, list[dict[str, str]]]:
    """'name k=v ...' lines -> {name: [{k: v}, ...]}"""
    rows: dict[str, list[dict[str, str]]] = {}
    for ln in out.splitlines():
        parts = ln.split()
        if not parts or "=" in parts[0]:
            continue
        rows.setdefault(parts[0], []).append(dict(p.split("=", 1) for p in parts[1:] if "=" in p))
    return rows


def read_until_holding(proc: subprocess.Popen[str]) -> str:
    """The output of a test program up to its `holding` line (it then keeps its memory until its
    stdin closes); fails with the output and stderr when it ends before."""
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "holding":
            return "".join(lines)
    raise AssertionError("".join(lines) + (proc.stderr.read() if proc.stderr else ""))
