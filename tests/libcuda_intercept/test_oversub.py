"""Virtual device memory (memory scaling S > 1): two containers with K = 2 and S = 2 on a
simulated 16 GiB GPU each get a 16 GiB slice and an 8 GiB physical share. Each allocates its 16
GiB through every allocation path; never more than 8 GiB of it is on the device — judged by the
simulated GPU's own count (`fakegpu-ctl dump`), not by the library's bookkeeping — and the other
container gets its 8 GiB of VRAM while the first holds everything it may."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.libcuda_intercept.support import UUID0, GiB, MiB, Node
from vgpu import region as R

pytestmark = pytest.mark.timeout(300)

SLICE, SHARE = 16 * GiB, 8 * GiB  # S * M / K and M / K
CHUNK = GiB

# one chunk of each path; 16 of them fill the slice
PATHS: dict[str, list[object]] = {
    "alloc": ["alloc", CHUNK],
    "pitch": ["pitch", 32768, 32768],  # rows of 32 KiB (already 512-aligned), 32768 of them
    "managed": ["managed", CHUNK],
    "async": ["async", CHUNK],
    "pool": ["pool", CHUNK],
    "vmm": ["vfull", CHUNK],
}


class Container:
    """One container's limits and region on the shared simulated node."""

    def __init__(self, node: Node, name: str, slice_: int = SLICE, share: int = SHARE) -> None:
        self.node = node
        self.limits = node.tmp / f"{name}.limits"
        self.region = node.tmp / f"{name}.region"
        self.limits.write_text(f"vgpu-limits 2\n{UUID0} {slice_} 50 1 {share}\n")

    def env(self) -> dict[str, str]:
        return {"VGPU_LIMITS_FILE": str(self.limits), "VGPU_REGION_FILE": str(self.region)}

    def start(self, *cmds: object) -> subprocess.Popen[str]:
        """cutest (cudart's lookup pattern) running the commands, then waiting on stdin."""
        p = self.node.popen("gpa", "init", *cmds, "wait", env=self.env())
        return p

    def usage(self) -> tuple[int, int]:
        """(device_bytes, host_bytes) the library charged, from the region."""
        snap = R.read_region(str(self.region))
        return sum(s.device_bytes[0] for s in snap.slots), sum(s.host_bytes[0] for s in snap.slots)


def until_waiting(p: subprocess.Popen[str]) -> list[str]:
    assert p.stdout is not None
    lines = []
    while True:
        ln = p.stdout.readline()
        assert ln, f"program ended early: {lines}\n{p.stderr.read() if p.stderr else ''}"
        if ln.startswith("waiting"):
            return lines
        lines.append(ln)


def finish(p: subprocess.Popen[str]) -> str:
    """Closes its stdin (the program's `wait` returns) and waits for it to exit cleanly."""
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return err


def resident(node: Node, p: subprocess.Popen[str]) -> int:
    """The simulated GPU's own count of device memory held by the process (NVML's usedGpuMemory:
    allocations, pool reservations, VMM handles, managed pages on the device, contexts)."""
    procs = node.dump()["processes"]
    [me] = [q for q in procs if q["host_pid"] == p.pid or q["pid"] == p.pid]
    return int(me["devices"][0]["used"])


def rcs(lines: list[str], name: str) -> list[str]:
    return [ln.split("rc=")[1].split()[0] for ln in lines if ln.startswith(name + " ")]


