"""The real `vgpu-dra-plugin` process over the simulated NVML (sim/fakegpu): what it would
publish, serving and publishing, a clean stop, a restart from its checkpoint, uninstall."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_plugin.config import Settings
from sim import kubeapi
from sim.drakubelet import DRAKubelet
from sim.fakegpu.harness import FakeGPU
from sim.procs import terminate
from tests.dra_plugin.conftest import GIB, NODE
from tests.dra_plugin.support import Claims
from tests.support import resourcevalidation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.vgpu.k8s.io"


@pytest.fixture
def node(tmp_path: Path, build_dir: Path) -> Iterator[FakeGPU]:
    g = FakeGPU(
        tmp_path / "fakegpu", build_dir, gpus=2, memory=16 * GIB, cc_major=8, cc_minor=6, driver_version="580.65.06"
    )
    try:
        yield g
    finally:
        g.close()


def argv(cfg: Settings, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "dra_plugin", *extra,
        "--config", str(Path(cfg.state_dir).parent / "none.toml"),
        "--state-dir", cfg.state_dir,
        "--kubelet-dir", cfg.kubelet_dir,
        "--cdi-dir", cfg.cdi_dir,
        "--node-name", NODE,
        "--library-path", cfg.library_path,
    ]  # fmt: skip


def env(node: FakeGPU, kube: kubeapi.KubeAPI | None, tmp: Path) -> dict[str, str]:
    e = {**node.env, "KUBECONFIG": str(kube.write_kubeconfig(tmp / "kubeconfig")) if kube else str(tmp / "none")}
    e.pop("KUBERNETES_SERVICE_HOST", None)
    return e


def test_print_describes_the_simulated_gpus(cfg: Settings, node: FakeGPU, tmp_path: Path) -> None:
    r = subprocess.run(
        [*argv(cfg, "print"), "--extended-resource-name", "nvidia.com/gpu", "--device-split-count", "4"],
        env=env(node, None, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    objs = json.loads(r.stdout)
    assert [o["kind"] for o in objs] == ["ResourceSlice", "DeviceClass"]
    assert all(resourcevalidation.validate(o) == [] for o in objs)
    d0 = objs[0]["spec"]["devices"][0]
    assert d0["attributes"]["uuid"] == {"string": node.uuids[0]}
    assert d0["attributes"]["cudaComputeCapability"] == {"version": "8.6.0"}
    assert d0["attributes"]["driverVersion"] == {"version": "580.65.6"}
    assert d0["capacity"]["memory"]["requestPolicy"]["default"] == "4Gi"  # 1/4 of 16 GiB
    assert objs[1]["spec"]["extendedResourceName"] == "nvidia.com/gpu"


def test_bad_settings_exit_2_naming_them(cfg: Settings, node: FakeGPU, tmp_path: Path) -> None:
    for extra, word in (
        (["--nvidia-cdi-device", "serial"], "nvidia_cdi_device"),
        (["--memory-step", "0"], "memory_step"),
    ):
        r = subprocess.run(
            [*argv(cfg, "print"), *extra],
            env=env(node, None, tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_publish_stop_restart_uninstall(
    cfg: Settings, node: FakeGPU, kube: kubeapi.KubeAPI, tmp_path: Path
) -> None:
    from vgpu.nvml import GPUInfo

    e = env(node, kube, tmp_path)
    log = open(tmp_path / "plugin.log", "wb")
    with DRAKubelet(cfg.kubelet_dir) as kubelet:
        proc = subprocess.Popen(argv(cfg), env=e, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            kubelet.wait_registered(DRIVER, timeout=60)
            [s] = _wait_slices(kube)
            assert [d["attributes"]["uuid"]["string"] for d in s["spec"]["devices"]] == node.uuids
            gpus = [GPUInfo(i, u, "x", 16 * GIB, None, None) for i, u in enumerate(node.uuids)]
            c = Claims(kube, cfg, gpus).make({"gpu": {"memory": "6Gi", "cores": "30"}})
            first = kubelet.prepare(DRIVER, [c])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert not os.path.exists(cfg.registration_socket) and not os.path.exists(cfg.endpoint)
            proc = subprocess.Popen(argv(cfg), env=e, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            kubelet.wait_registered(DRIVER, count=2, timeout=60)
            assert kubelet.prepare(DRIVER, [c]) == first
            kubelet.unprepare(DRIVER, [c])
            assert [s["spec"]["pool"]["generation"] for s in _wait_slices(kube)] == [1]  # unchanged: no bump
        finally:
            terminate(proc, 15)
            log.close()
    r = subprocess.run(argv(cfg, "unpublish"), env=e, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "deleted 1 ResourceSlice" in r.stdout and kube.objects("resourceslices") == []


def _wait_slices(kube: kubeapi.KubeAPI, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = kube.objects("resourceslices")
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError("no ResourceSlice published")


def test_an_xid_withdraws_the_gpu(cfg: Settings, node: FakeGPU, kube: kubeapi.KubeAPI, tmp_path: Path) -> None:
    from vgpu.nvml import GPUInfo

    log = open(tmp_path / "plugin.log", "wb")
    with DRAKubelet(cfg.kubelet_dir) as kubelet:
        proc = subprocess.Popen(
            argv(cfg), env=env(node, kube, tmp_path), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
        try:
            kubelet.wait_registered(DRIVER, timeout=60)
            _wait_slices(kube)
            gpus = [GPUInfo(i, u, "x", 16 * GIB, None, None) for i, u in enumerate(node.uuids)]
            claims = Claims(kube, cfg, gpus)
            claims.make({"a": {"memory": "14Gi"}})  # fills gpu-0: the next claim lands on gpu-1
            on_gpu1 = claims.make({"b": {"memory": "4Gi"}})
            node.inject_xid(1, 79)  # "GPU has fallen off the bus": a critical XID
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                [s] = kube.objects("resourceslices")
                if [d["name"] for d in s["spec"].get("devices", [])] == ["gpu-0"]:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"gpu-1 still published: {kube.objects('resourceslices')}")
            assert s["spec"]["pool"]["generation"] == 2
            resp = kubelet.prepare_raw(DRIVER, [on_gpu1])
            assert "unhealthy device gpu-1" in resp.claims[on_gpu1.uid].error
        finally:
            terminate(proc, 15)
            log.close()
