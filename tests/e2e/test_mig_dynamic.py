"""End to end with dynamic MIG: a pod asking `nvidia.com/gpumem: 20480` with `vgpu.k8s.io/mig:
"true"` on a simulated H200 in MIG mode gets the smallest instance that holds it (1g.35gb, NVIDIA's
H200 table: 1g.18gb has 16 GiB), made by the device plugin in Allocate and destroyed once the pod
is gone; a restarted scheduler does not give its placement to the next pod.

Real parts: `vgpu-scheduler` (extender + webhook over HTTP) and `vgpu-device-plugin` (`--mig-strategy
dynamic`) as processes, the Kubernetes API stand-in (sim/kubeapi.py), the kube-scheduler and
kubelet stand-ins, the simulated GPU (its own count of the instance), runc through the simulated
NVIDIA runtime with our prestart hook (the demo's harness, packaging/demo/vgpu_demo).
"""

from __future__ import annotations

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


def _create(api: KubeAPI, url: str, name: str) -> None:
    lim = {sc.RESOURCE_GPU: "1", sc.RESOURCE_MEM: str(20 * 1024)}
    api.create("pods", scheduler.admit(url, pod_object(name, [("main", lim)], annotations={sc.MIG_ANNOTATION: "true"})))


def _schedule(api: KubeAPI, url: str, name: str) -> sc.GPUAssignment:
    ks = KubeScheduler(api.api_client(), [ExtenderConfig(url_prefix=url)])
    wait_for(lambda: ks.schedule_one("default", name).status == "Scheduled", 30, f"{name} to be scheduled", step=0.1)
    d = sc.decode_decision(api.get("pods", name, "default")["metadata"]["annotations"][sc.DECISION_ANNOTATION])
    [c] = d.containers
    [g] = c.gpus
    return g


def test_twenty_gib_get_a_1g_35gb_instance_made_and_destroyed(build_dir: Path, tmp_path: Path) -> None:
    with (
        KubeAPI() as api,
        scenario.Demo(build_dir, workdir=tmp_path / "demo", log=lambda _l: None, mig_dynamic=True) as demo,
    ):
        api.create("nodes", node_object(NODE, gpus=scenario.SPLIT))
        kc = api.write_kubeconfig(tmp_path / "kubeconfig")

        # 1. the simulated H200 in MIG mode, no instance; the plugin publishes its profiles
        gpu = demo.start_gpu()
        demo.env["KUBECONFIG"] = str(kc)
        demo.env["NODE_NAME"] = NODE
        demo.start_plugin()

        def inventory() -> sc.NodeInventory | None:
            text = api.get("nodes", NODE)["metadata"].get("annotations", {}).get(sc.INVENTORY_ANNOTATION)
            return sc.decode_inventory(text) if text else None

        inv = wait_for(inventory, 30, "the node inventory annotation", step=0.1)
        assert inv.version == 3 and isinstance(inv.gpus[0].mig, sc.MigGPU) and inv.gpus[0].mig.instances == ()
        assert demo.gpu.mig_devices() == []

        # 2. the scheduler: the smallest profile holding 20 GiB is 1g.35gb (1g.18gb has 16 GiB)
        sched, url = scheduler.start(demo, kc)
        _create(api, url, "train")
        g = _schedule(api, url, "train")
        assert isinstance(g.mig, sc.MigAssignment)
        assert (g.uuid, g.mig.profile, g.mig.start, g.memory) == (gpu["uuid"], "1g.35gb", 6, 33280 * MiB)

        # 3. a restarted scheduler rebuilds what the first decided from the pods: the next pod
        #    gets another placement, although the instance is not made yet
        sched.terminate()
        sched.wait(15)
        _sched2, url2 = scheduler.start(demo, kc, "vgpu-scheduler-2")
        _create(api, url2, "second")
        g2 = _schedule(api, url2, "second")
        assert isinstance(g2.mig, sc.MigAssignment) and (g2.mig.profile, g2.mig.start) == ("1g.35gb", 4)
        api.delete("pods", "second", "default")

        # 4. the kubelet admits `train`: Allocate makes the 1g.35gb instance at 6 and gives the
        #    container its MIG device
        demo.pods = [scenario.Pod("train", 1)]
        [p] = demo.admit()
        [made] = demo.gpu.mig_devices()
        assert (made["gi_profile"], made["placement"]) == ("1g.35gb", (6, 2))
        rec = read_record(Paths(str(demo.state_dir)).allocation_record(p.token))
        assert [(x.uuid, x.memory_limit) for x in rec.gpus] == [(made["uuid"], 33280 * MiB)]
        assert p.alloc is not None and p.alloc.envs["NVIDIA_VISIBLE_DEVICES"] == made["uuid"]

        # 5. runc + the hook: the container sees the instance (cuMemGetInfo and NVML: 33280 MiB)
        #    and is refused past it
        demo.run_containers()
        demo.isolation()
        assert p.seen["info"]["json"]["mem_total"] == 33280 * MiB

        # 6. the pod is gone (its container stopped, the pod deleted): the plugin destroys the
        #    instance, and the inventory no longer has it
        assert p.container is not None
        scenario.ctr.stop(demo.runc_root, p.container)
        api.delete("pods", "train", "default")
        wait_for(lambda: demo.gpu.mig_devices() == [], 30, "the instance to be destroyed", step=0.2)

        def empty() -> bool:
            i = inventory()
            return i is not None and isinstance(i.gpus[0].mig, sc.MigGPU) and i.gpus[0].mig.instances == ()

        wait_for(empty, 30, "the inventory without the instance", step=0.2)
        assert "MIG instance destroyed" in demo.tail("device-plugin", 200)
