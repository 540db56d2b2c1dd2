"""The ResourceSlice publisher against the API server stand-in (HTTP, the kubernetes client):
create, no-op, generation bumps on a change (health), repair of a slice changed by someone else,
409 conflicts, obsolete slices, removal on uninstall, fields the API server drops."""

from __future__ import annotations

import copy
import http.client
import logging
from typing import Any

import pytest

from dra_plugin import apiclient
from dra_plugin.config import Settings
from dra_plugin.publisher import Publisher
from nodecore.core import NodeCore
from sim import kubeapi
from tests.dra_plugin.conftest import NODE, gpus
from tests.dra_plugin.support import node_core
from tests.support import resourcevalidation

GPUS = gpus(2)


def our_slices(kube: kubeapi.KubeAPI) -> list[dict[str, Any]]:
    return [o for o in kube.objects("resourceslices") if o["spec"]["driver"] == "gpu.vgpu.k8s.io"]


def writes(kube: kubeapi.KubeAPI) -> list[tuple[str, str]]:
    return [(m, p) for m, p, _ in kube.requests if m in ("POST", "PATCH", "PUT", "DELETE") and "resourceslices" in p]


@pytest.fixture
def pub(kube: kubeapi.KubeAPI, cfg: Settings) -> tuple[Publisher, NodeCore]:
    """A publisher of the node core's healthy GPUs (as the daemon wires it)."""
    node = node_core(cfg, GPUS)
    return Publisher(apiclient.KubeResourceAPI(kube.api_client()), cfg, NODE, node.healthy_gpus), node


def test_create_then_nothing_to_do(kube: kubeapi.KubeAPI, pub: tuple[Publisher, NodeCore]) -> None:
    p, _ = pub
    assert p.sync()
    [s] = our_slices(kube)
    assert s["spec"]["pool"]["generation"] == 1 and len(s["spec"]["devices"]) == 2
    node_uid = kube.get("nodes", NODE)["metadata"]["uid"]
    assert s["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
    ]
    stored = {k: v for k, v in s.items() if k in ("apiVersion", "kind", "spec")}
    stored["metadata"] = {"name": s["metadata"]["name"]}
    assert resourcevalidation.validate(stored) == []
    n = len(writes(kube))
    assert p.sync() and p.sync()
    assert len(writes(kube)) == n  # unchanged: no write at all
    # Quantities the server canonicalised differently are still equal ("16Gi" vs bytes).
    kube.patch(
        "resourceslices",
        s["metadata"]["name"],
        {"spec": {"devices": [_bytes(d) for d in s["spec"]["devices"]]}},
    )
    assert p.sync() and len(writes(kube)) == n


def _bytes(dev: dict[str, Any]) -> dict[str, Any]:
    d = copy.deepcopy(dev)
    d["capacity"]["memory"]["value"] = str(16 << 30)
    return d


def test_health_change_bumps_the_generation(kube: kubeapi.KubeAPI, pub: tuple[Publisher, NodeCore]) -> None:
    p, node = pub
    p.sync()
    node.table.mark_unhealthy(GPUS[1].uuid, "xid 79")
    assert p.sync()
    [s] = our_slices(kube)
    assert s["spec"]["pool"]["generation"] == 2 and [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]
    node.table.mark_unhealthy(GPUS[0].uuid, "lost")
    assert p.sync()
    [s] = our_slices(kube)
    assert s["spec"]["pool"]["generation"] == 3 and "devices" not in s["spec"]
    for g in GPUS:
        node.table.mark_healthy(g.uuid)
    assert p.sync()
    [s] = our_slices(kube)
    assert s["spec"]["pool"]["generation"] == 4 and len(s["spec"]["devices"]) == 2


def test_a_slice_changed_by_someone_else_is_repaired(kube: kubeapi.KubeAPI, pub: tuple[Publisher, NodeCore]) -> None:
    p, _ = pub
    p.sync()
    [s] = our_slices(kube)
    kube.patch("resourceslices", s["metadata"]["name"], {"spec": {"devices": s["spec"]["devices"][:1]}})
    assert p.sync()
    [s] = our_slices(kube)
    assert len(s["spec"]["devices"]) == 2 and s["spec"]["pool"]["generation"] == 2


def test_conflict_then_retry(kube: kubeapi.KubeAPI, pub: tuple[Publisher, NodeCore]) -> None:
    p, node = pub
    p.sync()
    node.table.mark_unhealthy(GPUS[1].uuid, "xid 79")
    kube.fail_next("PATCH", r"/resourceslices/", 409)
    assert not p.sync()
    assert p.sync()
    [s] = our_slices(kube)
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]


