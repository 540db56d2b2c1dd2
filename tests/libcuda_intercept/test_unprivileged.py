"""The same scenarios as an unprivileged user (nobody), as container processes
usually run: limits file read-only and root-owned, region writable."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import BUILD, MiB, Node, parse_lines

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vgpu-unpriv-", dir="/tmp"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as_nobody(node: Node, *cmds: object) -> tuple[int, list[dict[str, str]], str]:
    argv = [*NOBODY, str(BUILD / "intercept" / "cutest"), "gpa", *map(str, cmds)]
    p = subprocess.run(argv, env=node.env(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    return p.returncode, parse_lines(p.stdout), p.stderr


def test_limits_enforced_for_an_unprivileged_process(node: Node, shared_dir: Path, build_dir: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root to switch to nobody")
    probe = subprocess.run([*NOBODY, "test", "-x", str(BUILD / "intercept" / "cutest")], timeout=30)
    if probe.returncode != 0:
        pytest.skip("the build directory is not reachable for nobody")
    n = Node(shared_dir, node.flavour)
    n.limit(32 * MiB)
    n.limits.chmod(0o444)  # root-owned, read-only, as mounted
    n.region.touch(mode=0o666)
    n.region.chmod(0o666)
    rc, rows, err = _as_nobody(n, "init", "alloc", 32 * MiB, "alloc", 1, "info", "free", 0, "alloc", 32 * MiB)
    assert rc == 0, err
    allocs = [r for r in rows if r["_"] == "alloc"]
    assert [a["rc"] for a in allocs] == ["0", "2", "0"]
    assert next(r for r in rows if r["_"] == "info")["free"] == "0"
    # nobody cannot replace the limits file with a looser one
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(
            [*NOBODY, "sh", "-c", f"echo 'vgpu-limits 1' > {n.limits}"], check=True, timeout=30, capture_output=True
        )
