"""Hostile images under real runc: every case ends refused or correctly mounted,
and nothing outside the rootfs and the state dir is created or changed.

The "host" side of each attack is a directory of this test (absolute links
point at it, `..` chains climb towards it); a naive join-and-open hook would
write there.  Links into host paths that matter (/proc/self/root, /var/run)
are tried as well.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import hook as support
from tests.support.hook import Node

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

OURS = "preload=/run/vgpu/libvgpu.so"
SCRIPT = "echo preload=$(cat /etc/ld.so.preload); cat /run/vgpu/limits"


def _up(n: int = 12) -> str:
    return "/".join([".."] * n)


# Each case: (builder(rootfs, host), expectation) where expectation is "mounted" or a refusal substring.
def _etc_abs_in_root(r: Path, h: Path) -> None:
    os.rmdir(r / "etc")
    (r / "etc").symlink_to(h / "etcdir")  # absolute host path ...
    (r / str(h).lstrip("/") / "etcdir").mkdir(parents=True)  # ... that also exists inside the root


def _etc_abs_dangling(r: Path, h: Path) -> None:
    os.rmdir(r / "etc")
    (r / "etc").symlink_to(h / "etcdir")


def _etc_dotdot(r: Path, h: Path) -> None:
    os.rmdir(r / "etc")
    (r / "etc").symlink_to(_up() + str(h / "etcdir"))


def _etc_proc_root(r: Path, h: Path) -> None:
    os.rmdir(r / "etc")
    (r / "etc").symlink_to("/proc/self/root/etc")


def _preload_to_host_file(r: Path, h: Path) -> None:
    (r / "etc" / "ld.so.preload").symlink_to(h / "victim")


def _preload_dotdot(r: Path, h: Path) -> None:
    (r / "etc" / "ld.so.preload").symlink_to(_up() + str(h / "victim"))


def _preload_dir(r: Path, h: Path) -> None:
    (r / "etc" / "ld.so.preload").mkdir()


def _preload_fifo(r: Path, h: Path) -> None:
    os.mkfifo(r / "etc" / "ld.so.preload")


def _run_to_host(r: Path, h: Path) -> None:
    (r / "run").symlink_to(h / "rundir")


def _run_to_var_run(r: Path, h: Path) -> None:
    (r / "var" / "run").mkdir(parents=True)
    (r / "run").symlink_to("/var/run")  # resolves to <rootfs>/var/run, never the host's


def _run_vgpu_dotdot(r: Path, h: Path) -> None:
    (r / "run").mkdir()
    (r / "run" / "vgpu").symlink_to(_up() + str(h / "rundir"))


def _run_vgpu_loop(r: Path, h: Path) -> None:
    (r / "run").mkdir()
    (r / "run" / "vgpu").symlink_to("vgpu")


def _run_vgpu_file(r: Path, h: Path) -> None:
    (r / "run").mkdir()
    (r / "run" / "vgpu").write_text("not a dir")


def _limits_fifo(r: Path, h: Path) -> None:
    (r / "run" / "vgpu").mkdir(parents=True)
    os.mkfifo(r / "run" / "vgpu" / "limits")


def _region_to_proc(r: Path, h: Path) -> None:
    (r / "run" / "vgpu").mkdir(parents=True)
    (r / "run" / "vgpu" / "region").symlink_to("/proc/self/root" + str(h / "victim"))


def _lib_dir(r: Path, h: Path) -> None:
    (r / "run" / "vgpu" / "libvgpu.so").mkdir(parents=True)


def _lib_to_host(r: Path, h: Path) -> None:
    (r / "run" / "vgpu").mkdir(parents=True)
    (r / "run" / "vgpu" / "libvgpu.so").symlink_to(h / "victim")


CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "etc-abs-link-in-root": (_etc_abs_in_root, "mounted"),
    "etc-abs-link-dangling": (_etc_abs_dangling, "is not a directory"),
    "etc-dotdot-link": (_etc_dotdot, "is not a directory"),
    "etc-link-proc-self-root": (_etc_proc_root, "/etc is not a directory"),
    "preload-link-host-file": (_preload_to_host_file, "/etc/ld.so.preload in the image is a symlink"),
    "preload-dotdot-link": (_preload_dotdot, "/etc/ld.so.preload in the image is a symlink"),
    "preload-is-directory": (_preload_dir, "/etc/ld.so.preload in the image is a directory"),
    "preload-is-fifo": (_preload_fifo, "/etc/ld.so.preload in the image is a FIFO"),
    "run-link-host": (_run_to_host, "is not a directory"),
    "run-link-var-run": (_run_to_var_run, "mounted"),
    "run-vgpu-dotdot-link": (_run_vgpu_dotdot, "is not a directory"),
    "run-vgpu-loop": (_run_vgpu_loop, "is not a directory"),
    "run-vgpu-is-file": (_run_vgpu_file, "is not a directory"),
    "limits-is-fifo": (_limits_fifo, "/run/vgpu/limits in the image is a FIFO"),
    "region-link-proc": (_region_to_proc, "/run/vgpu/region in the image is a symlink"),
    "library-is-directory": (_lib_dir, "/run/vgpu/libvgpu.so in the image is a directory"),
    "library-link-host": (_lib_to_host, "/run/vgpu/libvgpu.so in the image is a symlink"),
}


def _host_state() -> dict[str, bool]:
    return {p: os.path.lexists(p) for p in ("/etc/ld.so.preload", "/run/vgpu", "/var/run/vgpu")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_image(node: Node, name: str) -> None:
    build, expect = CASES[name]
    host = node.base / "host"
    (host / "etcdir").mkdir(parents=True)
    (host / "rundir").mkdir()
    (host / "victim").write_text("host data\n")
    rootfs = support.make_rootfs(node.base / "rootfs")
    build(rootfs, host)
    token = support.write_record(node.state)
    b = node.bundle(["sh", "-c", SCRIPT], env=[f"VGPU_ALLOCATION_TOKEN={token}"], rootfs=rootfs)
    host_before = support.snapshot([host])
    top_before = sorted(os.listdir(node.base))
    sys_before = _host_state()
    etc_mtime = os.stat("/etc").st_mtime_ns

    r = node.run(b, f"atk-{name}")

    if expect == "mounted":
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == OURS and lines[1] == "vgpu-limits 2", lines
    else:
        assert r.returncode != 0, r.stdout
        assert "vgpu-hook: cannot set up vGPU isolation" in r.stderr and expect in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert "preload=" not in r.stdout
    # Nothing outside the rootfs and the state dir was created or changed.
    assert support.snapshot([host]) == host_before
    assert (host / "victim").read_text() == "host data\n"
    assert sorted(os.listdir(node.base)) == top_before
    assert _host_state() == sys_before
    assert os.stat("/etc").st_mtime_ns == etc_mtime
    assert node.containers() == []