def test_obsolete_slices_go_and_uninstall_removes_all(kube: kubeapi.KubeAPI, pub: tuple[Publisher, NodeCore]) -> None:
    p, _ = pub
    p.sync()
    [s] = our_slices(kube)
    old = copy.deepcopy(s)
    old["metadata"] = {"name": "old-name-of-ours"}
    kube.create("resourceslices", old, api_version="resource.k8s.io/v1")
    other = copy.deepcopy(s)
    other["metadata"] = {"name": "node-2-slice"}
    other["spec"]["nodeName"] = other["spec"]["pool"]["name"] = "node-2"
    kube.create("resourceslices", other, api_version="resource.k8s.io/v1")
    assert p.sync()
    assert sorted(o["metadata"]["name"] for o in our_slices(kube)) == sorted(["node-2-slice", s["metadata"]["name"]])
    [mine] = [o for o in our_slices(kube) if o["spec"]["nodeName"] == NODE]
    assert mine["spec"]["pool"]["generation"] == 2  # a changed pool: a new generation
    assert p.remove() == 1
    assert [o["metadata"]["name"] for o in our_slices(kube)] == ["node-2-slice"]


class DroppingAPI(apiclient.KubeResourceAPI):
    """The API server with DRAConsumableCapacity off: it drops allowMultipleAllocations and
    requestPolicy on write (pkg/registry/resource/resourceslice/strategy.go
    dropDisabledDRAConsumableCapacityFields)."""

    @staticmethod
    def _drop(obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        for d in (obj.get("spec") or {}).get("devices") or []:
            d.pop("allowMultipleAllocations", None)
            for c in (d.get("capacity") or {}).values():
                c.pop("requestPolicy", None)
        return obj

    def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        return super().create_slice(self._drop(obj))

    def patch_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return super().patch_slice(name, self._drop(body))


def test_fields_dropped_by_the_api_server_do_not_loop(
    kube: kubeapi.KubeAPI, cfg: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    p = Publisher(DroppingAPI(kube.api_client()), cfg, NODE, lambda: GPUS)
    with caplog.at_level(logging.ERROR):
        assert p.sync()
        n = len(writes(kube))
        assert p.sync() and p.sync()
    assert len(writes(kube)) == n
    assert "DRAConsumableCapacity is off" in caplog.text
    [s] = our_slices(kube)
    assert s["spec"]["pool"]["generation"] == 1


def test_claim_reads_carry_the_clients_credentials(kube: kubeapi.KubeAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    ac = kube.api_client()
    seen: list[dict[str, str]] = []
    request = http.client.HTTPConnection.request

    def spy(self: http.client.HTTPConnection, method: str, url: str, *a: Any, **kw: Any) -> Any:
        seen.append(dict(kw.get("headers") or {}))
        return request(self, method, url, *a, **kw)

    monkeypatch.setattr(http.client.HTTPConnection, "request", spy)
    api = apiclient.KubeResourceAPI(ac)
    with pytest.raises(apiclient.ApiError) as e:
        api.get_claim("default", "missing")
    assert e.value.status == 404 and "not found" in e.value.message
    assert seen[-1]["authorization"] == "Bearer test-token" and seen[-1]["Accept"] == "application/json"
    # keep-alive: a second read reuses the thread's connection; one the server closed is reopened
    n = len(kube.requests)
    conn = api._local.conn
    for _ in range(2):
        with pytest.raises(apiclient.ApiError):
            api.get_claim("default", "missing")
    assert api._local.conn is conn and len(kube.requests) == n + 2
    conn.sock.close()
    with pytest.raises(apiclient.ApiError) as e:
        api.get_claim("default", "missing")
    assert e.value.status == 404


def test_claim_reads_through_a_proxy_use_the_clients_pool(kube: kubeapi.KubeAPI) -> None:
    """With a proxy (or a TLS server name) configured, the read goes through the client's own
    pool, which knows how to use it."""
    ac = kube.api_client()
    seen: list[dict[str, str]] = []
    request = ac.rest_client.pool_manager.request

    def spy(method: str, url: str, **kw: Any) -> Any:
        seen.append(dict(kw.get("headers") or {}))
        return request(method, url, **kw)

    ac.rest_client.pool_manager.request = spy
    ac.configuration.proxy = "http://proxy.invalid:3128"
    api = apiclient.KubeResourceAPI(ac)
    with pytest.raises(apiclient.ApiError) as e:
        api.get_claim("default", "missing")
    assert e.value.status == 404
    assert seen[-1]["authorization"] == "Bearer test-token"


def test_credentials_are_asked_again_after_a_401(kube: kubeapi.KubeAPI) -> None:
    """Credentials are cached for a few seconds (the client's refresh hook is slow); a 401 within
    them asks the client again and retries once (a rotated token)."""
    ac = kube.api_client()
    asked: list[int] = []
    settings = ac.configuration.auth_settings

    def counting() -> Any:
        asked.append(1)
        return settings()

    ac.configuration.auth_settings = counting  # type: ignore[method-assign]
    api = apiclient.KubeResourceAPI(ac)
    for _ in range(3):
        with pytest.raises(apiclient.ApiError):
            api.get_claim("default", "missing")
    assert len(asked) == 1
    kube.fail_next("GET", r"/resourceclaims/missing$", 401)
    with pytest.raises(apiclient.ApiError) as e:
        api.get_claim("default", "missing")
    assert e.value.status == 404 and len(asked) == 2  # asked again, retried, answered
    kube.fail_next("GET", r"/resourceclaims/missing$", 401, times=2)
    with pytest.raises(apiclient.ApiError) as e:
        api.get_claim("default", "missing")
    assert e.value.status == 401  # a second 401 is the answer
