"""Helpers for the libvgpu.so tests: a simulated node (sim/fakegpu) seen
through the library, driven with the C test programs in build/intercept/.

Everything goes through the documented process-level contracts only:
`LD_LIBRARY_PATH=build/fakegpu`, `FAKEGPU_CONFIG`, `FAKEGPU_STATE`,
`fakegpu-ctl dump`, and the library's `VGPU_LIMITS_FILE` /
`VGPU_REGION_FILE` / `VGPU_LOG_LEVEL`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
FAKE = BUILD / "fakegpu"
UUID0 = "GPU-fa6e0000-0000-4000-8000-000000000100"
UUID1 = "GPU-fa6e0000-0000-4000-8000-000000000101"
MiB = 1 << 20
GiB = 1 << 30


def have_fake() -> bool:
    return (FAKE / "libcuda.so.1").exists() and (FAKE / "fakegpu-ctl").exists()


def asan_runtime() -> str | None:
    """Path of the ASan runtime matching the compiler, if installed."""
    cc = os.environ.get("CC", "cc")
    try:
        out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    p = out.strip()
    return os.path.realpath(p) if p and os.path.isabs(p) and os.path.exists(p) else None


def parse_lines(out: str) -> list[dict[str, str]]:
    """'name k=v k=v' lines -> [{'_': name, k: v}]"""
    rows = []
    for ln in out.splitlines():
        parts = ln.split()
        if not parts or "=" in parts[0]:
            continue
        row = {"_": parts[0]}
        for p in parts[1:]:
            if "=" in p:
                k, v = p.split("=", 1)
                row[k] = v
        rows.append(row)
    return rows


@dataclass
class Run:
    rc: int
    out: str
    err: str
    rows: list[dict[str, str]] = field(default_factory=list)

    def all(self, name: str) -> list[dict[str, str]]:
        return [r for r in self.rows if r["_"] == name]

    def one(self, name: str, i: int = 0) -> dict[str, str]:
        rows = self.all(name)
        assert len(rows) > i, f"no {name!r} line #{i} in output:\n{self.out}\nstderr:\n{self.err}"
        return rows[i]


class Node:
    """One simulated node + one container's limits/region files."""

    def __init__(self, tmp: Path, flavour: str = "plain", devices: str = "") -> None:
        self.tmp = tmp
        self.flavour = flavour
        self.state = tmp / "fakegpu.state"
        self.config = tmp / "fakegpu.conf"
        self.limits = tmp / "limits"
        self.region = tmp / "region"
        # context_overhead 0 by default so "used" in the simulator is exactly
        # what the programs allocated; tests about it set their own config
        self.write_config(devices or "[device]\ncontext_overhead = 0\n[device]\ncontext_overhead = 0\n")

    # ---- configuration
    def write_config(self, text: str) -> None:
        self.config.write_text(text)
        if self.state.exists():
            self.state.unlink()

    def write_limits(self, *lines: str, header: str = "vgpu-limits 1") -> None:
        self.limits.write_text("\n".join([header, *lines]) + "\n")

    def limit(
        self, nbytes: int, oversub: bool = False, uuid: str = UUID0, pct: int = 50, device: int | None = None
    ) -> None:
        """One device line; `device`: the physical share (default: the whole slice), which makes
        a version-2 file (version 1 otherwise, as files written before the share existed)."""
        if device is None and not oversub:
            self.write_limits(f"{uuid} {nbytes} {pct} 0")
        else:
            dev = nbytes if device is None else device
            self.write_limits(f"{uuid} {nbytes} {pct} {1 if oversub else 0} {dev}", header="vgpu-limits 2")

    # ---- environment
    def env(self, preload: bool = True, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "FAKEGPU_", "LD_", "ASAN", "UBSAN"))}
        env.update(
            FAKEGPU_STATE=str(self.state),
            FAKEGPU_CONFIG=str(self.config),
            LD_LIBRARY_PATH=str(FAKE),
            VGPU_LIMITS_FILE=str(self.limits),
            VGPU_REGION_FILE=str(self.region),
        )
        if preload:
            env["LD_PRELOAD"] = self.preload()
        if self.flavour == "asan":
            # any ASan/UBSan report fails the run with exit status 99
            env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:exitcode=99:verify_asan_link_order=0"
            env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=99"
        if extra:
            env.update(extra)
        return env

    def preload(self) -> str:
        if self.flavour == "asan":
            rt = asan_runtime()
            assert rt, "ASan runtime not found"
            return f"{rt}:{BUILD / 'intercept' / 'libvgpu-asan.so'}"
        return str(BUILD / "libvgpu.so")

    # ---- running
    def cutest(
        self,
        mode: str,
        *cmds: object,
        preload: bool = True,
        env: dict[str, str] | None = None,
        timeout: float = 60,
        linked: bool | None = None,
    ) -> Run:
        prog = "link_cutest" if (linked or mode in ("link", "gpa-linked")) else "cutest"
        argv = [str(BUILD / "intercept" / prog), mode, *[str(c) for c in cmds]]
        p = subprocess.run(
            argv, env=self.env(preload, env), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        r = Run(p.returncode, p.stdout, p.stderr, parse_lines(p.stdout))
        if self.flavour == "asan":
            assert p.returncode != 99 and "Sanitizer" not in p.stderr and "runtime error" not in p.stderr, p.stderr
        return r

    def popen(self, mode: str, *cmds: object, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        prog = "link_cutest" if mode in ("link", "gpa-linked") else "cutest"
        argv = [str(BUILD / "intercept" / prog), mode, *[str(c) for c in cmds]]
        return subprocess.Popen(
            argv,
            env=self.env(True, env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def paths(self, *cmds: object, preload: bool = True, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
        """build/intercept/paths (graphs, pools, host memory, sharing) in cudart's lookup mode."""
        argv = [str(BUILD / "intercept" / "paths"), "gpa", *[str(c) for c in cmds]]
        p = subprocess.run(
            argv, env=self.env(preload, env), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        r = Run(p.returncode, p.stdout, p.stderr, parse_lines(p.stdout))
        if self.flavour == "asan":
            assert p.returncode != 99 and "Sanitizer" not in p.stderr and "runtime error" not in p.stderr, p.stderr
        return r

    def paths_popen(self, *cmds: object, preload: bool = True) -> subprocess.Popen[str]:
        argv = [str(BUILD / "intercept" / "paths"), "gpa", *[str(c) for c in cmds]]
        return subprocess.Popen(
            argv,
            env=self.env(preload),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def high(self, reset: bool = False) -> dict:
        """The simulated GPU's own high-water marks of device memory (fakegpu-ctl high)."""
        p = subprocess.run(
            [str(FAKE / "fakegpu-ctl"), "high", *(["--reset"] if reset else [])],
            env=self.env(False),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return json.loads(p.stdout)["devices"][0]

    def dump(self) -> dict:
        p = subprocess.run(
            [str(FAKE / "fakegpu-ctl"), "dump"],
            env=self.env(False),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return json.loads(p.stdout)

    def used(self, dev: int = 0) -> int:
        return int(self.dump()["devices"][dev]["used"])


def cc() -> str:
    return os.environ.get("CC") or shutil.which("cc") or "gcc"
