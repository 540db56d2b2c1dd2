"""A private containerd 1.x for the CRI end-to-end test.

Everything lives under one temp dir: root, state, the gRPC socket, the
config (containerd's own default config, edited by `vgpu-hook containerd
install` exactly as on a node).  The runc shim's sockets still go to
/run/containerd/s (fixed path in containerd 1.6); ids are unique per run.

`make_shape` writes the node shapes the NVIDIA toolkit and GPU Operator leave
(docs/operators/install.md) for the detection, install, CRI and doctor tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import tomlkit

IMAGE = "docker.io/library/vgpu-hook-test:latest"  # the workload: nvidia/cuda's env (ociimage.CUDA_ENV)
PAUSE_IMAGE = "docker.io/library/vgpu-hook-pause:latest"  # the sandbox image (ociimage.PAUSE_ENV)
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
    cri["sandbox_image"] = PAUSE_IMAGE
    # Root here may lack CAP_SYS_RESOURCE: never try to lower oom_score_adj below ours.
    cri["restrict_oom_score_adj"] = True
    cri["disable_cgroup"] = False
    cri["enable_selinux"] = False
    cri["containerd"]["snapshotter"] = snapshotter  # type: ignore[index]
    cri["cni"]["bin_dir"] = str(d / "cni-bin")  # type: ignore[index]
    cri["cni"]["conf_dir"] = str(d / "cni-conf")  # type: ignore[index]
    # CDI specs of this containerd's own (1.7+ reads them, 2.x by default): never the host's
    # /etc/cdi or /var/run/cdi, where a GPU node has NVIDIA's (1.6 ignores the key).
    cri["cdi_spec_dirs"] = [str(d / "cdi")]
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


# ---- node shapes: the files NVIDIA's tools leave on a node ---------------------------------------
#
# Every shape but n1-117 is the exact set of files NVIDIA Container Toolkit 1.20 wrote
# (tests/data/real-traces/nvidia-toolkit: `nvidia-ctk runtime configure`, `nvidia-ctk config
# default`, `nvidia-ctk cdi generate`, the GPU Operator's `nvidia-ctk-installer`), with host
# paths moved under a prefix where a test needs real absolute paths.  A test that runs containerd
# needs a CRI section it can run (its own root, sockets, sandbox image): there the same
# transformation is applied to the test's config (`runtime_configure`, a model of nvidia-ctk
# checked against the recorded outputs by tests/node_setup/test_nodetype.py).

SHAPES = ("n1-117", "n1-118", "n1-cdi", "n2", "n3")
EXPECTED_TYPE = {"n1-117": "N1-legacy", "n1-118": "N1-jit-cdi", "n1-cdi": "N1-cdi", "n2": "N2", "n3": "N3"}
CRI = "io.containerd.grpc.v1.cri"
NCT = "nvidia-toolkit"  # the traces' folder
_OP_CONFIG = "usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml"
TRACE_FILES = {  # shape -> (runtime-configure / installer folder, toolkit config trace, CDI spec traces)
    "n1-118": ("runtime-configure/default-plain", "nvidia-ctk-config-default.toml", {}),
    "n1-cdi": ("runtime-configure/default-cdi-enabled", "runtime-edit/nvidia-container-runtime-config.toml",
               {"/etc/cdi/nvidia.com-gpu.json": "cdi-spec/nvidia.com-gpu.json"}),
    "n2": ("installer/default", f"installer/default/{_OP_CONFIG}", {}),
    "n3": ("installer/cdi", f"installer/cdi/{_OP_CONFIG}",
           {"/var/run/cdi/management.nvidia.com-gpu.yaml": "installer/cdi/var/run/cdi/management.nvidia.com-gpu.yaml"}),
}  # fmt: skip
HOST_BINARIES = (  # nvidia-container-toolkit{,-base} packaging/debian/*.install@v1.20.0
    "nvidia-container-runtime",
    "nvidia-container-runtime.cdi",
    "nvidia-container-runtime.legacy",
    "nvidia-container-runtime-hook",
)


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
        self.dropin = self.hp("/etc/containerd/conf.d/99-nvidia.toml")
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

    def own_cdi_dirs(self, host_path: str) -> None:
        """Under a prefix, containerd's CDI spec directories (implicitly the host's /etc/cdi and
        /var/run/cdi) named explicitly under the prefix too, in the CRI section of `host_path`
        (the file that owns it): containerd 1.7+ reads the shape's specs, never the host's."""
        if not self.prefix:
            return
        doc = tomlkit.parse(self.fs(host_path).read_text())
        cri = doc["plugins"][CRI]  # type: ignore[index]
        cri["cdi_spec_dirs"] = [self.hp("/etc/cdi"), self.hp("/var/run/cdi")]  # type: ignore[index]
        self.fs(host_path).write_text(tomlkit.dumps(doc))

    def moved(self, text: str) -> str:
        """A recorded file's host paths moved under the prefix (quoted TOML/JSON/YAML strings)."""
        if not self.prefix:
            return text
        for p in ("/usr/local/nvidia/toolkit", "/usr/bin/nvidia-", "/etc/containerd/", "/etc/cdi", "/var/run/cdi",
                  "/run/nvidia/driver", "/var/log/nvidia-"):  # fmt: skip
            for q in ('"', "'", ": "):
                text = text.replace(q + p, q + self.prefix + p)
        return text


