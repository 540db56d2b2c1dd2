"""Every allocation path beyond cuMemAlloc is counted, refused or left alone (docs/developers/intercept.md,
"Allocation paths"): graph memory, pools that keep freed memory, host locations, and memory shared
between processes.  Each test runs the C program build/intercept/paths through libvgpu.so (plain
and ASan+UBSan) on the simulated GPU, and judges by the simulated GPU's own count (fakegpu-ctl),
independent of the library's region; runs without the library show the memory the library keeps
out of reach."""

from __future__ import annotations

import os
import signal
import time

from tests.libcuda_intercept.support import MiB, Node, Run, parse_lines

OK, INVALID_VALUE, OOM, INVALID_CONTEXT = "0", "1", "2", "201"
LIMIT = 64 * MiB


def free_of(r: Run, i: int) -> int:
    return int(r.one("info", i)["free"])


def rcs(r: Run, name: str) -> list[str]:
    return [row["rc"] for row in r.all(name)]


def test_captured_graph_memory_counts_from_launch_until_trimmed(node: Node) -> None:
    node.limit(LIMIT)
    r = node.paths(
        "init",
        "cap_begin", "cap_alloc", 40 * MiB, "iscap", "info", "cap_end", "inst", "launch", "info",
        "cap_begin", "cap_alloc", 40 * MiB, "cap_end", "inst", "launch",  # a second graph: over the slice
        "free", 0, "launch",  # the first graph's allocation freed: its memory is reused
        "gattr", "free", 1, "alloc", 40 * MiB,  # freed, but the graph pool keeps the memory
        "trim", "gattr", "alloc", 40 * MiB, "info",
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert r.one("iscap")["status"] == "1"
    assert free_of(r, 0) == LIMIT, "capturing takes no memory"
    assert rcs(r, "launch") == [OK, OOM, OK]
    assert free_of(r, 1) == LIMIT - 40 * MiB
    assert r.one("gattr", 0)["reserved"] == str(40 * MiB)
    assert rcs(r, "alloc") == [OOM, OK]
    assert r.one("gattr", 1)["reserved"] == "0", "trimmed: nothing live, nothing kept"
    assert free_of(r, 2) == LIMIT - 40 * MiB
    high = node.high()
    assert high["alloc_high"] <= LIMIT, high

    # the simulated GPU itself would have let both graphs have their memory
    node.state.unlink()
    r = node.paths(
        "init", "cap_begin", "cap_alloc", 40 * MiB, "cap_end", "inst", "launch",
        "cap_begin", "cap_alloc", 40 * MiB, "cap_end", "inst", "launch", "gattr",
        preload=False,
    )  # fmt: skip
    assert rcs(r, "launch") == [OK, OK]
    assert r.one("gattr")["reserved"] == str(80 * MiB)


def test_graph_memory_nodes_freed_in_the_graph_stay_in_the_pool(node: Node) -> None:
    node.limit(LIMIT)
    r = node.paths(
        "init", "gnew", "galloc", 3 * MiB, "galloc", 30 * MiB, "gfree", 0, "gfree", 0, "inst",
        "launch", "launch", "gattr", "info", "free", 1, "launch", "gattr", "free", 0, "free", 1,
        "alloc", 40 * MiB, "trim", "gattr", "alloc", 40 * MiB,
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert rcs(r, "gfree") == [OK, INVALID_VALUE], "an allocation is freed once in its graph"
    # the 30 MiB allocation is not freed in the graph: a second launch needs it freed first
    assert rcs(r, "launch") == [OK, INVALID_VALUE, OK]
    g = r.one("gattr", 0)
    assert (g["used"], g["reserved"]) == (str(30 * MiB), str(34 * MiB))  # 3 MiB rounds up to 4
    assert free_of(r, 0) == LIMIT - 34 * MiB
    assert rcs(r, "free") == [OK, INVALID_VALUE, OK], "freed by its graph: not outside it"
    assert rcs(r, "alloc") == [OOM, OK], "the graph pool holds 34 MiB until trimmed"
    assert r.one("gattr", 2)["reserved"] == "0"
    assert node.high()["alloc_high"] <= LIMIT


def test_auto_free_on_launch_and_upload_are_charged_like_launches(node: Node) -> None:
    node.limit(LIMIT)
    r = node.paths(
        "init", "gnew", "galloc", 40 * MiB, "inst", 1, "launch", "launch", "gattr",  # AUTO_FREE_ON_LAUNCH
        "xdestroy", "gdestroy", "gnew", "galloc", 40 * MiB, "instp", 2,  # instantiate + upload: over
        "free", 0, "instp", 2, "info", "launch", "gattr",
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert rcs(r, "launch") == [OK, OK, OK]
    assert r.one("gattr", 0)["reserved"] == str(40 * MiB)
    # the first graph's allocation is live (not freed): the upload of a second 40 MiB does not fit
    assert rcs(r, "instp") == [OOM, OK]
    assert free_of(r, 0) == LIMIT - 40 * MiB, "uploaded into the memory the pool held"
    assert r.one("gattr", 1)["reserved"] == str(40 * MiB)
    assert node.high()["alloc_high"] <= LIMIT


def test_a_pool_counts_what_it_keeps_cached(node: Node) -> None:
    node.limit(LIMIT)
    r = node.paths(
        "init", "pdefault", "pthreshold", 1 << 30, "dalloc", 40 * MiB, "afree", 0, "sync", "pattr",
        "alloc", 40 * MiB,  # the pool keeps 40 MiB: no room
        "ptrim", 0, "alloc", 40 * MiB, "free", 1,
        "pthreshold", 0, "dalloc", 40 * MiB, "afree", 2, "sync", "pattr", "alloc", 40 * MiB, "info",
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert r.one("pattr", 0) == {"_": "pattr", "reserved": str(40 * MiB), "used": "0"}
    assert rcs(r, "alloc") == [OOM, OK, OK]
    assert r.one("pattr", 1)["reserved"] == "0", "threshold 0: released at the synchronisation"
    assert free_of(r, 0) == LIMIT - 40 * MiB
    assert node.high()["alloc_high"] <= LIMIT


def test_a_destroyed_pool_is_counted_until_its_last_allocation_is_freed(node: Node) -> None:
    node.limit(LIMIT)
    r = node.paths("init", "pcreate", "palloc", 30 * MiB, "pdestroy", "info", "palloc", 1, "afree", 0, "info")
    assert r.rc == 0, r.err
    assert rcs(r, "palloc") == [OK, INVALID_VALUE]
    assert free_of(r, 0) == LIMIT - 30 * MiB
    assert free_of(r, 1) == LIMIT


def test_host_locations_and_registered_host_memory_count_nowhere(node: Node) -> None:
    """HAMi-core #187: cuMemCreate with a host location crashed llama.cpp."""
    node.limit(LIMIT)
    r = node.paths(
        "init", "vmm", 128 * MiB, 2, "vmm", 128 * MiB, 3, "vmm", 128 * MiB, 4, "vmap", 0, "vmap", 1, "write", 0, 3,
        "read", 0, "info", "vunmap", 0, "vrelease", 0, "vrelease", 1, "vunmap", 1, "vrelease", 2,
        "hostreg", 128 * MiB, "info", "hostunreg", "pcreate", 2, "palloc", 128 * MiB, "info", "afree", 2,
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert rcs(r, "vmm") == [OK, OK, OK]
    assert set(rcs(r, "vmap") + rcs(r, "vunmap") + rcs(r, "vrelease") + rcs(r, "palloc")) == {OK}
    assert r.one("read")["byte"] == "3"
    assert [free_of(r, i) for i in range(3)] == [LIMIT] * 3
    assert r.one("hostreg")["rc"] == OK and r.one("hostunreg")["rc"] == OK
    assert node.high()["alloc_high"] == 0, "the simulated GPU saw no device memory"


def test_memory_shared_by_descriptor_counts_once_whoever_releases_last(node: Node) -> None:
    """NCCL >= 2.19: cuMemCreate + cuMemExportToShareableHandle(POSIX fd) between ranks."""
    node.limit(LIMIT)
    t = node.tmp
    a = node.paths_popen(
        "init", "vmm", 32 * MiB, 1, 1, "vmap", 0, "write", 0, 7, "vexport", 0, t / "fd", "info",
        "await", t / "b1", "vunmap", 0, "vrelease", 0, "info", "signal", t / "a1", "await", t / "b2", "info",
    )  # fmt: skip
    b = node.paths(
        "init", "vimport", t / "fd", 32 * MiB, "vmap", 0, "read", 0, "info", "alloc", 32 * MiB,
        "signal", t / "b1", "await", t / "a1", "info", "alloc", 1, "vunmap", 0, "vrelease", 0, "info",
        "free", 1, "signal", t / "b2",
    )  # fmt: skip
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0 and b.rc == 0, (err, b.err)
    ra = Run(a.returncode, out, err, parse_lines(out))
    assert b.one("read")["byte"] == "7", "the importer maps the exporter's bytes"
    assert free_of(b, 0) == LIMIT - 32 * MiB, "imported: not counted again"
    assert free_of(ra, 1) == 0, "the exporter let go; the importer holds it: still counted"
    assert b.one("alloc", 1)["rc"] == OOM
    assert free_of(b, 2) == LIMIT - 32 * MiB, "the last holder let go: freed"
    assert free_of(ra, 2) == LIMIT
    assert node.high()["alloc_high"] <= LIMIT
    assert node.dump()["shared"] == []


def test_legacy_ipc_counts_once_whoever_frees_last(node: Node) -> None:
    """torch.multiprocessing / vLLM: cuIpcGetMemHandle in one process, cuIpcOpenMemHandle in another."""
    node.limit(LIMIT)
    t = node.tmp
    a = node.paths_popen(
        "init", "alloc", 32 * MiB, "write", 0, 9, "ipc_get", 0, t / "h", "ipc_open", t / "h",
        "await", t / "b1", "free", 0, "info", "signal", t / "a1", "await", t / "b2", "info",
    )  # fmt: skip
    b = node.paths(
        "init", "ipc_open", t / "h", "ipc_open", t / "h", "read", 0, "info", "alloc", 32 * MiB,
        "signal", t / "b1", "await", t / "a1", "alloc", 1, "ipc_close", 0, "info", "ipc_close", 1, "info",
        "signal", t / "b2",
    )  # fmt: skip
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0 and b.rc == 0, (err, b.err)
    assert "ipc_open rc=201" in out, "not in the process that exported it (CUDA_ERROR_INVALID_CONTEXT)"
    assert rcs(b, "ipc_open") == [OK, OK]
    assert b.one("read")["byte"] == "9"
    assert free_of(b, 0) == LIMIT - 32 * MiB
    assert rcs(b, "alloc") == [OK, OOM], "the exporter freed it, the importer still maps it"
    assert free_of(b, 1) == 0, "opened twice: one close keeps it"
    assert free_of(b, 2) == LIMIT - 32 * MiB
    assert node.high()["alloc_high"] <= LIMIT


def test_a_killed_importer_lets_go_of_what_it_held(node: Node) -> None:
    node.limit(LIMIT)
    t = node.tmp
    b = node.paths_popen("init", "ipc_open", t / "h", "signal", t / "b1", "sleepms", 60000)
    a = node.paths(
        "init", "alloc", 32 * MiB, "ipc_get", 0, t / "h", "await", t / "b1", "free", 0, "info",
    )  # fmt: skip
    assert free_of(a, 0) == LIMIT - 32 * MiB, "still held by the importer"
    os.kill(b.pid, signal.SIGKILL)
    b.wait(timeout=30)
    deadline = time.time() + 10
    r = node.paths("init", "info")
    while free_of(r, 0) != LIMIT and time.time() < deadline:
        time.sleep(0.1)
        r = node.paths("init", "info")
    assert free_of(r, 0) == LIMIT
    assert node.dump()["shared"] == []


def test_pool_exports_count_in_the_exporting_pool_only(node: Node) -> None:
    node.limit(LIMIT)
    t = node.tmp
    a = node.paths_popen(
        "init", "pcreate", 1, 1, "palloc", 32 * MiB, "write", 0, 5, "pexport", t / "p", "pexptr", 0, t / "x",
        "await", t / "b1", "afree", 0, "ptrim", 0, "info",
    )  # fmt: skip
    b = node.paths("init", "pimport", t / "p", "pimptr", t / "x", "read", 0, "info", "afree", 0, "signal", t / "b1")
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0 and b.rc == 0, (err, b.err)
    assert b.one("read")["byte"] == "5"
    assert free_of(b, 0) == LIMIT - 32 * MiB, "counted in the exporter's pool, once"
    assert f"free={LIMIT} " in out
    assert node.high()["alloc_high"] <= LIMIT


def test_importing_an_unknown_descriptor_without_the_library_changes_nothing(node: Node) -> None:
    """The simulator's model: an import of a descriptor it never exported is CUDA_ERROR_INVALID_VALUE."""
    node.limit(LIMIT)
    (node.tmp / "fd").write_text(f"{os.getpid()} 0\n")
    r = node.paths("init", "vimport", node.tmp / "fd", 2 * MiB, preload=False)
    assert rcs(r, "vimport") == [INVALID_VALUE]


def test_every_command_runs_clean(node: Node) -> None:
    """A short sweep of every command (ASan + UBSan flavour included)."""
    node.limit(LIMIT)
    r = node.paths(
        "init", "gnew", "galloc", MiB, "gfree", 0, "inst", "upload", "launch", "xdestroy", "gdestroy", "trim",
        "gattr", "gattr_reset", "pcreate", "palloc", MiB, "afree", 1, "ctxsync", "pdestroy",
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert rcs(r, "gattr_reset") == [OK]
    assert r.one("gattr_reset")["bad"] == INVALID_VALUE and r.one("gattr_reset")["current"] == INVALID_VALUE


def test_the_region_ledger_reads_back_in_python(node_plain: Node) -> None:
    """vgpu/region.py reads the shared ledger (the monitor subtracts what a slot holds from the
    NVML usage it attributes to the process)."""
    from vgpu import region as R

    node = node_plain
    node.limit(LIMIT)
    t = node.tmp
    a = node.paths_popen("init", "alloc", 32 * MiB, "ipc_get", 0, t / "h", "await", t / "go")
    b = node.paths_popen("init", "ipc_open", t / "h", "signal", t / "b", "await", t / "go")
    try:
        deadline = time.time() + 30
        while not (t / "b").exists() and time.time() < deadline:
            time.sleep(0.05)
        snap = R.read_region(str(node.region))
        assert len(snap.shared) == 1
        e = snap.shared[0]
        assert (e.device, e.bytes) == (0, 32 * MiB)
        slots = {s.pid: s.index for s in snap.slots}
        assert sorted(e.holders) == sorted([slots[a.pid], slots[b.pid]])
        assert snap.shared_held(slots[b.pid], 0) == 32 * MiB
        assert sum(s.device_bytes[0] for s in snap.slots) == 0, "counted in the ledger, not in a slot"
    finally:
        (t / "go").write_text("1")
        a.communicate(timeout=30)
        b.communicate(timeout=30)
