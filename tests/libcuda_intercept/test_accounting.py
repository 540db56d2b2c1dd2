"""Every allocation path is charged to the container and returned by its free;
the region says who holds what; reporting calls show the slice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.libcuda_intercept.support import UUID0, UUID1, GiB, MiB, Node
from vgpu import region as R


def slot_bytes(node: Node) -> list[tuple[int, int, int]]:
    snap = R.read_region(str(node.region))
    return [(s.device_bytes[0], s.host_bytes[0], s.extra_bytes[0]) for s in snap.slots]


def test_region_records_the_process_and_returns_on_exit(node: Node) -> None:
    node.limit(GiB)
    p = node.popen("gpa", "init", "alloc", 100 * MiB, "alloc", 28 * MiB, "wait")
    try:
        assert p.stdout is not None
        while "waiting" not in (ln := p.stdout.readline()):
            assert ln, p.stderr.read() if p.stderr else ""
        snap = R.read_region(str(node.region))
        assert [(s.pid, s.host_pid, s.device_bytes) for s in snap.slots] == [(p.pid, 0, (128 * MiB,))]
        assert snap.devices[0].uuid == UUID0 and snap.devices[0].memory_limit == GiB
        assert snap.devices[0].used_device == 128 * MiB
        assert node.used() == 128 * MiB  # the simulator agrees
    finally:
        p.communicate(timeout=30)
    # a clean exit leaves a slot whose lock is gone: the next process reclaims it
    r = node.cutest("gpa", "init", "alloc", GiB, "info")
    assert r.one("alloc")["rc"] == "0" and r.one("info")["free"] == "0"


def test_pitch_managed_async_pool_paths(node: Node) -> None:
    node.limit(64 * MiB)
    r = node.cutest(
        "gpa",
        "init",
        "pitch",
        1000,
        1000,  # pitch*height charged
        "managed",
        8 * MiB,
        "async",
        8 * MiB,
        "pool",
        8 * MiB,
        "info",
        "alloc",
        64 * MiB,  # over: the others hold memory
        "free",
        0,
        "free",
        1,
        "afree",
        2,
        "afree",
        3,
        "pooltrim",
        "pooldestroy",
        "info",
        "alloc",
        64 * MiB,
    )
    assert r.rc == 0, r.err
    pitch = int(r.one("pitch")["pitch"])
    assert r.one("pitch")["rc"] == "0" and pitch >= 1000
    for name in ("managed", "async", "pool"):
        assert r.one(name)["rc"] == "0", (name, r.out)
    used = 1000 * pitch + 24 * MiB
    assert int(r.one("info", 0)["free"]) == 64 * MiB - used
    assert r.one("alloc", 0)["rc"] == "2"
    assert all(x["rc"] == "0" for x in r.all("free") + r.all("afree")), r.out
    assert r.one("info", 1)["free"] == str(64 * MiB)
    assert r.one("alloc", 1)["rc"] == "0"


def test_vmm_charged_until_released_and_unmapped(node: Node) -> None:
    node.limit(64 * MiB)
    r = node.cutest(
        "dlsym",
        "init",
        "vmm",
        32 * MiB,
        "vmap",
        0,
        "info",
        "vrelease",
        0,
        "info",  # still mapped: still charged
        "vmm",
        33 * MiB,  # over the limit
        "vunmap",
        0,
        "info",  # released + unmapped: returned
        "vmm",
        64 * MiB,
        "vrelease",
        1,
        "info",
    )
    assert r.rc == 0, r.err
    infos = [int(x["free"]) for x in r.all("info")]
    assert infos[0] == 32 * MiB and infos[1] == 32 * MiB
    vmm = r.all("vmm")
    assert vmm[0]["rc"] == "0" and vmm[1]["rc"] == "2" and vmm[2]["rc"] == "0"
    assert infos[2] == 64 * MiB and infos[3] == 64 * MiB


def test_arrays_charged_and_returned(node: Node) -> None:
    node.limit(8 * MiB - 1)
    r = node.cutest("gpa", "init", "array", 1024, 1024, "info", "array", 1024, 1024, "adestroy", 0, "info")
    assert r.rc == 0, r.err
    arr = r.all("array")
    assert arr[0]["rc"] == "0" and arr[1]["rc"] == "2"  # 1024x1024 float = 4 MiB each
    assert int(r.one("info", 0)["free"]) == 4 * MiB - 1
    assert int(r.one("info", 1)["free"]) == 8 * MiB - 1


def test_reporting_calls_show_the_slice(node: Node) -> None:
    node.limit(3 * GiB + 7)
    r = node.cutest("link", "init", "info", "total", "alloc", GiB, "info", "total")
    assert r.one("info", 0) == {"_": "info", "rc": "0", "free": str(3 * GiB + 7), "total": str(3 * GiB + 7)}
    assert r.one("total", 0)["bytes"] == str(3 * GiB + 7)
    assert r.one("info", 1)["free"] == str(2 * GiB + 7)


def test_limit_above_physical_reports_physical_total(node: Node) -> None:
    node.limit(64 * GiB)  # no oversubscription: the device (16 GiB) is the real bound
    r = node.cutest("gpa", "init", "info", "total")
    assert int(r.one("info")["total"]) == 16 * GiB and int(r.one("total")["bytes"]) == 16 * GiB
    assert int(r.one("info")["free"]) <= 16 * GiB


def test_monitor_extra_bytes_count_against_the_limit(node: Node) -> None:
    node.limit(GiB)
    p = node.popen("gpa", "init", "alloc", 1, "wait")
    try:
        assert p.stdout is not None
        while "waiting" not in p.stdout.readline():
            pass
        slot = R.read_region(str(node.region)).slots[0]
        assert R.write_extra_bytes(str(node.region), {(slot.index, 0): 512 * MiB})
        r = node.cutest("gpa", "init", "info", "alloc", 512 * MiB, "alloc", 512 * MiB - 1)
        assert int(r.one("info")["free"]) == GiB - 512 * MiB - 1
        assert r.one("alloc", 0)["rc"] == "2" and r.one("alloc", 1)["rc"] == "0"
    finally:
        p.communicate(timeout=30)


def test_context_reserve_env_only_tightens(node: Node) -> None:
    node.limit(GiB)
    r = node.cutest("gpa", "init", "alloc", 1, "info", env={"VGPU_CONTEXT_RESERVE": "256m"})
    assert int(r.one("info")["free"]) == GiB - 256 * MiB - 1
    r = node.cutest("gpa", "init", "alloc", GiB - 256 * MiB, "alloc", 1, env={"VGPU_CONTEXT_RESERVE": "256m"})
    assert r.one("alloc", 0)["rc"] == "0" and r.one("alloc", 1)["rc"] == "2"
    # nonsense or a "negative" value cannot loosen anything
    for bad in ("-1", "lots", "0"):
        r = node.cutest("gpa", "init", "alloc", GiB, "alloc", 1, env={"VGPU_CONTEXT_RESERVE": bad})
        assert r.one("alloc", 0)["rc"] == "0" and r.one("alloc", 1)["rc"] == "2"


def test_device_without_limits_line_is_refused(node: Node) -> None:
    node.write_limits(f"{UUID1} {GiB} 50 0")  # only device 1 is ours
    r = node.cutest("gpa", "init", 0, "alloc", 1, "info")
    assert r.one("alloc")["rc"] == "2"
    r = node.cutest("gpa", "init", 1, "alloc", GiB, "alloc", 1)
    assert r.one("alloc", 0)["rc"] == "0" and r.one("alloc", 1)["rc"] == "2"


def test_limits_follow_uuid_not_index(node: Node) -> None:
    """CUDA_VISIBLE_DEVICES reorders devices: the limit stays with the GPU."""
    node.write_limits(f"{UUID0} {GiB} 50 0", f"{UUID1} {2 * GiB} 50 0")
    r = node.cutest("gpa", "init", 0, "total", env={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert r.one("total")["bytes"] == str(2 * GiB)
    r = node.cutest("gpa", "init", 1, "total", env={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert r.one("total")["bytes"] == str(GiB)


def test_legacy_32bit_allocators_refused(node: Node) -> None:
    """cuMemAlloc (v1, 32-bit pointers) would bypass accounting: refused in a vGPU container."""
    code = (
        "import ctypes;c=ctypes.CDLL('libcuda.so.1', mode=ctypes.RTLD_GLOBAL);c.cuInit(0);"
        "g=ctypes.CDLL(None);p=ctypes.c_uint(0);print('rc', g.cuMemAlloc(ctypes.byref(p), 1024))"
    )
    node.limit(GiB)
    out = subprocess.run([sys.executable, "-c", code], env=node.env(), capture_output=True, text=True, timeout=60)
    assert "rc 801" in out.stdout, (out.stdout, out.stderr)  # CUDA_ERROR_NOT_SUPPORTED


@pytest.mark.parametrize("junk", ["random", "zeros-after-header", "huge-values"])
def test_corrupt_region_never_crashes_or_raises_the_limit(node: Node, junk: str) -> None:
    node.limit(64 * MiB)
    if junk == "random":
        node.region.write_bytes(os.urandom(R.REGION_SIZE))
        r = node.cutest("gpa", "init", "alloc", 1)
        assert r.one("init")["rc"] == "800" and "corrupt" in r.err and str(node.region) in r.err
        return
    r = node.cutest("gpa", "init", "alloc", 1)  # creates a valid region
    assert r.one("alloc")["rc"] == "0"
    buf = bytearray(node.region.read_bytes())
    if junk == "zeros-after-header":
        buf[64:] = bytes(len(buf) - 64)
    else:
        # every slot claims to be active with garbage counters; device table says 2^64-1
        for i in range(R.MAX_SLOTS):
            off = R.SLOT_OFFSET + i * R.SLOT_SIZE
            buf[off : off + 4] = (7 if i % 2 else 1).to_bytes(4, "little")
            buf[off + R.SLOT_DEV_OFFSET : off + R.SLOT_DEV_OFFSET + 8] = (2**64 - 1 - i).to_bytes(8, "little")
        dev = R.DEVICES_OFFSET
        buf[dev + 96 : dev + 104] = (2**64 - 1).to_bytes(8, "little")
        hwm = R.layout("vgpu_region")[2]["slot_hwm"][0]
        buf[hwm : hwm + 4] = (2**32 - 1).to_bytes(4, "little")
    node.region.write_bytes(bytes(buf))
    r = node.cutest("gpa", "init", "alloc", 64 * MiB, "alloc", 1, "info")
    assert r.one("init")["rc"] == "0", r.err
    a = r.all("alloc")
    # never more than the limit from the limits file
    assert not (a[0]["rc"] == "0" and a[1]["rc"] == "0")
    assert int(r.one("info")["total"]) == 64 * MiB
    if junk == "zeros-after-header":
        assert a[0]["rc"] == "0"  # dead/absent slots give everything back
