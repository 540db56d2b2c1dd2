#!/usr/bin/env python3
"""make bench-scheduler: vgpu-scheduler on simulated clusters, through the API stand-in.

Four processes, as in a cluster: the API stand-in (sim/kubeapi.py, with the latency of a
real API server's writes, below), the scheduler (vgpu_scheduler's Service and HTTP server; a
bench-only port reports its accounting for the drift check), and two playing kube-scheduler: this
driver's scheduling loop, one cycle after the other POSTing /filter with every feasible node's
name (nodeCacheCapable; percentageOfNodesToScore 100, the chart's value), and the binding cycles
in a process of their own (kube-scheduler binds in goroutines beside its loop), POSTing /bind on
BENCH_BIND_THREADS threads (default 16).

Write latency: every POST, PUT, PATCH and DELETE the stand-in serves waits a log-normal time with
median BENCH_WRITE_P50_MS (10) and 99th percentile BENCH_WRITE_P99_MS (50): what a real
kube-apiserver with etcd shows (a filter that wrote the decision synchronously took 13/54 ms
p50/p99 against a real API server at 100 nodes, of which the extender's own work was about
3 ms). Reads are not slowed. Setup (nodes, pods) runs before the
latency is switched on.

Cases (each prints its figures with a prefix; BENCH_CASES picks, default "100,5000"):

  100 nodes x 8 GPUs (80 GiB, split 10), 5,000 pods; 5,000 nodes x 8 GPUs, 4,000 pods.
  Mix (fixed seed): 1 or 2 GPUs (5 % ask 2), gpumem 1-40 GiB, gpucores 5-30 %.
  Full usage counted: every 10th node published two slices that no decision names (a pod of
  another scheduler), and while the run goes a device-plugin stand-in publishes each bound pod's
  slice, tagged with its decision, on its Node (at most once a second per node), as
  device_plugin/usage.py does after Allocate.

  filter_p50_ms, filter_p99_ms   /filter round trip (the filter writes nothing)
  bind_p50_ms, bind_p99_ms       /bind round trip (one patch, one Binding)
  pods_per_s                     pods placed (filter and bind done) per second of the run
  writes_per_pod                 POST/PUT/PATCH/DELETE the scheduler sent per placed pod
  sched_cpu_ms_per_pod           the scheduler process's CPU time per placed pod (all its threads:
                                 filter, bind, watches); 1000 / it is its pods/s on one free core
  filter_inside_p50_ms, _p99     the filter verb's own time inside the scheduler (the round trip
                                 less HTTP and waiting for the interpreter)
  gc_pauses_over_5ms             the cyclic GC's collections during the run that took over 5 ms
                                 (wall time: a descheduled process shows here too), [ms, generation]
  preempt_p50_ms, preempt_p99_ms /preempt round trip for 100 higher-priority pods of 24 GiB, each
                                 with 100 candidate nodes and kube-scheduler's proposed victims
  preempt_nodes_helped           candidate nodes answered with victims, per call
  preempt_victims_per_node       victims named per answered node (the exact search's minimum)
  preempt2_*                     the same for pods of 2 GPUs x 40 GiB
  nodes_used, nodes_lower_bound  nodes holding a pod after the run; total memory, cores and slots
                                 asked over one node's, rounded up
  packing_vs_lower_bound         nodes_lower_bound / nodes_used (1.0: as tight as possible)
  sampled_nodes_used             the same pods placed offline by the same fit code, each filter
                                 given only kube-scheduler's default sample (numFeasibleNodesToFind:
                                 50 - nodes/125 %, at least 5 %, from a start that rotates)
  drift_bytes                    after a scheduler restart and 500 random pod deletions: the
                                 scheduler's accounting vs the usage recomputed from the API's
                                 pods and nodes (must be 0)
  unplaced                       pods no node could take

The summary line says PASS when, at 5,000 nodes, filter p99 <= 20 ms, >= 100 pods/s and drift 0
(and at 100 nodes filter p99 <= 20 ms, drift 0). Exit status 0 even when a target is missed.
BENCH_PODS_100, BENCH_PODS_5000 and BENCH_SEED change the run.

With BENCH_KUBECONFIG set it measures a real cluster instead (the nodes are the cluster's, e.g.
simulated ones): it creates BENCH_PODS pods of the same mix with schedulerName BENCH_SCHEDULER
(default vgpu-scheduler; `default-scheduler` with BENCH_GPU_ONLY=1 for kube-scheduler alone) in
namespace BENCH_NAMESPACE (default vgpu-bench), waits until all are bound and prints pods_per_s.
"""

