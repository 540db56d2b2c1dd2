"""`make image` for real: its archives, its contents against packaging/image/Dockerfile, and the
daemons run from it through containerd's CRI API as the chart's DaemonSets describe them.

Debian's containerd is started by the test with a node shape of the simulated NVIDIA toolkit
(sim/fakegpu stand-in runtime as the `nvidia` handler); the image is imported with `ctr images
import`; the device-plugin pod (its node-installer init container first) and the monitor pod
are created from the Helm chart's rendered DaemonSets (command, args, env, volumes,
securityContext, runtimeClassName, hostPID): every hostPath is rebased under a temp dir (the
installer's `/` onto an overlay of a debootstrap'd Debian root), so the CRI run cannot drift from
the chart.  The installer exits 0 having wired that root; the device plugin registers with the
kubelet stand-in on the host, lists the vGPUs and allocates one; the monitor serves /metrics,
scraped over HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from tests.packaging import pkgbuild
from tests.support import ctrd, imagebuild, ociimage
from tests.support import hook as hooksupport
from tests.support.imagebuild import default_config
from tests.support.podman import Podman

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="mmdebstrap, containerd and chroot need root"),
    pytest.mark.timeout(900),
]

ROOT = imagebuild.ROOT
# Every console script the project declares (pyproject [project.scripts]) must run in the image.
ENTRY_POINTS = tuple(
    tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
)
GIB = 1 << 30
LIB = "/usr/lib/x86_64-linux-gnu"  # where NVIDIA's runtime puts the driver libraries in a container


def _version() -> str:
    from vgpu import __version__

    return __version__


def test_make_image_outputs(image: dict[str, Any], tmp_path: Path) -> None:
    ver = _version()
    assert image["image"] == f"ghcr.io/k8s-vgpu/k8s-vgpu:{ver}"
    assert image["digest"].startswith("sha256:") and len(image["digest"]) == 71
    assert Path(image["oci_archive"]).name == f"k8s-vgpu-{ver}.oci.tar"
    assert Path(image["docker_archive"]).name == f"k8s-vgpu-{ver}.docker.tar"
    assert 0 < int(image["compressed_bytes"]) < int(image["size_bytes"])
    index, manifest, config, tar = imagebuild.read_archive(Path(image["oci_archive"]))
    tar.close()
    ann = index["manifests"][0]["annotations"]
    assert ann["io.containerd.image.name"] == image["image"] == ann["org.opencontainers.image.ref.name"]
    assert (
        "sha256:"
        + __import__("hashlib").sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        == image["digest"]
    )
    # docker-archive: same config, tagged the same.
    import tarfile

    with tarfile.open(image["docker_archive"]) as t:
        man = json.loads(t.extractfile("manifest.json").read())  # type: ignore[union-attr]
        assert man[0]["RepoTags"] == [image["image"]]
        assert json.loads(t.extractfile(man[0]["Config"]).read()) == config  # type: ignore[union-attr]
    # A rebuild of an unchanged tree is the cache: same digest, nothing rebuilt.
    again = imagebuild.build()
    assert again["digest"] == image["digest"] and again["cached"] == "yes"
    # Reproducible: the layers and archives written again elsewhere are the same bytes.
    elsewhere = imagebuild.build(out=tmp_path)
    assert elsewhere["cached"] == "no" and elsewhere["digest"] == image["digest"]
    assert (tmp_path / Path(image["oci_archive"]).name).read_bytes() == Path(image["oci_archive"]).read_bytes()


def test_image_contents_are_the_dockerfiles(image: dict[str, Any]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vgpu_build_image", ROOT / "packaging/image/build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stage = mod.final_stage()
    files = imagebuild.image_files(image)
    _index, _manifest, config, tar = imagebuild.read_archive(Path(image["oci_archive"]))
    tar.close()
    # The Dockerfile's final stage, line for line: its COPY destinations are exactly the image's
    # files outside the base and the venv, with the same ENV and CMD.
    ours = sorted(n for n in files if n.startswith(("usr/lib/vgpu/", "usr/share/vgpu/")) and files[n].isfile())
    assert ours == sorted(d.strip("/") for _s, d in stage.copies)
    [(_stage, _src, venv_dest)] = stage.from_copies
    assert venv_dest == "/opt/vgpu"
    for ep in ENTRY_POINTS:
        assert files[f"opt/vgpu/bin/{ep}"].isfile() and files[f"opt/vgpu/bin/{ep}"].mode & 0o111
    assert config["config"]["Env"] == stage.env and config["config"]["Cmd"] == stage.cmd
    assert stage.labels.items() <= config["config"]["Labels"].items()
    # Slim: no compilers, no docs beyond copyright files, no apt lists or caches, no pip.
    assert not [n for n in files if n.startswith(("usr/bin/gcc", "usr/bin/cc", "usr/lib/gcc", "usr/include/"))]
    assert not [
        n for n in files if n.startswith("usr/share/doc/") and files[n].isfile() and not n.endswith("/copyright")
    ]
    assert not [n for n in files if n.startswith(("var/lib/apt/lists/", "var/cache/", "usr/share/man/"))]
    assert not [n for n in files if "/site-packages/pip/" in n or n.startswith("root/.cache")]
    assert "usr/bin/python3" in files and files["opt/vgpu/bin/python"].issym()


def test_entry_points_run_in_the_image(image: dict[str, Any]) -> None:
    """Every command starts in the image's own root (its python3, its libraries): --help exits 0."""
    root = imagebuild.rootfs(image)
    for ep in ENTRY_POINTS:
        r = subprocess.run(
            ["/usr/sbin/chroot", str(root), f"/opt/vgpu/bin/{ep}", "--help"],
            capture_output=True,
            text=True,
            env={"PATH": "/opt/vgpu/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            timeout=60,
        )
        assert r.returncode == 0 and "usage" in r.stdout.lower(), f"{ep}: {r.stderr[-2000:]}"


def test_archives_load_in_podman(image: dict[str, Any], podman: Podman) -> None:
    """Loaded into a podman store of the test's own (never the node's images)."""
    for archive in (image["oci_archive"], image["docker_archive"]):
        r = subprocess.run(podman.argv("load", "-i", archive), capture_output=True, text=True, timeout=300)
        try:
            assert r.returncode == 0, r.stderr
            assert image["image"] in r.stdout, r.stdout
            ins = subprocess.run(podman.argv("image", "inspect", image["image"]), capture_output=True, text=True)
            assert json.loads(ins.stdout)[0]["Config"]["Cmd"] == ["vgpuctl", "--help"]
        finally:
            subprocess.run(podman.argv("rmi", "-f", image["image"]), capture_output=True)


# ---- the daemons through CRI, as the chart runs them ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    def __init__(
        self, d: Path, c: ctrd.Containerd, rt: Any, gpu: Any, objects: list[dict[str, Any]], port: int
    ) -> None:
        self.dir, self.c, self.rt, self.gpu, self.objects, self.port = d, c, rt, gpu, objects, port
        self.host = d / "host"

        self.host_root: Path | None = None  # the stand-in for the host's whole `/` (the installer's volume)

    def rebase(self, host_path: str) -> Path:
        """The test's stand-in for a host path."""
        if host_path == "/" and self.host_root is not None:
            return self.host_root
        return self.host / host_path.lstrip("/")


