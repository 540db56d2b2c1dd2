"""End to end with the scheduler: a pod asking `nvidia.com/gpumem: 3072` and `nvidia.com/gpucores: 30`
goes through the webhook, kube-scheduler's extender calls (filter, then bind: one feasible node,
no prioritize) and the kubelet's Allocate, and the container sees 3072 MiB in cuMemGetInfo.

Real parts: `vgpu-scheduler` (extender + webhook over HTTP) and `vgpu-device-plugin` as processes,
the Kubernetes API stand-in (sim/kubeapi.py, real HTTP) and the kube-scheduler stand-in
(sim/kubescheduler.py) and kubelet stand-in (sim/kubelet.py, gRPC over unix
sockets), the simulated GPU, runc from the distribution with our prestart hook (the demo's
harness, packaging/demo/vgpu_demo).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "packaging" / "demo"
if str(DEMO_DIR) not in sys.path:
    sys.path.insert(0, str(DEMO_DIR))

from vgpu_demo import scenario  # noqa: E402

from sim.kubeapi import KubeAPI, node_object, pod_object  # noqa: E402
from sim.kubescheduler import ExtenderConfig, KubeScheduler  # noqa: E402
from tests.support import scheduler  # noqa: E402
from tests.support.hook import have_runc  # noqa: E402
from tests.support.poll import wait_for  # noqa: E402
from vgpu import scheduling as sc  # noqa: E402
from vgpu.paths import Paths  # noqa: E402
from vgpu.schemas import read_record  # noqa: E402

MiB = 1 << 20
NODE = "gpu-node-1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.root,
    pytest.mark.skipif(not have_runc(), reason="needs root, runc and busybox-static"),
    pytest.mark.timeout(300),
]


def test_decided_size_reaches_the_container(build_dir: Path, tmp_path: Path) -> None:
    with KubeAPI() as api, scenario.Demo(build_dir, workdir=tmp_path / "demo", log=lambda _l: None) as demo:
        api.create("nodes", node_object(NODE, gpus=scenario.SPLIT))
        kc = api.write_kubeconfig(tmp_path / "kubeconfig")

        # 1. the simulated 10 GiB GPU; the device plugin publishes inventory v2 on its Node
        gpu = demo.start_gpu()
        demo.env["KUBECONFIG"] = str(kc)
        demo.env["NODE_NAME"] = NODE
        demo.start_plugin()

        def inventory() -> sc.NodeInventory | None:
            text = api.get("nodes", NODE)["metadata"].get("annotations", {}).get(sc.INVENTORY_ANNOTATION)
            return sc.decode_inventory(text) if text else None

        inv = wait_for(inventory, 30, "the node inventory annotation", step=0.1)
        assert [g.uuid for g in inv.gpus] == [gpu["uuid"]] and inv.gpus[0].memory_schedulable == gpu["memory"]

        # 2. the extender + webhook process
        _sched, url = scheduler.start(demo, kc)

        # 3. the pod, through the webhook (schedulerName set, sizes validated), then created
        pod = pod_object("train", [("main", {sc.RESOURCE_GPU: "1", sc.RESOURCE_MEM: "3072", sc.RESOURCE_CORES: "30"})])
        pod = scheduler.admit(url, pod)
        assert pod["spec"]["schedulerName"] == "vgpu-scheduler"
        api.create("pods", pod)

        # 4. kube-scheduler's calls: filter (the choice held in memory) → bind (the Binding
        #    carries the decision)
        ks = KubeScheduler(api.api_client(), [ExtenderConfig(url_prefix=url)])

        def scheduled() -> bool:
            res = ks.schedule_one("default", "train")
            return res.status == "Scheduled"

        wait_for(scheduled, 30, "the pod to be scheduled", step=0.1)  # the extender's state follows the Node watch
        placed = api.get("pods", "train", "default")
        assert placed["spec"]["nodeName"] == NODE
        ann = placed["metadata"]["annotations"]
        d = sc.decode_decision(ann[sc.DECISION_ANNOTATION])
        assert d.node == NODE
        [c] = d.containers
        assert (c.name, [(g.uuid, g.memory, g.cores) for g in c.gpus]) == ("main", [(gpu["uuid"], 3072 * MiB, 30)])
        assert ann[sc.BIND_PHASE_ANNOTATION] == sc.PHASE_ALLOCATING

        # 5. the kubelet admits it: Allocate honours the decision (3072 MiB, 30 %), not 1/K (1024 MiB, 10 %)
        demo.pods = [scenario.Pod("train", 1)]
        [p] = demo.admit()
        rec = read_record(Paths(str(demo.state_dir)).allocation_record(p.token))
        assert [(g.uuid, g.memory_limit, g.core_percent) for g in rec.gpus] == [(gpu["uuid"], 3072 * MiB, 30)]
        ann = api.get("pods", "train", "default")["metadata"]["annotations"]
        assert json.loads(ann[sc.ALLOCATED_ANNOTATION]) == ["main"]
        assert ann[sc.BIND_PHASE_ANNOTATION] == sc.PHASE_SUCCESS

        # 6. runc + the hook: the container sees its decided memory (cuMemGetInfo and NVML)
        demo.run_containers()
        demo.isolation()
        assert p.seen["info"]["json"]["mem_total"] == 3072 * MiB  # cuMemGetInfo inside the container
        assert [g["total"] for g in p.seen["nvml"]["json"]] == [3072 * MiB]

        # 7. the monitor's share for it comes from the record, through the hook's limits file
        from monitor.containers import Registry

        assert p.container is not None
        found = Registry(Paths(str(demo.state_dir))).scan()[p.container.cid]
        assert found.share(gpu["uuid"]) == 30.0 and found.memory_limit(gpu["uuid"]) == 3072 * MiB