from __future__ import annotations

import http.client
import json
import math
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.kubeapi import node_object, pod_object  # noqa: E402
from tests.support.inventory import inventory as support_inventory  # noqa: E402
from vgpu import scheduling as sc  # noqa: E402
from vgpu_scheduler import fit, snapshot  # noqa: E402
from vgpu_scheduler.config import SchedulerConfig  # noqa: E402
from vgpu_scheduler.requests import container_requests, pod_options  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
GPUS, MEM_GIB, SPLIT = 8, 80, 10
SEED = int(os.environ.get("BENCH_SEED", "20261202"))
BIND_THREADS = int(os.environ.get("BENCH_BIND_THREADS", "16"))
WRITE_P50_MS = float(os.environ.get("BENCH_WRITE_P50_MS", "10"))
WRITE_P99_MS = float(os.environ.get("BENCH_WRITE_P99_MS", "50"))
DELETIONS = 500
MEM_MIX = [(1024, 10), (2048, 15), (4096, 25), (8192, 25), (10240, 10), (16384, 8), (20480, 5), (40960, 2)]
CORES_MIX = [(5, 30), (10, 35), (15, 15), (20, 12), (30, 8)]
Obj = dict[str, Any]


# ----- the cluster -----
def gpu_uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i}"


def inventory(node: str) -> sc.NodeInventory:
    return support_inventory(
        node, GPUS, mem_gib=MEM_GIB, split=SPLIT, numa=[i // 4 for i in range(GPUS)], heartbeat=time.time() + 3600,
        uuids=[gpu_uuid(node, i) for i in range(GPUS)],
    )  # fmt: skip


def node_name(n: int, total: int) -> str:
    return f"node-{n:0{len(str(total - 1))}d}"


def node(n: int, total: int) -> Obj:
    name = node_name(n, total)
    inv = inventory(name)
    ann = {sc.INVENTORY_ANNOTATION: sc.encode(inv)}
    if n % 10 == 0:  # two slices of a pod no decision names (another scheduler's), on GPU 0
        other = [sc.UsedSlice(gpu=gpu_uuid(name, 0), memory=8 * GiB, cores=10) for _ in range(2)]
        ann[sc.USAGE_ANNOTATION] = sc.encode(sc.NodeUsage(time=time.time(), slices=other))
    obj = node_object(name, ann, gpus=GPUS * SPLIT)
    for part in ("capacity", "allocatable"):
        obj["status"][part].update({k: str(v) for k, v in sc.node_capacity(inv).items()})
    return obj


def pod_mix(count: int, rng: random.Random, scheduler: str = "vgpu-scheduler", gpu_only: bool = False) -> list[Obj]:
    mems = [m for m, w in MEM_MIX for _ in range(w)]
    cores = [c for c, w in CORES_MIX for _ in range(w)]
    out = []
    for i in range(count):
        n = 2 if rng.random() < 0.05 else 1
        mem, core = rng.choice(mems), rng.choice(cores)
        lim = {"nvidia.com/gpu": str(n)}
        if not gpu_only:
            lim.update({"nvidia.com/gpumem": str(mem), "nvidia.com/gpucores": str(core)})
            lim.update({k: sc.canonical_quantity(v) for k, v in sc.node_level_requests(n, mem, core).items()})
        out.append(pod_object(f"bench-{i:05d}", [("main", lim)], scheduler=scheduler))
    return out


# ----- the API stand-in with a real API server's write latency (child process) -----
def serve_api(flag: str, history: int) -> None:
    from sim import kubeapi

    sigma = math.log(WRITE_P99_MS / WRITE_P50_MS) / 2.326
    rng = random.Random(SEED)
    lock = threading.Lock()
    real = kubeapi._Handler._handle

    def handle(self: Any, method: str) -> None:
        if method != "GET" and os.path.exists(flag):
            with lock:
                wait = rng.lognormvariate(math.log(WRITE_P50_MS / 1000), sigma)
            time.sleep(wait)  # concurrent writes wait concurrently, as etcd batches them
        real(self, method)

    kubeapi._Handler._handle = handle  # type: ignore[method-assign]
    api = kubeapi.KubeAPI(history=history).start()
    print(f"kubeapi: serving on {api.url}", flush=True)
    threading.Event().wait()


class APIConn:
    """Keep-alive JSON calls to the API stand-in, one connection per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._local = threading.local()

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        if not hasattr(self._local, "conn"):
            self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c = self._local.conn
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, data, {"Content-Type": ctype} if data else {})
        r = c.getresponse()
        out = json.loads(r.read())
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {out.get('message')}")
        return out


class RemoteAPI:
    def __init__(self, history: int, workdir: Path) -> None:
        self.flag = workdir / "latency-on"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "api", str(self.flag), str(history)],
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
        self.kubeconfig = workdir / "kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "b", "cluster": {"server": self.url}}],
                    "users": [{"name": "b", "user": {"token": "bench"}}],
                    "contexts": [{"name": "b", "context": {"cluster": "b", "user": "b"}}],
                    "current-context": "b",
                }
            )
        )
        self.conn = APIConn(self.port)

    def latency(self, on: bool) -> None:
        if on:
            self.flag.write_text("on")
        elif self.flag.exists():
            self.flag.unlink()

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        return self.conn.call(method, path, body, ctype)

    def create_many(self, path: str, objs: list[Obj]) -> list[Obj]:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda o: self.call("POST", path, o), objs))

    def objects(self, plural: str) -> list[Obj]:
        return self.call("GET", f"/api/v1/{plural}")["items"]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ----- the scheduler (child process) -----
def serve_scheduler(kubeconfig: str) -> None:
    """vgpu-scheduler's Service and server, plus a bench-only port: GET /usage answers its
    accounting (incremental and recomputed) and how many writes it sent."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vgpu_scheduler.kube import Kube, load_api_client
    from vgpu_scheduler.server import Service, make_server

    cfg = SchedulerConfig(node_policy="binpack", gpu_policy="binpack")
    if os.environ.get("BENCH_SWITCH_MS"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_MS"]) / 1000)
    prof_path = os.environ.get("BENCH_PROFILE")
    if prof_path:  # where the scheduler's threads spend their time: stacks sampled every 2 ms
        import collections
        import signal
        import traceback

        counts: collections.Counter[str] = collections.Counter()
        me = threading.get_ident()

        def sample() -> None:
            while True:
                time.sleep(0.002)
                for tid, frame in sys._current_frames().items():
                    if tid == me or tid == threading.get_ident():
                        continue
                    stack = traceback.extract_stack(frame)[-8:]
                    key = " <- ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(stack))
                    counts[key] += 1

        threading.Thread(target=sample, daemon=True).start()

        def dump(*_: object) -> None:
            with open(f"{prof_path}.{os.getpid()}", "w") as out:
                for key, n in counts.most_common(60):
                    out.write(f"{n} {key}\n")
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
    kube = Kube(load_api_client(kubeconfig), 60)
    writes = [0]
    for name in ("bind",):  # the extender's only write (filter writes nothing)
        real = getattr(kube, name)

        def counted(*a: Any, _real: Any = real, **kw: Any) -> Any:
            writes[0] += 1
            return _real(*a, **kw)

        setattr(kube, name, counted)
    svc = Service(cfg, kube)
    import gc

    pauses: list[tuple[int, float]] = []  # (generation, ms) of the cyclic GC's collections
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1000))

    gc.callbacks.append(on_gc)
    inside: list[float] = []  # the filter verb's own wall time, from handler to answer
    real_filter = svc.extender.filter

    def timed(args: Any) -> Any:
        threading.current_thread().name = "http-filter"
        t = time.perf_counter()
        try:
            return real_filter(args)
        finally:
            inside.append((time.perf_counter() - t) * 1000)

    svc.extender.filter = timed  # type: ignore[method-assign]
    for verb in ("bind", "preempt"):  # their handler threads get names (CPU per thread below)
        real_verb = getattr(svc.extender, verb)

        def named(args: Any, _real: Any = real_verb, _name: str = verb) -> Any:
            threading.current_thread().name = f"http-{_name}"
            return _real(args)

        setattr(svc.extender, verb, named)

    def thread_cpu() -> dict[str, float]:
        """CPU seconds per thread role (utime + stime of /proc/self/task/<tid>/stat)."""
        out: dict[str, float] = {}
        tick = os.sysconf("SC_CLK_TCK")
        for t in threading.enumerate():
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = t.name if t.name.startswith(("http-", "vgpu-")) else "other"
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out

    srv = make_server(svc, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    svc.start()
    svc.state.ready.wait(300)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            usage = svc.state.usage_copy()
            truth = svc.state.recomputed()
            out = {
                "usage": {n: {u: [x.memory, x.cores, x.slots] for u, x in g.items()} for n, g in usage.items()},
                "drift_self": snapshot.drift_bytes(usage, truth),
                "writes": writes[0],
                "reservations": len(svc.state.reservations),
                "cpu_s": time.process_time(),
                "thread_cpu_s": thread_cpu(),
                "filter_inside_p50_ms": pct(inside, 0.5),
                "filter_inside_p99_ms": pct(inside, 0.99),
                "gc_ms_over_5": sorted((round(ms, 1), g) for g, ms in pauses if ms > 5)[-10:],
            }
            if "reset" in self.path:  # the run starts: only its own filters and collections count
                inside.clear()
                pauses.clear()
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    bench = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=bench.serve_forever, daemon=True).start()
    print(f"sched: serving on {srv.server_address[1]} bench {bench.server_address[1]}", flush=True)
    threading.Event().wait()


