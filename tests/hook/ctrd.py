"""A private containerd 1.x for the CRI end-to-end test.

Everything lives under one temp dir: root, state, the gRPC socket, the
config (containerd's own default config, edited by `vgpu-hook containerd
install` exactly as on a node).  The runc shim's sockets still go to
/run/containerd/s (fixed path in containerd 1.6); ids are unique per run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import tomlkit

IMAGE = "docker.io/library/vgpu-hook-test:latest"


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
