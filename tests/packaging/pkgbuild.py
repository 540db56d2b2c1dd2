"""Helpers of the packaging tests: build the deb/rpm, list their files, make a clean Debian root.

The clean root is made by debootstrap (minbase + python3, systemd, containerd; the host's suite) once
and cached under build/pkgtest/; every test works on an overlay of it, so the cache stays
pristine and reruns take seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
PKG_DIR = BUILD / "pkg"
CACHE = BUILD / "pkgtest"
ROOTFS_PACKAGES = ("python3", "systemd", "containerd")
MIRROR = os.environ.get("VGPU_DEBIAN_MIRROR", "http://deb.debian.org/debian")


@dataclass(frozen=True)
class Packages:
    deb: Path
    rpm: Path


def build_packages() -> Packages:
    """`packaging/build-packages.sh deb rpm` (what `make deb rpm` runs once `make` has built)."""
    out = subprocess.run(
        ["packaging/build-packages.sh", "deb", "rpm"],
        cwd=ROOT,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.split()
    deb = next(Path(ROOT, p) for p in out if p.endswith(".deb"))
    rpm = next(Path(ROOT, p) for p in out if p.endswith(".rpm"))
    return Packages(deb, rpm)


def deb_files(deb: Path) -> dict[str, str]:
    """Regular files and symlinks of a .deb: path -> "f" or "l -> target"."""
    out = subprocess.run(["dpkg-deb", "-c", str(deb)], check=True, stdout=subprocess.PIPE, text=True).stdout
    files: dict[str, str] = {}
    for line in out.splitlines():
        perms, _owner, _size, _date, _time, rest = line.split(None, 5)
        if perms[0] == "-":
            files[rest.removeprefix(".")] = "f"
        elif perms[0] == "l":
            path, target = rest.split(" -> ", 1)
            files[path.removeprefix(".")] = "l -> " + target
    return files


def rpm_files(rpm: Path) -> dict[str, str]:
    """Regular files and symlinks of a .rpm (rpm -qp), same form as deb_files."""
    out = subprocess.run(
        ["rpm", "-qp", "--qf", r"[%{FILEMODES:perms}\t%{FILENAMES}\t%{FILELINKTOS}\n]", str(rpm)],
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ).stdout
    files: dict[str, str] = {}
    for line in out.splitlines():
        perms, path, target = line.split("\t")
        if perms[0] == "-":
            files[path] = "f"
        elif perms[0] == "l":
            files[path] = "l -> " + target
    return files


def _host_suite() -> str:
    with open("/etc/os-release") as f:
        for line in f:
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"')
    raise RuntimeError("no VERSION_CODENAME in /etc/os-release")


def debian_root() -> Path:
    """A clean Debian root of the host's suite (cached; made by debootstrap on first use)."""
    suite = _host_suite()
    name = f"{suite}-minbase-" + "-".join(ROOTFS_PACKAGES)
    root = CACHE / name
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").exists():
            return root
        shutil.rmtree(root, ignore_errors=True)
        tmp = CACHE / (name + ".tmp")
        for attempt in (1, 2):  # one retry: a mirror hiccup must not fail the suite
            shutil.rmtree(tmp, ignore_errors=True)
            r = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=" + ",".join(ROOTFS_PACKAGES),
                    suite,
                    str(tmp),
                    MIRROR,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            if r.returncode == 0:
                break
            if attempt == 2:
                raise RuntimeError(f"debootstrap {suite} from {MIRROR} failed:\n{r.stdout[-3000:]}")
        (tmp / ".complete").touch()
        tmp.rename(root)
        return root


@contextlib.contextmanager
def scratch_root(base: Path) -> Iterator[Path]:
    """A writable throw-away copy of `base`: an overlay mount (a full copy where overlayfs fails)."""
    work = Path(tempfile.mkdtemp(prefix="vgpu-root-", dir=CACHE))
    merged = work / "merged"
    for d in ("upper", "work", "merged"):
        (work / d).mkdir()
    opts = f"lowerdir={base},upperdir={work / 'upper'},workdir={work / 'work'}"
    mounted = (
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], capture_output=True).returncode
        == 0
    )
    if not mounted:
        merged.rmdir()
        subprocess.run(["cp", "-a", str(base), str(merged)], check=True)
    try:
        yield merged
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(merged)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def chroot(
    root: Path, *cmd: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a command inside the root (a minimal, explicit environment)."""
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(
        ["chroot", str(root), *cmd],
        env={**base, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    if check and r.returncode != 0:
        raise AssertionError(f"chroot {' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-4000:]}")
    return r
