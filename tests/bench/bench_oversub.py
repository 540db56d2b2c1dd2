"""make bench-oversub: what virtual device memory costs the workload that oversubscribes, and
what it costs its neighbour (nothing, is the target).

The workload: a working set of W bytes (BENCH_OVERSUB_WORKSET, default 8 GiB) in 512 MiB
cuMemAlloc_v2 allocations, and a stream of kernels reading all of it, pass after pass (the kernel
"touch" of build/intercept/cutest: a grid-stride read of every word; on the simulated GPU its run
time is what those bytes cost where they live, docs/developers/simulators.md "Kernel model"). It runs through
libvgpu.so in a container whose slice is W and whose physical share is W x (1 - x) for x = 0 %,
25 %, 50 % and 75 % oversubscribed: the library puts the part beyond the share in host memory
(unified memory advised to stay there), which the kernels then read over the host link. At the
same time a neighbour container with a physical share of 8 GiB (M/K of a 16 GiB GPU with K = 2)
runs the same kind of stream over 6 GiB of device memory, inside its share. The workload
allocates and touches its memory first, so that anything it took of the neighbour's VRAM would
push the neighbour's own allocations into host memory and show in its throughput.

Each run: both programs allocate, wait, are released at the same instant, run passes for
BENCH_OVERSUB_SECONDS (default 5) with the next pass always queued; throughput is passes per
second within the window where both run (first to last completion there), times the bytes per pass.

- plain_gib_per_s: the workload without libvgpu.so (the plain device plugin: all of it in VRAM)
- throughput_ratio_<x>: the workload's throughput at x % oversubscribed over plain_gib_per_s
- neighbour_throughput_ratio: the neighbour's lowest throughput during an oversubscribed run
  over its throughput during the plain run (target >= 0.95)
- workload_gib_per_s_<x>, neighbour_gib_per_s_<x>, plain/neighbour figures in GiB/s

Device: the simulated H200 (sim/fakegpu: 16 GiB here; HBM3e 4.8 TB/s, PCIe Gen5 x16 64 GB/s per
direction) unless BENCH_OVERSUB_DEVICE=real, which runs the same programs on the machine's real
GPU 0 (tests/gpu/ does that when a GPU is present). Prints name=value lines, the last one a summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
CUTEST = BUILD / "intercept" / "cutest"
GiB = 1 << 30
CHUNK = 512 << 20
NEIGHBOUR_SHARE = 8 * GiB
NEIGHBOUR_SET = 6 * GiB
PERCENTS = (0, 25, 50, 75)


def _int_env(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    return int(v) if v.strip() else default


class Setup:
    def __init__(self, tmp: Path, real: bool) -> None:
        self.tmp = tmp
        self.real = real
        base = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "FAKEGPU_", "LD_PRELOAD"))}
        if not real:
            (tmp / "config").write_text("[device]\nmemory = 17179869184\ncontext_overhead = 0\n")
            base.update(
                FAKEGPU_STATE=str(tmp / "state"),
                FAKEGPU_CONFIG=str(tmp / "config"),
                LD_LIBRARY_PATH=str(BUILD / "fakegpu"),
            )
        self.base = base
        out = subprocess.run(
            [str(CUTEST), "gpa", "init", "uuid"], env=base, capture_output=True, text=True, timeout=120, check=True
        ).stdout
        self.uuid = next(w.split("=", 1)[1] for ln in out.splitlines() for w in ln.split() if w.startswith("uuid=GPU"))

    def env(self, name: str, slice_: int | None, share: int = 0) -> dict[str, str]:
        """A container's environment: its own limits and region, the library preloaded (None: plain)."""
        env = dict(self.base)
        if slice_ is None:
            return env
        lim, reg = self.tmp / f"{name}.limits", self.tmp / f"{name}.region"
        over = 1 if share < slice_ else 0
        lim.write_text(f"vgpu-limits 2\n{self.uuid} {slice_} 100 {over} {share}\n")
        reg.unlink(missing_ok=True)
        env.update(VGPU_LIMITS_FILE=str(lim), VGPU_REGION_FILE=str(reg), LD_PRELOAD=str(BUILD / "libvgpu.so"))
        return env


