"""make bench-intercept: what libvgpu.so costs, measured on the simulated driver.

One binary (build/intercept/bench_intercept, driver functions through
cuGetProcAddress as cudart gets them), run interleaved without and with
LD_PRELOAD=build/libvgpu.so; every figure is "through the library" minus
"direct", the median over rounds.

- launch_overhead_ns: per cuLaunchKernel call, 10M calls per run.  The launch
  is one the simulator rejects at its entry (NULL function), so its own part
  is a constant few ns and the difference is the wrapper.
- alloc_free_overhead_ns: CPU time per cuMemAlloc_v2+cuMemFree_v2 pair (64 KiB)
  in each of 8 processes running at once in one region, mean over the 8.
- init_ms_per_process_n{1,16,64}: N processes of one container released at
  the same instant; CPU time of cuInit + context + first alloc/free (the
  library maps the region and takes a slot in there), mean over the N
  processes.  CPU, not wall: with 64 processes on a 2-core machine wall time
  is ~30x the CPU time for both runs alike and its noise (ms) hides the
  difference; waiting on the region lock would show as wall time only, and
  the wall-clock means of the two runs stay within that noise of each other.
  (HAMi-core's host-pid probe: about 612*N ms of wall time.)
- init_p50_ms_n256 / init_p99_ms_n256: 256 processes of one container released at
  the same instant (one pipe closed under all of them); per process, the wall
  time from the release to the end of cuInit + context + first alloc/free
  through the library (HAMi #1662: about a minute), the median over rounds of
  each round's percentile.  Target: p99 <= 50 ms on a 2-core VM.  The same
  without the library is printed for comparison (init_p99_ms_n256_direct): the
  simulated driver's own start-up is most of it.  The processes stay alive
  until all 256 have reported, as workers that start together keep running
  (exits in the middle of the burst would measure the teardown of the early
  ones against the start of the late ones), and each burst starts after the
  previous one's processes are gone from the simulator (a real driver frees a
  process's contexts when it exits; the simulator reclaims the slots of exited
  processes lazily, on a later start, which here is one process before the
  burst).

Prints name=value lines, the last one a summary.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
PROG = BUILD / "intercept" / "bench_intercept"
UUID0 = "GPU-fa6e0000-0000-4000-8000-000000000100"


def env_for(tmp: Path, lib: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "FAKEGPU_", "LD_"))}
    env.update(
        FAKEGPU_STATE=str(tmp / "state"),
        FAKEGPU_CONFIG=str(tmp / "config"),
        LD_LIBRARY_PATH=str(BUILD / "fakegpu"),
        VGPU_LIMITS_FILE=str(tmp / "limits"),
        VGPU_REGION_FILE=str(tmp / "region"),
    )
    if lib:
        env["LD_PRELOAD"] = str(BUILD / "libvgpu.so")
    return env


def values(out: str) -> dict[str, float]:
    res = {}
    for ln in out.splitlines():
        parts = ln.split()
        if len(parts) == 2:
            try:
                res[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return res


def launch(tmp: Path, lib: bool, n: int) -> float:
    p = subprocess.run(
        [str(PROG), "launch", str(n)], env=env_for(tmp, lib), capture_output=True, text=True, check=True, timeout=600
    )
    return values(p.stdout)["launch_ns"]


def together(tmp: Path, lib: bool, argv: list[str], n: int) -> list[dict[str, float]]:
    """Start n processes, wait until all are ready, release them at once (stdin EOF)."""
    procs = [
        subprocess.Popen(
            [str(PROG), *argv],
            env=env_for(tmp, lib),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"benchmark process not ready: {line!r} {p.stderr.read() if p.stderr else ''}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
        p.stdin = None  # released: communicate() must not touch it
    res = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(err)
        res.append(values(out))
    return res


def burst(tmp: Path, lib: bool, n: int) -> list[float]:
    """n processes blocked on one pipe, released by closing it: each one's latency (ms) from
    the release to the end of its CUDA start-up and first allocation.  They stay alive (blocked
    on a second pipe) until all have reported."""
    time.sleep(0.02)  # older than the simulator's lazy reclaim interval (FG_REAP_NS, 10 ms)
    together(tmp, lib, ["init"], 1)  # reclaims the slots of the previous burst's processes
    release = tmp / "release"
    release.unlink(missing_ok=True)
    r, w = os.pipe()
    hold_r, hold_w = os.pipe()
    procs = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [str(PROG), "init", str(release), str(hold_r)],
                    env=env_for(tmp, lib),
                    stdin=r,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    pass_fds=(hold_r,),
                )
            )
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"benchmark process not ready: {line!r} {p.stderr.read() if p.stderr else ''}")
        time.sleep(0.2)  # the last ones are blocked in read(), not still starting
        tmpf = tmp / "release.tmp"
        tmpf.write_text(str(time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
        os.rename(tmpf, release)
    finally:
        os.close(r)
        os.close(w)  # the release: every reader sees EOF at once
        os.close(hold_r)
    lat = []
    try:
        for p in procs:
            assert p.stdout is not None
            out = ""
            while (line := p.stdout.readline()) not in ("done\n", ""):
                out += line
            if "init_latency_ns" not in out:
                raise RuntimeError(f"benchmark process reported no latency: {out!r}")
            lat.append(values(out)["init_latency_ns"] / 1e6)
    finally:
        os.close(hold_w)  # all reported (or one failed): let them exit
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(err)
    return sorted(lat)


def percentile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]


def paired(rounds: int, measure) -> float:  # type: ignore[no-untyped-def]
    """median over rounds of (lib - direct); the order alternates per round"""
    diffs = []
    for r in range(rounds):
        if r % 2:
            lib = measure(True)
            direct = measure(False)
        else:
            direct = measure(False)
            lib = measure(True)
        diffs.append(lib - direct)
    return statistics.median(diffs)


def main() -> int:
    if not PROG.exists() or not (BUILD / "fakegpu" / "libcuda.so.1").exists():
        print("bench-intercept: build/intercept/bench_intercept or build/fakegpu missing (run make)", file=sys.stderr)
        return 2
    quick = os.environ.get("VGPU_BENCH_QUICK") == "1"
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-") as d:
        tmp = Path(d)
        (tmp / "config").write_text("[device]\ncontext_overhead = 0\n[device]\ncontext_overhead = 0\n")
        (tmp / "limits").write_text(f"vgpu-limits 1\n{UUID0} {8 << 30} 50 0\n")
        together(tmp, False, ["init"], 4)  # warm the page cache and the simulator state
        together(tmp, True, ["init"], 4)
        calls = 1_000_000 if quick else 10_000_000
        launch_ns = paired(3 if quick else 15, lambda lib: launch(tmp, lib, calls))
        print(f"launch_overhead_ns={launch_ns:.1f}", flush=True)

        pairs = 2000 if quick else 20000

        def allocfree(lib: bool) -> float:
            res = together(tmp, lib, ["allocfree", str(pairs), str(64 << 10)], 8)
            return statistics.mean(r["pair_cpu_ns"] for r in res)

        af_ns = paired(3 if quick else 9, allocfree)
        print(f"alloc_free_overhead_ns={af_ns:.0f}", flush=True)

        init_ms = {}
        for n in (1, 16, 64):

            def init(lib: bool, n: int = n) -> float:
                res = together(tmp, lib, ["init"], n)
                return statistics.mean(r["init_cpu_ns"] for r in res) / 1e6

            init_ms[n] = paired(3 if quick else 7, init)
            print(f"init_ms_per_process_n{n}={init_ms[n]:.3f}", flush=True)

        # 256 processes at once: 2 pipes each in this process
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 2048 <= hard or hard == resource.RLIM_INFINITY:
            resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
        rounds = 2 if quick else 5
        p50s, p99s, direct = [], [], []
        for _ in range(rounds):
            lat = burst(tmp, True, 256)
            p50s.append(percentile(lat, 0.50))
            p99s.append(percentile(lat, 0.99))
            direct.append(percentile(burst(tmp, False, 256), 0.99))
        p50, p99 = statistics.median(p50s), statistics.median(p99s)
        print(f"init_p50_ms_n256={p50:.1f}", flush=True)
        print(f"init_p99_ms_n256={p99:.1f}", flush=True)
        print(f"init_p99_ms_n256_direct={statistics.median(direct):.1f}", flush=True)

    ok = launch_ns <= 10 and af_ns <= 2000 and all(v <= 2 for v in init_ms.values()) and p99 <= 50
    print(
        f"summary launch_overhead_ns={launch_ns:.1f} alloc_free_overhead_ns={af_ns:.0f} "
        + " ".join(f"init_ms_per_process_n{n}={v:.3f}" for n, v in init_ms.items())
        + f" init_p50_ms_n256={p50:.1f} init_p99_ms_n256={p99:.1f}"
        + f" targets_met={'yes' if ok else 'no'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
