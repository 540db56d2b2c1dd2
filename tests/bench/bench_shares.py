"""make bench-shares: compute-share accuracy of vgpu-monitor on the simulated GPU.

Saturating workloads (`fakegpu-burn`, kernels launched back-to-back into a 1000-deep
queue), one per "container" (a state directory whose init pid is the workload), the
monitor as a real subprocess with policy `strict`.  Ground truth is each workload's
executed kernel time from the simulator (`fakegpu-ctl dump`), never NVML.

Cases (>= 30 s each): shares 30/70 and 20/30/50; in each, the last container joins
JOIN_S seconds after the others, and settle_s is measured from its start.  Then a
throughput baseline (policy off) and the monitor's CPU use with 32 containers.

Prints name=value lines, the last one a summary:
  share_error_pp       mean |share - target| over 1 s windows after settling (worst case)
  share_error_p95_pp   95th percentile of the same errors over all cases
  settle_s             time after the join until every share stays within +-5 pp (worst case)
  throughput_ratio     executed kernel time per second, throttled vs unthrottled
  monitor_cpu_pct      monitor + guardian CPU, one core = 100, at 32 containers
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.fakegpu.harness import FakeGPU  # noqa: E402
from tests.monitor.helpers import Gated, MonitorProc, exec_ns, make_container  # noqa: E402

KERNEL_US = 100
JOIN_S = 6.0
TICK_S = 0.25
SETTLE_HOLD_S = 3.0
TOL_PP = 5.0


def cpu_ticks(pid: int) -> int:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(f[11]) + int(f[12])  # utime + stime


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU ticks per thread name (the monitor names its NVML thread vgpu-nvml)."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            f = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[name] = out.get(name, 0) + int(f[11]) + int(f[12])
    return out


def run_case(gpu: FakeGPU, root: Path, shares: list[int], seconds: float, policy: str = "strict") -> dict:
    uuid = gpu.uuids[0]
    state = Path(tempfile.mkdtemp(prefix=f"state-{policy}-{'-'.join(map(str, shares))}-", dir=root))
    mon = MonitorProc(state, gpu.env, "--policy", policy)
    workers: list[Gated] = []
    try:
        mon.wait_ready()
        for i, s in enumerate(shares):
            w = Gated([gpu.burn, "--kernel-us", str(KERNEL_US), "--seconds", str(int(seconds + 30))], gpu.env)
            make_container(state, f"c{i}", w.pid, [(uuid, 8 << 30, s)], pod=f"bench-{i}")
            workers.append(w)
        time.sleep(1.3)  # the monitor's directory scan sees them (1 s)
        for w in workers[:-1]:
            w.release()
        join_at = time.monotonic() + JOIN_S
        samples: list[tuple[float, dict[int, int]]] = []
        end = time.monotonic() + JOIN_S + seconds
        joined = False
        while time.monotonic() < end:
            now = time.monotonic()
            if not joined and now >= join_at:
                workers[-1].release()
                joined = True
            samples.append((now, exec_ns(gpu.state())))
            time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
        status = mon.status() or {}
    finally:
        mon.stop()
        for w in workers:
            w.kill()
    join = workers[-1].released_at or join_at
    targets = {w.pid: float(s) for w, s in zip(workers, shares, strict=True)}

    def shares_over(i: int, j: int) -> dict[int, float] | None:
        (t0, a), (t1, b) = samples[i], samples[j]
        wall = (t1 - t0) * 1e9
        if wall <= 0:
            return None
        return {p: 100.0 * (b.get(p, 0) - a.get(p, 0)) / wall for p in targets}

    per = round(1.0 / TICK_S)
    # settle: first tick after the join from which every 1 s window stays within +-5 pp for SETTLE_HOLD_S
    ok: list[tuple[float, bool]] = []
    for j in range(per, len(samples)):
        if samples[j - per][0] < join:
            continue
        sh = shares_over(j - per, j)
        if sh is None:
            continue
        ok.append((samples[j][0], all(abs(sh[p] - targets[p]) <= TOL_PP for p in targets)))
    settle = float("nan")
    for k, (t, good) in enumerate(ok):
        if good and all(g for (t2, g) in ok[k:] if t2 <= t + SETTLE_HOLD_S):
            settle = max(0.0, t - join)
            break
    # errors: consecutive 1 s windows after settling (+1 s margin)
    start = join + (settle if settle == settle else 5.0) + 1.0
    errs: list[float] = []
    total_exec = 0.0
    total_wall = 0.0
    j0 = next((i for i, s in enumerate(samples) if s[0] >= start), len(samples))
    for i in range(j0, len(samples) - per, per):
        sh = shares_over(i, i + per)
        if sh is None:
            continue
        errs.extend(abs(sh[p] - targets[p]) for p in targets)
        total_exec += sum(sh.values()) / 100.0 * (samples[i + per][0] - samples[i][0])
        total_wall += samples[i + per][0] - samples[i][0]
    if os.environ.get("BENCH_TRACE"):
        for i in range(0, len(samples) - per, per):
            sh = shares_over(i, i + per)
            if sh:
                print(f"#   t={samples[i + per][0] - join:+6.2f}", [round(sh[p], 1) for p in targets], file=sys.stderr)
    longest = max((c.get("longest_stop_s", 0.0) for c in status.get("containers", [])), default=0.0)
    return {
        "errors": errs,
        "mean": statistics.mean(errs) if errs else float("nan"),
        "settle": settle,
        "busy": total_exec / total_wall if total_wall else float("nan"),
        "longest_stop_s": longest,
    }


def baseline(gpu: FakeGPU, root: Path, n: int, seconds: float) -> float:
    """Executed kernel time per second with no throttling (policy off)."""
    r = run_case(gpu, root, [100 // n] * n, seconds, policy="off")
    return r["busy"]


def cpu_at(gpu: FakeGPU, root: Path, n: int, seconds: float) -> tuple[float, float]:
    uuid = gpu.uuids[0]
    state = Path(tempfile.mkdtemp(prefix=f"state-cpu-{n}-", dir=root))
    mon = MonitorProc(state, gpu.env, "--policy", "strict")
    workers: list[Gated] = []
    try:
        mon.wait_ready()
        for i in range(n):
            w = Gated([gpu.burn, "--kernel-us", str(KERNEL_US), "--seconds", str(int(seconds + 30))], gpu.env)
            share = 1 if i % 2 == 0 else max(1, 200 // n - 1)  # half of them held well below an equal split
            make_container(state, f"cpu{i}", w.pid, [(uuid, 256 << 20, share)], pod=f"cpu-{i}")
            workers.append(w)
        time.sleep(1.3)
        for w in workers:
            w.release()
        time.sleep(3.0)  # everyone mapped, controller running
        guardian = mon.guardian_pid()
        pids = [mon.pid] + ([guardian] if guardian else [])
        c0 = sum(cpu_ticks(p) for p in pids)
        n0 = thread_ticks(mon.pid).get("vgpu-nvml", 0)
        t0 = time.monotonic()
        time.sleep(seconds)
        c1 = sum(cpu_ticks(p) for p in pids)
        n1 = thread_ticks(mon.pid).get("vgpu-nvml", 0)
        wall = time.monotonic() - t0
        st = mon.status() or {}
        mapped = sum(len(g["containers"]) for g in st.get("gpus", []))
        if mapped < n:
            print(f"# warning: only {mapped}/{n} containers mapped", file=sys.stderr)
    finally:
        mon.stop()
        for w in workers:
            w.kill()
    hz = os.sysconf("SC_CLK_TCK")
    return 100.0 * (c1 - c0) / hz / wall, 100.0 * (n1 - n0) / hz / wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds per case after the join")
    ap.add_argument("--cpu-containers", type=int, default=32)
    ap.add_argument("--cpu-seconds", type=float, default=15.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-shares-") as tmp:
        root = Path(tmp)
        gpu = FakeGPU(root / "node", ROOT / "build", gpus=1)
        try:
            cases = {"30/70": [30, 70], "20/30/50": [20, 30, 50]}
            results = {}
            for name, shares in cases.items():
                r = run_case(gpu, root, shares, a.seconds)
                results[name] = r
                print(
                    f"# case {name}: share_error_pp={r['mean']:.2f} settle_s={r['settle']:.2f} "
                    f"busy={r['busy']:.3f} longest_stop_s={r['longest_stop_s']:.2f}",
                    flush=True,
                )
            base = baseline(gpu, root, 2, 8.0)
            print(f"# baseline (policy off) busy={base:.3f}", flush=True)
            cpu, cpu_nvml = cpu_at(gpu, root, a.cpu_containers, a.cpu_seconds)
            print(
                f"# monitor CPU at {a.cpu_containers} containers: {cpu:.2f} %, of which the NVML thread "
                f"(calls into the simulated libnvidia-ml) {cpu_nvml:.2f} %",
                flush=True,
            )
        finally:
            gpu.close()
    all_errs = sorted(e for r in results.values() for e in r["errors"])
    err = max(r["mean"] for r in results.values())
    p95 = all_errs[min(len(all_errs) - 1, int(0.95 * len(all_errs)))] if all_errs else float("nan")
    settle = max(r["settle"] for r in results.values())
    thr = min(r["busy"] for r in results.values()) / base if base else float("nan")
    print(f"share_error_pp={err:.2f}")
    print(f"share_error_p95_pp={p95:.2f}")
    print(f"settle_s={settle:.2f}")
    print(f"throughput_ratio={thr:.3f}")
    print(f"monitor_cpu_pct={cpu:.2f}")
    ok = err <= 3.0 and p95 <= 6.0 and settle <= 2.0 and thr >= 0.95 and cpu <= 2.0
    print(
        f"summary: shares 30/70 and 20/30/50 strict, kernel {KERNEL_US} us, queue 1000: "
        f"error {err:.2f} pp (target <= 3), p95 {p95:.2f} pp (<= 6), settle {settle:.2f} s (<= 2), "
        f"throughput {thr:.3f} (>= 0.95), monitor CPU {cpu:.2f} % at {a.cpu_containers} containers (<= 2): "
        f"{'all targets met' if ok else 'targets NOT all met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
