#!/usr/bin/env python3
"""make bench-scheduler: vgpu-scheduler on a simulated cluster, through the API stand-in.

100 nodes x 8 GPUs (80 GiB, split 10) as Node objects with v2 inventories in the API stand-in
(tests/support/kubeapi.py); 5,000 pods with a fixed-seed mix of nvidia.com/gpu (1 or 2),
gpumem and gpucores. The scheduler runs in this process (its HTTP server, its watches) and
each pod goes through POST /filter (all 100 node names, as a nodeCacheCapable extender gets
them) and POST /bind over keep-alive HTTP, one scheduling cycle after the other as
kube-scheduler runs them, binds on BENCH_BIND_THREADS threads (default 1: with one GIL more binding
threads only slow the filters down). The API stand-in runs in a child process. Prints:

  filter_p99_ms, filter_p50_ms   /filter round trip, decision patch to the API included
  pods_per_s                     pods scheduled (filter + bind, Binding created) per second
  packing_ratio                  GPUs used by an offline first-fit-decreasing placement of the
                                 same pods (largest memory first, same fit rules) / GPUs used
                                 by the online binpack run (1.0: as tight as FFD)
  spread_stddev_pct              standard deviation over all GPUs of memory used (% of the
                                 GPU) after the same pods under node and GPU policy spread
  drift_bytes                    after a scheduler restart and 500 random pod deletions: the
                                 scheduler's accounting vs the usage recomputed from the pods'
                                 decision annotations (must be 0)
  unplaced                       pods no node could take in the binpack run
  gpus_lower_bound               total memory, cores and slots asked over one GPU's, rounded up:
                                 no placement uses fewer GPUs (packing_vs_lower_bound = it / binpack's)

and a summary line with the targets (filter p99 <= 20 ms, >= 50 pods/s, packing >= 0.95,
drift 0). Exit status 0 even when a target is missed. BENCH_PODS and BENCH_SEED change the run.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.kubeapi import node_object, pod_object  # noqa: E402
from vgpu import scheduling as sc  # noqa: E402
from vgpu_scheduler import fit, snapshot  # noqa: E402
from vgpu_scheduler.config import SchedulerConfig  # noqa: E402
from vgpu_scheduler.kube import Kube  # noqa: E402
from vgpu_scheduler.requests import container_requests, pod_options  # noqa: E402
from vgpu_scheduler.server import Service, make_server, serve_in_thread  # noqa: E402

GiB = 1 << 30
NODES, GPUS, MEM_GIB, SPLIT = 100, 8, 80, 10
PODS = int(os.environ.get("BENCH_PODS", "5000"))
SEED = int(os.environ.get("BENCH_SEED", "20261202"))
DELETIONS = 500
BIND_THREADS = int(os.environ.get("BENCH_BIND_THREADS", "1"))
MEM_MIX = [(1024, 10), (2048, 15), (4096, 25), (8192, 25), (10240, 10), (16384, 8), (20480, 5), (40960, 2)]
CORES_MIX = [(5, 30), (10, 35), (15, 15), (20, 12), (30, 8)]


def inventory(node: str) -> str:
    gpus = [
        sc.InventoryGPU(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model="NVIDIA A100-SXM4-80GB",
            memory=MEM_GIB * GiB,
            memory_schedulable=MEM_GIB * GiB,
            cores=100,
            split_count=SPLIT,
            numa=i // 4,
        )
        for i in range(GPUS)
    ]
    return sc.encode(sc.NodeInventory(split_count=SPLIT, heartbeat=time.time() + 3600, gpus=gpus))


def pod_mix(rng: random.Random) -> list[dict[str, Any]]:
    mems = [m for m, w in MEM_MIX for _ in range(w)]
    cores = [c for c, w in CORES_MIX for _ in range(w)]
    out = []
    for i in range(PODS):
        lim = {"nvidia.com/gpu": "2" if rng.random() < 0.05 else "1", "nvidia.com/gpumem": str(rng.choice(mems))}
        lim["nvidia.com/gpucores"] = str(rng.choice(cores))
        out.append(pod_object(f"bench-{i:05d}", [("main", lim)], scheduler="vgpu-scheduler"))
    return out


def cluster(api: RemoteAPI) -> None:
    for n in range(NODES):
        name = f"node-{n:03d}"
        api.create("nodes", node_object(name, {sc.INVENTORY_ANNOTATION: inventory(name)}, gpus=GPUS * SPLIT))


class RemoteAPI:
    """The API stand-in in a child process (`python -m tests.support.kubeapi`): its own GIL, as an API server."""

    def __init__(self, history: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.kubeapi", "--history", str(history)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            raise SystemExit(f"kubeapi did not start: {line!r}")
        self.url = line.split("serving on ")[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        if not hasattr(self._local, "conn"):
            self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        return self._local.conn

    def call(self, method: str, path: str, body: Any = None) -> Any:
        c = self._conn()
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        r = c.getresponse()
        out = json.loads(r.read())
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {out.get('message')}")
        return out

    def create(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        if plural == "nodes":
            return self.call("POST", "/api/v1/nodes", obj)  # type: ignore[no-any-return]
        return self.call("POST", "/api/v1/namespaces/default/pods", obj)  # type: ignore[no-any-return]

    def objects(self, plural: str) -> list[dict[str, Any]]:
        return self.call("GET", f"/api/v1/{plural}")["items"]  # type: ignore[no-any-return]

    def api_client(self) -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def __enter__(self) -> RemoteAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Client:
    """Keep-alive JSON POSTs to the extender, one connection per thread."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: Any) -> Any:
        data = json.dumps(body).encode()
        self.conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        return json.loads(r.read())