def start(env: dict[str, str], nbytes: int, seconds: int, touch_first: bool) -> subprocess.Popen[str]:
    cmds = ["alloc", str(CHUNK)] * (nbytes // CHUNK)
    if touch_first:
        cmds.append("touch")
    argv = [str(CUTEST), "gpa", "init", *cmds, "wait", "touchfor", str(seconds)]
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def until_waiting(p: subprocess.Popen[str], what: str) -> None:
    assert p.stdout is not None
    lines = []
    for ln in p.stdout:
        if ln.startswith("waiting"):
            bad = [x for x in lines if " rc=" in x and " rc=0" not in x]
            if bad:
                raise SystemExit(f"bench-oversub: {what}: {bad[0].strip()}")
            return
        lines.append(ln)
    raise SystemExit(f"bench-oversub: {what} ended early: {''.join(lines)} {p.stderr.read() if p.stderr else ''}")


def passes(p: subprocess.Popen[str], what: str) -> tuple[int, list[float]]:
    out, err = p.communicate(timeout=600)
    if p.returncode != 0 or "touchfor rc=0" not in out:
        raise SystemExit(f"bench-oversub: {what} failed ({p.returncode}): {out[-500:]} {err[-500:]}")
    nbytes = next(
        int(w.split("=")[1])
        for ln in out.splitlines()
        if ln.startswith("touchfor start")
        for w in ln.split()
        if w.startswith("bytes=")
    )
    times = [float(ln.split("t=")[1]) / 1e9 for ln in out.splitlines() if ln.startswith("pass ")]
    return nbytes, times


def rate(nbytes: int, times: list[float], lo: float, hi: float) -> float:
    """GiB/s over the passes completed in [lo, hi]: (n - 1) passes between the first and the last."""
    t = [x for x in times if lo <= x <= hi]
    if len(t) < 3:
        raise SystemExit(f"bench-oversub: only {len(t)} passes in the window; raise BENCH_OVERSUB_SECONDS")
    return (len(t) - 1) * nbytes / (t[-1] - t[0]) / GiB


def run(s: Setup, workset: int, pct: int | None, seconds: int) -> tuple[float, float]:
    """(workload GiB/s, neighbour GiB/s); pct None: the workload without the library."""
    if pct is None:
        wenv = s.env("workload", None)
    else:
        share = workset * (100 - pct) // 100 // CHUNK * CHUNK
        wenv = s.env("workload", workset, share)
    w = start(wenv, workset, seconds, touch_first=True)
    until_waiting(w, "workload")
    n = start(s.env("neighbour", NEIGHBOUR_SHARE, NEIGHBOUR_SHARE), NEIGHBOUR_SET, seconds, touch_first=False)
    until_waiting(n, "neighbour")
    go = time.monotonic()
    for p in (w, n):
        assert p.stdin is not None
        p.stdin.close()  # `wait` returns: both start their passes now
        p.stdin = None
    wb, wt = passes(w, "workload")
    nb, nt = passes(n, "neighbour")
    lo, hi = go + 0.5, go + seconds
    return rate(wb, wt, lo, hi), rate(nb, nt, lo, hi)


def main() -> int:
    if not CUTEST.exists():
        print("bench-oversub: build/intercept/cutest missing (make build-all)", file=sys.stderr)
        return 2
    real = os.environ.get("BENCH_OVERSUB_DEVICE", "sim") == "real"
    seconds = _int_env("BENCH_OVERSUB_SECONDS", 5)
    workset = _int_env("BENCH_OVERSUB_WORKSET", 8 * GiB) // CHUNK * CHUNK
    with tempfile.TemporaryDirectory(prefix="bench-oversub-") as d:
        s = Setup(Path(d), real)
        plain, n_plain = run(s, workset, None, seconds)
        print(f"plain_gib_per_s={plain:.3f}", flush=True)
        print(f"neighbour_gib_per_s_plain={n_plain:.3f}", flush=True)
        ratios, nratios = {}, []
        for pct in PERCENTS:
            wr, nr = run(s, workset, pct, seconds)
            ratios[pct] = wr / plain
            print(f"workload_gib_per_s_{pct}={wr:.3f}", flush=True)
            print(f"neighbour_gib_per_s_{pct}={nr:.3f}", flush=True)
            if pct:
                nratios.append(nr / n_plain)
        for pct in PERCENTS:
            print(f"throughput_ratio_{pct}={ratios[pct]:.4f}")
        nratio = min(nratios)
        print(f"neighbour_throughput_ratio={nratio:.4f}")
    print(
        f"summary device={'real' if real else 'simulated-h200'} workset_gib={workset / GiB:g} "
        + " ".join(f"ratio_{p}={ratios[p]:.3f}" for p in PERCENTS)
        + f" neighbour_ratio={nratio:.3f} neighbour_target_met={'yes' if nratio >= 0.95 else 'no'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
