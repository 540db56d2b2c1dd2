"""A kubelet restart: running vGPU pods keep running (same container, no restart), the device
plugin registers again, and new vGPU pods schedule and see their slice afterwards.

The suite cannot restart a kubelet through the API: VGPU_TEST_KUBELET_RESTART is a shell command
that does (run with NODE=<node name> in its environment), e.g. `ssh $NODE sudo systemctl restart
kubelet`; without it this test skips.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, MiB, Obj, decision, offered_gpus, wait
from vgpu import quantity
from vgpu import scheduling as sc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def _container(p: Obj) -> tuple[str, int]:
    [cs] = p["status"]["containerStatuses"]
    return cs.get("containerID", ""), int(cs.get("restartCount", 0))


def _lease_renewal(cluster: Cluster, node: str) -> str:
    """renewTime of the node's Lease (kube-node-lease), which only a running kubelet renews
    (every 10 s by default). The API server's node proxy cannot tell: it refuses loopback
    kubelet addresses."""
    from kubernetes import client

    resp = client.CoordinationV1Api(cluster.api_client).read_namespaced_lease(
        node, "kube-node-lease", _preload_content=False
    )
    return str(json.loads(resp.data)["spec"].get("renewTime", ""))


def test_running_pods_survive_and_new_ones_schedule(cluster: Cluster, pods: Pods) -> None:
    s = cluster.settings
    if not s.kubelet_restart:
        pytest.skip("set VGPU_TEST_KUBELET_RESTART to a command that restarts the kubelet of $NODE")
    gpus = [(n, g) for n, g in offered_gpus(cluster.view()) if g.slots - g.slots_allocated >= 2]
    if s.node:
        gpus = [(n, g) for n, g in gpus if n == s.node]
    if not gpus:
        pytest.skip("no GPU with two free vGPU slots")
    node, gpu = gpus[0]
    size = max(1, min(1024, gpu.memory_free // MiB // 4))
    pin = {sc.USE_GPUUUID_ANNOTATION: gpu.uuid}
    pods.create("before", {s.resource: "1", sc.RESOURCE_MEM: str(size)}, annotations=pin, node=node)
    before = cluster.wait_running("before")
    cid, restarts = _container(before)
    seen = cluster.seen("before")
    allocatable = cluster.node(node)["status"]["allocatable"][s.resource]

    r = subprocess.run(
        s.kubelet_restart, shell=True, env={**os.environ, "NODE": node}, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"VGPU_TEST_KUBELET_RESTART failed ({r.returncode}): {r.stdout}{r.stderr}"
    # The command has returned: the old kubelet is stopped (or already replaced), so a renewal
    # of the node's Lease from now on is the new kubelet's.
    renewed = _lease_renewal(cluster, node)
    wait(lambda: _lease_renewal(cluster, node) != renewed, s.timeout_s, f"the kubelet of {node} to renew its Lease")

    def registered() -> bool:  # the device plugin registered again: its vGPUs are allocatable
        st = cluster.node(node)["status"]
        return quantity.whole(st["allocatable"].get(s.resource, "0")) == quantity.whole(allocatable)

    wait(registered, s.timeout_s, f"{node} to offer {allocatable} {s.resource} again")
    after = cluster.wait_running("before")
    assert _container(after) == (cid, restarts), cluster.describe("before")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert cluster.seen("before") == seen

    pods.create("after", {s.resource: "1", sc.RESOURCE_MEM: str(size)}, annotations=pin, node=node)
    p = cluster.wait_running("after")
    d = decision(p)
    assert d is not None and [(g.uuid, g.memory) for g in d.containers[0].gpus] == [(gpu.uuid, size * MiB)]
    assert [(x["uuid"], x["total"]) for x in cluster.seen("after")["cuda"]["devices"]] == [(gpu.uuid, size * MiB)]