class Scheduler:
    def __init__(self, kubeconfig: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "sched", str(kubeconfig)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            raise SystemExit(f"scheduler did not start: {line!r}")
        parts = line.split()
        self.port, self.bench_port = int(parts[3]), int(parts[5])

    def stats(self, reset: bool = False) -> Obj:
        c = http.client.HTTPConnection("127.0.0.1", self.bench_port, timeout=120)
        c.request("GET", "/usage?reset" if reset else "/usage")
        out: Obj = json.loads(c.getresponse().read())
        c.close()
        return out

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Client:
    """Keep-alive POSTs to the extender, one connection per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._local = threading.local()

    def post(self, path: str, data: bytes) -> Any:
        if not hasattr(self._local, "conn"):
            self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c = self._local.conn
        c.request("POST", path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        return json.loads(r.read())


# ----- a device plugin stand-in: bound pods' slices published on their Nodes -----
class Publisher:
    """As device_plugin/usage.py after Allocate: the node's slices, tagged, at most 1/s per node."""

    def __init__(self, api: APIConn, base: dict[str, list[sc.UsedSlice]]) -> None:
        self.api, self.base = api, base
        self.slices: dict[str, list[sc.UsedSlice]] = {}
        self.dirty: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def bound(self, node: str, uid: str, d: sc.Decision) -> None:
        with self.lock:
            lst = self.slices.setdefault(node, [])
            for c in d.containers:
                lst += [
                    sc.UsedSlice(gpu=g.uuid, memory=g.memory, cores=g.cores, pod=uid, container=c.name) for g in c.gpus
                ]
            self.dirty.add(node)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.flush()

    def flush(self) -> None:
        with self.lock:
            todo = {n: list(self.base.get(n, [])) + list(self.slices.get(n, [])) for n in self.dirty}
            self.dirty.clear()
        for n, slices in todo.items():
            doc = sc.encode(sc.NodeUsage(time=time.time(), slices=slices))
            body = {"metadata": {"annotations": {sc.USAGE_ANNOTATION: doc}}}
            self.api.call("PATCH", f"/api/v1/nodes/{n}", body, "application/merge-patch+json")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def base_slots(total: int) -> dict[str, dict[str, int]]:
    """node -> GPU -> slots held by the slices no decision names (node())."""
    out: dict[str, dict[str, int]] = {}
    for n in range(total):
        for name, g in snapshot.usage_of([], [snapshot.node_info(node(n, total))]).items():
            out[name] = {u: x.slots for u, x in g.items()}
    return out


def nodes_holding(usage: dict[str, dict[str, int]], base: dict[str, dict[str, int]]) -> int:
    """Nodes where the bench's pods hold a slot (usage: node -> GPU -> slots)."""
    return sum(1 for n, g in usage.items() if any(s > base.get(n, {}).get(u, 0) for u, s in g.items()))


def sampled_nodes_used(pods: list[Obj], total: int, cfg: SchedulerConfig, base: dict[str, dict[str, int]]) -> int:
    """kube-scheduler's default sample offline: each filter sees numFeasibleNodesToFind nodes from a
    rotating start (schedule_one.go), the same fit code picks among them."""
    now = time.time()
    infos = [snapshot.node_info(node(n, total)) for n in range(total)]
    views = [snapshot.node_view(i, now, cfg.stale_after_s) for i in infos]
    usage: snapshot.Usage = snapshot.usage_of([], infos)
    want = max(total * max(50 - total // 125, 5) // 100, 100) if total >= 100 else total
    start = 0
    opts = pod_options({}, "binpack", "binpack")
    for p in pods:
        sample = [views[(start + i) % total] for i in range(want)]
        start = (start + want) % total
        best = fit.choose(sample, usage, container_requests(p), opts, cfg).best
        if best is None:
            continue
        for uuid, u in snapshot.decision_usage(sc.Decision(node=best.node, time=0, containers=best.containers)).items():
            usage.setdefault(best.node, {}).setdefault(uuid, snapshot.Use()).add(u)
    return nodes_holding({n: {u: x.slots for u, x in g.items()} for n, g in usage.items()}, base)


def lower_bound_nodes(pods: list[Obj]) -> int:
    mem = cores = slots = 0
    for p in pods:
        for r in container_requests(p):
            mem += r.count * (r.mem_mib or 0) * MiB
            cores += r.count * (r.cores or 0)
            slots += r.count
    per = GPUS
    return max(-(-mem // (MEM_GIB * GiB * per)), -(-cores // (100 * per)), -(-slots // (SPLIT * per)))


def bind_loop(api_port: int, sched_port: int, base: dict[str, list[sc.UsedSlice]], todo: Any, done: Any) -> None:
    """The binding cycles (a process of their own): POST /bind on BIND_THREADS threads, and the
    device-plugin stand-in publishing each bound pod's slice; answers (latencies, errors, end)."""
    api = APIConn(api_port)
    cl = Client(sched_port)
    pub = Publisher(api, base)
    binds: list[float] = []
    errors: list[str] = []

    def bind(name: str, uid: str, target: str) -> None:
        body = {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": target}
        t = time.perf_counter()
        out = cl.post("/bind", json.dumps(body).encode())
        binds.append((time.perf_counter() - t) * 1000)
        if out.get("Error"):
            errors.append(out["Error"])
            return
        got = api.call("GET", f"/api/v1/namespaces/default/pods/{name}")
        text = got["metadata"]["annotations"].get(sc.DECISION_ANNOTATION)
        pub.bound(target, uid, sc.decode_decision(text) if text else sc.Decision(node=target, time=0, containers=[]))

    with ThreadPoolExecutor(BIND_THREADS) as pool:
        futs = []
        while (item := todo.get()) is not None:
            futs.append(pool.submit(bind, *item))
        for f in futs:
            f.result()
    end = time.perf_counter()
    pub.stop.set()
    pub.flush()
    done.put((binds, errors, end))


def run_case(total: int, count: int, workdir: Path) -> dict[str, Any]:
    rng = random.Random(SEED)
    pods = pod_mix(count, rng)
    api = RemoteAPI(20 * count + 4 * total + 1000, workdir)
    sched: Scheduler | None = None
    try:
        nodes = [node(n, total) for n in range(total)]
        api.create_many("/api/v1/nodes", nodes)
        created = api.create_many("/api/v1/namespaces/default/pods", pods)
        base = {
            n["metadata"]["name"]: sc.decode_usage(n["metadata"]["annotations"][sc.USAGE_ANNOTATION]).slices
            for n in nodes
            if sc.USAGE_ANNOTATION in n["metadata"]["annotations"]
        }
        sched = Scheduler(api.kubeconfig)
        names = json.dumps([n["metadata"]["name"] for n in nodes]).encode()
        cl = Client(sched.port)
        st0 = sched.stats(reset=True)
        cpu0, tcpu0 = st0["cpu_s"], st0["thread_cpu_s"]
        api.latency(True)
        # The binding cycles run in their own process, as kube-scheduler's binding goroutines run
        # beside its scheduling loop: their work does not delay the next filter here.
        ctx = multiprocessing.get_context("fork")
        todo: Any = ctx.Queue()
        done: Any = ctx.Queue()
        binder = ctx.Process(target=bind_loop, args=(api.port, sched.port, base, todo, done), daemon=True)
        binder.start()
        flat: list[float] = []
        errors: list[str] = []
        unplaced = 0
        t0 = time.perf_counter()
        for pod in created:
            data = b'{"Pod":' + json.dumps(pod).encode() + b',"Nodes":null,"NodeNames":' + names + b"}"
            t = time.perf_counter()
            out = cl.post("/filter", data)
            flat.append((time.perf_counter() - t) * 1000)
            if out.get("Error"):
                errors.append(out["Error"])
                continue
            if not out.get("NodeNames"):
                unplaced += 1
                continue
            m = pod["metadata"]
            todo.put((m["name"], m["uid"], out["NodeNames"][0]))
        todo.put(None)
        binds, bind_errors, t_end = done.get()
        binder.join(30)
        errors += bind_errors
        wall = t_end - t0
        placed = count - unplaced - len(errors)
        stats = sched.stats()
        writes = stats["writes"]
        cpu_ms = (stats["cpu_s"] - cpu0) * 1000 / max(placed, 1)
        by_thread = {
            k: round((v - tcpu0.get(k, 0.0)) * 1000 / max(placed, 1), 2)
            for k, v in sorted(stats["thread_cpu_s"].items())
        }
        # preemption: 100 pods of 24 GiB at priority 1000, 100 candidate nodes each
        used_nodes = sorted(stats["usage"])
        pods_now = [p for p in api.objects("pods") if p["spec"].get("nodeName")]
        by_node: dict[str, list[str]] = {}
        for p in pods_now:
            by_node.setdefault(p["spec"]["nodeName"], []).append(p["metadata"]["uid"])
        cands = [n for n in used_nodes if n in by_node][:100]

        def preempt_round(gpus: int, mib: int) -> tuple[list[float], int, int]:
            """100 /preempt calls for a pod of `gpus` GPUs x `mib` MiB: (ms each, nodes helped, victims)."""
            times: list[float] = []
            helped = victims = 0
            for i in range(100):
                lim = {"nvidia.com/gpu": str(gpus), "nvidia.com/gpumem": str(mib)}
                high = pod_object(f"high-{gpus}-{i}", [("main", lim)])
                high["metadata"]["uid"] = f"high-uid-{gpus}-{i}"
                high["spec"]["priority"] = 1000
                meta = {n: {"Pods": [{"UID": by_node[n][-1]}], "NumPDBViolations": 0} for n in cands}
                body = json.dumps({"Pod": high, "NodeNameToVictims": None, "NodeNameToMetaVictims": meta}).encode()
                t = time.perf_counter()
                out = cl.post("/preempt", body)
                times.append((time.perf_counter() - t) * 1000)
                answered = out.get("NodeNameToMetaVictims") or {}
                helped += len(answered)
                victims += sum(len(v.get("Pods") or []) for v in answered.values())
            return times, helped, victims

        pre, helped, victims = preempt_round(1, 24576)
        pre2, helped2, victims2 = preempt_round(2, 40960)
        api.latency(False)
        slots = base_slots(total)
        nodes_used = nodes_holding({n: {u: x[2] for u, x in g.items()} for n, g in stats["usage"].items()}, slots)
        if errors:
            print(f"# {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
        # restart, then 500 random deletions while the new scheduler watches
        sched.close()
        sched = Scheduler(api.kubeconfig)
        bound = sorted(p["metadata"]["name"] for p in pods_now)
        for name in random.Random(SEED + 1).sample(bound, min(DELETIONS, len(bound))):
            api.call("DELETE", f"/api/v1/namespaces/default/pods/{name}")
        drift = -1
        end = time.monotonic() + 60
        while time.monotonic() < end:
            truth = snapshot.usage_of(
                [snapshot.pod_rec(o) for o in api.objects("pods")],
                [snapshot.node_info(o) for o in api.objects("nodes")],
            )
            st = sched.stats()
            mine = {n: {u: snapshot.Use(*x) for u, x in g.items()} for n, g in st["usage"].items()}
            drift = snapshot.drift_bytes(mine, truth) + st["drift_self"]
            if drift == 0:
                break
            time.sleep(0.5)
        return {
            "nodes": total,
            "pods": count,
            "filter_p50_ms": pct(flat, 0.5),
            "filter_p99_ms": pct(flat, 0.99),
            "bind_p50_ms": pct(binds, 0.5),
            "bind_p99_ms": pct(binds, 0.99),
            "pods_per_s": placed / wall,
            "writes_per_pod": writes / max(placed, 1),
            "sched_cpu_ms_per_pod": cpu_ms,
            "sched_cpu_ms_per_pod_by_thread": str(by_thread).replace(" ", ""),
            "filter_inside_p50_ms": stats["filter_inside_p50_ms"],
            "filter_inside_p99_ms": stats["filter_inside_p99_ms"],
            "gc_pauses_over_5ms": str(stats["gc_ms_over_5"]).replace(" ", ""),
            "preempt_p50_ms": pct(pre, 0.5),
            "preempt_p99_ms": pct(pre, 0.99),
            "preempt_nodes_helped": helped / 100,
            "preempt_victims_per_node": victims / max(helped, 1),
            "preempt2_p50_ms": pct(pre2, 0.5),
            "preempt2_p99_ms": pct(pre2, 0.99),
            "preempt2_nodes_helped": helped2 / 100,
            "preempt2_victims_per_node": victims2 / max(helped2, 1),
            "nodes_used": nodes_used,
            "nodes_lower_bound": lower_bound_nodes(pods),
            "sampled_nodes_used": sampled_nodes_used(pods, total, SchedulerConfig(node_policy="binpack"), slots)
            if total >= 1000
            else nodes_used,
            "drift_bytes": drift,
            "unplaced": unplaced,
            "errors": len(errors),
        }
    finally:
        if sched is not None:
            sched.close()
        api.close()


# ----- a real cluster (BENCH_KUBECONFIG) -----
def run_cluster(kubeconfig: str) -> int:
    from kubernetes import client, config, watch

    count = int(os.environ.get("BENCH_PODS", "1000"))
    ns = os.environ.get("BENCH_NAMESPACE", "vgpu-bench")
    scheduler = os.environ.get("BENCH_SCHEDULER", "vgpu-scheduler")
    api_client = config.new_client_from_config(config_file=kubeconfig)
    v1 = client.CoreV1Api(api_client)
    try:
        v1.create_namespace({"metadata": {"name": ns}})
    except client.ApiException as e:
        if e.status != 409:
            raise
    pods = pod_mix(count, random.Random(SEED), scheduler, gpu_only=bool(os.environ.get("BENCH_GPU_ONLY")))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: v1.create_namespaced_pod(ns, p, _preload_content=False), pods))
    bound: set[str] = set()
    last = t0
    w = watch.Watch()
    for ev in w.stream(v1.list_namespaced_pod, ns, timeout_seconds=600):
        p = ev["object"]
        if p.spec.node_name and p.metadata.name not in bound:
            bound.add(p.metadata.name)
            last = time.perf_counter()
            if len(bound) >= count:
                w.stop()
    print(f"cluster_pods={count} bound={len(bound)} scheduler={scheduler}")
    print(f"pods_per_s={len(bound) / max(last - t0, 1e-9):.1f}")
    print(f"summary: pods_per_s={len(bound) / max(last - t0, 1e-9):.1f} bound={len(bound)}/{count}")
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        if sys.argv[2] == "api":
            serve_api(sys.argv[3], int(sys.argv[4]))
        else:
            serve_scheduler(sys.argv[3])
        return 0
    if os.environ.get("BENCH_KUBECONFIG"):
        return run_cluster(os.environ["BENCH_KUBECONFIG"])
    import tempfile

    cases = [int(c) for c in os.environ.get("BENCH_CASES", "100,5000").split(",") if c]
    counts = {100: int(os.environ.get("BENCH_PODS_100", "5000")), 5000: int(os.environ.get("BENCH_PODS_5000", "4000"))}
    print(f"seed={SEED} write_latency_ms=p50:{WRITE_P50_MS:g},p99:{WRITE_P99_MS:g} bind_threads={BIND_THREADS}")
    results = {}
    for total in cases:
        with tempfile.TemporaryDirectory(prefix="bench-sched-") as d:
            r = run_case(total, counts.get(total, 4000), Path(d))
        results[total] = r
        for k, v in r.items():
            print(f"n{total}_{k}={v:.3f}" if isinstance(v, float) else f"n{total}_{k}={v}")
        print(f"n{total}_packing_vs_lower_bound={r['nodes_lower_bound'] / max(r['nodes_used'], 1):.3f}")
    ok = True
    parts = []
    for total, r in results.items():
        want_rate = 100 if total >= 5000 else 0
        good = r["filter_p99_ms"] <= 20 and r["pods_per_s"] >= want_rate and r["drift_bytes"] == 0
        ok = ok and good
        parts.append(
            f"n{total}: filter_p99_ms={r['filter_p99_ms']:.2f} (<= 20) pods_per_s={r['pods_per_s']:.1f}"
            + (f" (>= {want_rate})" if want_rate else "")
            + f" drift_bytes={r['drift_bytes']} (== 0) nodes_used={r['nodes_used']}"
            f" (lower bound {r['nodes_lower_bound']}, sampled {r['sampled_nodes_used']})"
        )
    print(f"summary: {'PASS' if ok else 'MISS'} " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
