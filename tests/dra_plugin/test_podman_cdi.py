"""Our claim CDI spec consumed by a real CDI engine: Debian's podman 4.3 (with runc), next to the
simulated NVIDIA spec (`fakegpu-cdi`), with the CDI device IDs the plugin returned to the kubelet
stand-in over gRPC. The container gets the GPU from NVIDIA's spec and the slice from ours: the
real libvgpu.so, preloaded through the /etc/ld.so.preload we mount, shows exactly the claimed
memory in cuMemGetInfo and refuses an allocation past it; two containers of one claim share one
slice, while another claim's container has its own.

The simulated NVIDIA spec and the plugin's specs go to the test's own CDI directory, which podman
reads in place of /etc/cdi and /var/run/cdi (tests/support/podman.py): the node's are never
read or written."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_plugin.config import Settings
from sim import kubeapi
from sim.drakubelet import DRAKubelet, cdi_devices
from sim.fakegpu import toolkit as tk
from sim.fakegpu.harness import FakeGPU
from tests.dra_plugin.conftest import GIB, make_cfg
from tests.dra_plugin.support import Claims, start_plugin
from tests.support import hook as support
from tests.support.podman import Podman, needs_podman

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(240),
    needs_podman,
]
LIB_DIR = "/usr/local/nvidia/lib64"
BURN = "/opt/fakegpu/fakegpu-burn"
DRIVER = "gpu.vgpu.k8s.io"


def burn_lines(out: str) -> list[dict[str, object]]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"pid"')]


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    return support.make_cdi_rootfs(tmp_path / "rootfs")


@pytest.fixture
def node(tmp_path: Path, build_dir: Path, podman: Podman) -> Iterator[FakeGPU]:
    g = FakeGPU(tmp_path / "fakegpu", build_dir, gpus=2, memory=16 * GIB)
    (podman.cdi / "fakegpu.json").write_text(json.dumps(tk.generate_cdi_spec(g, container_lib_dir=LIB_DIR)))
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def cfg(tmp_path: Path, build_dir: Path, podman: Podman) -> Settings:
    return make_cfg(tmp_path, cdi_dir=str(podman.cdi), library_path=str(build_dir / "libvgpu.so"))


def test_claimed_memory_is_what_the_container_sees_and_gets(
    cfg: Settings, node: FakeGPU, kube: kubeapi.KubeAPI, rootfs: Path, podman: Podman
) -> None:
    from vgpu.nvml import GPUInfo

    gpus = [GPUInfo(i, u, "NVIDIA Fake GPU", 16 * GIB, None, None) for i, u in enumerate(node.uuids)]
    plugin = start_plugin(cfg, gpus, kube)
    claims = Claims(kube, cfg, gpus)
    try:
        with DRAKubelet(cfg.kubelet_dir) as kubelet:
            kubelet.wait_registered(DRIVER)
            a = claims.make({"gpu": {"memory": "6Gi", "cores": "30"}})
            b = claims.make({"gpu": {"memory": "6Gi", "cores": "30"}})
            devs = kubelet.prepare(DRIVER, [a, b])
            ids_a, ids_b = cdi_devices(devs[a.uid], "gpu"), cdi_devices(devs[b.uid], "gpu")
            assert ids_a[0] == ids_b[0] == f"nvidia.com/gpu={node.uuids[0]}"  # both 6 GiB on GPU 0
            libs = ["-v", "/usr/lib:/usr/lib:ro", "-v", "/usr/lib64:/usr/lib64:ro", "-v", f"{node.burn}:{BURN}:ro"]
            libs += ["-e", f"LD_LIBRARY_PATH={LIB_DIR}"]
            dev_a = [x for i in ids_a for x in ("--device", i)]
            dev_b = [x for i in ids_b for x in ("--device", i)]

            show = "cat /etc/ld.so.preload; cat /run/vgpu/limits; echo claim=$VGPU_CLAIM_UID; "
            r = podman.run(rootfs, *dev_a, *libs, show + f"{BURN} --seconds 0 && {BURN} --alloc 5g --seconds 0")
            assert r.returncode == 0, r.stderr
            assert "/run/vgpu/libvgpu.so" in r.stdout and f"{node.uuids[0]} {6 * GIB} 30 0 {6 * GIB}" in r.stdout
            assert f"claim={a.uid}" in r.stdout
            first, alloc = burn_lines(r.stdout)
            assert first["uuid"] == node.uuids[0] and first["mem_total"] == 6 * GIB
            assert alloc["alloc_result"] == 0

            r = podman.run(rootfs, *dev_a, *libs, f"{BURN} --alloc 7g --seconds 0")
            assert r.returncode == 3, (r.stdout, r.stderr)  # out of memory: refused past the claim
            assert burn_lines(r.stdout)[0]["alloc_result"] == 2  # CUDA_ERROR_OUT_OF_MEMORY

            # Two containers of claim A share its 6 GiB: one holds 4 GiB, the other cannot take
            # 3 more; a container of claim B, on the same GPU, has a slice of its own.
            holder = podman.start(rootfs, *dev_a, *libs, f"{BURN} --alloc 4g --seconds 0 --hold 60")
            try:
                _wait_held(node, 4 * GIB)
                r = podman.run(rootfs, *dev_a, *libs, f"{BURN} --alloc 3g --seconds 0")
                assert r.returncode == 3, (r.stdout, r.stderr)
                r = podman.run(rootfs, *dev_a, *libs, f"{BURN} --alloc 1g --seconds 0")
                assert r.returncode == 0, (r.stdout, r.stderr)
                r = podman.run(rootfs, *dev_b, *libs, f"{BURN} --alloc 5g --seconds 0")
                assert r.returncode == 0, (r.stdout, r.stderr)
            finally:
                holder.kill()
                holder.communicate(timeout=60)

            kubelet.unprepare(DRIVER, [a, b])
            r = podman.run(rootfs, *dev_a, *libs, "echo STARTED")
            assert r.returncode != 0 and "STARTED" not in r.stdout
            # Fail closed: the runtime refuses the container. (podman 4.3 then names every device
            # of the request as unresolvable, NVIDIA's too.)
            assert "unresolvable CDI devices" in r.stderr and f"vgpu.k8s.io/claim={a.uid}" in r.stderr
    finally:
        plugin.stop()


def _wait_held(node: FakeGPU, nbytes: int, timeout: float = 60) -> None:
    """Until the simulated GPU shows a process holding at least `nbytes`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = node.state().get("processes") or []
        if any(int(d.get("allocated", 0)) >= nbytes for p in procs for d in p.get("devices") or []):
            return
        time.sleep(0.2)
    raise TimeoutError(f"no process holds {nbytes} bytes: {node.state()}")
