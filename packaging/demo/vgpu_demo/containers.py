"""OCI bundles for the demo's containers, run with the distribution's runc.

The rootfs is busybox (static) plus read-only bind mounts, at their host paths, of what the
workloads need from the host: the C library directories (fakegpu-burn and libvgpu.so are
dynamic glibc programs), the GPU driver libraries (the simulated ones from build/fakegpu, or the
real driver's), a Python interpreter with its standard library and pynvml (the NVML query).
The container's process runs a shell script the demo writes into a per-container directory
mounted at /demo, and reports there.

The hooks are the ones `vgpu-hook containerd install` writes (node_setup.containerd): the sh
filter in front of the Python hook, each with an explicit `env` and a timeout.

Containers are created the way containerd-shim does it: `<runtime> create`, then `start`, where
the runtime is NVIDIA's nvidia-container-runtime (or the simulated toolkit's stand-in of it), which
edits config.json on `create` and then execs runc: the GPU arrives through that chain only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "cat", "echo", "sleep", "test", "[", "true", "false", "mkdir", "ls", "printf")
CRI = "io.kubernetes.cri."


@dataclass
class Container:
    """One container of the demo: its bundle, its report directory and its runc state."""

    cid: str
    bundle: Path
    out: Path
    namespace: str
    pod: str
    name: str
    env: dict[str, str]
    mounts: list[dict[str, Any]] = field(default_factory=list)
    pid: int = 0

    def file(self, name: str) -> Path:
        return self.out / name


def have_runc() -> bool:
    return shutil.which("runc") is not None and os.path.exists(BUSYBOX)


def _bind(src: str, dst: str | None = None, *, ro: bool = True) -> dict[str, Any]:
    opts = ["rbind", "nosuid", "nodev"] + (["ro"] if ro else ["rw"])
    return {"destination": dst or src, "type": "bind", "source": src, "options": opts}


def host_mounts(extra_dirs: list[str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Read-only bind mounts of the host's C library and a Python with pynvml, at their host
    paths, and the symlinks (`/lib`, `/lib64` on merged-/usr systems) the rootfs must mirror."""
    import pynvml  # the NVML binding the tests use; a pure-Python module

    wanted: list[str] = []
    links: dict[str, str] = {}
    for top in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):
            links[top] = os.readlink(top)
            wanted.append(os.path.realpath(top))
        elif os.path.isdir(top):
            wanted.append(top)
    wanted.append("/usr/lib/x86_64-linux-gnu" if os.path.isdir("/usr/lib/x86_64-linux-gnu") else "/usr/lib")
    python = os.path.realpath(sys.executable)
    wanted += [os.path.join(sys.base_prefix, "lib"), os.path.dirname(os.path.realpath(pynvml.__file__))]
    wanted += extra_dirs
    dirs: list[str] = []
    for d in sorted(set(wanted), key=len):
        if os.path.isdir(d) and not any(d == p or d.startswith(p + "/") for p in dirs):
            dirs.append(d)
    mounts = [_bind(d) for d in dirs]
    if not any(python.startswith(p + "/") for p in dirs):
        mounts.append(_bind(python))
    return mounts, links


def make_rootfs(root: Path, links: dict[str, str]) -> Path:
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    for d in ("proc", "dev", "sys", "tmp", "etc", "run", "demo"):
        (root / d).mkdir(exist_ok=True)
    for path, target in links.items():
        (root / path.lstrip("/")).symlink_to(target)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
    return root


def runc_spec() -> dict[str, Any]:
    tmp = Path(subprocess.run(["mktemp", "-d"], check=True, capture_output=True, text=True).stdout.strip())
    try:
        subprocess.run(["runc", "spec", "--bundle", str(tmp)], check=True)
        spec: dict[str, Any] = json.loads((tmp / "config.json").read_text())
        return spec
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bundle(
    c: Container,
    script: str,
    *,
    hooks: dict[str, Any],
    annotations: dict[str, str],
    mounts: list[dict[str, Any]],
    links: dict[str, str],
    devices: list[dict[str, Any]] | None = None,
) -> None:
    """config.json for `runc run`: busybox rootfs, the script as the process, our hooks."""
    rootfs = make_rootfs(c.bundle / "rootfs", links)
    c.out.mkdir(parents=True, exist_ok=True)
    (c.out / "run.sh").write_text(script)
    spec = runc_spec()
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/bin/sh", "/demo/run.sh"]
    spec["process"]["env"] = ["PATH=/bin"] + [f"{k}={v}" for k, v in sorted(c.env.items())]
    spec["process"]["cwd"] = "/"
    spec["root"] = {"path": os.path.relpath(rootfs, c.bundle), "readonly": False}
    spec["hostname"] = c.pod
    spec["mounts"] = spec["mounts"] + mounts + c.mounts + [_bind(str(c.out), "/demo", ro=False)]
    spec["hooks"] = hooks
    spec["annotations"] = {
        **annotations,
        CRI + "container-type": "container",
        CRI + "sandbox-namespace": c.namespace,
        CRI + "sandbox-name": c.pod,
        CRI + "sandbox-uid": f"demo-{c.pod}",
        CRI + "container-name": c.name,
    }
    if devices:
        linux = spec.setdefault("linux", {})
        linux.setdefault("devices", []).extend(devices)
        allow = linux.setdefault("resources", {}).setdefault("devices", [])
        allow.extend(
            {"allow": True, "type": d["type"], "major": d["major"], "minor": d["minor"], "access": "rwm"}
            for d in devices
        )
    (c.bundle / "config.json").write_text(json.dumps(spec, indent=1))


def runc(runc_root: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runc", "--root", str(runc_root), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def start(runc_root: Path, c: Container, runtime: str = "runc", env: dict[str, str] | None = None) -> None:
    """`<runtime> create` then `start`, as containerd-shim does: the NVIDIA runtime edits the
    bundle on create, the prestart hooks run there; their error is the runtime's error."""
    err_path = c.bundle / "runc.stderr"
    base = [runtime, "--root", str(runc_root)]
    with open(err_path, "w") as err:
        for args in (["create", "--bundle", str(c.bundle), c.cid], ["start", c.cid]):
            r = subprocess.run(
                base + args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # the container must not hold a pipe of ours open
                stderr=err,
                timeout=120,
                env=env,
            )
            if r.returncode != 0:
                name = os.path.basename(runtime)
                raise RuntimeError(f"{name} {args[0]} {c.cid} failed: {err_path.read_text().strip()[-1500:]}")
    st = runc(runc_root, "state", c.cid)
    if st.returncode != 0:
        raise RuntimeError(f"runc state {c.cid}: {st.stderr.strip()}")
    c.pid = int(json.loads(st.stdout)["pid"])


def stop(runc_root: Path, c: Container) -> None:
    """Kill and delete (the poststop hook runs on delete); quiet when already gone."""
    runc(runc_root, "kill", c.cid, "KILL")
    runc(runc_root, "delete", "--force", c.cid)


def status(runc_root: Path, c: Container) -> str:
    st = runc(runc_root, "state", c.cid)
    if st.returncode != 0:
        return "gone"
    return str(json.loads(st.stdout).get("status", "unknown"))