@pytest.fixture(scope="module")
def node(image: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    import grpc

    from sim.fakegpu import toolkit as fk
    from sim.fakegpu.harness import FakeGPU
    from tests.support.cri import api_pb2_grpc as cri_grpc
    from tests.support.helm import render

    why = ctrd.available()
    if why:
        pytest.fail(f"containerd CRI run of the image: {why}")
    if not fk.RUNTIME.exists():
        pytest.fail("build/fakegpu/nvidia-container-runtime missing: run `make build-all`")
    d = tmp_path_factory.mktemp("image-cri")
    port = _free_port()
    # A node without NVIDIA's runtime in the installer's host root (the stand-in is the test
    # containerd's): the installer gets --without-nvidia-runtime.
    objects = render({"monitor": {"port": port}, "nodeSetup": {"withoutNvidiaRuntime": True}})
    gpu = FakeGPU(d / "gpu", ROOT / "build", gpus=1, memory=16 * GIB)
    c = ctrd.Containerd(d)
    c.snapshotter = "overlayfs" if ctrd.overlay_works(d) else "native"
    base = ctrd.base_config(d, c.snapshotter)

    def toolkit_text(**kw: Any) -> str:
        return fk.toolkit_config_text(gpu, container_lib_dir=LIB, **kw)

    # N1 (toolkit 1.17 in place): the `nvidia` handler is the default, as on most GPU nodes.
    s = ctrd.make_shape("n1-117", Path("/"), str(d / "nvidia"), base_text=base, runtime_dir=fk.BUILD,
                        toolkit_text=toolkit_text)  # fmt: skip
    c.config = Path(s.conf)
    pause = d / "pause"
    hooksupport.make_rootfs(pause)
    ociimage.build_image(pause, d / "pause.tar", ctrd.PAUSE_IMAGE, ["sleep", "3600"], env=ociimage.PAUSE_ENV)
    c.start()
    try:
        for archive in (d / "pause.tar", Path(image["oci_archive"])):
            r = c.ctr("images", "import", "--snapshotter", c.snapshotter, str(archive), timeout=300)
            assert r.returncode == 0, r.stderr
        listed = c.ctr("images", "ls", "-q").stdout.split()
        assert image["image"] in listed, listed
        chan = grpc.insecure_channel(f"unix://{c.sock}")
        yield Node(d, c, cri_grpc.RuntimeServiceStub(chan), gpu, objects, port)
        chan.close()
    finally:
        c.stop()
        gpu.close()


def _daemonset(objects: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    [ds] = [o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"].endswith(suffix)]
    return ds


def _pod(node: Node, ds: dict[str, Any]) -> tuple[str, Any]:
    """A sandbox as kubelet makes it for the DaemonSet's pod (hostPID from the spec; host network:
    no CNI here), on the pod's runtimeClassName handler."""
    from tests.support.cri import api_pb2 as cri

    spec = ds["spec"]["template"]["spec"]
    name = ds["metadata"]["name"]
    uid = uuid.uuid4().hex
    sb = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace="kube-system", attempt=0),
        log_directory=str(node.dir / "logs" / uid),
        linux=cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(
                    network=cri.NODE, pid=cri.NODE if spec.get("hostPID") else cri.CONTAINER, ipc=cri.POD
                )
            )
        ),
    )
    # kubelet makes the sandbox privileged when one of the pod's containers is.
    every = spec.get("initContainers", []) + spec["containers"]
    sb.linux.security_context.privileged = any(c.get("securityContext", {}).get("privileged") for c in every)
    handler = spec.get("runtimeClassName") or ""
    pod = node.rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb, runtime_handler=handler)).pod_sandbox_id
    return pod, sb


