"""Node side: every vGPU node offers K vGPUs per GPU to the kubelet, and its inventory is sound."""

from __future__ import annotations

import math
import time

import pytest

from tests.cluster.kube import Cluster
from vgpu import quantity
from vgpu import scheduling as sc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


def test_node_allocatable_is_k_times_the_gpus(cluster: Cluster) -> None:
    resource = cluster.settings.resource
    checked = 0
    for node in cluster.nodes():
        text = (node["metadata"].get("annotations") or {}).get(sc.INVENTORY_ANNOTATION)
        if text is None:
            continue
        name = node["metadata"]["name"]
        inv = sc.decode_inventory(text)
        assert inv.resource == resource, name
        assert inv.gpus, f"{name}: an inventory without GPUs"
        assert time.time() - inv.heartbeat < sc.DEFAULT_STALE_AFTER_S, f"{name}: stale inventory heartbeat"
        status = node["status"]
        # The device plugin registers split_count vGPUs per GPU; the kubelet counts them all in
        # capacity and the healthy ones in allocatable.
        assert quantity.whole(status["capacity"][resource]) == sum(g.split_count for g in inv.gpus), name
        assert quantity.whole(status["allocatable"][resource]) == sum(g.split_count for g in inv.gpus if g.health), name
        # The node-level totals kube-scheduler counts (docs/operators/scheduling.md, "Resources"), written to
        # the Node's status by the device plugin: all GPUs, healthy or not, in capacity and allocatable.
        for key, want in sc.node_capacity(inv).items():
            for part in ("capacity", "allocatable"):
                assert key in status[part], f"{name}: no {key} in {part}"
                assert quantity.whole(status[part][key]) == want, (name, part, key)
        assert len({g.uuid for g in inv.gpus}) == len(inv.gpus)
        for g in inv.gpus:
            # device_plugin/inventory.py: what the scheduler may give away of each GPU
            assert g.memory > 0 and g.memory_schedulable == math.floor(g.memory * inv.memory_scaling), (name, g)
            assert g.cores == math.floor(100 * inv.cores_scaling + 1e-9), (name, g)
        checked += 1
    if not checked:
        pytest.fail("no node publishes a vgpu.k8s.io/node-inventory: is the device plugin running?")