def _runtime_script(target: Path | None, toolkit_config: str | None) -> str:
    lines = ["#!/bin/sh"]
    if toolkit_config:
        lines += [f"NVIDIA_CTK_CONFIG_FILE_PATH='{toolkit_config}'", "export NVIDIA_CTK_CONFIG_FILE_PATH"]
    lines.append(f"exec '{target}' \"$@\"" if target else "exit 1")
    return "\n".join(lines) + "\n"


def _copy(t: Any) -> Any:
    return tomlkit.parse(tomlkit.dumps(tomlkit.document().add("x", t)))["x"]


def runtime_configure(
    base_text: str,
    runtimes: dict[str, str],
    *,
    set_as_default: str | None = None,
    cdi: bool = False,
    dropin_glob: str = "/etc/containerd/conf.d/*.toml",
) -> tuple[str, str]:
    """(main config, drop-in) as `nvidia-ctk runtime configure --runtime=containerd
    --drop-in-config=<conf.d>/99-nvidia.toml [--set-as-default] [--cdi.enabled]` (and the
    operator's installer, which adds nvidia, nvidia-cdi, nvidia-legacy) write them on containerd
    1.x, toolkit 1.20 (pkg/config/engine/containerd):

    - the drop-in holds `version = 2` and a copy of the WHOLE CRI section of the config, plus
      `runtimes.<name>` for each runtime: a copy of the `runc` table (GetDefaultRuntimeOptions;
      without one - Debian's config - `runtime_type`, `runtime_root`, `runtime_engine`,
      `privileged_without_host_devices` only) with `options.BinaryName` (AddRuntimeWithOptions);
      `default_runtime_name` when set as default, `enable_cdi = true` with --cdi.enabled;
    - the main file only gets `imports = ["<conf.d>/*.toml"]` (config_drop_in.go: ensureImports).
    `runtimes`: name -> BinaryName.
    """
    main = tomlkit.parse(base_text)
    arr = tomlkit.array()
    arr.append(dropin_glob)
    main["imports"] = arr
    doc = tomlkit.parse(base_text)
    plugins = doc.get("plugins") or tomlkit.table()
    cri = plugins.get(CRI) or tomlkit.table()
    ctd = cri.get("containerd")
    if ctd is None:
        ctd = cri["containerd"] = tomlkit.table()
    if "runtimes" not in ctd:
        ctd["runtimes"] = tomlkit.table()
    rts = ctd["runtimes"]
    for name, binary in runtimes.items():
        if "runc" in rts:
            t = _copy(rts["runc"])
        else:
            t = tomlkit.table()
            t["privileged_without_host_devices"] = False
            t["runtime_engine"] = ""
            t["runtime_root"] = ""
            t["runtime_type"] = "io.containerd.runc.v2"
        if "options" not in t:
            t["options"] = tomlkit.table()
        t["options"]["BinaryName"] = binary
        rts[name] = t
    if set_as_default:
        ctd["default_runtime_name"] = set_as_default
    if cdi:
        cri["enable_cdi"] = True
    drop = tomlkit.document()
    drop["version"] = 2
    p = tomlkit.table(is_super_table=True)
    p[CRI] = cri
    drop["plugins"] = p
    return tomlkit.dumps(main), tomlkit.dumps(drop)