def _container(node: Node, ds: dict[str, Any], pod: str, sb: Any, extra_env: dict[str, str], init: bool = False) -> str:
    """The DaemonSet's container (or init container) as kubelet would create it (volumes rebased)."""
    from google.protobuf import wrappers_pb2  # noqa: F401  (int64 wrappers live in the CRI message)

    from tests.support.cri import api_pb2 as cri

    spec = ds["spec"]["template"]["spec"]
    [ctr] = spec["initContainers" if init else "containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = []
    for vm in ctr["volumeMounts"]:
        v = volumes[vm["name"]]
        if "hostPath" in v:
            src = node.rebase(v["hostPath"]["path"])
            if v["hostPath"].get("type") == "Directory":
                assert src.is_dir(), f"hostPath {v['hostPath']['path']} (type Directory) must exist on the node"
            src.mkdir(parents=True, exist_ok=True)
        else:  # emptyDir
            src = node.dir / "emptydir" / ds["metadata"]["name"] / v["name"]
            src.mkdir(parents=True, exist_ok=True)
        mounts.append(cri.Mount(container_path=vm["mountPath"], host_path=str(src), readonly=bool(vm.get("readOnly"))))
    envs = [
        cri.KeyValue(key=e["key"] if "key" in e else e["name"], value=e.get("value", "")) for e in ctr.get("env", [])
    ]
    envs = [e for e in envs if e.value] + [cri.KeyValue(key=k, value=v) for k, v in extra_env.items()]
    sc = ctr["securityContext"]
    caps = sc.get("capabilities", {})
    security = cri.LinuxContainerSecurityContext(
        capabilities=cri.Capability(add_capabilities=caps.get("add", []), drop_capabilities=caps.get("drop", [])),
        privileged=bool(sc.get("privileged")),
        readonly_rootfs=bool(sc.get("readOnlyRootFilesystem")),
        no_new_privs=not sc.get("allowPrivilegeEscalation", True),
        namespace_options=sb.linux.security_context.namespace_options,
    )
    if "runAsUser" in sc:
        security.run_as_user.value = sc["runAsUser"]
    cfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=ctr["name"]),
        image=cri.ImageSpec(image=ctr["image"]),
        command=ctr["command"],
        args=ctr.get("args", []),
        envs=envs,
        mounts=mounts,
        log_path=f"{ctr['name']}.log",
        linux=cri.LinuxContainerConfig(security_context=security),
    )
    cid = node.rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod, config=cfg, sandbox_config=sb)
    ).container_id
    node.rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    return str(cid)


