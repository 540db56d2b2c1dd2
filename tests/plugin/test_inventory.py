"""Node inventory annotation: the JSON, the no-API-server path, and a PATCH
against a small local HTTP stand-in of the API server."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from device_plugin import inventory
from device_plugin.devices import DeviceTable, Slicing
from tests.plugin.conftest import APIServer, GiB, synthetic_gpus


def _table() -> DeviceTable:
    return DeviceTable(synthetic_gpus(2, 16 * GiB), Slicing(4, 1.5, 1.0))


def test_build_json() -> None:
    t = _table()
    t.mark_unhealthy(synthetic_gpus()[1].uuid, "xid 79")
    doc = json.loads(inventory.build(t, "nvidia.com/gpu"))
    assert doc["version"] == 1 and doc["resource"] == "nvidia.com/gpu"
    assert (doc["split_count"], doc["memory_scaling"], doc["cores_scaling"]) == (4, 1.5, 1.0)
    g0, g1 = doc["gpus"]
    assert g0 == {
        "uuid": synthetic_gpus()[0].uuid,
        "index": 0,
        "model": "Fake H100",
        "memory": 16 * GiB,
        "numa": 0,
        "health": "Healthy",
        "vgpus": 4,
        "vgpu_memory": 6 * GiB,
        "vgpu_cores": 25,
    }
    assert g1["health"] == "Unhealthy" and g1["numa"] == 1


def test_no_api_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
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
    assert len(apiserver.patches) == 1
    path, ctype, body, auth = apiserver.patches[0]
    assert path == "/api/v1/nodes/gpu-node-7"
    assert "merge-patch+json" in ctype
    assert auth == "Bearer test-token"
    doc = json.loads(body["metadata"]["annotations"][inventory.ANNOTATION])
    assert [g["uuid"] for g in doc["gpus"]] == [g.uuid for g in synthetic_gpus()]
    t.mark_unhealthy(synthetic_gpus()[0].uuid, "xid 48")
    assert a.publish()
    assert len(apiserver.patches) == 2
    doc = json.loads(apiserver.patches[1][2]["metadata"]["annotations"][inventory.ANNOTATION])
    assert doc["gpus"][0]["health"] == "Unhealthy"


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
