"""Test helpers: processes that are always cleaned up (SIGCONT + SIGKILL), state dirs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from monitor.procs import ProcKey, key_of, read_stat
from tests.support.poll import poll
from vgpu import limits as vlimits
from vgpu import region as vregion
from vgpu import schemas


class Procs:
    """Spawns processes and guarantees none survives the test, stopped or not."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []

    def spawn(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(list(argv), **kw)
        self.procs.append(p)
        return p

    def adopt(self, pid: int) -> None:
        self.pids.append(pid)

    def cleanup(self) -> None:
        pids = [p.pid for p in self.procs if p.poll() is None] + self.pids
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def state(pid: int) -> str:
    st = read_stat(pid)
    return st.state if st else "-"


def key(pid: int) -> ProcKey:
    k = key_of(pid)
    assert k is not None, pid
    return k


def make_container(
    state_dir: Path,
    cid: str,
    init_pid: int,
    gpus: list[tuple[str, int, int]] | list[tuple[str, int, int, int]],
    *,
    pod: str = "",
    namespace: str = "default",
    container: str = "main",
    cgroup_path: str = "",
    region: bool = True,
) -> Path:
    """A per-container state dir as the hook makes it: limits, region, metadata.json.

    gpus: (uuid, memory_limit, core_percent) or (uuid, memory_limit, core_percent, device_limit): with
    a device limit (physical share) below the limit, the slice oversubscribes."""
    d = state_dir / "containers" / cid
    d.mkdir(parents=True, exist_ok=True)
    lims = [
        vlimits.DeviceLimit(
            uuid=g[0], memory_limit=g[1], core_percent=g[2], oversubscribe=g[-1] < g[1], device_limit=g[-1]
        )
        if len(g) == 4
        else vlimits.DeviceLimit(uuid=g[0], memory_limit=g[1], core_percent=g[2], oversubscribe=False)
        for g in gpus
    ]
    (d / "limits").write_text(vlimits.render(lims))
    if region:
        vregion.initialise(str(d / "region"), lims)
    st = read_stat(init_pid)
    meta = schemas.ContainerMetadata(
        container_id=cid,
        init_pid=init_pid,
        init_start_time=st.start_time if st else 0,
        created=time.time(),
        token="0" * 32,
        pod_namespace=namespace,
        pod_name=pod or f"pod-{cid}",
        container_name=container,
        cgroup_path=cgroup_path,
        gpus=[schemas.AllocatedGPU(uuid=g[0], memory_limit=g[1], core_percent=g[2]) for g in gpus],
    )
    schemas.write_atomic(str(d / "metadata.json"), schemas.encode(meta))
    return d


class ScriptedSource:
    """A stand-in for NvmlSource with a crude plant: each listed process that is not
    stopped (state T) gets an equal slice of its GPU; memory is whatever the test sets.
    `down` makes a GPU fail like a lost device."""

    def __init__(self, gpus: dict[str, dict[int, int]], total: int = 16 << 30) -> None:
        self.gpus = gpus  # uuid -> {pid: used bytes}
        self.total = total
        self.down: set[str] = set()
        self.idle: set[int] = set()  # listed with a context, but launching nothing (no samples)
        self.errors = 0
        self.calls = 0

    def observe(self) -> list:
        from monitor.observe import GpuObs, UtilSample

        self.calls += 1
        ts = int(time.monotonic() * 1e6)
        out = []
        for i, (uuid, pids) in enumerate(sorted(self.gpus.items())):
            if uuid in self.down:
                self.errors += 1
                out.append(GpuObs(index=i, uuid=uuid, up=False, error="GPU is lost"))
                continue
            live = {p: b for p, b in pids.items() if state(p) not in ("-", "Z", "X")}
            running = [p for p in live if state(p) != "T" and p not in self.idle]
            share = 100 // max(1, len(running))
            out.append(
                GpuObs(
                    index=i,
                    uuid=uuid,
                    name="Scripted GPU",
                    memory_total=self.total,
                    memory_used=sum(live.values()),
                    util=100 if running else 0,
                    procs=dict(live),
                    samples=[UtilSample(pid=p, ts=ts, sm=share) for p in running],
                )
            )
        return out

    def close(self) -> None:
        pass


class Gated:
    """A workload whose pid and start time exist before it runs: `sh` waits for a line on
    stdin, then execs the workload (same pid, same start time).  Lets a test create the
    container's state directory (init_pid = this pid) before the workload touches the GPU."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], procs: Procs | None = None, **kw) -> None:
        script = 'read _go; exec "$@"'
        kw.setdefault("stdout", subprocess.DEVNULL)
        full = ["sh", "-c", script, "sh", *argv]
        if procs is not None:
            self.proc = procs.spawn(full, stdin=subprocess.PIPE, env=env, **kw)
        else:
            self.proc = subprocess.Popen(full, stdin=subprocess.PIPE, env=env, **kw)
        self.pid = self.proc.pid
        self.released_at: float | None = None

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        self.proc.stdin.close()
        self.released_at = time.monotonic()

    def kill(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(self.pid, sig)
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def exec_ns(gpu_state: dict, device: int = 0) -> dict[int, int]:
    """Executed kernel time per host pid on a device, from FakeGPU.state()."""
    out: dict[int, int] = {}
    for p in gpu_state.get("processes", []):
        for d in p.get("devices", []):
            if d.get("index") == device:
                out[int(p["host_pid"])] = out.get(int(p["host_pid"]), 0) + int(d.get("exec_ns", 0))
    return out


class MonitorProc:
    """`vgpu-monitor` as a real subprocess (python -m monitor) on a simulated node."""

    def __init__(self, state_dir: Path, env: dict[str, str], *args: str, procs: Procs | None = None) -> None:
        import sys

        self.state_dir = Path(state_dir)
        self.status_path = self.state_dir / "monitor" / "status.json"
        argv = [sys.executable, "-m", "monitor", "--state-dir", str(state_dir), "--metrics-address", "127.0.0.1"]
        if not any(a.startswith("--metrics-port") for a in args):
            argv += ["--metrics-port", "0"]
        env = dict(env)
        env.pop("VGPU_CONFIG", None)
        env["VGPU_CONFIG"] = str(self.state_dir / "no-config.toml")  # defaults + flags only
        self.proc = (procs.spawn if procs else subprocess.Popen)([*argv, *args], env=env)  # type: ignore[operator]
        self.pid = self.proc.pid

    def status(self) -> dict | None:
        import json

        try:
            data = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("pid") == self.pid else None

    def wait_ready(self, timeout: float = 30.0) -> dict:
        assert poll(lambda: (self.status() or {}).get("guardian_armed") or self.proc.poll() is not None, timeout)
        st = self.status()
        assert st is not None and self.proc.poll() is None, "monitor did not start"
        return st

    def guardian_pid(self) -> int | None:
        for line in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split():
            return int(line)
        return None

    def scrape(self) -> str:
        import urllib.request

        st = self.status() or {}
        with urllib.request.urlopen(f"http://127.0.0.1:{st['metrics_port']}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of `name` in a Prometheus text scrape with these labels."""
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


class Monitors:
    """The monitors a test starts on one state dir, each ready and its guardian adopted by
    `procs` (so that teardown kills it by the PID we know); `stop_all` at teardown."""

    def __init__(self, state_dir: Path, env: dict[str, str], procs: Procs) -> None:
        self.state_dir, self.env, self.procs = state_dir, env, procs
        self.started: list[MonitorProc] = []

    def start(self, *flags: str) -> MonitorProc:
        m = MonitorProc(self.state_dir, self.env, *flags, procs=self.procs)
        m.wait_ready()
        g = m.guardian_pid()
        if g:
            self.procs.adopt(g)
        self.started.append(m)
        return m

    def stop_all(self) -> None:
        for m in self.started:
            m.stop()
