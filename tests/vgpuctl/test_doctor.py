"""`vgpuctl doctor` on each node shape, on an empty node, with broken pieces, and as JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_setup import hookcmd as cli
from node_setup.nodetype.root import Root
from tests.support import ctrd
from vgpuctl import cli as ctl
from vgpuctl import doctor

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

GPUS = [("GPU-11111111-2222-3333-4444-555555555555", "Fake GPU", 16 << 30)]


def py311(root: Root, python: str) -> tuple[int, int] | None:
    return (3, 11) if python else None


def nvml_ok() -> list[tuple[str, str, int]]:
    return list(GPUS)


class Node:
    """A host tree (`--root`) with a node shape, our install and the daemons' traces."""

    def __init__(self, tmp: Path, kind: str | None) -> None:
        self.tmp = tmp
        self.root = tmp / "host"
        self.shape = ctrd.make_shape(kind, self.root, "") if kind else None  # the files NVIDIA's tools wrote
        self.socks: list[socket.socket] = []
        if kind:  # a containerd binary that cannot run in the tree: detection falls back to the files
            self.fs("/usr/bin").mkdir(parents=True, exist_ok=True)
            self.fs("/usr/bin/containerd").write_text("#!/bin/sh\n")
            os.chmod(self.fs("/usr/bin/containerd"), 0o755)

    def fs(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def install(self, *extra: str) -> int:
        spec = self.tmp / "spec.json"
        spec.write_text('{"ociVersion": "1.0.2", "process": {"cwd": "/"}}')
        self.fs("/usr/local/vgpu/runtime_hook/fastpath.py").parent.mkdir(parents=True, exist_ok=True)
        self.fs("/usr/local/vgpu/runtime_hook/fastpath.py").write_text("# the hook\n")
        self.fs("/usr/bin/python3").write_text("#!/bin/false\n")
        return cli.main(["--config", str(self.tmp / "none.toml"), "--state-dir", "/var/lib/vgpu", "--log-dir",
                         "/var/log/vgpu", "--library-path", "/usr/lib/vgpu/libvgpu.so", "containerd", "install",
                         "--root", str(self.root), "--base-spec-source", str(spec), "--python", "/usr/bin/python3",
                         "--hook-path", "/usr/local/vgpu/runtime_hook/fastpath.py", *extra])  # fmt: skip

    def daemons(self, armed: bool = True) -> None:
        """The library, the device plugin's socket, a fresh monitor status."""
        lib = self.fs("/usr/lib/vgpu/libvgpu.so")
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"\x7fELF")
        d = self.fs("/var/lib/kubelet/device-plugins")
        d.mkdir(parents=True, exist_ok=True)
        short = Path(tempfile.mkdtemp(dir="/tmp"))  # sun_path is 108 bytes: bind short, then move
        for name in ("kubelet.sock", "vgpu.sock"):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(short / name))
            os.rename(short / name, d / name)
            self.socks.append(s)
        short.rmdir()
        st = self.fs("/var/lib/vgpu/monitor/status.json")
        st.parent.mkdir(parents=True, exist_ok=True)
        status = {"time": time.time(), "running": True, "pid": 42, "policy": "contended", "guardian_armed": armed}
        st.write_text(json.dumps(status))

    def config(self, text: str) -> None:
        self.fs("/etc/vgpu/config.toml").parent.mkdir(parents=True, exist_ok=True)
        self.fs("/etc/vgpu/config.toml").write_text(text)

    def run(self, **kw: object) -> doctor.Report:
        opts = doctor.Options(root=str(self.root), config="/etc/vgpu/config.toml", nvml=False)
        d = doctor.Doctor(opts, nvml=kw.get("nvml", nvml_ok), python=kw.get("python", py311))  # type: ignore[arg-type]
        return d.run()

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[object]:
    nodes: list[Node] = []

    def make(kind: str | None) -> Node:
        n = Node(tmp_path / f"n{len(nodes)}", kind)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.close()


def by_name(r: doctor.Report) -> dict[str, doctor.Check]:
    return {c.name: c for c in r.checks}


