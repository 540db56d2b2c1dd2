"""libvgpu.so is loaded by the container's glibc, which may be old; ld.so
ignores a preload it cannot load (the process would run unlimited), so the
library must not need symbol versions newer than glibc 2.17."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.libcuda_intercept.support import BUILD


def test_needs_no_glibc_newer_than_2_17(build_dir: Path) -> None:
    if not shutil.which("objdump"):
        pytest.skip("objdump not installed")
    out = subprocess.run(
        ["objdump", "-T", str(BUILD / "libvgpu.so")], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    versions = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", out)}
    assert versions, out
    assert max(versions) <= (2, 17), sorted(versions)
    # and it still exports the entry points a preload needs
    for sym in ("dlsym", "cuGetProcAddress_v2", "cuMemAlloc_v2", "nvmlDeviceGetMemoryInfo_v2"):
        assert re.search(rf"\s{sym}$", out, re.M), sym
