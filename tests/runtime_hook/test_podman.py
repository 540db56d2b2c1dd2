"""podman (Debian's 4.3) as a real consumer of what we generate: the simulated GPUs' CDI spec
(`fakegpu-cdi`) taken by `podman run --device nvidia.com/gpu=<uuid>` (the device stand-in,
libraries and env appear; an unknown name fails with `unresolvable CDI devices`), and the
hooks.d entries of `vgpu-hook hooksd install` running our hook under podman only for a
container with the token annotation.

podman runs with the test's own state and CDI directories (tests/support/podman.py: the node's
/etc/cdi and /var/run/cdi are never read or written).  `--rootfs` avoids images; `--ulimit`
because root here may lack CAP_SYS_RESOURCE."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_setup import hookcmd as cli
from sim.fakegpu import toolkit as tk
from sim.fakegpu.harness import FakeGPU
from tests.support import hook as support
from tests.support.podman import Podman, needs_podman

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(180),
    needs_podman,
]
LIB_DIR = "/usr/local/nvidia/lib64"
BURN = "/opt/fakegpu/fakegpu-burn"


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    return support.make_cdi_rootfs(tmp_path / "rootfs")


@pytest.fixture
def gpu(tmp_path: Path, build_dir: Path, podman: Podman) -> Iterator[FakeGPU]:
    g = FakeGPU(tmp_path / "fakegpu", build_dir, gpus=2, memory=8 << 30)
    (podman.cdi / "fakegpu.json").write_text(json.dumps(tk.generate_cdi_spec(g, container_lib_dir=LIB_DIR)))
    try:
        yield g
    finally:
        g.close()


def libs(g: FakeGPU) -> list[str]:
    ro = ["-v", "/usr/lib:/usr/lib:ro", "-v", "/usr/lib64:/usr/lib64:ro", "-v", f"{g.burn}:{BURN}:ro"]
    return [*ro, "-e", f"LD_LIBRARY_PATH={LIB_DIR}"]


def test_cdi_device_by_uuid(rootfs: Path, gpu: FakeGPU, podman: Podman) -> None:
    script = f"ls /dev; env; {BURN} --seconds 0; {BURN} --device 1 --seconds 0; true"
    r = podman.run(rootfs, "--device", f"nvidia.com/gpu={gpu.uuids[1]}", *libs(gpu), script)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert "nvidia1" in words and "nvidiactl" in words and "nvidia0" not in words
    assert "NVIDIA_VISIBLE_DEVICES=void" in words  # as NVIDIA's generated specs leave it
    [burn] = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"pid"') and "uuid" in line]
    assert burn["uuid"] == gpu.uuids[1] and burn["device"] == 0  # one GPU visible: the chosen one
    assert '"device":1,"init_result":101}' in r.stdout  # CUDA_ERROR_INVALID_DEVICE: no 2nd GPU


def test_cdi_all_and_index(rootfs: Path, gpu: FakeGPU, podman: Podman) -> None:
    r = podman.run(rootfs, "--device", "nvidia.com/gpu=all", *libs(gpu), "ls /dev")
    assert r.returncode == 0, r.stderr
    assert {"nvidia0", "nvidia1", "nvidiactl"} <= set(r.stdout.split())
    r = podman.run(rootfs, "--device", "nvidia.com/gpu=0", *libs(gpu), f"{BURN} --seconds 0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["uuid"] == gpu.uuids[0]


def test_unknown_cdi_name_fails(rootfs: Path, gpu: FakeGPU, podman: Podman) -> None:
    r = podman.run(rootfs, "--device", "nvidia.com/gpu=GPU-00000000-0000-0000-0000-000000000000", "echo STARTED")
    assert r.returncode != 0 and "STARTED" not in r.stdout
    assert "unresolvable CDI devices nvidia.com/gpu=GPU-00000000-0000-0000-0000-000000000000" in r.stderr


def test_hooksd_entry_runs_our_hook_only_with_the_annotation(tmp_path: Path, rootfs: Path, podman: Podman) -> None:
    state, logs, hooks = tmp_path / "state", tmp_path / "log", tmp_path / "hooks.d"
    lib = support.placeholder_library(tmp_path)
    glob = ["--config", str(tmp_path / "none.toml"), "--state-dir", str(state), "--library-path", str(lib)]
    glob += ["--log-dir", str(logs)]
    assert cli.main([*glob, "hooksd", "install", "--dir", str(hooks), "--python", sys.executable]) == 0
    token = support.write_record(state)
    show = "echo PRELOAD=$(cat /etc/ld.so.preload 2>/dev/null)=; echo STARTED"
    env = ["-e", f"VGPU_ALLOCATION_TOKEN={token}"]
    r = podman.run(
        rootfs, "--hooks-dir", str(hooks), "--annotation", f"vgpu.k8s.io/allocation-token={token}", *env, show
    )
    assert r.returncode == 0, r.stderr
    assert "STARTED" in r.stdout and "PRELOAD==" not in r.stdout  # our hook mounted the preload list
    assert not (state / "containers").exists() or list((state / "containers").iterdir()) == []  # poststop ran
    # The token in the env only: hooks.d does not match, podman runs no hook of ours.
    r = podman.run(rootfs, "--hooks-dir", str(hooks), *env, show)
    assert r.returncode == 0, r.stderr
    assert "PRELOAD==" in r.stdout  # (an empty mount target may be left in the shared rootfs)
    # A token without a record: the hook ran and refused the container, in one line.
    bad = "f" * 32
    r = podman.run(rootfs, "--hooks-dir", str(hooks), "--annotation", f"vgpu.k8s.io/allocation-token={bad}", show)
    assert r.returncode != 0 and "STARTED" not in r.stdout
    assert "unknown vGPU allocation token" in r.stderr
