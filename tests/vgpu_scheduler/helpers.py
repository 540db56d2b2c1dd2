"""Builders shared by the scheduler tests: inventories, nodes, pods, a running scheduler (in this
process, or the real program: start_process)."""

from __future__ import annotations

import http.client
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.kubeapi import KubeAPI, node_object, pod_object
from tests.support.inventory import inventory
from vgpu import scheduling as sc
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import Kube
from vgpu_scheduler.server import Service, make_server, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MiB = 1 << 20


def gpu_node(name: str, **kw: Any) -> dict[str, Any]:
    inv = inventory(name, **kw)
    return node_object(name, {sc.INVENTORY_ANNOTATION: sc.encode(inv)}, gpus=len(inv.gpus) * inv.split_count)


def vgpu_pod(name: str, gpu: int = 1, mem: int | None = None, cores: int | None = None, **kw: Any) -> dict[str, Any]:
    lim = {"nvidia.com/gpu": str(gpu)}
    if mem is not None:
        lim["nvidia.com/gpumem"] = str(mem)
    if cores is not None:
        lim["nvidia.com/gpucores"] = str(cores)
    kw.setdefault("scheduler", "vgpu-scheduler")
    return pod_object(name, [("main", lim)], **kw)


def decision_of(api: KubeAPI, name: str, ns: str = "default") -> sc.Decision | None:
    text = api.get("pods", name, ns)["metadata"].get("annotations", {}).get(sc.DECISION_ANNOTATION)
    return sc.decode_decision(text) if text else None


def api_usage(api: KubeAPI) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per node and GPU (memory, cores, slots) recomputed from the API's pods and the nodes'
    published usage (the truth)."""
    from vgpu_scheduler import snapshot

    recs = [snapshot.pod_rec(p) for p in api.objects("pods")]
    nodes = [snapshot.node_info(n) for n in api.objects("nodes")]
    return _plain(snapshot.usage_of(recs, nodes))


def _plain(usage: Any) -> dict[str, dict[str, tuple[int, int, int]]]:
    out = {
        n: {u: (x.memory, x.cores, x.slots) for u, x in g.items() if x.slots or x.memory or x.cores}
        for n, g in usage.items()
    }
    return {n: g for n, g in out.items() if g}


def state_usage(svc: Service) -> dict[str, dict[str, tuple[int, int, int]]]:
    return _plain(svc.state.usage_copy())


@dataclass
class Running:
    service: Service
    url: str
    servers: list[Any] = field(default_factory=list)

    def stop(self, release: bool = True) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()
        self.service.stop(release)


@contextmanager
def running_scheduler(api: KubeAPI, cfg: SchedulerConfig | None = None, **tls: Any) -> Iterator[Running]:
    r = start_scheduler(api, cfg, True, **tls)
    try:
        yield r
    finally:
        r.stop()


def start_scheduler(api: KubeAPI, cfg: SchedulerConfig | None = None, wait: bool = True, **tls: Any) -> Running:
    cfg = cfg or SchedulerConfig()
    svc = Service(cfg, Kube(api.api_client(), cfg.api_timeout_s))
    srv = make_server(svc, "127.0.0.1", 0, tls.get("cert_file", ""), tls.get("key_file", ""))
    serve_in_thread(srv)
    svc.start()
    if wait:
        assert svc.state.ready.wait(10), "scheduler state never synced"
    scheme = "https" if tls.get("cert_file") else "http"
    return Running(svc, f"{scheme}://127.0.0.1:{srv.server_address[1]}", [srv])


def start_process(kc: Path, *args: str) -> tuple[subprocess.Popen[str], int]:
    """`python -m vgpu_scheduler` (the real program) on a free port; (process, port)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vgpu_scheduler", "--bind", "127.0.0.1:0", "--kubeconfig", str(kc), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise AssertionError(line + (proc.stderr.read() if proc.stderr else ""))
    return proc, int(line.rsplit(":", 1)[1])


def stop_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def send_raw(port: int, data: bytes, ctx: ssl.SSLContext | None) -> tuple[int, dict[str, str], bytes]:
    """Send these bytes as they are (TLS when ctx) and read one HTTP response."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    with sock:
        conn = ctx.wrap_socket(sock, server_hostname="127.0.0.1") if ctx else sock
        conn.sendall(data)
        resp = http.client.HTTPResponse(conn)
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
