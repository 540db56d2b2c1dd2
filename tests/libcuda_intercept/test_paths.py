"""All four ways of reaching the driver end in the hooks (reference §1)."""

from __future__ import annotations

import pytest

from tests.libcuda_intercept.support import MiB, Node

MODES = ["link", "dlsym", "gpa", "gpa-linked"]
HOOKED = {
    "cuInit",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync_ptsz",
    "cuMemFreeAsync_ptsz",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolTrimTo",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuArrayCreate_v2",
    "cuArrayDestroy",
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch_ptsz",
    "cuMemAdvise_v2",
    "cuMemPrefetchAsync_v2",
    "cuEventSynchronize",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemAllocFromPoolAsync",
    "cuDeviceGetDefaultMemPool",
    "cuGraphInstantiateWithFlags",
    "cuGraphInstantiateWithParams",
    "cuGraphLaunch",
    "cuGraphUpload",
    "cuGraphExecDestroy",
    "cuDeviceGraphMemTrim",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
}


@pytest.mark.parametrize("mode", MODES)
def test_limit_exact_at_the_byte_boundary(node: Node, mode: str) -> None:
    limit = 64 * MiB + 12345
    node.limit(limit)
    r = node.cutest(
        mode,
        "init",
        "alloc",
        limit - 1000,
        "alloc",
        1001,
        "alloc",
        1000,
        "info",
        "free",
        0,
        "info",
        "alloc",
        limit - 1000,
        "alloc",
        1,
    )
    assert r.rc == 0, r.err
    a = r.all("alloc")
    assert a[0]["rc"] == "0"
    assert a[1]["rc"] == "2", "one byte over the limit must be CUDA_ERROR_OUT_OF_MEMORY"
    assert a[2]["rc"] == "0", "exactly at the limit must succeed"
    assert r.one("info", 0) == {"_": "info", "rc": "0", "free": "0", "total": str(limit)}
    assert r.one("info", 1)["free"] == str(limit - 1000)
    assert a[3]["rc"] == "0" and a[4]["rc"] == "2"


@pytest.mark.parametrize("mode", MODES)
def test_every_hooked_entry_point_resolves_into_libvgpu(node: Node, mode: str) -> None:
    node.limit(1 << 30)
    r = node.cutest(mode, "hooks")
    assert r.rc == 0, r.err
    for row in r.all("hook"):
        if row["found"] != "1":
            continue
        want = row["name"] in HOOKED
        assert row["libvgpu"] == ("1" if want else "0"), row
    if mode.startswith("gpa"):
        # cudart re-fetches cuGetProcAddress at 11030 and 12000: it must get ours
        assert r.one("gpa_self")["libvgpu"] == "1"


def test_unlimited_process_is_untouched(node: Node) -> None:
    """No limits file, no variable: physical numbers, no region, no output."""
    node.limits.unlink(missing_ok=True)
    r = node.cutest("gpa", "init", "info", "alloc", 1 << 30, "hooks", env={"VGPU_LIMITS_FILE": ""})
    assert r.rc == 0 and r.err == ""
    assert int(r.one("info")["total"]) == 16 << 30
    assert not node.region.exists()
    # nothing is substituted: the program talks to the driver directly
    assert all(row["libvgpu"] == "0" for row in r.all("hook") if row["name"] != "cuInit")


def test_rtld_next_is_resolved_relative_to_the_caller(node: Node) -> None:
    node.limit(1 << 30)
    r = node.cutest("dlsym", "rtld_next")
    row = r.one("rtld_next")
    # from the program, the next "dlsym" after it is libvgpu's (preloaded);
    # a forwarding wrapper would have produced libc's
    assert row["next_libvgpu"] == "1" and row["same"] == "1"
    assert row["cu_unhooked_libvgpu"] == "0"


def test_launch_path_forwards(node: Node) -> None:
    node.limit(1 << 30)
    for mode in MODES:
        r = node.cutest(mode, "init", "launch", 1000)
        assert r.one("launch")["rc"] == "0", (mode, r.out, r.err)