def start(api: RemoteAPI, cfg: SchedulerConfig) -> tuple[Service, Any]:
    svc = Service(cfg, Kube(api.api_client(), 30))
    srv = make_server(svc, "127.0.0.1", 0)
    serve_in_thread(srv)
    svc.start()
    if not svc.state.ready.wait(60):
        raise SystemExit("scheduler state never synced")
    return svc, srv


def memory_stddev_pct(usage: snapshot.Usage) -> float:
    pcts = [
        100 * usage.get(f"node-{n:03d}", {}).get(f"GPU-node-{n:03d}-{i}", snapshot.Use()).memory / (MEM_GIB * GiB)
        for n in range(NODES)
        for i in range(GPUS)
    ]
    return statistics.pstdev(pcts)


def schedule(
    api: RemoteAPI, cfg: SchedulerConfig, pods: list[dict[str, Any]]
) -> tuple[Service, Any, list[float], float, int]:
    svc, srv = start(api, cfg)
    port = srv.server_address[1]
    names = [f"node-{n:03d}" for n in range(NODES)]
    filt = Client(port)
    local = threading.local()
    lat: list[float] = []
    unplaced = 0
    created = [api.create("pods", p) for p in pods]
    errors: list[str] = []

    def bind(i: int, pod: dict[str, Any], node: str) -> None:
        m = pod["metadata"]
        if not hasattr(local, "client"):
            local.client = Client(port)
        out = local.client.post(
            "/bind", {"PodName": m["name"], "PodNamespace": "default", "PodUID": m["uid"], "Node": node}
        )
        if out.get("Error"):
            errors.append(out["Error"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(BIND_THREADS) as pool:
        futs = []
        for i, pod in enumerate(created):
            t = time.perf_counter()
            out = filt.post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
            lat.append((time.perf_counter() - t) * 1000)
            if out.get("Error"):
                errors.append(out["Error"])
                continue
            if not out.get("NodeNames"):
                unplaced += 1
                continue
            futs.append(pool.submit(bind, i, pod, out["NodeNames"][0]))
        for f in futs:
            f.result()
    wall = time.perf_counter() - t0
    if errors:
        print(f"# {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    return svc, srv, lat, wall, unplaced


def stop(svc: Service, srv: Any) -> None:
    srv.shutdown()
    srv.server_close()
    svc.stop()


def gpus_used(usage: snapshot.Usage) -> int:
    return sum(1 for g in usage.values() for u in g.values() if u.slots > 0)


def ffd_gpus(pods: list[dict[str, Any]], cfg: SchedulerConfig) -> tuple[int, int]:
    """Offline first-fit-decreasing: largest memory x GPU count first, first node that fits (same rules)."""
    now = time.time()
    views = [
        snapshot.node_view(
            snapshot.node_info(
                node_object(f"node-{n:03d}", {sc.INVENTORY_ANNOTATION: inventory(f"node-{n:03d}")}, GPUS * SPLIT)
            ),
            now,
            cfg.stale_after_s,
        )
        for n in range(NODES)
    ]
    reqs = [container_requests(p) for p in pods]
    order = sorted(range(len(pods)), key=lambda i: -(reqs[i][0].count * (reqs[i][0].mem_mib or 0)))
    opts = pod_options({}, "binpack", "binpack")
    usage: snapshot.Usage = {}
    unplaced = 0
    for i in order:
        for v in views:
            r = fit.fit_node(v, usage.get(v.name, {}), reqs[i], opts, cfg)
            if isinstance(r, fit.Placement):
                snapshot.add_pod(
                    usage,
                    snapshot.PodRec(
                        str(i), "", "", "", "Pending", False, sc.Decision(node=v.name, time=0, containers=r.containers)
                    ),
                )
                break
        else:
            unplaced += 1
    return gpus_used(usage), unplaced


def lower_bound_gpus(pods: list[dict[str, Any]]) -> int:
    """GPUs no placement can do without: total memory, cores and slots over one GPU's, rounded up."""
    mem = cores = slots = 0
    for pod in pods:
        for r in container_requests(pod):
            mem += r.count * (r.mem_mib or 0) * (1 << 20)
            cores += r.count * (r.cores or 0)
            slots += r.count
    return max(-(-mem // (MEM_GIB * GiB)), -(-cores // 100), -(-slots // SPLIT))


def p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    rng = random.Random(SEED)
    pods = pod_mix(rng)
    binpack = SchedulerConfig(node_policy="binpack", gpu_policy="binpack")
    with RemoteAPI(10 * PODS + 1000) as api:
        cluster(api)
        svc, srv, lat, wall, unplaced = schedule(api, binpack, pods)
        placed = PODS - unplaced
        pods_per_s = placed / wall
        time.sleep(0.5)
        used = gpus_used(svc.state.usage_copy())
        binpack_stddev = memory_stddev_pct(svc.state.usage_copy())
        stop(svc, srv)
        ffd, ffd_unplaced = ffd_gpus(pods, binpack)
        packing = ffd / used if used else 0.0
        # restart, then 500 random deletions through the API while the new scheduler watches
        svc, srv = start(api, binpack)
        from kubernetes import client

        v1 = client.CoreV1Api(api.api_client())
        bound = sorted(p_["metadata"]["name"] for p_ in api.objects("pods") if p_["spec"].get("nodeName"))
        for name in random.Random(SEED + 1).sample(bound, min(DELETIONS, len(bound))):
            v1.delete_namespaced_pod(name, "default", _preload_content=False)
        end = time.monotonic() + 30
        truth: snapshot.Usage = {}
        drift = -1
        while time.monotonic() < end:
            truth = snapshot.usage_of([snapshot.pod_rec(o) for o in api.objects("pods")])
            drift = snapshot.drift_bytes(svc.state.usage_copy(), truth)
            if drift == 0:
                break
            time.sleep(0.2)
        stop(svc, srv)
    spread = SchedulerConfig(node_policy="spread", gpu_policy="spread")
    with RemoteAPI(10 * PODS + 1000) as api:
        cluster(api)
        svc, srv, _lat, _wall, _un = schedule(api, spread, pod_mix(random.Random(SEED)))
        time.sleep(0.5)
        stddev = memory_stddev_pct(svc.state.usage_copy())
        stop(svc, srv)
    p99, p50 = p(lat, 0.99), p(lat, 0.50)
    print(f"nodes={NODES} gpus={NODES * GPUS} pods={PODS} seed={SEED}")
    print(f"filter_p50_ms={p50:.2f}")
    print(f"filter_p99_ms={p99:.2f}")
    print(f"pods_per_s={pods_per_s:.1f}")
    print(f"unplaced={unplaced} ffd_unplaced={ffd_unplaced}")
    lb = lower_bound_gpus(pods)
    print(f"gpus_used_binpack={used} gpus_used_ffd={ffd} gpus_lower_bound={lb} packing_vs_lower_bound={lb / used:.3f}")
    print(f"packing_ratio={packing:.3f}")
    print(f"spread_stddev_pct={stddev:.2f} binpack_stddev_pct={binpack_stddev:.2f}")
    print(f"drift_bytes={drift}")
    ok = p99 <= 20 and pods_per_s >= 50 and packing >= 0.95 and drift == 0
    print(
        f"summary: {'PASS' if ok else 'MISS'} filter_p99_ms={p99:.2f} (<= 20) pods_per_s={pods_per_s:.1f} (>= 50) "
        f"packing_ratio={packing:.3f} (>= 0.95) drift_bytes={drift} (== 0) spread_stddev_pct={stddev:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
