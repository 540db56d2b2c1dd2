"""make bench-hook: what the vGPU hook adds to `runc run` of `true`.

Three variants, interleaved in random order, >= 20 runs each (BENCH_HOOK_RUNS):
no hook, our hooks on a container without a token, our hooks on a vGPU
container.  Overheads are differences of medians against the no-hook runs.
BENCH_HOOK_BASELINE=<git revision> adds the same two hooked variants with the hook of that
revision (its runtime_hook/ and vgpu/, from `git archive`), interleaved in the same run: an A/B
that the machine's load cannot bias (`*_baseline` lines, and `ab_vgpu_ms` = this tree minus it).
Also prints where the time of one no-token hook invocation goes.
Prints name=value lines; the last line is the summary.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support import hook as support  # noqa: E402

TARGET_PLAIN_MS = 20.0
TARGET_VGPU_MS = 35.0


def _time(cmd: list[str], stdin: bytes = b"") -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, input=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return (time.perf_counter() - t0) * 1000


def _median_of(n: int, cmd: list[str], stdin: bytes = b"") -> float:
    return statistics.median(_time(cmd, stdin) for _ in range(n))


def _host_python() -> str:
    """The interpreter the installed hook runs with: the node's python3 (node_setup.hostpython
    picks /usr/bin/python3 first), else this one. BENCH_HOOK_PYTHON overrides."""
    want = os.environ.get("BENCH_HOOK_PYTHON")
    if want:
        return want
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            r = subprocess.run(
                [cand, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 9))"],
                capture_output=True,
                text=True,
                check=False,
            )
            if r.stdout.strip() == "True":
                return cand
    return sys.executable


def _site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def _baseline_tree(rev: str, dst: Path) -> Path:
    """runtime_hook/ and vgpu/ of git revision `rev`, extracted under dst; its hook script."""
    dst.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "runtime_hook", "vgpu"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst / "runtime_hook" / "fastpath.py"


def main() -> int:
    if not support.have_runc():
        print("bench-hook: needs root, runc and busybox-static", file=sys.stderr)
        return 1
    runs = max(20, int(os.environ.get("BENCH_HOOK_RUNS", "30")))
    tmp = Path(tempfile.mkdtemp(prefix="vgpu-bench-hook-"))
    try:
        lib = support.placeholder_library(tmp)
        state = tmp / "state"
        state.mkdir()
        token = support.write_record(state)
        hook_py = _host_python()  # as on a node: vgpu-node-setup points the hook at the host's python3
        print(f"hook_python={hook_py}")
        installed = support.hooks(state, lib, tmp / "log", shell=True, python=hook_py)  # as `containerd install`
        python_only = support.hooks(state, lib, tmp / "log", shell=False, python=hook_py)  # python3 -I -S fastpath.py
        rootfs = support.make_rootfs(tmp / "rootfs")
        env = [f"VGPU_ALLOCATION_TOKEN={token}"]
        bundles = {
            "none": support.make_bundle(tmp / "b-none", ["true"], rootfs=rootfs),
            "plain": support.make_bundle(tmp / "b-plain", ["true"], rootfs=rootfs, hook=installed),
            "vgpu": support.make_bundle(tmp / "b-vgpu", ["true"], rootfs=rootfs, hook=installed, env=env),
            "plain_python": support.make_bundle(tmp / "b-plain-py", ["true"], rootfs=rootfs, hook=python_only),
            "vgpu_python": support.make_bundle(tmp / "b-vgpu-py", ["true"], rootfs=rootfs, hook=python_only, env=env),
        }
        baseline = os.environ.get("BENCH_HOOK_BASELINE", "")
        if baseline:
            old = _baseline_tree(baseline, tmp / "baseline")
            print(f"baseline={baseline}")
            base = support.hooks(state, lib, tmp / "log", shell=True, python=hook_py, fastpath=old)
            bundles["plain_baseline"] = support.make_bundle(tmp / "b-plain-base", ["true"], rootfs=rootfs, hook=base)
            bundles["vgpu_baseline"] = support.make_bundle(
                tmp / "b-vgpu-base", ["true"], rootfs=rootfs, hook=base, env=env
            )
        runc_root = tmp / "runc"
        times: dict[str, list[float]] = {k: [] for k in bundles}
        order = [k for k in bundles for _ in range(runs)]
        random.shuffle(order)
        warm = list(bundles)
        for i, kind in enumerate([*warm, *order]):
            t0 = time.perf_counter()
            r = subprocess.run(
                ["runc", "--root", str(runc_root), "run", "--bundle", str(bundles[kind]), f"bench{i}"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
            )
            dt = (time.perf_counter() - t0) * 1000
            if r.returncode != 0:
                print(f"bench-hook: runc run ({kind}) failed: {r.stderr.decode()[-300:]}", file=sys.stderr)
                return 1
            if i >= len(warm):
                times[kind].append(dt)
        med = {k: statistics.median(v) for k, v in times.items()}
        plain = med["plain"] - med["none"]
        vgpu = med["vgpu"] - med["none"]
        for k in bundles:
            print(f"runc_run_median_ms_{k}={med[k]:.1f}")
        print(f"hook_overhead_ms_plain={plain:.1f}")
        print(f"hook_overhead_ms_vgpu={vgpu:.1f}")
        print(f"hook_overhead_ms_plain_python_only={med['plain_python'] - med['none']:.1f}")
        print(f"hook_overhead_ms_vgpu_python_only={med['vgpu_python'] - med['none']:.1f}")
        if baseline:
            print(f"hook_overhead_ms_plain_baseline={med['plain_baseline'] - med['none']:.1f}")
            print(f"hook_overhead_ms_vgpu_baseline={med['vgpu_baseline'] - med['none']:.1f}")
            print(f"ab_plain_ms={med['plain'] - med['plain_baseline']:.1f}")
            print(f"ab_vgpu_ms={med['vgpu'] - med['vgpu_baseline']:.1f}")

        # Where the time of one no-token invocation goes (median of 20 each).
        py = hook_py
        bundle = bundles["plain_python"]
        st = f'{{"ociVersion":"1.0.2","id":"x","pid":1,"status":"creating","bundle":"{bundle}"}}'.encode()
        n = 20
        print(f"python_startup_ms_isolated={_median_of(n, [py, '-I', '-S', '-c', 'pass']):.1f}")
        print(f"python_startup_ms_site={_median_of(n, [py, '-c', 'pass']):.1f}")
        args = support.hook_args("prestart", state_dir=state, library=lib, log_dir=tmp / "log", python=py)
        print(f"hook_prestart_notoken_ms_fastpath={_median_of(n, args, st):.1f}")
        entry = shutil.which("vgpu-hook", path=os.path.dirname(sys.executable)) or ""
        if entry:
            print(f"hook_prestart_notoken_ms_entry_point={_median_of(n, [entry, *args[4:]], st):.1f}")
        print(f"hook_poststop_notoken_ms_fastpath={_median_of(n, [*args[:-1], 'poststop'], st):.1f}")
        filt = installed["prestart"][0]["args"]
        print(f"hook_prestart_notoken_ms_shell_filter={_median_of(n, filt, st):.1f}")
        me = sys.executable  # msgspec is installed for this one
        imp = [me, "-I", "-S", "-c", f"import sys; sys.path.append({str(_site_packages())!r}); import msgspec"]
        print(f"msgspec_import_ms={_median_of(n, imp) - _median_of(n, [me, '-I', '-S', '-c', 'pass']):.1f}")
        ok = plain <= TARGET_PLAIN_MS and vgpu <= TARGET_VGPU_MS
        print(
            f"summary: installed hook overhead on runc run (median of {runs}): plain {plain:.1f} ms "
            f"(target <= {TARGET_PLAIN_MS:.0f}), vgpu {vgpu:.1f} ms (target <= {TARGET_VGPU_MS:.0f}), "
            f"no-hook runc run {med['none']:.1f} ms: {'OK' if ok else 'ABOVE TARGET'}"
            + (
                f"; against {baseline}: vgpu {med['vgpu'] - med['vgpu_baseline']:+.1f} ms, "
                f"plain {med['plain'] - med['plain_baseline']:+.1f} ms"
                if baseline
                else ""
            )
        )
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
