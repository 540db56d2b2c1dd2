"""What the DRA plugin asks the API server, behind a small interface.

`ResourceAPI` is the interface (claims read by Prepare; the node's ResourceSlices kept by the
publisher); `KubeResourceAPI` implements it with the kubernetes client (`ResourceV1Api`,
`CoreV1Api`), reading raw JSON (`_preload_content=False`) that the plugin decodes into its own
Structs. Errors become `ApiError` with the HTTP status (0 when the server was not reached).
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

REQUEST_TIMEOUT_S = 10.0
AUTH_CACHE_S = 5.0


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


def _direct_target(cfg: Any) -> tuple[str, str, int] | None:
    """(scheme, host, port) when claims can be read over a plain keep-alive connection with the
    client's own TLS settings; None where the kubernetes client's pool must do it (a proxy, a TLS
    server name or host name override: rare set-ups, read as before)."""
    if cfg.proxy or cfg.tls_server_name or isinstance(cfg.assert_hostname, str) or cfg.socket_options:
        return None
    u = urlsplit(cfg.host)
    if u.scheme not in ("http", "https") or not u.hostname or (u.path not in ("", "/")):
        return None
    return u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)


def _ssl_context(cfg: Any) -> ssl.SSLContext:
    """The kubernetes client's TLS settings (kubernetes/client/rest.py RESTClientObject: verify_ssl,
    ssl_ca_cert, ca_cert_data, cert_file, key_file, assert_hostname)."""
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None, cadata=cfg.ca_cert_data or None)
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    if not cfg.verify_ssl:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif cfg.assert_hostname is False:
        ctx.check_hostname = False
    return ctx


class KubeResourceAPI:
    """ResourceAPI over a kubernetes.client.ApiClient."""

    def __init__(self, api_client: Any, timeout: float = REQUEST_TIMEOUT_S) -> None:
        from kubernetes import client  # slow import: only when an API server is configured

        self._client = api_client
        self._resource = client.ResourceV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._timeout = timeout
        self._direct = _direct_target(api_client.configuration)
        self._ssl = _ssl_context(api_client.configuration) if self._direct and self._direct[0] == "https" else None
        self._local = threading.local()  # one keep-alive connection per reading thread
        self._auth: tuple[float, dict[str, str]] | None = None

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, _preload_content=False, _request_timeout=self._timeout, **kw)
        except Exception as e:  # ApiException, urllib3 errors, pydantic validation of a body
            status, msg = _message(e)
            raise ApiError(status, msg) from None

    def get_claim(self, namespace: str, name: str) -> bytes:
        """GET with the client's credentials (the bearer token of `auth_settings`, refreshed by
        the client's hook: in-cluster token files, kubeconfig exec plugins; client certificates)
        and TLS settings, over a keep-alive connection of this thread: NodePrepareResources reads
        one claim per claim, and the generated method (argument validation, its pool's
        bookkeeping, response objects) cost several times the read itself (make bench-dra)."""
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"
        headers = self._headers()
        if self._direct is None:
            return self._get_pooled(self._client.configuration.host + path, headers)
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request("GET", path, headers=headers)
                r = conn.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException) as e:
                # A keep-alive connection the server closed meanwhile: once more on a new one.
                conn.close()
                self._local.conn = None
                if attempt == 2 or isinstance(e, TimeoutError):
                    raise ApiError(0, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
                continue
            if r.will_close:
                conn.close()
                self._local.conn = None
            if r.status == 401 and attempt == 1:
                headers = self._headers(fresh=True)  # a token rotated within AUTH_CACHE_S
                continue
            if r.status != 200:
                raise ApiError(r.status, _status_message(data))
            return data
        raise AssertionError("unreachable")  # pragma: no cover

    def _headers(self, fresh: bool = False) -> dict[str, str]:
        """The request headers with the client's credentials, asked of the client at most every
        AUTH_CACHE_S (its refresh hook re-reads kubeconfig or token files, and setting the host
        reads the whole proxy environment: half a millisecond a call)."""
        now = time.monotonic()
        cached = self._auth
        if cached is not None and not fresh and now - cached[0] < AUTH_CACHE_S:
            return cached[1]
        headers = {"Accept": "application/json", "User-Agent": "vgpu-dra-plugin"}
        for auth in self._client.configuration.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        self._auth = (now, headers)
        return headers

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            assert self._direct is not None
            scheme, host, port = self._direct
            if scheme == "https":
                conn = http.client.HTTPSConnection(host, port, timeout=self._timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self._timeout)
            self._local.conn = conn
        return conn

    def _get_pooled(self, url: str, headers: dict[str, str]) -> bytes:
        """The same GET through the client's own connection pool (proxies and the like)."""
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
    """The API by vgpu.kube's rule, None when nothing is configured (KubeConfigError when broken)."""
    from vgpu import kube

    api = kube.load()
    return KubeResourceAPI(api) if api is not None else None
