"""Fixtures of the device plugin suite.

- `kubelet`: a started FakeKubelet under tmp_path (sim/kubelet.py).
- `inproc`: a factory running `device_plugin.daemon.Daemon` in a thread over
  synthetic GPUs (real gRPC, real unix sockets; no NVML).
- `PluginProcess`: the real `vgpu-device-plugin` as a subprocess (NVML from sim/fakegpu).
- `apiserver`: a local HTTP stand-in of the Kubernetes API server, with $KUBECONFIG pointing at it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from device_plugin.daemon import Daemon
from sim.kubeapi import KubeAPI, node_object, pod_object, use_kubeconfig
from sim.kubelet import FakeKubelet
from vgpu import scheduling
from vgpu.config import DevicePluginConfig
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths
from vgpu.scheduling import ContainerDecision, Decision, GPUAssignment

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def synthetic_gpus(n: int = 2, mem: int = 16 * GiB) -> list[GPUInfo]:
    return [
        GPUInfo(i, f"GPU-{i:08x}-abcd-ef01-2345-6789abcdef01", "Fake H100", mem, f"0000:{i + 1:02x}:00.0", i % 2)
        for i in range(n)
    ]


# ---- one node in the Kubernetes API stand-in, and pods the scheduler placed there ----

NODE = "node-a"
GPUS = synthetic_gpus(2, 16 * GiB)
U0, U1 = GPUS[0].uuid, GPUS[1].uuid


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeAPI]:
    with KubeAPI() as a:
        a.create("nodes", node_object(NODE, gpus=8))
        use_kubeconfig(monkeypatch, a.write_kubeconfig(tmp_path / "kubeconfig"))
        yield a


def add_pod(
    api: KubeAPI,
    name: str,
    containers: list[tuple[str, bool, list[tuple[str, int, int]]]],
    bind_time: float = 1000.0,
    node: str = NODE,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod placed by the scheduler: decision (for `node`), bind-phase=allocating, bound to NODE."""
    d = Decision(
        node=node,
        time=bind_time - 1,
        containers=[
            ContainerDecision(name=n, init=i, gpus=[GPUAssignment(uuid=u, memory=m, cores=c) for u, m, c in g])
            for n, i, g in containers
        ],
    )
    ann = {
        scheduling.DECISION_ANNOTATION: scheduling.encode(d),
        scheduling.BIND_PHASE_ANNOTATION: scheduling.PHASE_ALLOCATING,
        scheduling.BIND_TIME_ANNOTATION: str(int(bind_time)),
        **(extra or {}),
    }
    obj = pod_object(
        name,
        [(n, {"nvidia.com/gpu": str(len(g))}) for n, i, g in containers if not i],
        init=[(n, {"nvidia.com/gpu": str(len(g))}) for n, i, g in containers if i] or None,
        annotations=ann,
    )
    api.create("pods", obj)
    api.bind(name, "default", NODE)
    return api.get("pods", name, "default")


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(tmp_path / "kubelet")
    k.start()
    try:
        yield k
    finally:
        k.stop()


@dataclass
class InProc:
    daemon: Daemon
    thread: threading.Thread
    state: Paths

    def stop(self) -> None:
        self.daemon.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[Callable[..., InProc]]:
    running: list[InProc] = []

    def start(gpus: list[GPUInfo] | None = None, **cfg: Any) -> InProc:
        cfg.setdefault("kubelet_dir", str(tmp_path / "kubelet"))
        conf = DevicePluginConfig(**cfg)
        state = Paths(str(tmp_path / "state"))
        d = Daemon(conf, state, gpus if gpus is not None else synthetic_gpus(), nvml_health=False)
        t = threading.Thread(target=d.run, name="plugin", daemon=True)
        t.start()
        p = InProc(d, t, state)
        running.append(p)
        return p

    yield start
    for p in running:
        if p.thread.is_alive():
            p.stop()


@dataclass
class PluginProcess:
    """`python -m device_plugin` with the given flags and environment."""

    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def start(self) -> PluginProcess:
        self._log = open(self.log_path, "ab")
        env = {**os.environ, **self.env, **self.extra}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "device_plugin", *self.args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        return rc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def run_cli(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "device_plugin", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class APIServer(BaseHTTPRequestHandler):
    """A tiny API server stand-in: records PATCHes of Nodes (path, content type, body, auth); a
    PATCH of the status subresource answers the status it was given."""

    patches: list[tuple[str, str, dict, str]] = []
    status = 200

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).patches.append(
            (self.path, self.headers.get("Content-Type", ""), body, self.headers.get("Authorization", ""))
        )
        name = self.path.rsplit("/", 1)[-1]
        if self.status != 200:
            out = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": self.status}).encode()
        else:
            name = self.path.split("/")[4]
            meta = {"name": name, **(body.get("metadata") or {})}
            out = json.dumps({"kind": "Node", "apiVersion": "v1", "metadata": meta, **body}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def apiserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[APIServer]]:
    handler = type("Handler", (APIServer,), {"patches": [], "status": 200})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{srv.server_address[1]}"}}],
                "users": [{"name": "u", "user": {"token": "test-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    use_kubeconfig(monkeypatch, kubeconfig)
    yield handler
    srv.shutdown()
    srv.server_close()
