"""Real programs in runc containers through the hook's real mounts, against a slice.

The container gets what a vGPU container gets on a node: the prestart hook (`vgpu-hook`, as
`vgpu-hook containerd install` writes it) reads the allocation record and bind-mounts
/etc/ld.so.preload, /run/vgpu/libvgpu.so, the limits file and the region; the simulated GPU's
libraries and state file are bind-mounted as the docs describe (docs/developers/simulators.md, "Using it").
Inside, unmodified programs run: a C program linked against NVIDIA's libcudart.so.12 from PyPI
(cudaMalloc until it fails) and CuPy (its default pool and its stream-ordered pool).  They reach
cudaErrorMemoryAllocation / cupy.cuda.memory.OutOfMemoryError exactly at the slice; the oracle
is the simulated GPU's own count of the container process's memory, read from the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.fakegpu.harness import FakeGPU
from tests.support import cudart
from tests.support import hook as support

MiB = 1 << 20
CHUNK = 64 * MiB
LIMIT = 16 * CHUNK + 33 * MiB

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not support.have_runc(), reason="needs root, runc and busybox-static"),
]

BUILD = Path(__file__).resolve().parents[2] / "build"


def _bind(src: str, *, ro: bool = True) -> dict[str, object]:
    return {
        "destination": src,
        "type": "bind",
        "source": src,
        "options": ["rbind", "nosuid", "nodev", "ro" if ro else "rw"],
    }


def host_dirs() -> tuple[list[str], dict[str, str]]:
    """The host directories a dynamic program and the venv's Python need, and the top-level
    symlinks (/lib -> usr/lib on merged-/usr systems) the rootfs must mirror."""
    dirs, links = [], {}
    for top in ("/lib", "/lib64"):
        if os.path.islink(top):
            links[top] = os.readlink(top)
            dirs.append(os.path.realpath(top))
        elif os.path.isdir(top):
            dirs.append(top)
    dirs.append("/usr/lib")
    dirs += [sys.base_prefix, sys.prefix, str(BUILD / "fakegpu")]
    out: list[str] = []
    for d in sorted({os.path.realpath(x) for x in dirs if os.path.isdir(x)}, key=len):
        if not any(d == p or d.startswith(p + "/") for p in out):
            out.append(d)
    return out, links


class Box:
    """One simulated node with a vGPU slice on its first GPU, and runc containers on it."""

    def __init__(self, base: Path, gpu: FakeGPU) -> None:
        self.base, self.gpu = base, gpu
        self.state = base / "state"
        self.runc_root = base / "runc"
        self.runc_root.mkdir()
        self.token = support.write_record(self.state, [(gpu.uuids[0], LIMIT, 50)])
        self.hooks = support.hooks(self.state, BUILD / "libvgpu.so", base / "log")

    def start(self, cid: str, argv: list[str], extra_ro: list[str], env: list[str]) -> subprocess.Popen[str]:
        bundle = self.base / cid
        dirs, links = host_dirs()
        rootfs = support.make_rootfs(bundle / "rootfs")
        for path, target in links.items():
            if not (rootfs / path.lstrip("/")).exists():
                (rootfs / path.lstrip("/")).symlink_to(target)
        support.make_bundle(
            bundle,
            argv,
            rootfs=rootfs,
            hook=self.hooks,
            env=[
                f"VGPU_ALLOCATION_TOKEN={self.token}",
                f"NVIDIA_VISIBLE_DEVICES={self.gpu.uuids[0]}",
                f"FAKEGPU_STATE={self.gpu.state_path}",
                f"FAKEGPU_CONFIG={self.gpu.config_path}",
                f"LD_LIBRARY_PATH={BUILD / 'fakegpu'}",
                "HOME=/tmp",
                *env,
            ],
        )
        cfg = json.loads((bundle / "config.json").read_text())
        cfg["mounts"] += [_bind(d) for d in dirs + extra_ro] + [_bind(str(self.gpu.state_path.parent), ro=False)]
        (bundle / "config.json").write_text(json.dumps(cfg))
        return subprocess.Popen(
            ["runc", "--root", str(self.runc_root), "run", "--bundle", str(bundle), cid],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run_holding(self, cid: str, argv: list[str], extra_ro: list[str], env: list[str]) -> tuple[str, int]:
        """Runs the container until its program prints `holding`; returns its output and the
        simulated GPU's count of the memory of the container's processes at that moment."""
        proc = self.start(cid, argv, extra_ro, env)
        assert proc.stdout is not None and proc.stdin is not None
        try:
            out = cudart.read_until_holding(proc)
            st = self.gpu.state()
            used = sum(int(p["devices"][0]["used"]) for p in st["processes"])
            # the container really got the hook's files: libvgpu.so preloaded from /run/vgpu
            assert (self.state / "containers" / cid / "limits").exists()
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
            subprocess.run(["runc", "--root", str(self.runc_root), "delete", "--force", cid], capture_output=True)
        return out, used


@pytest.fixture
def box(tmp_path: Path, build_dir: Path) -> Iterator[Box]:
    gpu = FakeGPU(tmp_path / "fakegpu", build_dir, gpus=1, memory=8 << 30, context_overhead=0)
    try:
        yield Box(tmp_path, gpu)
    finally:
        gpu.close()


def test_cudart_program_in_a_container_stops_at_the_slice(box: Box, tmp_path: Path) -> None:
    if cudart.libcudart(12) is None:
        pytest.skip("nvidia-cuda-runtime-cu12 not installed")
    progdir = tmp_path / "prog"
    prog = cudart.build_prog(progdir, 12)
    argv = [
        str(prog),
        "fill",
        "malloc",
        str(CHUNK),
        "fill",
        "malloc",
        str(32 * MiB),
        "1",
        "fill",
        "malloc",
        str(MiB),
        "1",
        "fill",
        "malloc",
        "1",
        "1",
        "hold",
    ]
    out, used = box.run_holding("cudart", argv, [str(progdir)], [])
    big, rest, last, over = cudart.parse(out)["fill"]
    assert (big["count"], big["name"]) == ("16", "cudaErrorMemoryAllocation"), out
    assert (rest["count"], last["count"], over["count"], over["err"]) == ("1", "1", "0", "2"), out
    assert used == LIMIT  # exactly the slice, on the simulated GPU's own count


@pytest.mark.parametrize("kind", ["default", "async"])
def test_cupy_in_a_container_stops_at_the_slice(box: Box, kind: str) -> None:
    if not cudart.have_cupy():
        pytest.skip("cupy-cuda12x not installed")
    cache = box.gpu.state_path.parent / "cupy-cache"  # a directory the container writes
    argv = [sys.executable, "-c", cudart.CUPY_FILL, kind, str(CHUNK)]
    out, used = box.run_holding(f"cupy-{kind}", argv, [], [f"CUPY_CACHE_DIR={cache}", "PYTHONDONTWRITEBYTECODE=1"])
    [row] = cudart.parse(out)["fill"]
    assert (row["count"], row["err"]) == ("16", "OutOfMemoryError"), out
    assert used == 16 * CHUNK