def _logs(node: Node, cid: str) -> str:
    from tests.support.cri import api_pb2 as cri

    path = node.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.log_path
    return Path(path).read_text() if Path(path).exists() else ""


def _stop(node: Node, pod: str) -> None:
    from tests.support.cri import api_pb2 as cri

    node.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod))
    node.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod))


def test_installer_and_daemons_run_from_the_image_through_cri(node: Node) -> None:
    plugin_ds = _daemonset(node.objects, "-device-plugin")
    monitor_ds = _daemonset(node.objects, "-monitor")
    assert plugin_ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"  # the `nvidia` handler
    plugin = plugin_ds["spec"]["template"]["spec"]["containers"][0]
    kubelet_dir = next(a.split("=", 1)[1] for a in plugin["args"] if a.startswith("--kubelet-dir="))
    state_dir = next(a.split("=", 1)[1] for a in plugin["args"] if a.startswith("--state-dir="))
    host_kubelet = node.rebase(kubelet_dir)
    host_kubelet.mkdir(parents=True, exist_ok=True)
    pods: list[str] = []
    with pkgbuild.scratch_root(pkgbuild.debian_root()) as host_root:
        node.host_root = host_root
        # The node's containerd config as kubeadm's instructions make it (Debian's shipped one
        # relies on the built-in runc handler: docs/developers/node-setup.md, known gaps).
        (host_root / "etc/containerd/config.toml").write_text(default_config(host_root))
        try:
            pod, sb = _pod(node, plugin_ds)
            pods.append(pod)
            # kubelet runs the init container to completion first: the node installer, privileged,
            # with the host's / (here a debootstrap'd Debian 12 root with containerd) at /host.
            icid = _container(node, plugin_ds, pod, sb, {}, init=True)
            st = _wait_exit(node, icid)
            assert st.exit_code == 0, _logs(node, icid)[-3000:]
            assert "hook runs with the host's /usr/bin/python3" in _logs(node, icid)
            assert (host_root / "usr/local/vgpu/lib/libvgpu.so").is_file()
            assert "runtimes.vgpu" in (host_root / "etc/containerd/config.toml").read_text()
            _run_daemons(node, plugin_ds, monitor_ds, pod, sb, kubelet_dir, state_dir, pods)
        finally:
            node.host_root = None
            for p in pods:
                _stop(node, p)
            shutil.rmtree(node.host, ignore_errors=True)


def _wait_exit(node: Node, cid: str, timeout: float = 120) -> Any:
    return ctrd.wait_exit(node.rt, cid, timeout, describe=lambda: _logs(node, cid)[-2000:])


def _run_daemons(node: Node, plugin_ds: dict[str, Any], monitor_ds: dict[str, Any], pod: str, sb: Any,
                 kubelet_dir: str, state_dir: str, pods: list[str]) -> None:  # fmt: skip
    from sim.kubelet import FakeKubelet

    host_kubelet = node.rebase(kubelet_dir)
    with FakeKubelet(host_kubelet) as kubelet:
        cid = _container(node, plugin_ds, pod, sb, {})
        try:
            ep = kubelet.wait_endpoint("nvidia.com/gpu", timeout=90)
        except Exception:
            raise AssertionError(f"device plugin did not register:\n{_logs(node, cid)[-3000:]}") from None
        ep.wait_devices(lambda dv: len(dv) == 2, timeout=60)  # the chart's deviceSplitCount 2
        assert all(dv.healthy for dv in ep.devices().values())
        alloc = kubelet.admit("default", "cuda", "main", count=1)
        token = alloc.envs["VGPU_ALLOCATION_TOKEN"]
        record = json.loads((node.rebase(state_dir) / "allocations" / f"{token}.json").read_text())
        assert record["gpus"][0]["uuid"] == node.gpu.uuids[0] and record["gpus"][0]["memory_limit"] == 8 * GIB

        mpod, msb = _pod(node, monitor_ds)
        pods.append(mpod)
        mcid = _container(node, monitor_ds, mpod, msb, {})
        deadline = time.monotonic() + 90
        text = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                if "vgpu_gpu_up" in text:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert f'vgpu_gpu_up{{gpu="0",uuid="{node.gpu.uuids[0]}"}} 1.0' in text, _logs(node, mcid)[-3000:]
