#!/usr/bin/env python3
"""libvgpu.so on a real NVIDIA GPU: the intercept suite's C programs, unchanged,
against the real driver, plus PyTorch where it is installed.

    make build-all && python3 tests/gpu/real_gpu.py [--limit-mib 1024] [--device 0]

Needs: an NVIDIA driver (libcuda.so.1 and libnvidia-ml.so.1 on the loader
path), build/libvgpu.so and build/intercept/{cutest,link_cutest}.  Nothing of
the simulator is used: LD_LIBRARY_PATH is left as the machine has it.  Limits
and region go to a temporary directory named by VGPU_LIMITS_FILE /
VGPU_REGION_FILE (so this also runs outside a container, where
/run/vgpu/limits does not exist).  Prints one PASS/FAIL/SKIP line per check and
exits non-zero if any check failed.

What it checks (device ordinal --device, a slice of --limit-mib):
  - the device's UUID as CUDA reports it keys the limits line
  - all four acquisition paths (link, dlsym, gpa = cudart's pattern,
    gpa-linked): OUT_OF_MEMORY one byte past the slice, success exactly at it,
    cuMemGetInfo/cuDeviceTotalMem show the slice, hooked entry points resolve
    into libvgpu.so and cuGetProcAddress returns itself
  - VMM (create/map/release/unmap), stream-ordered and pool allocations,
    managed, pitch, arrays: charged and returned
  - 4 processes racing random alloc/free never exceed the slice (region sums)
  - kill -9 of a process holding half the slice: a newcomer gets all of it
  - pynvml (if installed) reports the slice
  - PyTorch (if installed): torch.cuda.mem_get_info() shows the slice, and
    allocating past it raises torch.cuda.OutOfMemoryError; with the default
    allocator and with expandable segments (cuMemCreate)
  - virtual device memory (a slice of 4x, a physical share of 1x the limit):
    every path allocates the whole slice and a kernel reads all of it; the
    GPU's used memory (NVML, device level) grows by the share and the
    context, not by the slice; cuMemCreate beyond the share is host-NUMA
    memory where the driver has it (else refused)
  - the host-resident bytes are charged to the process's memory cgroup
    (cgroup v2, root): memory.current grows by them
  - make bench-oversub on this GPU: its figures, the neighbour's target
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
MiB = 1 << 20

results: list[tuple[str, str, str]] = []


def record(name: str, ok: bool | None, detail: str = "") -> None:
    status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    results.append((status, name, detail))
    print(f"{status} {name}" + (f": {detail}" if detail else ""), flush=True)


def rows(out: str) -> list[dict[str, str]]:
    res = []
    for ln in out.splitlines():
        parts = ln.split()
        if parts and "=" not in parts[0]:
            res.append({"_": parts[0], **dict(p.split("=", 1) for p in parts[1:] if "=" in p)})
    return res


class Env:
    def __init__(self, tmp: Path, device: int, limit: int) -> None:
        self.tmp = tmp
        self.device = device
        self.limit = limit
        self.limits = tmp / "limits"
        self.region = tmp / "region"

    def env(self, preload: bool = True, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "FAKEGPU_"))}
        env.pop("LD_PRELOAD", None)
        env["VGPU_LIMITS_FILE"] = str(self.limits)
        env["VGPU_REGION_FILE"] = str(self.region)
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "") or str(self.device)
        if preload:
            env["LD_PRELOAD"] = str(BUILD / "libvgpu.so")
        env.update(extra)
        return env

    def cutest(self, mode: str, *cmds: object, preload: bool = True, timeout: float = 300) -> tuple[int, list, str]:
        prog = "link_cutest" if mode in ("link", "gpa-linked") else "cutest"
        p = subprocess.run(
            [str(BUILD / "intercept" / prog), mode, *map(str, cmds)],
            env=self.env(preload),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        return p.returncode, rows(p.stdout), p.stderr

    def popen(self, mode: str, *cmds: object) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(BUILD / "intercept" / "cutest"), mode, *map(str, cmds)],
            env=self.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def pick(rs: list, name: str, i: int = 0) -> dict[str, str]:
    found = [r for r in rs if r["_"] == name]
    return found[i] if len(found) > i else {}


def check_paths(e: Env) -> None:
    L = e.limit
    for mode in ("link", "dlsym", "gpa", "gpa-linked"):
        rc, rs, err = e.cutest(
            mode,
            "init",
            "alloc",
            L - 4 * MiB,
            "alloc",
            4 * MiB + 1,
            "alloc",
            4 * MiB,
            "info",
            "total",
            "freeall",
            "info",
            "hooks",
        )
        a = [r for r in rs if r["_"] == "alloc"]
        ok = rc == 0 and len(a) == 3 and a[0]["rc"] == "0" and a[1]["rc"] == "2" and a[2]["rc"] == "0"
        record(f"{mode}: OOM one byte past the slice, success exactly at it", ok, err.strip()[-300:] if not ok else "")
        i0, i1 = pick(rs, "info", 0), pick(rs, "info", 1)
        record(
            f"{mode}: cuMemGetInfo shows the slice",
            i0.get("total") == str(L) and i0.get("free") == "0" and i1.get("free") == str(L),
            f"{i0} {i1}",
        )
        record(f"{mode}: cuDeviceTotalMem is the slice", pick(rs, "total").get("bytes") == str(L))
        hooked = {r["name"]: r["libvgpu"] for r in rs if r["_"] == "hook" and r["found"] == "1"}
        must = [
            "cuMemAlloc_v2",
            "cuMemFree_v2",
            "cuMemGetInfo_v2",
            "cuMemCreate",
            "cuMemAllocAsync_ptsz",
            "cuLaunchKernel",
        ]
        missing = [n for n in must if hooked.get(n) != "1"]
        record(f"{mode}: hooked entry points resolve into libvgpu.so", not missing, f"not hooked: {missing}")
        if mode.startswith("gpa"):
            record(f"{mode}: cuGetProcAddress returns itself", pick(rs, "gpa_self").get("libvgpu") == "1")


def check_paths_more(e: Env) -> None:
    L = e.limit
    rc, rs, err = e.cutest(
        "gpa",
        "init",
        "vmm",
        64 * MiB,
        "vmap",
        0,
        "vrelease",
        0,
        "info",
        "vunmap",
        0,
        "info",
        "async",
        8 * MiB,
        "pool",
        8 * MiB,
        "managed",
        8 * MiB,
        "pitch",
        4096,
        1024,
        "array",
        1024,
        1024,
        "info",
        "afree",
        0,
        "afree",
        1,
        "free",
        2,
        "free",
        3,
        "adestroy",
        0,
        "pooltrim",
        "pooldestroy",
        "info",
        "launch",
        1000,
    )
    infos = [int(r.get("free", -1)) for r in rs if r["_"] == "info"]
    ok = rc == 0 and len(infos) == 4 and infos[0] == L - 64 * MiB and infos[1] == L and infos[3] == L
    ok = ok and all(
        r.get("rc") == "0"
        for r in rs
        if r["_"] in ("vmm", "vmap", "vrelease", "vunmap", "async", "pool", "managed", "pitch", "array")
    )
    record("VMM, async, pool, managed, pitch, array: charged and returned", ok, f"{rs} {err[-300:]}" if not ok else "")
    record("launch path works through the wrapper", pick(rs, "launch").get("rc") == "0", str(pick(rs, "launch")))


def check_race(e: Env) -> None:
    sys.path.insert(0, str(ROOT))
    from vgpu import region as R

    procs = [e.popen("gpa", "init", "race", 300, e.limit // 8, i + 1) for i in range(4)]
    peak = 0
    while any(p.poll() is None for p in procs):
        try:
            snap = R.read_region(str(e.region))
            peak = max(peak, sum(s.device_bytes[0] + s.host_bytes[0] for s in snap.slots))
        except (OSError, R.RegionCorrupt):
            pass
        time.sleep(0.001)
    outs = [p.communicate()[0] for p in procs]
    ok = all(p.returncode == 0 for p in procs) and all("other=0" in o for o in outs)
    record("4 processes racing never exceed the slice", ok and peak <= e.limit, f"peak {peak} limit {e.limit}")


def check_kill(e: Env) -> None:
    p = e.popen("gpa", "init", "alloc", e.limit // 2, "wait")
    assert p.stdout is not None
    for _ in range(3):
        if "waiting" in p.stdout.readline():
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(0.5)  # the driver tears the dead process's context down
    _, rs, _ = e.cutest("gpa", "init", "alloc", e.limit)
    record("kill -9: a newcomer gets the dead process's share", pick(rs, "alloc").get("rc") == "0", str(rs))


PYNVML = textwrap.dedent("""
    import pynvml, sys
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByUUID(sys.argv[1])
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    print(m.total, m.used, m.free)
""")

TORCH = textwrap.dedent("""
    import sys, torch
    limit = int(sys.argv[1])
    free, total = torch.cuda.mem_get_info()
    print("meminfo", free, total)
    assert total == limit, (total, limit)
    x = torch.empty(limit // 2, dtype=torch.uint8, device="cuda")
    try:
        y = torch.empty(limit, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as exc:
        print("oom", type(exc).__name__)
    else:
        print("no-oom")
        sys.exit(1)
""")


def check_python(e: Env, uuid: str) -> None:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        record("pynvml reports the slice", None, "pynvml not installed")
    else:
        p = subprocess.run(
            [sys.executable, "-c", PYNVML, uuid], env=e.env(), capture_output=True, text=True, timeout=120
        )
        total = p.stdout.split()[0] if p.stdout.split() else ""
        record("pynvml reports the slice", p.returncode == 0 and total == str(e.limit), p.stdout + p.stderr[-300:])
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=300,
        env=e.env(preload=False),
    )
    if probe.returncode != 0 or "True" not in probe.stdout:
        record("PyTorch sees the slice and hits OOM past it", None, "PyTorch with CUDA not installed")
        return
    for conf in ("", "expandable_segments:True"):
        p = subprocess.run(
            [sys.executable, "-c", TORCH, str(e.limit)],
            env=e.env(PYTORCH_CUDA_ALLOC_CONF=conf),
            capture_output=True,
            text=True,
            timeout=600,
        )
        record(
            f"PyTorch ({conf or 'default allocator'}): mem_get_info shows the slice, OOM past it",
            p.returncode == 0 and "oom OutOfMemoryError" in p.stdout,
            (p.stdout + p.stderr)[-400:],
        )


def gpu_used(device: int) -> int:
    out = subprocess.run(
        ["nvidia-smi", f"--id={device}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return int(out.strip().splitlines()[0]) * MiB


def check_oversub(e: Env, uuid: str) -> None:
    share, slice_ = e.limit, 4 * e.limit
    chunk = share // 4
    e.limits.write_text(f"vgpu-limits 2\n{uuid} {slice_} 100 1 {share}\n")
    paths = {
        "alloc": ["alloc", chunk],
        "pitch": ["pitch", 32768, chunk // 32768],
        "managed": ["managed", chunk],
        "async": ["async", chunk],
        "pool": ["pool", chunk],
        "vmm": ["vfull", chunk - chunk % (2 * MiB)],
    }
    for name, cmd in paths.items():
        e.region.unlink(missing_ok=True)
        before = gpu_used(e.device)
        p = e.popen("gpa", "init", *(cmd * 16), "touch", "wait")
        lines = []
        assert p.stdout is not None
        for ln in p.stdout:
            if ln.startswith("waiting"):
                break
            lines.append(ln)
        grown = gpu_used(e.device) - before
        p.communicate(timeout=120)
        rs = rows("".join(lines))
        allocs = [r for r in rs if r["_"] == cmd[0]]
        ok = [r.get("rc") for r in allocs] == ["0"] * 16 and pick(rs, "touch").get("rc") == "0"
        if name == "vmm" and not ok and [r.get("rc") for r in allocs][:4] == ["0"] * 4:
            record("oversub vmm: beyond the share refused (no host-NUMA VMM here)", True, str(allocs[4:5]))
            continue
        # the share and a context (well under 1 GiB) on the device; the slice would be 4x the share
        fits = grown <= share + 1024 * MiB
        record(
            f"oversub {name}: 4x the share allocated and read, device grew by {grown // MiB} MiB",
            ok and fits,
            "".join(lines)[-400:] if not (ok and fits) else "",
        )


def check_cgroup(e: Env, uuid: str) -> None:
    root = Path("/sys/fs/cgroup")
    if (
        os.geteuid() != 0
        or not (root / "cgroup.controllers").exists()
        or "memory" not in (root / "cgroup.subtree_control").read_text()
    ):
        record("host-resident bytes charged to the memory cgroup", None, "needs root and cgroup v2 with memory")
        return
    cg = root / f"vgpu-gpu-test-{os.getpid()}"
    cg.mkdir()
    share = e.limit
    e.limits.write_text(f"vgpu-limits 2\n{uuid} {4 * share} 100 1 {share}\n")
    e.region.unlink(missing_ok=True)
    try:
        argv = [
            "sh",
            "-c",
            f'echo $$ > {cg}/cgroup.procs && exec "$@"',
            "sh",
            str(BUILD / "intercept" / "cutest"),
            "gpa",
            "init",
            *(["alloc", str(share // 4)] * 16),
            "touch",
            "wait",
        ]
        p = subprocess.Popen(argv, env=e.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        base = None
        assert p.stdout is not None
        for ln in p.stdout:
            if ln.startswith("init"):
                base = int((cg / "memory.current").read_text())
            if ln.startswith("waiting"):
                break
        grown = int((cg / "memory.current").read_text()) - (base or 0)
        p.communicate(timeout=120)
        host = 3 * share
        record(
            f"host-resident bytes charged to the memory cgroup (+{grown // MiB} MiB for {host // MiB} MiB)",
            grown >= host * 0.9,
        )
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass


def check_bench() -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "bench" / "bench_oversub.py")],
        env={**os.environ, "BENCH_OVERSUB_DEVICE": "real"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(p.stdout, flush=True)
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    record(
        "bench-oversub on this GPU: neighbour target met",
        p.returncode == 0 and "neighbour_target_met=yes" in summary,
        summary or p.stderr[-400:],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit-mib", type=int, default=1024)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    for f in ("libvgpu.so", "intercept/cutest", "intercept/link_cutest"):
        if not (BUILD / f).exists():
            print(f"missing build/{f}: run make build-all", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="vgpu-gpu-") as d:
        e = Env(Path(d), args.device, args.limit_mib * MiB)
        rc, rs, err = e.cutest("dlsym", "init", "uuid", "info", preload=False)
        uuid = pick(rs, "uuid").get("uuid", "")
        if rc != 0 or not uuid:
            print(f"no usable CUDA device: {err.strip()[-400:]}", file=sys.stderr)
            return 2
        phys_total = int(pick(rs, "info").get("total", "0"))
        if e.limit >= phys_total:
            print(f"--limit-mib must be below the device's {phys_total // MiB} MiB", file=sys.stderr)
            return 2
        print(f"device {args.device}: {uuid}, {phys_total // MiB} MiB; slice {args.limit_mib} MiB", flush=True)
        e.limits.write_text(f"vgpu-limits 1\n{uuid} {e.limit} 100 0\n")
        check_paths(e)
        check_paths_more(e)
        check_race(e)
        check_kill(e)
        check_python(e, uuid)
        check_oversub(e, uuid)
        check_cgroup(e, uuid)
    check_bench()
    failed = [r for r in results if r[0] == "FAIL"]
    print(
        f"summary passed={sum(r[0] == 'PASS' for r in results)} failed={len(failed)} "
        f"skipped={sum(r[0] == 'SKIP' for r in results)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