@pytest.mark.parametrize("kind", ctrd.SHAPES)
def test_each_shape_installed_is_healthy(kind: str, node_factory: object) -> None:
    n = node_factory(kind)  # type: ignore[operator]
    assert n.install() == 0
    n.daemons()
    r = n.run()
    c = by_name(r)
    assert r.node_type == ctrd.EXPECTED_TYPE[kind]
    assert c["node-type"].status == "OK" and r.node_type in c["node-type"].message
    assert c["vgpu-handler"].status == "OK" and "reaches the NVIDIA runtime" in c["vgpu-handler"].message
    if kind == "n3":  # the operator's installer set skip-mode-detection: its legacy hook works
        assert c["vgpu-handler"].message.endswith(".legacy (legacy mode)")
    if kind == "n1-cdi":  # a host toolkit in cdi mode: the runtime is kept, the spec names the GPU by UUID
        assert c["vgpu-handler"].message.endswith("/usr/bin/nvidia-container-runtime (cdi mode)")
    assert c["vgpu-base-spec"].status == "OK"
    for name in ("config", "containerd", "cdi", "library", "hook", "hook-python", "device-plugin", "monitor",
                 "guardian"):  # fmt: skip
        assert c[name].status == "OK", c[name]
    # the toolkit's default accepts GPU requests through an unprivileged container's env
    assert c["toolkit"].status == "WARN"
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged = false" in c["toolkit"].fix
    assert not r.failed
    assert c["containerd"].status == "OK" and "files" in c["containerd"].message  # containerd cannot run in the tree