@pytest.fixture
def node16(node: Node) -> Node:
    """A 16 GiB GPU; the library plain and under AddressSanitizer + UBSan."""
    node.write_config("[device]\nmemory = 17179869184\ncontext_overhead = 0\n")
    return node


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_holds_the_slice_and_the_neighbour_keeps_its_share(node16: Node, path: str) -> None:
    node = node16
    a, b = Container(node, "a"), Container(node, "b")
    cmds = PATHS[path] * 16
    pa = a.start(*cmds, "touch")
    try:
        la = until_waiting(pa)
        assert rcs(la, cmds[0] if path != "vmm" else "vfull") == ["0"] * 16, la
        assert rcs(la, "touch") == ["0"], la  # the device reads all of it, host-backed half included
        if path == "vmm":
            assert all("map=0 access=0" in ln for ln in la if ln.startswith("vfull")), la
        assert a.usage() == (SHARE, SLICE - SHARE)
        # the simulated GPU's own count: half of the slice on the device, the rest in host memory
        assert resident(node, pa) == SHARE
        # one byte more is over the slice, whatever the path
        over = node.cutest("gpa", "init", "alloc", 1, env=a.env())
        assert over.one("alloc")["rc"] == "2"

        # the neighbour, while A holds everything it may: its 8 GiB of VRAM, then 8 GiB in host memory
        pb = b.start(*cmds, "touch")
        try:
            lb = until_waiting(pb)
            assert rcs(lb, cmds[0] if path != "vmm" else "vfull") == ["0"] * 16, lb
            assert resident(node, pb) == SHARE and resident(node, pa) == SHARE
            assert b.usage() == (SHARE, SLICE - SHARE)
            assert node.used() == 2 * SHARE  # the GPU, all 16 GiB of it, shared out exactly
            assert node.high()["used"] == 2 * SHARE  # (and its running total is what the processes hold)
        finally:
            finish(pb)
    finally:
        finish(pa)
    assert node.used() == 0


def test_neighbour_gets_its_vram_first_or_last(node16: Node) -> None:
    """B allocates its 8 GiB of device memory before, between and after A's allocations: always."""
    node = node16
    a, b = Container(node, "a"), Container(node, "b")
    pb = b.start(*["alloc", CHUNK] * 4)
    pa = a.start(*["managed", CHUNK] * 16, "touch")
    try:
        until_waiting(pb)
        until_waiting(pa)
        rest = node.cutest("gpa", "init", *["alloc", CHUNK] * 4, env=b.env())
        assert [r["rc"] for r in rest.all("alloc")] == ["0"] * 4  # B's other 4 GiB, A full
        assert resident(node, pa) == SHARE
    finally:
        for p in (pa, pb):
            finish(p)


def test_arrays_are_refused_at_the_physical_share_with_a_log_line(node16: Node) -> None:
    node = node16
    a = Container(node, "a")
    r = node.cutest("gpa", "init", *["array", 16384, 16384] * 9, "alloc", CHUNK, env=a.env())  # 1 GiB each
    assert [x["rc"] for x in r.all("array")] == ["0"] * 8 + ["2"]
    assert r.one("alloc")["rc"] == "0"  # a path that can fall back still does
    errs = [ln for ln in r.err.splitlines() if "cuArrayCreate_v2" in ln]
    assert len(errs) == 1 and "physical share of 8589934592 bytes" in errs[0], r.err
    assert "cannot live in host memory" in errs[0]


def test_host_backed_memory_stays_out_of_vram_whatever_the_program_advises(node16: Node) -> None:
    """Prefetches to the device, a device preferred location and read-mostly on host-backed memory
    are ignored (a neighbour's VRAM is at stake); advice that only maps is passed on."""
    node = node16
    a = Container(node, "a")
    cmds: list[object] = ["alloc", CHUNK] * 9  # the 9th is host-backed
    cmds += ["prefetch", 8, 1, 0, "advise", 8, 3, 1, 0, "advise", 8, 1, 1, 0, "advise", 8, 4, 1, 0]
    cmds += ["advise", 8, 5, 1, 0, "touch"]
    p = a.start(*cmds)
    try:
        lines = until_waiting(p)
        assert rcs(lines, "alloc") == ["0"] * 9
        assert rcs(lines, "prefetch") == ["0"] and rcs(lines, "advise") == ["0"] * 4 and rcs(lines, "touch") == ["0"]
        assert resident(node, p) == SHARE  # nothing moved onto the device
        assert a.usage() == (SHARE, CHUNK)
    finally:
        finish(p)


def test_stream_ordered_free_waits_for_the_stream(node: Node) -> None:
    """cuMemFreeAsync of host-backed memory frees it once the work queued before it is done."""
    # reading 1 GiB of host memory takes ~4 s at this link speed
    node.write_config("[device]\nmemory = 2147483648\ncontext_overhead = 0\nhost_link_bandwidth = 268435456\n")
    a = Container(node, "a", slice_=2 * GiB, share=GiB)
    p = a.start("async", GiB, "async", GiB, "touchq", "afreeq", 1, "sleepms", 6000, "alloc", MiB, "info")
    try:
        assert p.stdout is not None
        lines = []
        while not (ln := p.stdout.readline()).startswith("afreeq"):
            assert ln, lines
            lines.append(ln)
        assert "rc=0" in ln
        assert a.usage() == (GiB, GiB)  # the kernel still reads it: not freed yet
        until_waiting(p)
        # freed when the next allocation came, the stream long done (the new MiB is over the share too)
        assert a.usage() == (GiB, MiB)
        procs = node.dump()["processes"]
        [me] = [q for q in procs if q["host_pid"] == p.pid or q["pid"] == p.pid]
        assert me["devices"][0]["managed_host"] == MiB
    finally:
        finish(p)


