"""The scheduler's API edge: the few Kubernetes calls it makes, as plain JSON dicts.

The kubernetes Python client does the HTTP (auth, TLS, kubeconfig); responses are read raw
(`_preload_content=False`) and parsed as JSON (msgspec: plain dicts and lists, a few times
faster than the json module and many times faster than the client's model objects for thousands
of pods and nodes), which keeps annotations exactly as stored.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec

log = logging.getLogger(__name__)

Obj = dict[str, Any]


def _decode(data: bytes | str) -> Obj:
    try:
        out = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise APIFailure(0, f"answer is not JSON: {e}") from None
    if not isinstance(out, dict):
        raise APIFailure(0, "answer is not a JSON object")
    return out


class APIFailure(Exception):
    """An API call that failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Conflict(APIFailure):
    pass


class NotFound(APIFailure):
    pass


class Expired(APIFailure):
    """A watch's resourceVersion is too old (410 Gone): relist."""


def _failure(e: Exception) -> APIFailure:
    from kubernetes.client.rest import ApiException

    if isinstance(e, ApiException):
        status = int(e.status or 0)
        msg = e.reason or ""
        try:
            msg = json.loads(e.body or "{}").get("message") or msg
        except (ValueError, AttributeError):
            pass
        cls = {409: Conflict, 404: NotFound, 410: Expired}.get(status, APIFailure)
        return cls(status, f"{status}: {msg}")
    return APIFailure(0, f"{type(e).__name__}: {e}")


def load_api_client(kubeconfig: str = "") -> Any:
    """An ApiClient: in-cluster service account, else the kubeconfig file ($KUBECONFIG, ~/.kube/config)."""
    from kubernetes import client, config

    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser("~/.kube/config")
    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)
    return client.ApiClient(cfg)


def micro_time(t: float) -> str:
    """A MicroTime (RFC 3339 with microseconds, UTC), as Lease spec times are written."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


class Kube:
    """Thin, typed wrappers; every failure is an APIFailure (Conflict, NotFound, Expired)."""

    def __init__(self, api_client: Any, timeout_s: float = 10.0) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.coord = client.CoordinationV1Api(api_client)
        self.timeout_s = timeout_s

    def _raw(self, fn: Any, *args: Any, **kw: Any) -> Obj:
        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kw)
            data = resp.data
        except Exception as e:
            raise _failure(e) from None
        return _decode(data) if data else {}

    # ----- pods and nodes -----
    def list_pods(self) -> tuple[list[Obj], str]:
        doc = self._raw(self.core.list_pod_for_all_namespaces)
        return doc.get("items") or [], (doc.get("metadata") or {}).get("resourceVersion") or ""

    def list_nodes(self, label_selector: str = "") -> tuple[list[Obj], str]:
        kw = {"label_selector": label_selector} if label_selector else {}
        doc = self._raw(self.core.list_node, **kw)
        return doc.get("items") or [], (doc.get("metadata") or {}).get("resourceVersion") or ""

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = ""
    ) -> Iterator[tuple[str, Obj]]:
        """(type, object) events of pods or nodes from resource_version; Expired on 410."""
        from kubernetes.watch.watch import iter_resp_lines

        fn = self.core.list_pod_for_all_namespaces if kind == "pods" else self.core.list_node
        kw: dict[str, Any] = {"label_selector": label_selector} if label_selector and kind == "nodes" else {}
        resp: Any
        try:
            resp = fn(
                watch=True,
                resource_version=resource_version,
                timeout_seconds=timeout_s,
                allow_watch_bookmarks=True,
                _preload_content=False,
                _request_timeout=(self.timeout_s, timeout_s + self.timeout_s),
                **kw,
            )
        except Exception as e:
            raise _failure(e) from None
        try:
            for line in iter_resp_lines(resp):
                ev = _decode(line)
                et, obj = str(ev.get("type") or ""), ev.get("object") or {}
                if et == "ERROR":
                    code = int(obj.get("code") or 0)
                    if code == 410:
                        raise Expired(410, obj.get("message") or "resource version too old")
                    raise APIFailure(code, obj.get("message") or "watch error")
                yield et, obj
        except APIFailure:
            raise
        except Exception as e:
            raise _failure(e) from None
        finally:
            resp.release_conn()

    def get_pod(self, namespace: str, name: str) -> Obj:
        return self._raw(self.core.read_namespaced_pod, name, namespace)

    def bind(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: dict[str, str] | None = None,
        resource_version: str = "",
    ) -> None:
        """Create the pod's Binding. kube-apiserver merges the Binding's annotations into the pod in
        the same update that sets nodeName, with its UID and resourceVersion as preconditions
        (pkg/registry/core/pod/storage/storage.go BindingREST.setPodNodeAndMetadata): one write
        that places the pod and records its decision, or neither (409 when the pod changed)."""
        meta: Obj = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if resource_version:
            meta["resourceVersion"] = resource_version
        if annotations:
            meta["annotations"] = annotations
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self._raw(self.core.create_namespaced_pod_binding, name, namespace, body)

    # ----- leases -----
    def get_lease(self, namespace: str, name: str) -> Obj:
        return self._raw(self.coord.read_namespaced_lease, name, namespace)

    def create_lease(self, namespace: str, body: Obj) -> Obj:
        return self._raw(self.coord.create_namespaced_lease, namespace, body)

    def replace_lease(self, namespace: str, name: str, body: Obj) -> Obj:
        return self._raw(self.coord.replace_namespaced_lease, name, namespace, body)
