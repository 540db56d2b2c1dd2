"""The two commands on a fresh machine: in a debootstrap'd Debian 12 root with only git, make and
python3, a clone of this repository runs the host-dependency steps of `make demo` and `make test`
(`make host-deps-demo host-deps-test`: packaging/host-deps.sh installs the missing Debian packages
with apt), and a second run reports nothing missing: every package the suites need exists in the
suite and installs.  The root is cached in build/pkgtest/; each run works on an overlay of it, and
the downloaded .debs are kept in /var/cache/k8s-vgpu/apt-archives so a warm run does not download.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.packaging import pkgbuild

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="debootstrap, chroot and mounts need root"),
    pytest.mark.timeout(1200),
]

PACKAGES = ("git", "make", "python3")
APT_CACHE = Path(os.environ.get("VGPU_IMAGE_CACHE", "/var/cache/k8s-vgpu")) / "apt-archives"
TOOLS = ("cc", "make", "runc", "containerd", "ctr", "busybox", "podman", "mmdebstrap", "debootstrap", "rpm",
         "lintian", "systemd-analyze", "ip", "unshare", "python3",
         "prometheus", "promtool")  # fmt: skip


def fresh_root() -> Path:
    suite = pkgbuild._host_suite()
    name = f"{suite}-minbase-" + "-".join(PACKAGES)
    root = pkgbuild.CACHE / name
    pkgbuild.CACHE.mkdir(parents=True, exist_ok=True)
    with open(pkgbuild.CACHE / ".lock-fresh", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").exists():
            return root
        tmp = pkgbuild.CACHE / (name + ".tmp")
        for attempt in (1, 2):
            shutil.rmtree(tmp, ignore_errors=True)
            r = subprocess.run(
                ["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), suite, str(tmp),
                 pkgbuild.MIRROR],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            if r.returncode == 0:
                break
            if attempt == 2:
                raise RuntimeError(f"debootstrap failed:\n{r.stdout[-3000:]}")
        (tmp / ".complete").touch()
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
        return root


def run(root: Path, script: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`script` in the root with /proc, /dev, the repository (read-only) and the apt cache mounted."""
    setup = (
        f"set -e; mount -t proc proc {root}/proc; mount --rbind /dev {root}/dev; "
        f"mount --bind -o ro {pkgbuild.ROOT} {root}/mnt/repo; "
        f"mount --bind {APT_CACHE} {root}/var/cache/apt/archives; "
    )
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         setup + f"exec chroot {root} sh -c {subprocess.list2cmdline([script])}"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_a_clone_installs_what_demo_and_test_need() -> None:
    base = fresh_root()
    APT_CACHE.mkdir(parents=True, exist_ok=True)
    (APT_CACHE / "partial").mkdir(exist_ok=True)
    with pkgbuild.scratch_root(base) as root:
        (root / "mnt/repo").mkdir(parents=True, exist_ok=True)
        shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
        # As in a container build: no services started by maintainer scripts; keep the .debs.
        (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
        os.chmod(root / "usr/sbin/policy-rc.d", 0o755)
        (root / "etc/apt/apt.conf.d/99keep").write_text('Binary::apt::APT::Keep-Downloaded-Packages "true";\n')
        (root / "etc/dpkg/dpkg.cfg.d/99unsafe-io").write_text("force-unsafe-io\n")
        # Nothing of the suites is there yet.
        r = run(root, "for t in runc containerd podman lintian cc; do command -v $t || true; done")
        assert r.stdout.strip() == "", r.stdout
        r = run(root, "git -c safe.directory='*' clone -q /mnt/repo /src && make -C /src host-deps-demo host-deps-test")
        assert r.returncode == 0, r.stdout[-4000:]
        assert "installing" in r.stdout, r.stdout[-2000:]
        # A second run: nothing missing, nothing said.
        r = run(root, "cd /src && make -s host-deps-demo host-deps-test && packaging/host-deps.sh image")
        assert (r.returncode, r.stdout.strip()) == (0, ""), r.stdout[-2000:]
        r = run(root, "for t in " + " ".join(TOOLS) + "; do command -v $t >/dev/null || echo missing $t; done")
        assert r.stdout.strip() == "", r.stdout
