"""Builders shared by the scheduler tests: inventories, nodes, pods, a running scheduler."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sim.kubeapi import KubeAPI, node_object, pod_object
from vgpu import scheduling as sc
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.kube import Kube
from vgpu_scheduler.server import Service, make_server, serve_in_thread

GiB = 1 << 30
MiB = 1 << 20


def uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i:04d}"


def inventory(
    node: str,
    n: int = 4,
    mem_gib: int = 80,
    split: int = 4,
    model: str = "NVIDIA A100-SXM4-80GB",
    numa: list[int] | None = None,
    unhealthy: tuple[int, ...] = (),
    heartbeat: float | None = None,
    scaling: float = 1.0,
) -> sc.NodeInventory:
    gpus = [
        sc.InventoryGPU(
            uuid=uuid(node, i),
            index=i,
            model=model,
            memory=mem_gib * GiB,
            memory_schedulable=int(mem_gib * GiB * scaling),
            cores=100,
            split_count=split,
            numa=(numa[i] if numa else -1),
            health=i not in unhealthy,
        )
        for i in range(n)
    ]
    return sc.NodeInventory(
        split_count=split, memory_scaling=scaling, heartbeat=time.time() if heartbeat is None else heartbeat, gpus=gpus
    )


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


def wait_for(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


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


def post(url: str, body: Any) -> tuple[int, Any]:
    """POST JSON as kube-scheduler or kube-apiserver would; (status, decoded answer), errors too."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