def test_empty_node_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = ctl.main(["doctor", "--root", str(empty), "--no-nvml"])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.startswith("node type: none (no NVIDIA container runtime)")
    for line in ("FAIL  containerd", "FAIL  node-type", "FAIL  vgpu-handler", "FAIL  library", "FAIL  hook-python",
                 "WARN  device-plugin", "FAIL  monitor"):  # fmt: skip
        assert line in out, out
    assert "fix: install containerd" in out and "nvidia-ctk runtime configure" in out
    assert "apt-get install python3-minimal" in out and "/usr/local/vgpu" in out  # alternatives for the hook
    assert ctl.main(["doctor", "--root", str(empty), "--no-nvml", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["node_type"] == "none" and rep["root"] == str(empty)
    statuses = {c["name"]: c["status"] for c in rep["checks"]}
    assert statuses["node-type"] == "FAIL" and statuses["config"] == "OK"
    assert all(c["fix"] for c in rep["checks"] if c["status"] == "FAIL")


def test_handler_without_the_nvidia_runtime_fails_with_the_fix(node_factory: object) -> None:
    n = node_factory("n1-117")  # type: ignore[operator]
    assert n.install("--nvidia-runtime", "/usr/bin/runc") == 0  # a handler that bypasses NVIDIA's runtime
    n.fs("/usr/bin/runc").write_text("#!/bin/sh\n")
    n.daemons()
    c = by_name(n.run())
    assert c["vgpu-handler"].status == "FAIL" and "no GPU from NVIDIA's runtime" in c["vgpu-handler"].message
    assert "vgpu-hook containerd install" in c["vgpu-handler"].fix


def test_broken_base_spec_and_missing_binary(node_factory: object) -> None:
    n = node_factory("n2")  # type: ignore[operator]
    assert n.install() == 0
    n.daemons()
    n.fs("/etc/containerd/vgpu-base-spec.json").unlink()
    c = by_name(n.run())
    assert c["vgpu-base-spec"].status == "FAIL" and "does not exist" in c["vgpu-base-spec"].message
    assert "vgpu-hook containerd install" in c["vgpu-base-spec"].fix
    n.fs("/usr/local/nvidia/toolkit/nvidia-container-runtime").unlink()
    c = by_name(n.run())
    assert c["node-type"].status == "FAIL" and "does not exist" in c["node-type"].message
    assert c["vgpu-handler"].status == "FAIL"


def test_not_installed_and_unarmed_guardian(node_factory: object) -> None:
    n = node_factory("n1-118")  # type: ignore[operator]
    n.daemons(armed=False)
    c = by_name(n.run())
    assert c["node-type"].status == "OK" and c["vgpu-handler"].status == "FAIL"
    assert c["guardian"].status == "FAIL"


def test_strategy_against_toolkit_flags_and_cdi_mode(node_factory: object) -> None:
    n = node_factory("n1-117")  # type: ignore[operator]
    assert n.install() == 0
    n.daemons()
    n.config('[device_plugin]\ndevice_list_strategy = ["volume-mounts"]\n')
    c = by_name(n.run())
    assert c["toolkit"].status == "FAIL" and "as-volume-mounts = true" in c["toolkit"].fix
    m = node_factory("n3")  # type: ignore[operator]
    m.fs("/usr/local/nvidia/toolkit/nvidia-container-runtime.legacy").unlink()
    assert m.install() == 0  # cdi mode kept; the installer's management spec names no GPU by UUID
    m.daemons()
    c = by_name(m.run())
    assert c["vgpu-handler"].status == "FAIL" and "nvidia.com/gpu=<uuid>, which no CDI spec defines" in c[
        "vgpu-handler"].message  # fmt: skip
    m.config('[device_plugin]\ndevice_list_strategy = ["cdi-annotations"]\ncdi_kind = "nvidia.com/gpu"\n')
    c = by_name(m.run())
    assert c["vgpu-handler"].status == "OK"
    assert c["cdi"].status == "FAIL" and "kind nvidia.com/gpu" in c["cdi"].message  # only the management spec


def test_cdi_mode_with_a_uuid_named_spec_takes_the_envvar_strategy(node_factory: object) -> None:
    """Host toolkit in cdi mode, default-kind nvidia.com/gpu, the spec of `nvidia-ctk cdi
    generate` (GPUs by index and UUID): NVIDIA_VISIBLE_DEVICES=<uuid> resolves - OK.  Without
    the spec it cannot - FAIL with the generator command."""
    n = node_factory("n1-cdi")  # type: ignore[operator]
    assert n.install() == 0
    n.daemons()
    c = by_name(n.run())
    assert c["vgpu-handler"].status == "OK" and c["vgpu-handler"].message.endswith("(cdi mode)")
    n.fs("/etc/cdi/nvidia.com-gpu.json").unlink()
    c = by_name(n.run())
    assert c["vgpu-handler"].status == "FAIL" and "which no CDI spec defines" in c["vgpu-handler"].message
    assert "nvidia-ctk cdi generate" in c["vgpu-handler"].fix


def test_legacy_sibling_whose_hook_refuses_fails(node_factory: object) -> None:
    """A handler on `.legacy` where the toolkit config is in cdi mode with skip-mode-detection =
    false (`nvidia-ctk config default`): the hook refuses every GPU container (what install picked
    before it knew)."""
    n = node_factory("n1-cdi")  # type: ignore[operator]
    assert n.install("--nvidia-runtime", "/usr/bin/nvidia-container-runtime.legacy") == 0
    n.daemons()
    c = by_name(n.run())
    assert c["vgpu-handler"].status == "FAIL" and "legacy hook refuses every GPU container" in c["vgpu-handler"].message
    assert "skip-mode-detection = true" in c["vgpu-handler"].fix


@pytest.mark.parametrize("mode", ["jit-cdi", "legacy"])
def test_cdi_annotations_outside_cdi_mode_without_containerd_cdi_fail(mode: str, node_factory: object) -> None:
    """The runtime in jit-cdi or legacy mode ignores CDI annotations; containerd 1.x without
    enable_cdi has no CDI of its own: the pod would get its limits and no GPU."""
    n = node_factory("n1-118")  # type: ignore[operator]
    tk = n.fs("/etc/nvidia-container-runtime/config.toml")
    tk.write_text(tk.read_text().replace('mode = "auto"', f'mode = "{mode}"'))
    assert n.install() == 0
    n.daemons()
    n.config('[device_plugin]\ndevice_list_strategy = ["cdi-annotations"]\n')
    c = by_name(n.run())
    assert c["vgpu-handler"].status == "FAIL"
    assert f"the runtime in {mode} mode ignores CDI annotations" in c["vgpu-handler"].message
    # auto: CDI names in annotations make the runtime resolve cdi mode - that works
    tk.write_text(tk.read_text().replace(f'mode = "{mode}"', 'mode = "auto"'))
    assert by_name(n.run())["vgpu-handler"].status == "OK"


def test_containerd_whose_cri_cannot_load_fails(node_factory: object) -> None:
    """Debian's config.toml + nvidia-ctk 1.20's drop-in (recorded): containerd 1.x cannot load CRI."""
    from tests.support import traces

    n = node_factory("n1-118")  # type: ignore[operator]
    rec = "nvidia-toolkit/runtime-configure/debian-plain/etc/containerd/"
    n.fs("/etc/containerd/config.toml").write_text(traces.text(rec + "config.toml"))
    n.fs("/etc/containerd/conf.d/99-nvidia.toml").write_text(traces.text(rec + "conf.d/99-nvidia.toml"))
    n.daemons()
    c = by_name(n.run())
    assert c["containerd"].status == "FAIL" and "CRI plugin will not load" in c["containerd"].message
    assert "runtimes.runc" in c["containerd"].fix and "/etc/containerd/conf.d/99-nvidia.toml" in c["containerd"].fix


def test_swarm_resource_the_hook_does_not_check_fails(node_factory: object) -> None:
    n = node_factory("n1-118")  # type: ignore[operator]
    assert n.install() == 0
    n.daemons()
    tk = n.fs("/etc/nvidia-container-runtime/config.toml")
    tk.write_text(tk.read_text().replace('#swarm-resource = "DOCKER_RESOURCE_GPU"', 'swarm-resource = "MY_GPUS"'))
    c = by_name(n.run())
    assert c["toolkit"].status == "FAIL" and "MY_GPUS" in c["toolkit"].message


def test_old_python_fails_and_names_alternatives(node_factory: object) -> None:
    n = node_factory("n1-117")  # type: ignore[operator]
    assert n.install() == 0
    n.daemons()
    c = by_name(n.run(python=lambda root, p: (3, 6) if p == "/usr/bin/python3" else None))
    assert c["hook-python"].status == "FAIL" and "Python 3.6" in c["hook-python"].message
    assert "--python" in c["hook-python"].fix


def test_real_interpreter_probe_under_root(tmp_path: Path) -> None:
    """python_version runs the interpreter (chroot under --root): here the host's, at /."""
    v = doctor.python_version(Root("/"), sys.executable)
    assert v == sys.version_info[:2]
    assert doctor.python_version(Root(str(tmp_path)), "/usr/bin/python3") is None


def test_nvml_on_the_simulated_gpu(tmp_path: Path) -> None:
    """The NVML probe for real: the fakegpu libnvidia-ml in a child process."""
    from sim.fakegpu.harness import FakeGPU

    gpu = FakeGPU(tmp_path / "gpu", ROOT / "build", gpus=2, memory=8 << 30)
    try:
        env = {**gpu.env, "VGPU_CONFIG": str(tmp_path / "none.toml")}
        r = subprocess.run([sys.executable, "-m", "vgpuctl.cli", "doctor", "--json", "--containerd-config",
                            str(tmp_path / "none.toml")], env=env, capture_output=True, text=True,
                           cwd=ROOT, timeout=60)  # fmt: skip
        rep = json.loads(r.stdout)
        nv = next(c for c in rep["checks"] if c["name"] == "nvml")
        assert nv["status"] == "OK" and nv["message"].startswith("2 GPU(s)"), nv
        assert all(u in nv["message"] for u in gpu.uuids)
        assert r.returncode == 1  # the rest of this machine is not a vGPU node
    finally:
        gpu.close()
    r = subprocess.run([sys.executable, "-m", "vgpuctl.cli", "doctor", "--json", "--containerd-config",
                        str(tmp_path / "none.toml")], env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path)},
                       capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    nv = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "nvml")
    assert nv["status"] == "FAIL" and "NVML not reachable" in nv["message"]
