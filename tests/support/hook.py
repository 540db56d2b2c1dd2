"""Helpers for the hook tests: busybox rootfs, OCI bundles, records, runc runs."""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vgpu import schemas

ROOT = Path(__file__).resolve().parents[2]
FASTPATH = ROOT / "runtime_hook" / "fastpath.py"
BUSYBOX = "/bin/busybox"
APPLETS = ["sh", "cat", "ls", "echo", "stat", "test", "grep", "true", "false", "sleep", "touch", "mkdir", "id"]
HOOK_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
UUID_A = "GPU-11111111-2222-3333-4444-555555555555"
UUID_B = "GPU-66666666-7777-8888-9999-000000000000"


def have_runc() -> bool:
    return shutil.which("runc") is not None and os.path.exists(BUSYBOX) and os.geteuid() == 0


def make_rootfs(root: Path) -> Path:
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for a in APPLETS:
        link = root / "bin" / a
        if not link.exists():
            link.symlink_to("busybox")
    for d in ("proc", "dev", "sys", "tmp", "etc"):
        (root / d).mkdir(exist_ok=True)
    return root


def make_cdi_rootfs(root: Path) -> Path:
    """make_rootfs for a container that gets the host's C library from a CDI spec: the simulated
    NVIDIA spec bind-mounts it at /usr/lib*, so /lib and /lib64 lead there."""
    make_rootfs(root)
    for link in ("lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    return root


_BASE_SPEC: dict[str, Any] | None = None


def base_spec() -> dict[str, Any]:
    global _BASE_SPEC
    if _BASE_SPEC is None:
        d = Path(os.environ.get("TMPDIR", "/tmp")) / f"vgpu-spec-{os.getpid()}"
        d.mkdir(exist_ok=True)
        subprocess.run(["runc", "spec", "--bundle", str(d)], check=True)
        _BASE_SPEC = json.loads((d / "config.json").read_text())
        shutil.rmtree(d)
    return copy.deepcopy(_BASE_SPEC)


def hook_args(kind: str, *, state_dir: Path, library: Path, log_dir: Path, python: str = sys.executable) -> list[str]:
    return [
        python,
        "-I",
        "-S",
        str(FASTPATH),
        "--config",
        str(state_dir / "no-config.toml"),
        "--state-dir",
        str(state_dir),
        "--library-path",
        str(library),
        "--log-dir",
        str(log_dir),
        "--log-level",
        "info",
        "--log-max-bytes",
        "1048576",
        kind,
    ]


def hooks(
    state_dir: Path,
    library: Path,
    log_dir: Path,
    *,
    shell: bool = False,
    python: str = sys.executable,
    fastpath: Path = FASTPATH,
) -> dict[str, Any]:
    """Hook objects as `vgpu-hook containerd install` writes them (shell=True: with the sh filter);
    `fastpath`: the hook script of another tree (bench-hook's A/B against an earlier version)."""
    from node_setup.hookspec import hook_entries

    gargs = hook_args("x", state_dir=state_dir, library=library, log_dir=log_dir)[4:-1]
    entries = hook_entries(python, gargs, 30, str(state_dir) if shell else None, str(fastpath))
    return {k: [v] for k, v in entries.items()}


def make_bundle(
    bundle: Path,
    args: list[str],
    *,
    rootfs: Path | None = None,
    hook: dict[str, Any] | None = None,
    env: list[str] | None = None,
    annotations: dict[str, str] | None = None,
    readonly: bool = False,
) -> Path:
    bundle.mkdir(parents=True, exist_ok=True)
    if rootfs is None:
        rootfs = make_rootfs(bundle / "rootfs")
    spec = base_spec()
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] = ["PATH=/bin", *(env or [])]
    spec["root"] = {
        "path": os.path.relpath(rootfs, bundle) if rootfs.is_relative_to(bundle) else str(rootfs),
        "readonly": readonly,
    }
    if hook:
        spec["hooks"] = hook
    if annotations:
        spec["annotations"] = annotations
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def write_record(state_dir: Path, gpus: list[tuple[str, int, int]] | None = None, token: str | None = None) -> str:
    token = token or secrets.token_hex(16)
    rec = schemas.AllocationRecord(
        token=token,
        created=time.time(),
        gpus=[
            schemas.AllocatedGPU(uuid=u, memory_limit=m, core_percent=c)
            for u, m, c in (gpus or [(UUID_A, 4 << 30, 50)])
        ],
    )
    d = state_dir / "allocations"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    schemas.write_atomic(str(d / f"{token}.json"), schemas.encode(rec))
    return token


def runc(runc_root: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runc", "--root", str(runc_root), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def runc_run(runc_root: Path, bundle: Path, cid: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return runc(runc_root, "run", "--bundle", str(bundle), cid, timeout=timeout)
    finally:
        runc(runc_root, "delete", "--force", cid)


def placeholder_library(build_dir: Path) -> Path:
    """build/libvgpu.so when it exists, else a tiny placeholder .so compiled once."""
    real = ROOT / "build" / "libvgpu.so"
    if real.exists():
        return real
    out = build_dir / "libvgpu-placeholder.so"
    if not out.exists():
        src = build_dir / "placeholder.c"
        src.write_text("int vgpu_placeholder(void) { return 42; }\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def snapshot(paths: list[Path]) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime_ns) of every entry under each path, symlinks not followed."""
    out: dict[str, tuple[int, int, int]] = {}
    for base in paths:
        if not base.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                out[p] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def runc_detach(runc_root: Path, bundle: Path, cid: str) -> subprocess.CompletedProcess[str]:
    """`runc run --detach` with the container's stdio on /dev/null (a pipe would be held open by it)."""
    errf = bundle / "runc-stderr"
    with open(errf, "w") as err:
        p = subprocess.run(
            ["runc", "--root", str(runc_root), "run", "--detach", "--bundle", str(bundle), cid],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            timeout=60,
        )
    return subprocess.CompletedProcess(p.args, p.returncode, "", errf.read_text())


def recording_python(d: Path) -> tuple[str, Path]:
    """An interpreter stand-in that logs each invocation's last argument (the hook kind), then runs Python."""
    log = d / "python-invocations"
    exe = d / "python-recorder"
    exe.write_text(f'#!/bin/sh\nfor a; do k=$a; done\necho "$k" >> {log}\nexec {sys.executable} "$@"\n')
    exe.chmod(0o755)
    return str(exe), log


class Node:
    """One test's host view: state dir, log dir, runc root, the library to mount."""

    def __init__(self, base: Path, lib: Path, shell: bool = False) -> None:
        self.shell = shell
        self.base = base
        self.state = base / "state"
        self.logs = base / "log"
        self.runc_root = base / "runc"
        self.lib = lib
        self.state.mkdir()
        self.logs.mkdir()
        self.runc_root.mkdir()
        self._n = 0

    def hooks(self) -> dict[str, object]:
        return hooks(self.state, self.lib, self.logs, shell=self.shell)

    def bundle(self, args: list[str], **kw: object) -> Path:
        self._n += 1
        return make_bundle(self.base / f"bundle{self._n}", args, hook=self.hooks(), **kw)  # type: ignore[arg-type]

    def run(self, bundle: Path, cid: str) -> object:
        return runc_run(self.runc_root, bundle, cid)

    def containers(self) -> list[str]:
        d = self.state / "containers"
        return sorted(p.name for p in d.iterdir()) if d.exists() else []
