"""pynvml in a limited process sees the slice; oversubscription spills to host
memory; the library also works when loaded through /etc/ld.so.preload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.libcuda_intercept.support import BUILD, UUID0, UUID1, GiB, MiB, Node
from vgpu import region as R

PYNVML = """
import json, pynvml
pynvml.nvmlInit()
out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    out.append({"uuid": pynvml.nvmlDeviceGetUUID(h), "total": m.total, "free": m.free, "used": m.used,
                "total2": m2.total, "free2": m2.free, "used2": m2.used})
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def _pynvml(node: Node, **env: str) -> list[dict]:
    p = subprocess.run(
        [sys.executable, "-c", PYNVML], env=node.env(extra=env), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_pynvml_reports_the_slice_and_container_usage(node: Node) -> None:
    node.write_limits(f"{UUID0} {4 * GiB} 50 0")
    holder = node.popen("gpa", "init", "alloc", 100 * MiB, "wait")
    try:
        assert holder.stdout is not None
        while "waiting" not in holder.stdout.readline():
            pass
        devs = {d["uuid"]: d for d in _pynvml(node)}
        d0 = devs[UUID0]
        assert d0["total"] == 4 * GiB and d0["total2"] == 4 * GiB
        assert d0["used"] == 100 * MiB and d0["used2"] == 100 * MiB
        assert d0["free"] == 4 * GiB - 100 * MiB and d0["free2"] == 4 * GiB - 100 * MiB
        # a GPU without a limits line is not this container's: untouched
        assert devs[UUID1]["total"] == 16 * GiB
    finally:
        holder.communicate(timeout=30)


def test_pynvml_fails_closed_on_bad_limits(node: Node) -> None:
    node.limits.write_text("vgpu-limits 9\n")
    p = subprocess.run([sys.executable, "-c", PYNVML], env=node.env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout
    assert "NVMLError_NoPermission" in p.stderr, p.stderr  # NVML_ERROR_NO_PERMISSION from the hook
    assert "unknown limits version" in p.stderr and str(node.limits) in p.stderr


def test_oversubscription_falls_back_to_host_memory(node: Node) -> None:
    # a 1 GiB GPU, a 1.5 GiB slice with oversubscription on
    node.write_config("[device]\nmemory = 1073741824\ncontext_overhead = 0\n")
    node.limit(GiB + 512 * MiB, oversub=True, device=GiB)
    p = node.popen("gpa", "init", "alloc", 768 * MiB, "alloc", 512 * MiB, "alloc", 256 * MiB + 1, "info", "wait")
    try:
        assert p.stdout is not None
        lines = []
        while "waiting" not in (ln := p.stdout.readline()):
            assert ln
            lines.append(ln)
        allocs = [ln for ln in lines if ln.startswith("alloc")]
        assert "rc=0" in allocs[0] and "rc=0" in allocs[1], lines  # the second does not fit the GPU
        assert "rc=2" in allocs[2], lines  # over the scaled slice
        snap = R.read_region(str(node.region))
        s = snap.slots[0]
        assert s.device_bytes[0] == 768 * MiB and s.host_bytes[0] == 512 * MiB
        assert snap.devices[0].used_host == 512 * MiB and snap.devices[0].oversubscribe
        info = next(ln for ln in lines if ln.startswith("info"))
        assert f"free={256 * MiB}" in info and f"total={GiB}" in info  # total never above the hardware
    finally:
        p.communicate(timeout=30)
    # without the flag the same request fails
    node.limit(GiB + 512 * MiB, oversub=False)
    r = node.cutest("gpa", "init", "alloc", 768 * MiB, "alloc", 512 * MiB)
    assert r.one("alloc", 1)["rc"] == "2"


_NS = r"""
set -e
mount -t tmpfs vgpu-etc "$1"
cp -a /etc/. "$1"/
echo "$2" > "$1"/ld.so.preload
mount --bind "$1" /etc
shift 2
exec "$@"
"""


@pytest.mark.root
def test_loaded_through_etc_ld_so_preload(node: Node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The container mechanism: no LD_PRELOAD, /etc/ld.so.preload names the library
    (in a private mount namespace, so the host's /etc is untouched)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    if node.flavour == "asan":
        pytest.skip("the ASan runtime must come first; covered by LD_PRELOAD runs")
    node.limit(64 * MiB)
    etc = tmp_path / "etc"
    etc.mkdir()
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "probe", str(etc)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private mount namespace here: {probe.stderr.strip()}")
    env = node.env(preload=False)
    for mode, prog in (("gpa", "cutest"), ("link", "link_cutest"), ("dlsym", "cutest")):
        argv = [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            _NS,
            "sh",
            str(etc),
            str(BUILD / "libvgpu.so"),
            str(BUILD / "intercept" / prog),
            mode,
            "init",
            "alloc",
            64 * MiB,
            "alloc",
            1,
            "hooks",
        ]
        p = subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=120)
        if p.returncode != 0 and "unshare" in p.stderr:
            pytest.skip(f"cannot make a mount namespace: {p.stderr.strip()}")
        assert p.returncode == 0, p.stderr
        assert "alloc size=67108864 rc=0" in p.stdout and "alloc size=1 rc=2" in p.stdout, p.stdout
        assert "hook name=cuMemAlloc_v2 base=cuMemAlloc ver=3020 flags=0 found=1 libvgpu=1" in p.stdout


_RUN = r"""
set -e
mount -t tmpfs vgpu-run /run
mkdir -p /run/vgpu
printf 'vgpu-limits 1\n%s %s 50 0\n' "$1" "$2" > /run/vgpu/limits
chmod 444 /run/vgpu/limits
: > /run/vgpu/region
shift 2
exec "$@"
"""


@pytest.mark.root
def test_mounted_limits_file_beats_the_environment(node: Node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With /run/vgpu/limits present, VGPU_LIMITS_FILE/VGPU_REGION_FILE are ignored
    (in a private mount namespace with its own /run)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "probe", "/run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private mount namespace here: {probe.stderr.strip()}")
    node.limit(GiB)  # what the environment asks for
    argv = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        _RUN,
        "sh",
        UUID0,
        str(16 * MiB),
        str(BUILD / "intercept" / "cutest"),
        "gpa",
        "init",
        "info",
        "alloc",
        16 * MiB,
        "alloc",
        1,
    ]
    p = subprocess.run([str(a) for a in argv], env=node.env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"total={16 * MiB}" in p.stdout, p.stdout
    assert "alloc size=1 rc=2" in p.stdout
    assert not node.region.exists()  # the environment's region was not used either
