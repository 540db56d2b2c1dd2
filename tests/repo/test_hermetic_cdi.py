"""The suite is hermetic on a GPU node: with NVIDIA's CDI spec in /etc/cdi and /var/run/cdi (the
recorded `nvidia-ctk cdi generate` output), every test that reads or writes CDI specs, containerd
or podman state passes, and leaves both directories exactly as it found them.

The spec is installed in a mount namespace of the run's own (tests/support/cdiguard.py: fresh
tmpfs mounts on both directories, seen by every process the tests start), not in the host's
directories: on a real GPU node those hold the node's own spec, which pods starting meanwhile
need, and other test runs on the machine must not see ours.  The host's directories are checked
unchanged too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cdiguard, traces

ROOT = Path(__file__).resolve().parents[2]
SPEC = "nvidia-toolkit/cdi-spec/nvidia.com-gpu.json"
# Every test file that reads or writes CDI specs, containerd's or podman's state.
CDI_TESTS = [
    "tests/node_setup/test_nodetype.py",  # detection, also through `containerd config dump`
    "tests/node_setup/test_containerd_install.py",
    "tests/node_setup/test_containerd_cri.py",  # containerd with the node shapes' CDI specs
    "tests/vgpuctl/test_doctor.py",
    "tests/runtime_hook/test_podman.py",  # podman resolving nvidia.com/gpu=...
    "tests/dra_plugin/test_podman_cdi.py",  # the DRA plugin's claim specs under podman
    "tests/dra_plugin/test_grpc.py",  # the DRA plugin writing and removing claim specs
    "tests/dra_plugin/test_process.py",
    "tests/sim/test_toolkit.py",  # the NVIDIA runtime stand-in reading spec dirs
]

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"),
]


def test_cdi_tests_pass_beside_nvidias_spec_and_leave_the_cdi_dirs_alone(tmp_path: Path) -> None:
    spec = tmp_path / os.path.basename(SPEC)
    spec.write_bytes(traces.path(SPEC).read_bytes())
    made = [d for d in map(Path, cdiguard.DIRS) if not d.exists()]  # mount points (the host lacks /etc/cdi)
    for d in made:
        d.mkdir(parents=True)
    try:
        host_before = cdiguard.contents()
        outer = os.readlink("/proc/self/ns/mnt")
        r = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-m", "tests.support.cdiguard",
             outer, str(spec), "--", "-q", "--basetemp", str(tmp_path / "run"), *CDI_TESTS],
            cwd=ROOT, capture_output=True, text=True, timeout=1700,
        )  # fmt: skip
        host_after = cdiguard.contents()
    finally:
        for d in reversed(made):
            d.rmdir()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    installed = {f"{d}/{spec.name}" for d in cdiguard.DIRS}
    assert set(out["before"]) == installed  # the run saw NVIDIA's spec in both directories
    assert out["rc"] == 0, out["tail"]
    assert out["after"] == out["before"]  # nothing written, removed or changed there
    assert host_after == host_before  # and the host's own directories were never touched
