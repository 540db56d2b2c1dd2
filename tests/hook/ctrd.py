"""A private containerd 1.x for the CRI end-to-end test.

Everything lives under one temp dir: root, state, the gRPC socket, the
config (containerd's own default config, edited by `vgpu-hook containerd
install` exactly as on a node).  The runc shim's sockets still go to
/run/containerd/s (fixed path in containerd 1.6); ids are unique per run.

`make_shape` writes the node shapes the NVIDIA toolkit and GPU Operator leave
(docs/node-types.md) for the detection, install, CRI and doctor tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import tomlkit

IMAGE = "docker.io/library/vgpu-hook-test:latest"
HAVE_CONTAINERD = shutil.which("containerd") is not None

# An operator's containerd 1.x config (comments, a pinned sandbox image, an explicit runc handler
# with SystemdCgroup): what detection and install must read, edit in place and restore.
V1_CONFIG = """# my node's containerd config
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"   # pinned by ops
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
"""


def available() -> str | None:
    """None when usable, else why not."""
    for exe in ("containerd", "ctr", "containerd-shim-runc-v2", "runc"):
        if not shutil.which(exe):
            return f"{exe} not installed"
    if os.geteuid() != 0:
        return "needs root"
    return None


def overlay_works(d: Path) -> bool:
    """Whether overlayfs mounts on this filesystem (not on an overlay root, e.g. in some CI containers)."""
    t = d / "ovl-probe"
    for sub in ("lower", "upper", "work", "merged"):
        (t / sub).mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={t}/lower,upperdir={t}/upper,workdir={t}/work", str(t / "merged")],
        capture_output=True,
    )  # fmt: skip
    if r.returncode == 0:
        subprocess.run(["umount", str(t / "merged")], capture_output=True)
    shutil.rmtree(t, ignore_errors=True)
    return r.returncode == 0


def base_config(d: Path, snapshotter: str = "overlayfs") -> str:
    text = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True).stdout
    doc = tomlkit.parse(text)
    doc["root"] = str(d / "root")
    doc["state"] = str(d / "state")
    grpc = doc["grpc"]
    grpc["address"] = str(d / "containerd.sock")  # type: ignore[index]
    doc["ttrpc"]["address"] = str(d / "containerd.sock.ttrpc")  # type: ignore[index]
    doc["debug"]["address"] = ""  # type: ignore[index]
    doc["metrics"]["address"] = ""  # type: ignore[index]
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]  # type: ignore[index]
    cri["sandbox_image"] = IMAGE
    # Root here may lack CAP_SYS_RESOURCE: never try to lower oom_score_adj below ours.
    cri["restrict_oom_score_adj"] = True
    cri["disable_cgroup"] = False
    cri["enable_selinux"] = False
    cri["containerd"]["snapshotter"] = snapshotter  # type: ignore[index]
    cri["cni"]["bin_dir"] = str(d / "cni-bin")  # type: ignore[index]
    cri["cni"]["conf_dir"] = str(d / "cni-conf")  # type: ignore[index]
    # runc state of this containerd apart from any other.
    opts = cri["containerd"]["runtimes"]["runc"]["options"]  # type: ignore[index]
    opts["Root"] = str(d / "runc")
    doc["plugins"]["io.containerd.internal.v1.opt"]["path"] = str(d / "opt")  # type: ignore[index]
    return tomlkit.dumps(doc)


class Containerd:
    def __init__(self, d: Path) -> None:
        self.dir = d
        self.config = d / "config.toml"
        self.sock = d / "containerd.sock"
        self.log = d / "containerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.snapshotter = "overlayfs"

    def write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.snapshotter = "overlayfs" if overlay_works(self.dir) else "native"
        self.config.write_text(base_config(self.dir, self.snapshotter))

    def start(self, timeout: float = 60) -> None:
        logf = open(self.log, "wb")
        self.proc = subprocess.Popen(
            ["containerd", "--config", str(self.config), "--log-level", "info"],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited: {self.log.read_text()[-2000:]}")
            if self.sock.exists():
                r = self.ctr("version")
                if r.returncode == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"containerd did not come up: {self.log.read_text()[-2000:]}")

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", str(self.sock), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        # Kill any leftover tasks' shims of this containerd (they are children of
        # their own sessions): list them through ctr first.
        r = self.ctr("tasks", "ls", "-q")
        for tid in r.stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", tid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        subprocess.run(["umount", "-R", "-l", str(self.dir / "root")], capture_output=True)
        subprocess.run(["umount", "-R", "-l", str(self.dir / "state")], capture_output=True)


# ---- node shapes: containerd + toolkit configs exactly as the toolkit leaves them ----------

SHAPES = ("n1-117", "n1-118", "n2", "n3")
EXPECTED_TYPE = {"n1-117": "N1-legacy", "n1-118": "N1-jit-cdi", "n2": "N2", "n3": "N3"}
CRI = "io.containerd.grpc.v1.cri"


class Shape:
    """One node's files under `root`; host paths are `prefix` + the usual path.

    prefix "" with a temp root: a host tree as an installer container sees it (`--root`);
    a temp prefix with root "/": real absolute paths, so containerd itself can read them.
    """

    def __init__(self, kind: str, root: Path, prefix: str) -> None:
        self.kind = kind
        self.root = root
        self.prefix = prefix
        self.conf = self.hp("/etc/containerd/config.toml")
        self.toolkit_config = ""
        self.binary = ""

    def hp(self, p: str) -> str:
        return self.prefix + p

    def fs(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def write(self, host_path: str, text: str, mode: int = 0o644) -> None:
        f = self.fs(host_path)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        os.chmod(f, mode)

    def snapshot(self) -> dict[str, bytes]:
        """Every file of the tree (bytes), for byte-for-byte comparisons."""
        base = self.fs(self.hp("/"))
        return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def _runtime_script(target: Path | None, toolkit_config: str | None) -> str:
    lines = ["#!/bin/sh"]
    if toolkit_config:
        lines += [f"NVIDIA_CTK_CONFIG_FILE_PATH='{toolkit_config}'", "export NVIDIA_CTK_CONFIG_FILE_PATH"]
    lines.append(f"exec '{target}' \"$@\"" if target else "exit 1")
    return "\n".join(lines) + "\n"


def make_shape(
    kind: str,
    root: Path,
    prefix: str = "",
    *,
    base_text: str,
    runtime_dir: Path | None = None,
    toolkit_text: Any = None,
    cdi_spec: dict[str, Any] | None = None,
) -> Shape:
    """Writes the containerd config (from `base_text`) and toolkit files of a node shape.

    n1-117: `nvidia-ctk runtime configure --set-as-default` of toolkit 1.17 (main file edited in place);
    n1-118: toolkit >= 1.18 (drop-in conf.d/99-nvidia.toml with a copy of the whole CRI section + imports);
    n2: GPU Operator < 25.10 (wrappers under /usr/local/nvidia/toolkit, nvidia/nvidia-cdi/nvidia-legacy,
        `nvidia` default); n3: GPU Operator >= 25.10 (same, `runc` default, enable_cdi, mode cdi,
        default kind management.nvidia.com/gpu).
    `runtime_dir`: where the stand-in binaries are (the runtimes exec them), None for inert scripts.
    `toolkit_text(mode=..., **flags)` renders a toolkit config.toml (tests.fakegpu.toolkit).
    """
    from tests.fakegpu import toolkit as fk

    render = toolkit_text or (lambda **kw: fk.toolkit_config_text(None, **kw))
    s = Shape(kind, root, prefix)
    doc = tomlkit.parse(base_text)
    cri = doc["plugins"][CRI]  # type: ignore[index]
    ctd = cri["containerd"]  # type: ignore[index]
    runc = ctd["runtimes"]["runc"]  # type: ignore[index]

    def nvidia_table(binary: str) -> Any:
        t = tomlkit.parse(tomlkit.dumps(tomlkit.document().add("x", runc)))["x"]  # a deep copy of runc's table
        t["options"]["BinaryName"] = binary  # type: ignore[index]
        return t

    operator = kind in ("n2", "n3")
    if operator:
        tk = s.hp("/usr/local/nvidia/toolkit")
        s.toolkit_config = tk + "/.config/nvidia-container-runtime/config.toml"
        flags: dict[str, Any] = {"hook_path": tk + "/nvidia-container-runtime-hook"}
        if kind == "n3":
            flags.update(mode="cdi", default_kind="management.nvidia.com/gpu")
            flags["spec_dirs"] = [s.hp("/etc/cdi"), s.hp("/var/run/cdi")]
        else:
            flags.update(mode="auto")
        s.write(s.toolkit_config, render(**flags))
        for name in fk.OPERATOR_BINARIES:
            target = runtime_dir / name if runtime_dir else None
            s.write(f"{tk}/{name}", _runtime_script(target, s.toolkit_config), 0o755)
        s.binary = tk + "/nvidia-container-runtime"
        rts = ctd["runtimes"]  # type: ignore[index]
        rts["nvidia"] = nvidia_table(s.binary)
        rts["nvidia-cdi"] = nvidia_table(s.binary + ".cdi")
        rts["nvidia-legacy"] = nvidia_table(s.binary + ".legacy")
        if kind == "n2":
            ctd["default_runtime_name"] = "nvidia"
        else:
            cri["enable_cdi"] = True
            cri["cdi_spec_dirs"] = [s.hp("/etc/cdi"), s.hp("/var/run/cdi")]
            spec = cdi_spec or {
                "cdiVersion": "0.5.0",
                "kind": "management.nvidia.com/gpu",
                "devices": [{"name": "all", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}],
            }
            s.write(s.hp("/var/run/cdi/management.nvidia.com-gpu.json"), json.dumps(spec, indent=1))
        s.write(s.conf, tomlkit.dumps(doc))
        return s
    s.toolkit_config = s.hp("/etc/nvidia-container-runtime/config.toml")
    s.write(s.toolkit_config, render(mode="auto"))
    s.binary = s.hp("/usr/bin/nvidia-container-runtime")
    for name in ("nvidia-container-runtime", "nvidia-container-runtime-hook"):
        target = runtime_dir / name if runtime_dir else None
        # A host toolkit reads /etc/nvidia-container-runtime/config.toml; under a prefix the script
        # names the prefixed one (as NVIDIA_CTK_CONFIG_FILE_PATH does), with prefix "" it is plain.
        s.write(s.hp(f"/usr/bin/{name}"), _runtime_script(target, s.toolkit_config if prefix else None), 0o755)
    if kind == "n1-117":
        ctd["runtimes"]["nvidia"] = nvidia_table(s.binary)  # type: ignore[index]
        ctd["default_runtime_name"] = "nvidia"
        s.write(s.conf, tomlkit.dumps(doc))
        return s
    # n1-118: the main file is left as it was, plus `imports`; the drop-in copies the CRI section.
    main = tomlkit.parse(base_text)
    arr = tomlkit.array()
    arr.append(s.hp("/etc/containerd/conf.d/*.toml"))
    main["imports"] = arr
    s.write(s.conf, tomlkit.dumps(main))
    ctd["runtimes"]["nvidia"] = nvidia_table(s.binary)  # type: ignore[index]
    drop = tomlkit.document()
    drop["version"] = 2
    plugins = tomlkit.table(is_super_table=True)
    plugins[CRI] = cri
    drop["plugins"] = plugins
    s.write(s.hp("/etc/containerd/conf.d/99-nvidia.toml"), tomlkit.dumps(drop))
    return s


def wait_exit(rt: Any, cid: str, timeout: float = 60, describe: Any = None) -> Any:
    """The CRI status of container `cid` once it has exited (polled through RuntimeService `rt`);
    AssertionError after `timeout` s, with `describe()` (e.g. its logs) in the message."""
    from tests.hook.cri import api_pb2 as cri

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
        if st.state == cri.CONTAINER_EXITED:
            return st
        time.sleep(0.1)
    raise AssertionError(f"container {cid} did not exit" + (f": {describe()}" if describe else ""))