def make_shape(
    kind: str,
    root: Path,
    prefix: str = "",
    *,
    base_text: str | None = None,
    runtime_dir: Path | None = None,
    toolkit_text: Any = None,
    fakegpu_text: str = "",
) -> Shape:
    """Writes the containerd and toolkit files of a node shape (SHAPES).

    n1-117: `nvidia-ctk runtime configure --set-as-default` of toolkit <= 1.17 (the main file edited
        in place; no recording: modelled, `base_text` or V1_CONFIG as the node's config);
    n1-118: host toolkit 1.20, `nvidia-ctk runtime configure` (drop-in conf.d/99-nvidia.toml) and
        `nvidia-ctk config default` (mode auto);
    n1-cdi: host toolkit 1.20 in cdi mode: `runtime configure --cdi.enabled`, the default config with
        mode cdi, the spec of `nvidia-ctk cdi generate` in /etc/cdi;
    n2 / n3: the GPU Operator's nvidia-ctk-installer 1.20 (wrappers under /usr/local/nvidia/toolkit,
        handlers nvidia/nvidia-cdi/nvidia-legacy, `nvidia` default) in mode auto / mode cdi
        (skip-mode-detection = true, enable_cdi, the management spec in /var/run/cdi).

    `base_text` None: the recorded files (n1-117: V1_CONFIG); else the node's containerd config
    that `runtime_configure` turns into the shape (what a containerd test can run).
    `runtime_dir`: where the stand-in binaries are (the runtimes exec them), None for inert
    scripts.  `toolkit_text(mode=..., **flags)`: n1-117's toolkit config; `fakegpu_text`: the
    stand-in's [fakegpu] table appended to the recorded toolkit configs.
    """
    from sim.fakegpu import toolkit as fk
    from tests.support import traces

    s = Shape(kind, root, prefix)
    operator = kind in ("n2", "n3")
    tkdir = s.hp("/usr/local/nvidia/toolkit")
    if operator:
        s.toolkit_config = tkdir + "/.config/nvidia-container-runtime/config.toml"
        s.binary = tkdir + "/nvidia-container-runtime"
        names = {"nvidia": s.binary, "nvidia-cdi": s.binary + ".cdi", "nvidia-legacy": s.binary + ".legacy"}
        for name in fk.OPERATOR_BINARIES:  # toolkit/installer/executables.go: wrappers with the config's path
            target = runtime_dir / name if runtime_dir else None
            s.write(f"{tkdir}/{name}", _runtime_script(target, s.toolkit_config), 0o755)
    else:
        s.toolkit_config = s.hp("/etc/nvidia-container-runtime/config.toml")
        s.binary = s.hp("/usr/bin/nvidia-container-runtime")
        names = {"nvidia": s.binary}
        for name in HOST_BINARIES:
            target = runtime_dir / name if runtime_dir else None
            # A host toolkit reads /etc/nvidia-container-runtime/config.toml; under a prefix the script
            # names the prefixed one (as NVIDIA_CTK_CONFIG_FILE_PATH does), with prefix "" it is plain.
            s.write(s.hp(f"/usr/bin/{name}"), _runtime_script(target, s.toolkit_config if prefix else None), 0o755)
    if kind == "n1-117":
        render = toolkit_text or (lambda **kw: fk.toolkit_config_text(None, **kw))
        # toolkit <= 1.17: `auto` meant legacy; the stand-in models 1.20 (auto = jit-cdi), so a node
        # whose runtime runs is given the mode `auto` resolved to on 1.17
        # under a prefix, the runtime's CDI spec dirs too (the default is the host's /etc/cdi, /var/run/cdi)
        dirs = {"spec_dirs": [s.hp("/etc/cdi"), s.hp("/var/run/cdi")]} if prefix else {}
        s.write(s.toolkit_config, render(mode="legacy" if runtime_dir else "auto", **dirs))
        doc = tomlkit.parse(base_text or V1_CONFIG)
        ctd = doc["plugins"][CRI]["containerd"]  # type: ignore[index]
        t = _copy(ctd["runtimes"]["runc"])  # type: ignore[index]
        t["options"]["BinaryName"] = s.binary
        ctd["runtimes"]["nvidia"] = t  # type: ignore[index]
        ctd["default_runtime_name"] = "nvidia"
        s.write(s.conf, tomlkit.dumps(doc))
        s.own_cdi_dirs(s.conf)
        return s
    folder, tk_trace, specs = TRACE_FILES[kind]
    tk_text = s.moved(traces.text(f"{NCT}/{tk_trace}"))
    s.write(s.toolkit_config, tk_text + ("\n" + fakegpu_text if fakegpu_text else ""))
    for host, rel in specs.items():
        s.write(s.hp(host), s.moved(traces.text(f"{NCT}/{rel}")))
    if base_text is None:
        s.write(s.conf, s.moved(traces.text(f"{NCT}/{folder}/etc/containerd/config.toml")))
        s.write(s.dropin, s.moved(traces.text(f"{NCT}/{folder}/etc/containerd/conf.d/99-nvidia.toml")))
        s.own_cdi_dirs(s.dropin)
        return s
    glob = s.hp("/etc/containerd/conf.d/*.toml")
    main, drop = runtime_configure(base_text, names, set_as_default="nvidia" if operator else None,
                                   cdi=kind in ("n1-cdi", "n3"), dropin_glob=glob)  # fmt: skip
    s.write(s.conf, main)
    s.write(s.dropin, drop)
    s.own_cdi_dirs(s.dropin)
    return s


