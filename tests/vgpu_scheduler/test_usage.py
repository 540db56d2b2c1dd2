"""One truth for usage: slices no decision names are counted.

The device plugin runs in this process (device_plugin.daemon.Daemon over a synthetic 16 GiB GPU,
real gRPC with the kubelet stand-in) and publishes what it handed out on its Node; the scheduler
and the kube-scheduler stand-in talk to the same API stand-in. A pod placed by default-scheduler
holds 12288 MiB that no decision names: a 4096 MiB vGPU pod still fits, a second one must not
(12288 + 4096 + 4096 MiB on a 16 GiB GPU), and `vgpuctl cluster` shows the same numbers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from sim.kubeapi import KubeAPI, pod_object
from sim.kubelet import FakeKubelet
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.device_plugin.conftest import NODE, InProc, api, inproc, kubelet, synthetic_gpus  # noqa: F401 - fixtures
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import GiB, MiB, api_usage, running_scheduler, state_usage, vgpu_pod
from vgpu import scheduling as sc
from vgpu_scheduler import snapshot
from vgpuctl import cluster

pytestmark = pytest.mark.timeout(180)
[GPU] = synthetic_gpus(1, 16 * GiB)


def test_slices_without_a_decision_are_counted_and_no_gpu_is_over_committed(
    api: KubeAPI,  # noqa: F811
    kubelet: FakeKubelet,  # noqa: F811
    inproc: Callable[..., InProc],  # noqa: F811
) -> None:
    plugin = inproc(gpus=[GPU], device_split_count=8, node_name=NODE)
    kubelet.wait_endpoint()
    wait_for(lambda: sc.INVENTORY_ANNOTATION in api.get("nodes", NODE)["metadata"]["annotations"], 20, "inventory")
    # default-scheduler's pod: 6 of the 8 slots, n x 1/K = 12288 MiB, no decision
    api.create("pods", pod_object("other", [("main", {"nvidia.com/gpu": "6"})]))
    api.bind("other", "default", NODE)
    kubelet.admit("default", "other", "main", count=6, uid=api.get("pods", "other")["metadata"]["uid"])
    with running_scheduler(api) as s:
        g = GPU.uuid
        wait_for(lambda: state_usage(s.service).get(NODE, {}).get(g, (0, 0, 0))[0] == 12288 * MiB, 20, "published")
        ks = KubeScheduler(api.api_client(), [ExtenderConfig(s.url)])
        for n in ("a", "b"):
            api.create("pods", vgpu_pod(n, mem=4096, cores=10))
        assert ks.schedule_one("default", "a").status == "Scheduled"
        r = ks.schedule_one("default", "b")
        assert r.status == "Unschedulable", r  # 12288 + 4096 + 4096 MiB on a 16 GiB GPU: no
        assert f"{g}: 0 MiB free < 4096 MiB asked" in r.message
        # the kubelet admits a: its record follows the decision and is published with its pod
        uid = api.get("pods", "a")["metadata"]["uid"]
        kubelet.admit("default", "a", "main", uid=uid)

        def tagged() -> bool:
            text = api.get("nodes", NODE)["metadata"]["annotations"].get(sc.USAGE_ANNOTATION)
            return bool(text) and any(x.pod == uid for x in sc.decode_usage(text).slices)

        wait_for(tagged, 20, "a's slice published")
        time.sleep(0.3)  # the scheduler's Node watch
        # counted once (its decision and its published slice are the same 4096 MiB)
        assert state_usage(s.service)[NODE][g] == (16384 * MiB, 600 // 8 + 10, 7)
        assert state_usage(s.service) == api_usage(api)  # incremental == recomputed from the API
        assert ks.schedule_one("default", "b").status == "Unschedulable"
        # vgpuctl cluster: the same numbers, every slice with its pod, the undecided one flagged
        v = cluster.view(api.objects("nodes"), api.objects("pods"), time.time())
        [gr] = v.nodes[0].gpus
        assert (gr.memory_allocated, gr.memory_free, gr.slots_allocated) == (16384 * MiB, 0, 7)
        who = sorted((p.name, p.memory, p.decided) for p in gr.pods)
        assert who == [("a", 4096 * MiB, True), ("other", 12288 * MiB, False)]
        # decisions alone (the old accounting) see 4096 MiB used: they would have let b in
        rec = snapshot.usage_of([snapshot.pod_rec(p) for p in api.objects("pods")])
        assert rec[NODE][g].memory == 4096 * MiB
    plugin.stop()


def test_a_node_full_of_ended_pods_lingering_records_admits_a_new_pod(
    api: KubeAPI,  # noqa: F811
    kubelet: FakeKubelet,  # noqa: F811
    inproc: Callable[..., InProc],  # noqa: F811
) -> None:
    """The deadlock of long-lived records: the kubelet keeps an ended pod's Allocate answers in its
    checkpoint until its next allocation or device list change (it may replay them), so the
    plugin keeps their records and publishes their slices; on a node that looks full no vGPU pod
    would be admitted and the checkpoint never rewritten. The slices name their pods, and the
    scheduler stops counting those of ended pods at once: a new pod is placed, with the scheduler
    running through the pods' ends and with one started afterwards (the pods unknown to it)."""
    plugin = inproc(gpus=[GPU], device_split_count=8, node_name=NODE, record_gc_grace_s=1.0, record_gc_interval_s=0.2)
    kubelet.wait_endpoint()
    wait_for(lambda: sc.INVENTORY_ANNOTATION in api.get("nodes", NODE)["metadata"]["annotations"], 20, "inventory")
    g = GPU.uuid

    def uid(name: str) -> str:
        return str(api.get("pods", name)["metadata"]["uid"])

    # default-scheduler's pod (no decision): 4 slots, 8192 MiB; a vGPU pod: the other 8192 MiB
    api.create("pods", pod_object("other", [("main", {"nvidia.com/gpu": "4"})]))
    api.bind("other", "default", NODE)
    kubelet.admit("default", "other", "main", count=4, uid=uid("other"))
    with running_scheduler(api) as s:
        ks = KubeScheduler(api.api_client(), [ExtenderConfig(s.url)])
        api.create("pods", vgpu_pod("a", mem=8192, cores=10))
        assert ks.schedule_one("default", "a").status == "Scheduled"
        kubelet.admit("default", "a", "main", uid=uid("a"))

        def published(n: int) -> bool:
            text = api.get("nodes", NODE)["metadata"]["annotations"].get(sc.USAGE_ANNOTATION)
            got = sc.decode_usage(text).slices if text else []
            return len(got) == n and all(x.pod for x in got)

        wait_for(lambda: published(5), 20, "both pods' slices published with their pods")
        wait_for(lambda: state_usage(s.service).get(NODE, {}).get(g, (0,))[0] == 16384 * MiB, 20, "full")
        api.create("pods", vgpu_pod("b", mem=4096, cores=10))
        assert ks.schedule_one("default", "b").status == "Unschedulable"
        # other finishes, a is deleted: the kubelet drops both but rewrites its checkpoint only
        # at its next allocation, so their records stay and stay published
        kubelet.release("default", "other")
        kubelet.release("default", "a")
        api.patch("pods", "other", {"status": {"phase": "Succeeded"}})
        api.delete("pods", "a")
        time.sleep(1.5)  # collector passes past its grace: nothing collected
        assert len(os.listdir(plugin.state.allocations_dir)) == 2 and published(5)
        # the scheduler counts none of it: the GPU is free, and the new pod is placed
        wait_for(lambda: state_usage(s.service).get(NODE, {}).get(g) is None, 10, "the ended pods' slices dropped")
        assert state_usage(s.service) == api_usage(api)
        assert ks.schedule_one("default", "b").status == "Scheduled"
    api.delete("pods", "other")
    # a scheduler started now knows neither ended pod (deleted before its list): not counted either
    with running_scheduler(api) as s:
        assert state_usage(s.service) == {NODE: {g: (4096 * MiB, 10, 1)}} and published(5)
        ks = KubeScheduler(api.api_client(), [ExtenderConfig(s.url)])
        api.create("pods", vgpu_pod("c", mem=4096, cores=10))
        assert ks.schedule_one("default", "c").status == "Scheduled"
        # the kubelet admits b and c: its checkpoint is rewritten, the old records go
        kubelet.admit("default", "b", "main", uid=uid("b"))
        kubelet.admit("default", "c", "main", uid=uid("c"))
        wait_for(lambda: published(2), 20, "the ended pods' records collected")
        assert len(os.listdir(plugin.state.allocations_dir)) == 2
        wait_for(lambda: state_usage(s.service) == {NODE: {g: (8192 * MiB, 20, 2)}}, 10, "b and c counted once each")
        assert state_usage(s.service) == api_usage(api)
    plugin.stop()