def test_an_exported_host_numa_handle_stays_host_memory(node16: Node) -> None:
    """A cuMemCreate past the share is a host-NUMA handle; exporting it (a POSIX descriptor) does
    not move it into the shared ledger, which counts device memory: the exporter keeps it as
    host bytes and its device bytes are not lowered by it."""
    node = node16
    a = Container(node, "a")
    p = a.start(*["vmmfd", CHUNK] * 9, "vexport", 8, "vexport", 0)
    try:
        lines = until_waiting(p)
        assert rcs(lines, "vmm") == ["0"] * 9 and rcs(lines, "vexport") == ["0", "0"], lines
        snap = R.read_region(str(a.region))
        ledger = sum(e.bytes for e in snap.shared)  # live entries only
        assert ledger == CHUNK  # the device handle 0, not the host-NUMA handle 8
        assert a.usage() == (SHARE - CHUNK, CHUNK)
        # the share is still full (the ledger counts against it): the next handle is host memory
        more = node.cutest("gpa", "init", "vmm", 2 * MiB, env=a.env())
        assert more.one("vmm")["rc"] == "0"
        assert resident(node, p) == SHARE
    finally:
        finish(p)


def test_graph_memory_stops_at_the_physical_share(node: Node) -> None:
    """Graph memory (captured cudaMallocAsync, memory nodes) lives in the graph pool, device
    memory: its launch is refused past the share, within the slice; the paths that can fall back
    still do (build/intercept/paths)."""
    a = Container(node, "a", slice_=128 * MiB, share=64 * MiB)
    r = node.paths(
        "init", "alloc", 40 * MiB,
        "cap_begin", "cap_alloc", 40 * MiB, "cap_end", "inst", "launch",  # 80 MiB > the share: refused
        "cap_begin", "cap_alloc", 20 * MiB, "cap_end", "inst", "launch",  # 60 MiB: fits
        "alloc", 40 * MiB, "gattr", "info",  # host memory, the share full
        env=a.env(),
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert [x["rc"] for x in r.all("launch")] == ["2", "0"], r.out
    assert [x["rc"] for x in r.all("alloc")] == ["0", "0"], r.out
    assert r.one("gattr")["reserved"] == str(20 * MiB)
    assert a.usage() == (60 * MiB, 40 * MiB)  # (what the exited process left, until reclaimed)
    assert r.one("info")["free"] == str(28 * MiB)
    assert node.high()["alloc_high"] <= 64 * MiB


def test_without_oversubscription_nothing_falls_back(node16: Node) -> None:
    node = node16
    node.limit(SHARE)  # a version-1 file: slice = share = 8 GiB
    r = node.cutest("gpa", "init", *["alloc", CHUNK] * 9)
    assert [x["rc"] for x in r.all("alloc")] == ["0"] * 8 + ["2"]


def test_reporting_shows_the_slice_never_above_the_hardware(node16: Node) -> None:
    """cuMemGetInfo and NVML: total = min(slice, GPU), free = what the slice has left (device or
    host), NVML used = device-resident bytes only."""
    node = node16
    a = Container(node, "a", slice_=24 * GiB, share=8 * GiB)  # a slice above the hardware (K=1, S=1.5)
    p = a.start(*["alloc", CHUNK] * 12, "info")
    try:
        lines = until_waiting(p)
        info = next(ln for ln in lines if ln.startswith("info"))
        assert f"total={16 * GiB}" in info and f"free={12 * GiB}" in info, info
        out = subprocess.run(
            [sys.executable, "-c", PYNVML],
            env=node.env(extra=a.env()),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        total, free, used = (int(x) for x in out.stdout.split())
        assert (total, free, used) == (16 * GiB, 12 * GiB, 8 * GiB)
    finally:
        finish(p)


PYNVML = """
import pynvml
pynvml.nvmlInit()
m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
print(m.total, m.free, m.used)
"""
