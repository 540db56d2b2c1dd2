"""End to end through containerd's CRI API (the path kubelet uses).

A private containerd 1.x (Debian's) runs under a temp dir with its default
config edited by `vgpu-hook containerd install`; an image built from a
busybox rootfs is imported; pods and containers are created with a small
CRI v1 client (tests/support/cri, generated from the public API definitions).
The vGPU container carries the token as the device plugin sets it (env and
annotation); the hook arrives only through the runtime handler's
base_runtime_spec.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ctrd
from tests.support import hook as support

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(240)]

_why = ctrd.available()
if _why:
    pytest.skip(f"containerd CRI test: {_why}", allow_module_level=True)

import grpc  # noqa: E402

from tests.support.cri import api_pb2 as cri  # noqa: E402
from tests.support.cri import api_pb2_grpc as cri_grpc  # noqa: E402


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
            "node_setup.hookcmd",
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
    c.start()
    try:
        ctrd.import_images(c, d, d / "img")  # the workload image has nvidia/cuda's env
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


def _create(env: Any, pod: str, sb: Any, name: str, script: str, envs: dict[str, str], ann: dict[str, str]) -> Any:
    """CreateContainer of the test image running `sh -c script` with these env and annotations."""
    cfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name),
        image=cri.ImageSpec(image=ctrd.IMAGE),
        command=["sh", "-c", script],
        envs=[cri.KeyValue(key=k, value=v) for k, v in envs.items()],
        annotations=ann,
        log_path=f"{name}.log",
    )
    return env.rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod, config=cfg, sandbox_config=sb))


def _run(env: Env, pod: str, sb: Any, name: str, script: str, token_env: str | None, token_ann: str | None) -> Any:
    """The container as kubelet creates it: the device plugin's env and annotation on top of the
    image's env (nvidia/cuda's, NVIDIA_VISIBLE_DEVICES=all first in config.json)."""
    envs: dict[str, str] = {}
    ann: dict[str, str] = {}
    if token_env:
        envs["VGPU_ALLOCATION_TOKEN"] = token_env
        envs["NVIDIA_VISIBLE_DEVICES"] = support.UUID_A
    if token_ann:
        ann["vgpu.k8s.io/allocation-token"] = token_ann
    return _create(env, pod, sb, name, script, envs, ann)


def _wait_exit(env: Env, cid: str, timeout: float = 60) -> Any:
    return ctrd.wait_exit(env.rt, cid, timeout)


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
        assert f"{support.UUID_A} {2 << 30} 25 0 {2 << 30}" in out
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


def _bundle_spec(env: Env, cid: str) -> dict[str, Any]:
    """The config.json containerd wrote for the running container `cid`."""
    path = env.c.dir / "state" / "io.containerd.runtime.v2.task" / "k8s.io" / cid / "config.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_cri_vgpu_spec_equals_the_plain_spec_but_for_our_hooks(env: Env) -> None:
    """The same container (a CUDA image, the device plugin's env and annotation) in a pod on the
    handler without a base spec (`runc`) and in a pod on `vgpu`: the two config.json files
    containerd writes differ only by our hooks and our annotation - no RLIMIT_NOFILE 1024 (or
    any other default of `ctr oci spec`) from our base spec; the process sees the same limit."""
    token = support.write_record(env.state, [(support.UUID_A, 2 << 30, 25)])
    specs: dict[str, dict[str, Any]] = {}
    out: dict[str, list[str]] = {}
    for handler in ("runc", "vgpu"):
        sb = _sandbox_config(env, "same-pod")
        pod = env.rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb, runtime_handler=handler)).pod_sandbox_id
        try:
            cid = _run(env, pod, sb, "cuda", "ulimit -n; echo done; exec sleep 300", token, token).container_id
            env.rt.StartContainer(cri.StartContainerRequest(container_id=cid))
            log_path = env.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.log_path
            out[handler] = _wait_log(log_path, "done")
            text = json.dumps(_bundle_spec(env, cid))
            # what differs by construction between two pods: ids, the pod's uid, its pause's pid
            for old, new in ((cid, "<cid>"), (pod, "<pod>"), (sb.metadata.uid, "<uid>"), (sb.log_directory, "<logs>")):
                text = text.replace(old, new)
            spec = json.loads(text)
            for ns in spec["linux"]["namespaces"]:
                if "path" in ns:
                    ns["path"] = "/proc/<pause>/" + ns["path"].split("/", 3)[3]
            specs[handler] = spec
            env.rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
            _wait_exit(env, cid)
            env.rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
        finally:
            env.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
            env.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))
    plain, vgpu = specs["runc"], specs["vgpu"]
    assert "rlimits" not in plain["process"] and "rlimits" not in vgpu["process"]
    assert out["runc"] == out["vgpu"]  # `ulimit -n`: containerd's own limit in both
    assert "hooks" not in plain and set(vgpu.pop("hooks")) == {"prestart", "poststop"}
    assert vgpu["annotations"].pop("vgpu.k8s.io/allocation-token") == token
    assert vgpu == plain


# ---- the node shapes: our handler passes through the (stand-in) NVIDIA runtime -----------------------

GIB = 1 << 30
LIB64 = "/usr/local/nvidia/lib64"  # where the stand-in mounts the driver libraries (CUDA images' path)


class ShapeEnv(Env):
    shape: ctrd.Shape
    gpu: Any
    before: dict[str, bytes]
    install_cmd: list[str]
    cdi: bool


def _add_glibc_program(rootfs: Path, program: Path) -> None:
    """Copy a dynamic glibc program and the C library it and libvgpu.so need into the image."""
    (rootfs / "lib/x86_64-linux-gnu").mkdir(parents=True)
    (rootfs / "lib64").mkdir()
    for lib in ("libc.so.6", "libdl.so.2"):
        shutil.copy2(os.path.realpath(f"/lib/x86_64-linux-gnu/{lib}"), rootfs / "lib/x86_64-linux-gnu" / lib)
    shutil.copy2(os.path.realpath("/lib64/ld-linux-x86-64.so.2"), rootfs / "lib64/ld-linux-x86-64.so.2")
    shutil.copy2(program, rootfs / "bin" / program.name)


# n3-cdi: N3 without a .legacy runtime: the handler keeps NVIDIA's runtime in cdi mode and the
# device plugin names the GPU as a CDI device in an annotation (strategy cdi-annotations).
# n1-cdi: a host toolkit in cdi mode (its .legacy hook would refuse): the runtime stays in cdi mode
# and the envvar strategy works through the spec of the default kind, which names GPUs by UUID.
@pytest.fixture(scope="module", params=[*ctrd.SHAPES, "n3-cdi"])
def shape_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapeEnv]:
    from sim.fakegpu import toolkit as fk
    from sim.fakegpu.harness import FakeGPU

    kind = request.param
    cdi = kind == "n3-cdi"
    kind = "n3" if cdi else kind
    if not fk.RUNTIME.exists() or not (support.ROOT / "build" / "libvgpu.so").exists():
        pytest.fail("build/fakegpu/nvidia-container-runtime or build/libvgpu.so missing: run `make build-all`")
    d = tmp_path_factory.mktemp(f"shape-{request.param}")
    gpu = FakeGPU(d / "gpu", support.ROOT / "build", gpus=1, memory=16 * GIB)
    c = ctrd.Containerd(d)
    c.snapshotter = "overlayfs" if ctrd.overlay_works(d) else "native"
    base = ctrd.base_config(d, c.snapshotter)

    def toolkit_text(**kw: Any) -> str:
        return fk.toolkit_config_text(gpu, container_lib_dir=LIB64, **kw)

    s = ctrd.make_shape(kind, Path("/"), str(d / "host"), base_text=base, runtime_dir=fk.BUILD,
                        toolkit_text=toolkit_text,
                        fakegpu_text=fk.fakegpu_section(gpu, container_lib_dir=LIB64))  # fmt: skip
    if cdi:
        s.fs(s.binary + ".legacy").unlink()
        fk.write_cdi_spec(s.fs(s.hp("/var/run/cdi")), gpu, container_lib_dir=LIB64)  # kind nvidia.com/gpu
    if kind == "n1-cdi":  # what `nvidia-ctk cdi generate` writes there, for the simulated GPU
        fk.write_cdi_spec(s.fs(s.hp("/etc/cdi")), gpu, container_lib_dir=LIB64)
    c.config = Path(s.conf)
    before = s.snapshot()
    python, calls = support.recording_python(d)
    lib = support.ROOT / "build" / "libvgpu.so"
    cmd = [sys.executable, "-m", "node_setup.hookcmd", "--config", str(d / "none.toml"), "--state-dir", str(d / "vgpu"),
           "--library-path", str(lib), "--log-dir", str(d / "log"), "containerd"]  # fmt: skip
    r = subprocess.run([*cmd, "install", "--containerd-config", s.conf, "--python", python],
                       capture_output=True, text=True, cwd=support.ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"node type {ctrd.EXPECTED_TYPE[kind]}" in r.stdout, r.stdout
    if kind in ("n1-cdi", "n3"):
        assert ("legacy-mode sibling" in r.stdout) == (kind == "n3" and not cdi), r.stdout
    img = d / "img"
    support.make_rootfs(img)
    _add_glibc_program(img, support.ROOT / "build" / "fakegpu" / "fakegpu-burn")
    pause = d / "pause"
    support.make_rootfs(pause)
    c.start()
    try:
        ctrd.import_images(c, d, pause, img)
        chan = grpc.insecure_channel(f"unix://{c.sock}")
        e = ShapeEnv(d, c, cri_grpc.RuntimeServiceStub(chan), lib, calls)
        e.shape, e.gpu, e.before, e.install_cmd, e.cdi = s, gpu, before, cmd, cdi
        yield e
        chan.close()
    finally:
        c.stop()
        gpu.close()


def _run_gpu(env: ShapeEnv, pod: str, sb: Any, name: str, script: str, token: str | None) -> Any:
    envs: dict[str, str] = {}  # PATH, LD_LIBRARY_PATH and NVIDIA_VISIBLE_DEVICES=all come from the image
    ann = {}
    if token:
        envs["VGPU_ALLOCATION_TOKEN"] = token
        ann["vgpu.k8s.io/allocation-token"] = token
        if env.cdi:  # as NVIDIA's plugin names devices with cdi-annotations
            ann["cdi.k8s.io/vgpu-device-plugin_" + token] = f"nvidia.com/gpu={env.gpu.uuids[0]}"
        else:  # the envvar strategy
            envs["NVIDIA_VISIBLE_DEVICES"] = env.gpu.uuids[0]
    return _create(env, pod, sb, name, script, envs, ann)


def test_shape_vgpu_container_through_the_nvidia_runtime(shape_env: ShapeEnv) -> None:
    env = shape_env
    uuid0 = env.gpu.uuids[0]
    token = support.write_record(env.state, [(uuid0, 2 * GIB, 25)])
    sb = _sandbox_config(env, "gpu-pod")
    pod = env.rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb, runtime_handler="vgpu")).pod_sandbox_id
    burn = "/bin/fakegpu-burn"
    try:
        script = (
            f"ls /dev/nvidiactl /dev/nvidia0 {LIB64}/libcuda.so.1 {LIB64}/libnvidia-ml.so.1 2>&1; "
            "echo preload=$(cat /etc/ld.so.preload); cat /run/vgpu/limits; "
            f"echo burn=$({burn} --seconds 0 2>&1); echo done"
        )
        cid = _run_gpu(env, pod, sb, "cuda", script, token).container_id
        env.rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        st = _wait_exit(env, cid)
        out = _log_lines(st.log_path)
        assert "done" in out, out
        # the GPU, as the (stand-in) NVIDIA runtime put it there
        for p in ("/dev/nvidiactl", "/dev/nvidia0", f"{LIB64}/libcuda.so.1", f"{LIB64}/libnvidia-ml.so.1"):
            assert p in out, out
        # our mounts
        assert "preload=/run/vgpu/libvgpu.so" in out and f"{uuid0} {2 * GIB} 25 0 {2 * GIB}" in out
        # and the slice: cuMemGetInfo through libvgpu.so on the simulated 16 GiB GPU
        burn_line = next(ln for ln in out if ln.startswith("burn="))
        info = json.loads(burn_line[len("burn=") :])
        assert info["uuid"] == uuid0 and info["mem_total"] == 2 * GIB, burn_line
        assert env.calls.read_text().split() == ["prestart"]
        env.rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
        # a plain container on the same handler: nothing of ours, and Python never started.  Its
        # image's NVIDIA_VISIBLE_DEVICES=all still asks NVIDIA's runtime for every GPU, which the
        # toolkit's default (accept-nvidia-visible-devices-envvar-when-unprivileged = true) grants:
        # no limits then - `vgpuctl doctor` WARNs about exactly this (docs/operators/install.md).
        cid2 = _run_gpu(env, pod, sb, "plain", "test -e /run/vgpu && echo has-vgpu || echo no-vgpu; "
                        "test -e /dev/nvidia0 && echo has-gpu || echo no-gpu", None).container_id  # fmt: skip
        env.rt.StartContainer(cri.StartContainerRequest(container_id=cid2))
        st2 = _wait_exit(env, cid2)
        assert st2.exit_code == 0 and _log_lines(st2.log_path) == ["no-vgpu", "has-gpu"]
        assert env.calls.read_text().split() == ["prestart"]
        env.rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid2))
    finally:
        env.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
        env.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))


def test_shape_uninstall_restores_every_file(shape_env: ShapeEnv) -> None:
    env = shape_env
    r = subprocess.run([*env.install_cmd, "uninstall", "--containerd-config", env.shape.conf],
                       capture_output=True, text=True, cwd=support.ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert env.shape.snapshot() == env.before
