"""Concurrent filters and binds onto one node: optimistic concurrency never over-commits a GPU."""

from __future__ import annotations

import threading

from sim.kubeapi import KubeAPI
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.vgpu_scheduler.helpers import GiB, api_usage, gpu_node, running_scheduler, state_usage, vgpu_pod


def test_50_concurrent_binds_onto_one_node(kubeapi: KubeAPI) -> None:
    # 2 GPUs x 16 GiB, 10 slots each: 5 pods of 3000 MiB fit per GPU (memory binds), 10 in all.
    kubeapi.create("nodes", gpu_node("only", n=2, mem_gib=16, split=10))
    for i in range(50):
        kubeapi.create("pods", vgpu_pod(f"p{i:02d}", mem=3000, cores=5))
    results: dict[str, str] = {}
    with running_scheduler(kubeapi) as s:
        start = threading.Barrier(50)

        def one(i: int) -> None:
            ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url, http_timeout_s=30)])
            start.wait()
            r = ks.schedule_one("default", f"p{i:02d}")
            results[f"p{i:02d}"] = r.status

        threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 50
        scheduled = [p for p, st in results.items() if st == "Scheduled"]
        assert len(scheduled) == 10, results
        assert set(results.values()) <= {"Scheduled", "Unschedulable"}
        truth = api_usage(kubeapi)
        for _uuid, (mem, cores, slots) in truth["only"].items():
            assert mem <= 16 * GiB and cores <= 100 and slots <= 10
        assert sum(slots for _m, _c, slots in truth["only"].values()) == 10
        bound = [p["metadata"]["name"] for p in kubeapi.objects("pods") if p["spec"].get("nodeName")]
        assert sorted(bound) == sorted(scheduled)
        assert state_usage(s.service) == truth  # the scheduler's accounting is the API's
