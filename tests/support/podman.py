"""podman (Debian's 4.3) for the tests, with state and CDI specs of the test's own.

Storage, run and temporary directories are the test's (`--root`, `--runroot`, `--tmpdir`, the
vfs driver: with `--rootfs` no layer is ever stored; events to a file in the tmpdir).  podman
4.3 reads CDI specs from /etc/cdi and /var/run/cdi only (no spec-dir option before 4.5), so
every podman command runs in a private mount namespace (unshare(1), propagation private) where
each of them that exists is a bind mount of a directory of the test's own: the node's specs -
NVIDIA's on a GPU node - are neither seen nor touched, and the test's never land there.  Only
on a host with neither directory is /var/run/cdi made, as the mount point of the test's specs,
and removed again (`close`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ETC_CDI, RUN_CDI = Path("/etc/cdi"), Path("/var/run/cdi")

# Bind-mounts each "$1" over "$2" up to "--" (in this mount namespace only), then runs the rest.
_BIND = 'set -e; while [ "$1" != -- ]; do mount --bind "$1" "$2"; shift 2; done; shift; exec "$@"'


def available() -> bool:
    """Root, podman, unshare(1) and busybox-static (the containers' rootfs)."""
    return os.geteuid() == 0 and all(shutil.which(x) for x in ("podman", "unshare")) and os.path.exists("/bin/busybox")


needs_podman = pytest.mark.skipif(not available(), reason="needs root, podman, unshare and busybox-static")


class Podman:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.cdi = base / "cdi"  # the test's specs: podman sees them in /var/run/cdi (or /etc/cdi)
        self.etc_cdi = base / "etc-cdi"  # empty: hides the host's /etc/cdi
        for d in (self.cdi, self.etc_cdi, base / "storage", base / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        self.runroot = Path(tempfile.mkdtemp(prefix="vgpu-podman-"))  # podman wants <= 50 characters
        self._made: list[Path] = []
        if not ETC_CDI.is_dir() and not RUN_CDI.is_dir():
            RUN_CDI.mkdir(parents=True)
            self._made.append(RUN_CDI)
        # the test's specs where podman reads them; the other directory (if any) hidden by an empty one
        specs_at = RUN_CDI if RUN_CDI.is_dir() else ETC_CDI
        self.binds = [(self.cdi, specs_at)] + [(self.etc_cdi, ETC_CDI)] * (specs_at != ETC_CDI and ETC_CDI.is_dir())

    def argv(self, *args: str) -> list[str]:
        """A podman command line in its own mount namespace, with this test's state."""
        podman = ["podman", "--root", str(self.base / "storage"), "--runroot", str(self.runroot)]
        podman += ["--tmpdir", str(self.base / "tmp"), "--storage-driver", "vfs", "--events-backend", "file"]
        binds = [str(p) for pair in self.binds for p in pair]
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _BIND, "podman-cdi", *binds, "--",
                *podman, *args]  # fmt: skip

    def run_argv(self, rootfs: Path, *args: str) -> list[str]:
        """`podman run --rm` of `rootfs` (no image): `args` are run's options, then the sh script."""
        argv = ["run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        return self.argv(*argv, *args[:-1], "--rootfs", str(rootfs), "/bin/sh", "-c", args[-1])

    def run(self, rootfs: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.run_argv(rootfs, *args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def start(self, rootfs: Path, *args: str) -> subprocess.Popen[str]:
        """`run` without waiting (the Popen is podman's own process: unshare and sh exec it)."""
        return subprocess.Popen(
            self.run_argv(rootfs, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def _stragglers(self) -> list[int]:
        """Processes still running with this state (conmon and the `podman container cleanup` it
        starts when a container exits, which may outlive `podman run --rm`)."""
        key = str(self.runroot).encode()
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        if key in f.read():
                            pids.append(int(d))
                except OSError:
                    pass
        return pids

    def close(self, timeout: float = 15) -> None:
        """Once the stragglers are done: the run directory removed, and the mount points made for
        the test (left where something was put in them)."""
        deadline = time.monotonic() + timeout
        while self._stragglers() and time.monotonic() < deadline:
            time.sleep(0.1)
        for d in reversed(self._made):
            try:
                d.rmdir()
            except OSError:
                pass
        self._made = []
        shutil.rmtree(self.runroot, ignore_errors=True)
