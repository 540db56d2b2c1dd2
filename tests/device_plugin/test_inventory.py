"""Node inventory annotation: the JSON, the no-API-server path, and a PATCH
against a small local HTTP stand-in of the API server."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from device_plugin import inventory
from nodecore.devices import DeviceTable, Slicing
from sim.kubeapi import KubeAPI, node_object, use_kubeconfig
from tests.device_plugin.conftest import APIServer, GiB, synthetic_gpus
from vgpu import scheduling


def _table() -> DeviceTable:
    return DeviceTable(synthetic_gpus(2, 16 * GiB), Slicing(4, 1.5, 1.0))


def test_build_json() -> None:
    t = _table()
    t.mark_unhealthy(synthetic_gpus()[1].uuid, "xid 79")
    text = inventory.build(t, "nvidia.com/gpu", now=1234.5)
    inv = scheduling.decode_inventory(text)  # the contract's own decoder accepts it
    assert (inv.version, inv.resource, inv.heartbeat) == (2, "nvidia.com/gpu", 1234.5)
    assert (inv.split_count, inv.memory_scaling, inv.cores_scaling) == (4, 1.5, 1.0)
    doc = json.loads(text)
    g0, g1 = doc["gpus"]
    assert g0 == {
        "uuid": synthetic_gpus()[0].uuid,
        "index": 0,
        "model": "Fake H100",
        "memory": 16 * GiB,
        "memory_schedulable": 24 * GiB,
        "cores": 100,
        "split_count": 4,
        "numa": 0,
        "health": True,
    }
    assert g1["health"] is False and g1["numa"] == 1


def test_unknown_numa_and_cores_scaling() -> None:
    from dataclasses import replace

    t = DeviceTable([replace(g, numa_node=None) for g in synthetic_gpus(1)], Slicing(3, 1.0, 2.0))
    [g] = scheduling.decode_inventory(inventory.build(t, "nvidia.com/gpu")).gpus
    assert (g.numa, g.cores, g.split_count, g.memory_schedulable) == (-1, 200, 3, 16 * GiB)


def test_no_api_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    use_kubeconfig(monkeypatch, tmp_path / "absent")
    caplog.set_level(logging.WARNING)
    a = inventory.NodeAnnotator(_table(), "nvidia.com/gpu", "node-1")
    assert not a.publish()
    assert not a.publish()
    msgs = [r.getMessage() for r in caplog.records if "node inventory annotation disabled" in r.getMessage()]
    assert len(msgs) == 1


def test_patch_node(apiserver: type[APIServer]) -> None:
    t = _table()
    a = inventory.NodeAnnotator(t, "nvidia.com/gpu", "gpu-node-7")
    assert a.publish()
    assert a.publish()  # unchanged: no second PATCH
    # the annotation, then the node-level totals (the answer's status lacked them)
    assert [p[0] for p in apiserver.patches] == ["/api/v1/nodes/gpu-node-7", "/api/v1/nodes/gpu-node-7/status"]
    apiserver.patches[:] = apiserver.patches[:1]
    path, ctype, body, auth = apiserver.patches[0]
    assert path == "/api/v1/nodes/gpu-node-7"
    assert "merge-patch+json" in ctype
    assert auth == "Bearer test-token"
    doc = json.loads(body["metadata"]["annotations"][inventory.ANNOTATION])
    assert [g["uuid"] for g in doc["gpus"]] == [g.uuid for g in synthetic_gpus()]
    t.mark_unhealthy(synthetic_gpus()[0].uuid, "xid 48")
    assert a.publish()
    assert apiserver.patches[1][0] == "/api/v1/nodes/gpu-node-7"
    doc = json.loads(apiserver.patches[1][2]["metadata"]["annotations"][inventory.ANNOTATION])
    assert doc["gpus"][0]["health"] is False


def test_patch_refused_is_not_fatal(apiserver: type[APIServer], caplog: pytest.LogCaptureFixture) -> None:
    apiserver.status = 403
    caplog.set_level(logging.WARNING)
    a = inventory.NodeAnnotator(_table(), "nvidia.com/gpu", "gpu-node-7")
    assert not a.publish()
    assert not a.publish()
    assert len(apiserver.patches) == 2
    assert sum("cannot annotate node" in r.getMessage() for r in caplog.records) == 1


def test_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "from-env")
    assert inventory.node_name("") == "from-env"
    assert inventory.node_name("explicit") == "explicit"


def test_heartbeat_refresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchanged inventory: no PATCH until the heartbeat is due; then the Node's heartbeat moves."""
    with KubeAPI() as api:
        api.create("nodes", node_object("gpu-node-7", {"other": "kept"}))
        use_kubeconfig(monkeypatch, api.write_kubeconfig(tmp_path / "kubeconfig"))
        a = inventory.NodeAnnotator(_table(), "nvidia.com/gpu", "gpu-node-7", heartbeat_s=30)

        def node_inventory() -> scheduling.NodeInventory:
            ann = api.get("nodes", "gpu-node-7")["metadata"]["annotations"]
            assert ann["other"] == "kept"
            return scheduling.decode_inventory(ann[inventory.ANNOTATION])

        def patches() -> int:
            return sum(
                1
                for m, path, _ in api.requests
                if m == "PATCH" and path.startswith("/api/v1/nodes/") and not path.endswith("/status")
            )

        assert a.publish(now=1000.0)
        assert node_inventory().heartbeat == 1000.0
        assert a.publish(now=1029.0)
        assert patches() == 1
        assert a.publish(now=1030.5)
        assert patches() == 2 and node_inventory().heartbeat == 1030.5
        a.table.mark_unhealthy(synthetic_gpus()[0].uuid, "xid 48")
        assert a.publish(now=1031.0)  # a change is published at once
        inv = node_inventory()
        assert patches() == 3 and inv.heartbeat == 1031.0 and inv.gpus[0].health is False
