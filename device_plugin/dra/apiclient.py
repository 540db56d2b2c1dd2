"""What the DRA plugin asks the API server, behind a small interface.

`ResourceAPI` is the interface (claims read by Prepare; the node's ResourceSlices kept by the
publisher); `KubeResourceAPI` implements it with the kubernetes client (`ResourceV1Api`,
`CoreV1Api`), reading raw JSON (`_preload_content=False`) that the plugin decodes into its own
Structs. Errors become `ApiError` with the HTTP status (0 when the server was not reached).
"""

from __future__ import annotations

import json
from typing import Any, Protocol
from urllib.parse import quote

REQUEST_TIMEOUT_S = 10.0


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ResourceAPI(Protocol):
    def get_claim(self, namespace: str, name: str) -> bytes:
        """The ResourceClaim's JSON (resource.k8s.io/v1)."""
        ...

    def node_uid(self, node: str) -> str: ...

    def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        """ResourceSlices with spec.driver = driver and spec.nodeName = node."""
        ...

    def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]: ...

    def patch_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch; a metadata.resourceVersion in it is a precondition (409 if stale)."""
        ...

    def delete_slice(self, name: str) -> None: ...


def _status_message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message") or "")[:500]
    except (ValueError, AttributeError, TypeError):
        return body[:200].decode("utf-8", "replace")


def _message(e: Exception) -> tuple[int, str]:
    status = int(getattr(e, "status", 0) or 0)
    body = getattr(e, "body", None)
    msg = ""
    if body:
        try:
            msg = str(json.loads(body).get("message") or "")
        except (ValueError, AttributeError, TypeError):
            msg = str(body)[:200]
    if not msg:
        msg = str(getattr(e, "reason", "") or e).splitlines()[0] if str(e) else type(e).__name__
    return status, msg


class KubeResourceAPI:
    """ResourceAPI over a kubernetes.client.ApiClient."""

    def __init__(self, api_client: Any, timeout: float = REQUEST_TIMEOUT_S) -> None:
        from kubernetes import client  # slow import: only when an API server is configured

        self._client = api_client
        self._resource = client.ResourceV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._timeout = timeout

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, _preload_content=False, _request_timeout=self._timeout, **kw)
        except Exception as e:  # ApiException, urllib3 errors, pydantic validation of a body
            status, msg = _message(e)
            raise ApiError(status, msg) from None

    def get_claim(self, namespace: str, name: str) -> bytes:
        """GET through the client's own connection pool, TLS settings and credentials (the
        bearer token of `auth_settings`, refreshed by the client's hook: in-cluster token
        files, kubeconfig exec plugins; client certificates live in the pool), without the
        generated method's per-call argument validation: NodePrepareResources reads one claim
        per claim, and that validation cost more CPU than the rest of the read (make bench-dra)."""
        cfg = self._client.configuration
        headers = {"Accept": "application/json"}
        for auth in cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        ns, n = quote(namespace, safe=""), quote(name, safe="")
        url = f"{cfg.host}/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{n}"
        try:
            r = self._client.rest_client.pool_manager.request("GET", url, headers=headers, timeout=self._timeout)
        except Exception as e:  # urllib3 errors: connection refused, timeouts, TLS
            raise ApiError(0, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        if r.status != 200:
            raise ApiError(r.status, _status_message(r.data))
        data: bytes = r.data
        return data

    def node_uid(self, node: str) -> str:
        obj = json.loads(self._call(self._core.read_node, node).data)
        return str(obj.get("metadata", {}).get("uid", ""))

    def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        sel = f"spec.driver={driver},spec.nodeName={node}"
        obj = json.loads(self._call(self._resource.list_resource_slice, field_selector=sel).data)
        items: list[dict[str, Any]] = obj.get("items") or []
        return items

    def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self._call(self._resource.create_resource_slice, obj).data)
        return out

    def patch_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self._call(self._resource.patch_resource_slice, name, body, _content_type="application/merge-patch+json")
        out: dict[str, Any] = json.loads(resp.data)
        return out

    def delete_slice(self, name: str) -> None:
        self._call(self._resource.delete_resource_slice, name)


def load() -> KubeResourceAPI | None:
    """The API of the in-cluster service account or the kubeconfig, None when there is none."""
    from device_plugin import inventory

    core = inventory.load_client()
    return KubeResourceAPI(core.api_client) if core is not None else None
