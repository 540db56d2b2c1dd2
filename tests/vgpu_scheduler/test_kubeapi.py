"""The API stand-in itself (sim/kubeapi.py), through the unmodified kubernetes client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from sim.kubeapi import KubeAPI, apply_json_patch, merge_patch, node_object, pod_object, use_kubeconfig


@pytest.fixture
def v1(kubeapi: KubeAPI) -> Iterator[Any]:
    yield client.CoreV1Api(kubeapi.api_client())


def test_crud_and_conditional_merge_patch(kubeapi: KubeAPI, v1: Any) -> None:
    v1.create_node(node_object("n1", gpus=4))
    with pytest.raises(ApiException) as e:
        v1.create_node(node_object("n1"))
    assert e.value.status == 409
    p = v1.create_namespaced_pod("ns", pod_object("p", [("c", {"nvidia.com/gpu": "1"})], namespace="ns"))
    assert p.metadata.uid and p.status.phase == "Pending"
    rv = p.metadata.resource_version
    body = {"metadata": {"resourceVersion": rv, "annotations": {"a": "1"}}}
    v1.patch_namespaced_pod("p", "ns", body, _content_type="application/merge-patch+json")
    with pytest.raises(ApiException) as e:
        v1.patch_namespaced_pod("p", "ns", body, _content_type="application/merge-patch+json")
    assert e.value.status == 409 and "the object has been modified" in str(e.value.body)
    v1.patch_namespaced_pod("p", "ns", {"metadata": {"annotations": {"a": None, "b": "2"}}})  # strategic, unconditional
    assert v1.read_namespaced_pod("p", "ns").metadata.annotations == {"b": "2"}
    with pytest.raises(ApiException) as e:
        v1.read_namespaced_pod("p", "other")
    assert e.value.status == 404
    g = v1.create_namespaced_pod("ns", {"metadata": {"generateName": "gen-"}, "spec": {"containers": []}})  # type: ignore[arg-type]
    assert g.metadata.name.startswith("gen-") and len(g.metadata.name) == 9


def test_binding_selectors_and_delete(kubeapi: KubeAPI, v1: Any) -> None:
    for n in ("a", "b"):
        v1.create_namespaced_pod("default", pod_object(n, [("c", {})]))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "a"},
        "target": {"kind": "Node", "name": "n1"},
    }
    v1.create_namespaced_pod_binding("a", "default", binding, _preload_content=False)
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod_binding("a", "default", binding, _preload_content=False)
    assert e.value.status == 409 and "already assigned" in str(e.value.body)
    names = [p.metadata.name for p in v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1").items]
    assert names == ["a"]
    assert [p.metadata.name for p in v1.list_namespaced_pod("default", field_selector="spec.nodeName!=n1").items] == [
        "b"
    ]
    v1.patch_namespaced_pod("b", "default", {"metadata": {"labels": {"app": "x"}}})
    assert [p.metadata.name for p in v1.list_namespaced_pod("default", label_selector="app=x").items] == ["b"]
    v1.delete_namespaced_pod("a", "default")
    assert [p.metadata.name for p in v1.list_namespaced_pod("default").items] == ["b"]


def test_watch_resumes_and_expires(kubeapi: KubeAPI, v1: Any) -> None:
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version

    def later() -> None:
        time.sleep(0.2)
        v1.create_namespaced_pod("default", pod_object("w", [("c", {})]))
        v1.patch_namespaced_pod("w", "default", {"metadata": {"labels": {"x": "1"}}})
        v1.delete_namespaced_pod("w", "default")

    threading.Thread(target=later).start()
    seen = []
    for ev in watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=5):
        seen.append((ev["type"], ev["object"].metadata.name))
        if len(seen) == 3:
            break
    assert seen == [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]
    kubeapi.expire_history()
    with pytest.raises(ApiException) as e:
        for _ev in watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=2):
            pass
    assert e.value.status == 410
    events = list(watch.Watch().stream(v1.list_node, timeout_seconds=1))
    assert events == []  # a watch without a version and nothing there: ends at its timeout


def test_graceful_pods_and_fault_injection(v1: Any) -> None:
    with KubeAPI(graceful_pods=True) as api:
        c: Any = client.CoreV1Api(api.api_client())
        c.create_namespaced_pod("default", pod_object("g", [("c", {})]))
        c.delete_namespaced_pod("g", "default")
        assert api.get("pods", "g")["metadata"]["deletionTimestamp"]
        api.finalize_pod("g")
        assert api.objects("pods") == []
        api.fail_next("GET", "/api/v1/nodes$", 503)
        with pytest.raises(ApiException) as e:
            c.list_node()
        assert e.value.status == 503
        assert c.list_node().items == []


def test_patch_helpers() -> None:
    doc = {"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b"}]}, "metadata": {"labels": {"k": "v"}}}
    out = merge_patch(doc, {"spec": {"containers": [{"name": "b", "image": "y"}]}}, strategic=True)
    assert out["spec"]["containers"] == [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]
    out = merge_patch(doc, {"spec": {"containers": [{"name": "b"}]}})  # RFC 7386: lists replace
    assert out["spec"]["containers"] == [{"name": "b"}]
    ops = [
        {"op": "add", "path": "/metadata/labels/a~1b", "value": "1"},
        {"op": "replace", "path": "/spec/containers/0/image", "value": "z"},
        {"op": "remove", "path": "/metadata/labels/k"},
        {"op": "test", "path": "/spec/containers/1/name", "value": "b"},
    ]
    out = apply_json_patch(doc, ops)
    assert out["metadata"]["labels"] == {"a/b": "1"} and out["spec"]["containers"][0]["image"] == "z"
    with pytest.raises(ValueError):
        apply_json_patch(doc, [{"op": "test", "path": "/metadata/labels/k", "value": "no"}])
    with pytest.raises(ValueError):
        apply_json_patch(doc, [{"op": "replace", "path": "/nope/x", "value": 1}])


def test_device_plugin_node_annotator_against_the_stand_in(
    kubeapi: KubeAPI, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device plugin's real inventory publisher patches a Node here, as on a cluster."""
    from device_plugin import inventory
    from nodecore.devices import DeviceTable, Slicing
    from tests.device_plugin.conftest import synthetic_gpus

    kubeapi.create("nodes", node_object("gpu-node-7"))
    use_kubeconfig(monkeypatch, kubeapi.write_kubeconfig(tmp_path / "kubeconfig"))
    table = DeviceTable(synthetic_gpus(), Slicing(4, 1.0, 1.0))
    a = inventory.NodeAnnotator(table, "nvidia.com/gpu", "gpu-node-7")
    assert a.publish()
    ann = kubeapi.get("nodes", "gpu-node-7")["metadata"]["annotations"]
    assert inventory.ANNOTATION in ann
