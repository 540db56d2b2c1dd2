"""End to end through containerd's CRI API (the path kubelet uses).

A private containerd 1.x (Debian's) runs under a temp dir with its default
config edited by `vgpu-hook containerd install`; an image built from a
busybox rootfs is imported; pods and containers are created with a small
CRI v1 client (tests/hook/cri, generated from the public API definitions).
The vGPU container carries the token as the device plugin sets it (env and
annotation); the hook arrives only through the runtime handler's
base_runtime_spec.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hook import ctrd, ociimage, support

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(240)]

_why = ctrd.available()
if _why:
    pytest.skip(f"containerd CRI test: {_why}", allow_module_level=True)

import grpc  # noqa: E402

from tests.hook.cri import api_pb2 as cri  # noqa: E402
from tests.hook.cri import api_pb2_grpc as cri_grpc  # noqa: E402


class Env:
    def __init__(self, d: Path, c: ctrd.Containerd, rt: Any, lib: Path, calls: Path) -> None:
        self.calls = calls  # one line per Python hook start (the sh filter let it through)
        self.dir = d
        self.c = c
        self.rt = rt
        self.lib = lib
        self.state = d / "vgpu"
        self.logs = d / "pod-logs"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    d = tmp_path_factory.mktemp("ctrd")
    lib = support.placeholder_library(d)
    python, calls = support.recording_python(d)
    c = ctrd.Containerd(d)
    c.write_config()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime_hook",
            "--config",
            str(d / "none.toml"),
            "--state-dir",
            str(d / "vgpu"),
            "--library-path",
            str(lib),
            "--log-dir",
            str(d / "log"),
            "containerd",
            "install",
            "--containerd-config",
            str(c.config),
            "--python",
            python,
            "--without-nvidia-runtime",  # the GPU-less module below; test_shape_* go through the NVIDIA stand-in
        ],
        capture_output=True,
        text=True,
        cwd=support.ROOT,
    )
    assert r.returncode == 0, r.stderr
    support.make_rootfs(d / "img")
    ociimage.build_image(d / "img", d / "img.tar", ctrd.IMAGE, ["sleep", "3600"])
    c.start()
    try:
        r2 = c.ctr("images", "import", "--snapshotter", c.snapshotter, str(d / "img.tar"))
        assert r2.returncode == 0, r2.stderr
        chan = grpc.insecure_channel(f"unix://{c.sock}")
        rt = cri_grpc.RuntimeServiceStub(chan)
        yield Env(d, c, rt, lib, calls)
        chan.close()
    finally:
        c.stop()


def _sandbox_config(env: Env, name: str) -> Any:
    uid = uuid.uuid4().hex
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace="team-a", attempt=0),
        log_directory=str(env.logs / uid),
        linux=cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
            )
        ),
    )


def _run(env: Env, pod: str, sb: Any, name: str, script: str, token_env: str | None, token_ann: str | None) -> Any:
    envs = [cri.KeyValue(key="PATH", value="/bin")]
    ann = {}
    if token_env:
        envs.append(cri.KeyValue(key="VGPU_ALLOCATION_TOKEN", value=token_env))
        envs.append(cri.KeyValue(key="NVIDIA_VISIBLE_DEVICES", value=support.UUID_A))
    if token_ann:
        ann["vgpu.k8s.io/allocation-token"] = token_ann
    cfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name),
        image=cri.ImageSpec(image=ctrd.IMAGE),
        command=["sh", "-c", script],
        envs=envs,
        annotations=ann,
        log_path=f"{name}.log",
    )
    return env.rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod, config=cfg, sandbox_config=sb))


def _wait_exit(env: Env, cid: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = env.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
        if st.state == cri.CONTAINER_EXITED:
            return st
        time.sleep(0.1)
    raise AssertionError(f"container {cid} did not exit")


def _wait_log(path: str, last: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    out: list[str] = []
    while time.monotonic() < deadline:
        if Path(path).exists():
            out = _log_lines(path)
            if last in out:
                return out
        time.sleep(0.1)
    raise AssertionError(f"container log never showed {last!r}: {out}")


def _wait_gone(p: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while p.exists():
        assert time.monotonic() < deadline, f"poststop did not remove {p}"
        time.sleep(0.1)


def _log_lines(path: str) -> list[str]:
    # CRI log format: "<time> <stream> <P|F> <content>"
    return [ln.split(" ", 3)[3] for ln in Path(path).read_text().splitlines() if ln.count(" ") >= 3]


def test_cri_vgpu_container_end_to_end(env: Env) -> None:
    v = env.rt.Version(cri.VersionRequest(version="v1"))
    assert v.runtime_name == "containerd"
    token = support.write_record(env.state, [(support.UUID_A, 2 << 30, 25)])
    sb = _sandbox_config(env, "gpu-pod")
    pod = env.rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb, runtime_handler="vgpu")).pod_sandbox_id
    try:
        script = (
            "echo preload=$(cat /etc/ld.so.preload); cat /run/vgpu/limits; "
            "stat -c 'mode %n %a' /run/vgpu/libvgpu.so /run/vgpu/limits /run/vgpu/region; "
            "(echo x >> /run/vgpu/limits) 2>/dev/null && echo limits=writable || echo limits=readonly; "
            "(echo x >> /etc/ld.so.preload) 2>/dev/null && echo preload=writable || echo preload=readonly; "
            "(printf '' >> /run/vgpu/region) && echo region=writable; echo done; exec sleep 300"
        )
        cid = _run(env, pod, sb, "cuda", script, token, token).container_id
        env.rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        log_path = env.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.log_path
        out = _wait_log(log_path, "done")
        assert "preload=/run/vgpu/libvgpu.so" in out
        assert f"{support.UUID_A} {2 << 30} 25 0" in out
        assert "limits=readonly" in out and "preload=readonly" in out and "region=writable" in out
        assert "mode /run/vgpu/region 666" in out
        # State of the container on the host, with the pod identity from the CRI annotations.
        meta = json.loads((env.state / "containers" / cid / "metadata.json").read_text())
        assert meta["pod_name"] == "gpu-pod" and meta["pod_namespace"] == "team-a"
        assert meta["container_name"] == "cuda" and meta["token"] == token
        # Task exit -> containerd deletes the runc container -> poststop removes the state.
        env.rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
        _wait_exit(env, cid)
        _wait_gone(env.state / "containers" / cid)
        assert env.calls.read_text().split() == ["prestart"]  # the vGPU container only; poststop: sh rm
        env.rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
        # The sandbox (pause) container never gets the base spec's hooks.
        assert not (env.state / "containers" / pod).exists()
    finally:
        env.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        env.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))


def test_cri_plain_and_refused_containers(env: Env) -> None:
    sb = _sandbox_config(env, "mixed-pod")
    pod = env.rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb, runtime_handler="vgpu")).pod_sandbox_id
    try:
        # No token: untouched, and the sh filter never even started Python (nor for the sandbox).
        before = env.calls.read_text() if env.calls.exists() else ""
        cid = _run(env, pod, sb, "plain", "test -e /run/vgpu && echo has-vgpu || echo no-vgpu", None, None).container_id
        env.rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        st = _wait_exit(env, cid)
        assert st.exit_code == 0 and _log_lines(st.log_path) == ["no-vgpu"]
        assert not (env.state / "containers" / cid).exists()
        assert not (env.state / "containers").exists() or not any((env.state / "containers").iterdir())
        assert (env.calls.read_text() if env.calls.exists() else "") == before
        env.rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
        # A token without a record: the container must not start, with the hook's reason.
        bogus = uuid.uuid4().hex
        cid2 = _run(env, pod, sb, "bogus", "echo started", bogus, bogus).container_id
        with pytest.raises(grpc.RpcError) as ei:
            env.rt.StartContainer(cri.StartContainerRequest(container_id=cid2))
        assert "unknown vGPU allocation token" in str(ei.value.details())
        assert not (env.state / "containers" / cid2).exists()
        env.rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid2))
    finally:
        env.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        env.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))