def import_images(c: Containerd, d: Path, rootfs: Path, workload_rootfs: Path | None = None) -> None:
    """Builds and imports the sandbox image (PAUSE_IMAGE, a PATH only) and the workload image
    (IMAGE, nvidia/cuda's env) from busybox rootfs dirs."""
    from tests.support import ociimage

    ociimage.build_image(rootfs, d / "pause.tar", PAUSE_IMAGE, ["sleep", "3600"], env=ociimage.PAUSE_ENV)
    ociimage.build_image(workload_rootfs or rootfs, d / "img.tar", IMAGE, ["sleep", "3600"])
    for tar in ("pause.tar", "img.tar"):
        r = c.ctr("images", "import", "--snapshotter", c.snapshotter, str(d / tar))
        if r.returncode != 0:
            raise RuntimeError(f"ctr images import {tar}: {r.stderr}")


def wait_exit(rt: Any, cid: str, timeout: float = 60, describe: Any = None) -> Any:
    """The CRI status of container `cid` once it has exited (polled through RuntimeService `rt`);
    AssertionError after `timeout` s, with `describe()` (e.g. its logs) in the message."""
    from tests.support.cri import api_pb2 as cri

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
        if st.state == cri.CONTAINER_EXITED:
            return st
        time.sleep(0.1)
    raise AssertionError(f"container {cid} did not exit" + (f": {describe()}" if describe else ""))
