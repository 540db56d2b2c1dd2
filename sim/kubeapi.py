"""A local stand-in of the Kubernetes API server (NOT kube-apiserver): real HTTP, in-memory objects.

The kubernetes Python client talks to it unmodified (point a kubeconfig at `url`). What it does:

- Objects under `/api/v1[/namespaces/<ns>]/<plural>[/<name>[/<sub>]]` and
  `/apis/<group>/<version>[/namespaces/<ns>]/<plural>[/<name>]` for any plural (pods, nodes,
  events, leases, configmaps... kinds named from a small table, else derived from the plural).
- get, list (labelSelector with `k=v`, `k!=v`, `k`; fieldSelector `spec.nodeName`,
  `metadata.name`, `metadata.namespace`, `status.phase` with `=`/`==`/`!=`), watch (chunked JSON
  lines from a resourceVersion; a version older than the kept history gets an ERROR event with
  code 410, as kube-apiserver sends; `timeoutSeconds` honoured), create (409 AlreadyExists,
  generateName), replace (PUT; a stale metadata.resourceVersion is a 409 Conflict), patch
  (`merge-patch+json` RFC 7386, `strategic-merge-patch+json` approximated as a merge patch whose
  lists of named objects merge by `name`, `json-patch+json` RFC 6902; a metadata.resourceVersion
  in a merge patch is a precondition: 409 when stale), delete (immediate, or with
  `graceful_pods=True` a pod gets deletionTimestamp first and goes on `finalize_pod`), the
  `pods/<name>/binding` subresource (sets spec.nodeName, 409 when already bound) and
  `<name>/status` (patch/replace of the same object).
- One global resourceVersion counter; every change is a watch event.
- What kube-apiserver does to Pods and Nodes on the way in (sim/admission.py, from its
  sources, checked against tests/data/real-traces/{webhook,quantities}): quantities written in
  canonical form (3000 is stored as "3k"), requests defaulted from limits, the mutating webhooks
  of the MutatingWebhookConfigurations stored here called as the API server calls them
  (`POST /webhook?timeout=10s`, selectors, matchConditions, failurePolicy; `endpoints` says where
  a Service is served), the generateName after admission, and container resources validated
  (an extended resource must be whole: 422 "must be an integer").

Not modelled: other admission plugins, the rest of defaulting and validation, RBAC, server-side
apply, field managers, list pagination (limit/continue are ignored: lists are whole).

Tests use it directly too: `create`, `get`, `update`, `delete`, `objects`, `expire_history`,
`fail_next` (inject an HTTP error on the next matching request), `requests` (what was asked).
"""

from __future__ import annotations

import bisect
import copy
import datetime
import json
import re
import socket
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sim import admission

Obj = dict[str, Any]

KINDS: dict[str, tuple[str, str]] = {
    # plural -> (kind, apiVersion); core group when apiVersion has no "/"
    "pods": ("Pod", "v1"),
    "nodes": ("Node", "v1"),
    "namespaces": ("Namespace", "v1"),
    "events": ("Event", "v1"),
    "configmaps": ("ConfigMap", "v1"),
    "secrets": ("Secret", "v1"),
    "leases": ("Lease", "coordination.k8s.io/v1"),
    # DRA (resource.k8s.io/v1, staging/src/k8s.io/api/resource/v1/types.go): ResourceClaim is
    # namespaced; ResourceSlice and DeviceClass are `+genclient:nonNamespaced`.
    "resourceclaims": ("ResourceClaim", "resource.k8s.io/v1"),
    "resourceslices": ("ResourceSlice", "resource.k8s.io/v1"),
    "deviceclasses": ("DeviceClass", "resource.k8s.io/v1"),
}
CLUSTER_SCOPED = {"nodes", "namespaces", "resourceslices", "deviceclasses"}


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class APIError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch; `strategic` merges lists of objects by their `name`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue  # strategic directives ($patch, $retainKeys...) are not modelled
        if v is None:
            out.pop(k, None)
        elif (
            strategic
            and isinstance(v, list)
            and isinstance(out.get(k), list)
            and all(isinstance(i, dict) and "name" in i for i in v + out[k])
        ):
            merged = {i["name"]: i for i in out[k]}
            order = [i["name"] for i in out[k]]
            for item in v:
                n = item["name"]
                if n in merged:
                    merged[n] = merge_patch(merged[n], item, strategic)
                else:
                    merged[n] = copy.deepcopy(item)
                    order.append(n)
            out[k] = [merged[n] for n in order]
        else:
            out[k] = merge_patch(out.get(k), v, strategic)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_json_patch(doc: Any, ops: list[Obj]) -> Any:
    """RFC 6902 (add, remove, replace, test, copy, move) on a copy of `doc`; ValueError on a bad op."""
    doc = copy.deepcopy(doc)

    def parent(parts: list[str]) -> tuple[Any, str]:
        cur = doc
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur, parts[-1]

    def get(parts: list[str]) -> Any:
        cur = doc
        for p in parts:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur

    def add(parts: list[str], value: Any) -> None:
        nonlocal doc
        if not parts:
            doc = value
            return
        c, k = parent(parts)
        if isinstance(c, list):
            if k == "-":
                c.append(value)
            else:
                i = int(k)
                if not 0 <= i <= len(c):
                    raise ValueError(f"index {i} out of range")
                c.insert(i, value)
        elif isinstance(c, dict):
            c[k] = value
        else:
            raise ValueError("add into a scalar")

    def remove(parts: list[str]) -> Any:
        c, k = parent(parts)
        if isinstance(c, list):
            return c.pop(int(k))
        if k not in c:
            raise ValueError(f"remove: no {k!r}")
        return c.pop(k)

    try:
        for op in ops:
            kind, parts = op["op"], _pointer(op["path"])
            if kind == "add":
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(parts)
            elif kind == "replace":
                get(parts)  # must exist
                remove(parts) if parts else None
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "test":
                if get(parts) != op["value"]:
                    raise ValueError(f"test failed at {op['path']}")
            elif kind in ("copy", "move"):
                src = _pointer(op["from"])
                value = copy.deepcopy(get(src))
                if kind == "move":
                    remove(src)
                add(parts, value)
            else:
                raise ValueError(f"unknown op {kind!r}")
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"JSON patch: {e!r}") from None
    return doc


def _parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            out.append((k.strip(), "!=", v.strip()))
        elif "==" in term:
            k, v = term.split("==", 1)
            out.append((k.strip(), "=", v.strip()))
        elif "=" in term:
            k, v = term.split("=", 1)
            out.append((k.strip(), "=", v.strip()))
        elif term.startswith("!"):
            out.append((term[1:].strip(), "!", None))
        else:
            out.append((term, "exists", None))
    return out


def _field(obj: Obj, path: str) -> str:
    cur: Any = obj
    for p in path.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def _matches(obj: Obj, labels: list[tuple[str, str, str | None]], fields: list[tuple[str, str, str | None]]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    for k, op, v in labels:
        if op == "=" and have.get(k) != v:
            return False
        if op == "!=" and have.get(k) == v:
            return False
        if op == "exists" and k not in have:
            return False
        if op == "!" and k in have:
            return False
    for k, op, v in fields:
        got = _field(obj, k)
        if op == "=" and got != v:
            return False
        if op == "!=" and got == v:
            return False
    return True


Key = tuple[str, str, str]  # (plural, namespace, name)


class Route:
    """A parsed request path."""

    def __init__(self, plural: str, namespace: str, name: str, sub: str, api_version: str) -> None:
        self.plural, self.namespace, self.name, self.sub, self.api_version = plural, namespace, name, sub, api_version


_CORE = re.compile(
    r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)
_GROUP = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)


def _route(path: str) -> Route | None:
    m = _CORE.match(path)
    if m:
        if m["plural"] == "namespaces" and m["ns"] is None and m["name"] is None:
            pass
        return Route(m["plural"], m["ns"] or "", m["name"] or "", m["sub"] or "", "v1")
    m = _GROUP.match(path)
    if m:
        return Route(m["plural"], m["ns"] or "", m["name"] or "", m["sub"] or "", f"{m['group']}/{m['version']}")
    return None


class KubeAPI:
    """The stand-in: `with KubeAPI() as api: api.write_kubeconfig(path)`; state is shared by HTTP and direct calls."""

    def __init__(self, history: int = 20_000, graceful_pods: bool = False) -> None:
        self._lock = threading.Condition()
        self._objects: dict[Key, Obj] = {}
        self._events: list[tuple[int, str, str, str, Obj]] = []  # (rv, plural, ns, type, object)
        self._history = history
        self._oldest = 1  # the oldest resourceVersion a watch may resume from
        self._rv = 1
        self.graceful_pods = graceful_pods
        self.requests: list[tuple[str, str, str]] = []  # (method, path+query, content type)
        self._faults: list[tuple[str, re.Pattern[str], int, int]] = []  # (method, path regex, status, times)
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.latency_s = 0.0  # added to every HTTP request (timeouts, races)
        self.endpoints = admission.Endpoints()  # where webhook Services are served
        self.admission_calls: list[Obj] = []  # AdmissionReviews sent to webhooks

    # ----- lifecycle -----
    def start(self) -> KubeAPI:
        api = self

        class Handler(_Handler):
            server_api = api

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kubeapi", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> KubeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "test-token"}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "u"}}],
            "current-context": "standin",
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.kubeconfig()))
        return p

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient bound to this stand-in (no kubeconfig file needed)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.api_key = {"authorization": "test-token"}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    # ----- fault injection -----
    def fail_next(self, method: str, path_regex: str, status: int, times: int = 1) -> None:
        with self._lock:
            self._faults.append((method.upper(), re.compile(path_regex), status, times))

    def _fault(self, method: str, path: str) -> int:
        with self._lock:
            for i, (m, rx, status, times) in enumerate(self._faults):
                if m == method and rx.search(path):
                    if times <= 1:
                        del self._faults[i]
                    else:
                        self._faults[i] = (m, rx, status, times - 1)
                    return status
        return 0

    # ----- store (thread-safe; objects handed out are copies) -----
    def _bump(self, plural: str, ns: str, etype: str, obj: Obj) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, plural, ns, etype, obj))  # published objects are never mutated
        if len(self._events) > self._history:
            drop = len(self._events) - self._history
            self._oldest = self._events[drop - 1][0]
            del self._events[:drop]
        self._lock.notify_all()

    def expire_history(self) -> None:
        """Forget every watch event: a watch resuming from any earlier version now gets 410 Gone."""
        with self._lock:
            self._events.clear()
            self._rv += 1  # as a compaction: every version before now is gone; lists give the new one
            self._oldest = self._rv
            self._lock.notify_all()

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    def _kind(self, plural: str, api_version: str) -> tuple[str, str]:
        if plural in KINDS:
            return KINDS[plural]
        k = plural[:-1] if plural.endswith("s") else plural
        return k[:1].upper() + k[1:], api_version

    def create(self, plural: str, obj: Obj, namespace: str = "", api_version: str = "v1") -> Obj:
        """As kube-apiserver's create handler (sim/admission.py): decode and defaulting,
        mutating admission (Pods), then the name from generateName, validation, the store."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns = "" if plural in CLUSTER_SCOPED else (namespace or meta.get("namespace") or "default")
        kind, av = self._kind(plural, api_version)
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", av)
        if ns:
            meta["namespace"] = ns
        try:
            admission.normalize(plural, obj)
            if plural == "pods":
                obj = self._admit_pod(obj, ns)  # outside the lock: a webhook may call this API
        except admission.AdmissionError as e:
            raise APIError(e.code, e.reason, e.message) from None
        meta = obj.setdefault("metadata", {})
        with self._lock:
            if not meta.get("name"):
                # rest.BeforeCreate, after mutating admission: the webhook saw no name.
                gen = meta.get("generateName")
                if not gen:
                    raise APIError(422, "Invalid", f"{plural}: metadata.name: Required value")
                meta["name"] = gen + uuidlib.uuid4().hex[:5]
            name = meta["name"]
            if plural == "pods":
                try:
                    admission.validate_pod(obj)
                except admission.AdmissionError as e:
                    raise APIError(e.code, e.reason, e.message) from None
            if (plural, ns, name) in self._objects:
                raise APIError(409, "AlreadyExists", f'{plural} "{name}" already exists')
            meta["uid"] = meta.get("uid") or str(uuidlib.uuid4())
            meta.setdefault("creationTimestamp", now_rfc3339())
            meta.pop("resourceVersion", None)
            if plural == "pods":
                obj.setdefault("spec", {})
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            self._objects[(plural, ns, name)] = obj
            self._bump(plural, ns, "ADDED", obj)
            return copy.deepcopy(obj)

    def _admit_pod(self, pod: Obj, ns: str) -> Obj:
        """Mutating admission webhooks of the MutatingWebhookConfigurations stored here."""
        configs = self.objects("mutatingwebhookconfigurations")
        if not configs:
            return pod
        with self._lock:
            nso = self._objects.get(("namespaces", "", ns))
        # The NamespaceLifecycle controller labels every namespace with its name.
        labels = {**((nso or {}).get("metadata", {}).get("labels") or {}), "kubernetes.io/metadata.name": ns}
        return admission.mutate(pod, ns, configs, labels, self.endpoints, apply_json_patch, self.admission_calls)

    def get(self, plural: str, name: str, namespace: str = "") -> Obj:
        ns = "" if plural in CLUSTER_SCOPED else (namespace or "default")
        with self._lock:
            o = self._objects.get((plural, ns, name))
            if o is None:
                raise APIError(404, "NotFound", f'{plural} "{name}" not found')
            return copy.deepcopy(o)

    def objects(self, plural: str, namespace: str | None = None) -> list[Obj]:
        with self._lock:
            return [
                copy.deepcopy(o)
                for (p, ns, _), o in sorted(self._objects.items())
                if p == plural and (namespace is None or ns == namespace)
            ]

    def _mutate(
        self, plural: str, ns: str, name: str, fn: Callable[[Obj], Obj], rv: str | None = None, pure: bool = False
    ) -> Obj:
        with self._lock:
            cur = self._objects.get((plural, ns, name))
            if cur is None:
                raise APIError(404, "NotFound", f'{plural} "{name}" not found')
            if rv and rv != cur["metadata"]["resourceVersion"]:
                raise APIError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again",
                )
            new = fn(cur if pure else copy.deepcopy(cur))
            part = {"pods": "spec", "nodes": "status"}.get(plural)
            if part and new is not cur and not (pure and new.get(part) is cur.get(part)):
                if pure and isinstance(new.get(part), dict):
                    new[part] = copy.deepcopy(new[part])  # a merge patch shares what it did not touch
                try:
                    admission.normalize(plural, new)  # every write is decoded and defaulted
                except admission.AdmissionError as e:
                    raise APIError(e.code, e.reason, e.message) from None
            new["metadata"] = dict(new.get("metadata") or {})  # its own, as _bump writes resourceVersion
            meta = new.setdefault("metadata", {})
            # immutable identity
            for k in ("name", "namespace", "uid", "creationTimestamp"):
                if k in cur["metadata"]:
                    meta[k] = cur["metadata"][k]
            if cur["metadata"].get("deletionTimestamp"):
                meta["deletionTimestamp"] = cur["metadata"]["deletionTimestamp"]
            if new == cur:
                return copy.deepcopy(cur)  # no-op: no new version, no event (as kube-apiserver)
            self._objects[(plural, ns, name)] = new
            self._bump(plural, ns, "MODIFIED", new)
            return copy.deepcopy(new)

    def update(self, plural: str, obj: Obj, namespace: str = "") -> Obj:
        """Replace (PUT semantics): a metadata.resourceVersion given must be current."""
        meta = obj.get("metadata", {})
        ns = "" if plural in CLUSTER_SCOPED else (namespace or meta.get("namespace") or "default")
        return self._mutate(plural, ns, meta["name"], lambda _cur: copy.deepcopy(obj), meta.get("resourceVersion"))

    def patch(self, plural: str, name: str, body: Any, namespace: str = "", kind: str = "merge") -> Obj:
        ns = "" if plural in CLUSTER_SCOPED else (namespace or "default")
        if kind == "json":
            if not isinstance(body, list):
                raise APIError(400, "BadRequest", "json patch body must be a list")

            def fn(cur: Obj) -> Obj:
                try:
                    out = apply_json_patch(cur, body)
                except ValueError as e:
                    raise APIError(422, "Invalid", str(e)) from None
                return out

            return self._mutate(plural, ns, name, fn)
        if not isinstance(body, dict):
            raise APIError(400, "BadRequest", "patch body must be an object")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        body = copy.deepcopy(body)
        if "metadata" in body and isinstance(body["metadata"], dict):
            body["metadata"].pop("resourceVersion", None)
        return self._mutate(plural, ns, name, lambda cur: merge_patch(cur, body, kind == "strategic"), rv, pure=True)

    def delete(self, plural: str, name: str, namespace: str = "") -> Obj:
        ns = "" if plural in CLUSTER_SCOPED else (namespace or "default")
        with self._lock:
            cur = self._objects.get((plural, ns, name))
            if cur is None:
                raise APIError(404, "NotFound", f'{plural} "{name}" not found')
            if plural == "pods" and self.graceful_pods and not cur["metadata"].get("deletionTimestamp"):
                cur = copy.deepcopy(cur)
                cur["metadata"]["deletionTimestamp"] = now_rfc3339()
                cur["metadata"]["deletionGracePeriodSeconds"] = 30
                self._objects[(plural, ns, name)] = cur
                self._bump(plural, ns, "MODIFIED", cur)
                return copy.deepcopy(cur)
            del self._objects[(plural, ns, name)]
            self._bump(plural, ns, "DELETED", cur)
            return copy.deepcopy(cur)

    def set_terminating(self, name: str, namespace: str = "default") -> Obj:
        """Mark a pod as being deleted (deletionTimestamp set, object kept) as a graceful delete does."""
        with self._lock:
            cur = copy.deepcopy(self._objects[("pods", namespace, name)])
            cur["metadata"]["deletionTimestamp"] = now_rfc3339()
            self._objects[("pods", namespace, name)] = cur
            self._bump("pods", namespace, "MODIFIED", cur)
            return copy.deepcopy(cur)

    def finalize_pod(self, name: str, namespace: str = "default") -> None:
        """The end of a graceful delete: the pod goes."""
        with self._lock:
            cur = self._objects.pop(("pods", namespace, name))
            self._bump("pods", namespace, "DELETED", cur)

    def bind(
        self,
        name: str,
        namespace: str,
        node: str,
        annotations: dict[str, str] | None = None,
        uid: str = "",
        resource_version: str = "",
    ) -> None:
        """pods/binding as kube-apiserver's BindingREST (pkg/registry/core/pod/storage/storage.go
        setPodNodeAndMetadata): the Binding's UID and resourceVersion are preconditions (409), a
        pod being deleted or already assigned is refused, the Binding's annotations are merged
        into the pod's in the same update as nodeName and PodScheduled=True."""

        def fn(cur: Obj) -> Obj:
            if uid and cur["metadata"].get("uid") != uid:
                raise APIError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on pods/binding "{name}": Precondition failed: UID in '
                    f"precondition: {uid}, UID in object meta: {cur['metadata'].get('uid')}",
                )
            if cur["metadata"].get("deletionTimestamp"):
                raise APIError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is being deleted, '
                    "cannot be assigned to a host",
                )
            if annotations:
                cur["metadata"]["annotations"] = {**(cur["metadata"].get("annotations") or {}), **annotations}
            if cur.get("spec", {}).get("nodeName"):
                raise APIError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on pods/binding "{name}": '
                    f'pod {name} is already assigned to node "{cur["spec"]["nodeName"]}"',
                )
            cur.setdefault("spec", {})["nodeName"] = node
            conds = cur.setdefault("status", {}).setdefault("conditions", [])
            conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()})
            return cur

        self._mutate("pods", namespace, name, fn, rv=resource_version or None)

    def list(self, plural: str, ns: str | None, labels: str = "", fields: str = "") -> tuple[list[Obj], int]:
        ls, fs = _parse_selector(labels), _parse_selector(fields)
        with self._lock:
            items = [
                copy.deepcopy(o)
                for (p, ons, _), o in self._objects.items()
                if p == plural and (ns is None or ons == ns) and _matches(o, ls, fs)
            ]
            return items, self._rv

    def watch(
        self, plural: str, ns: str | None, rv: str, labels: str, fields: str, timeout_s: float
    ) -> Iterator[Obj | None]:
        """Watch events from `rv` ("" / "0": current objects as ADDED first); None = keep-alive tick."""
        ls, fs = _parse_selector(labels), _parse_selector(fields)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if rv in ("", "0"):
                start = self._rv
                initial = [
                    {"type": "ADDED", "object": o}
                    for (p, ons, _), o in self._objects.items()
                    if p == plural and (ns is None or ons == ns) and _matches(o, ls, fs)
                ]
            else:
                try:
                    start = int(rv)
                except ValueError:
                    start = -1
                if start < self._oldest:
                    initial = [
                        {
                            "type": "ERROR",
                            "object": APIError(
                                410, "Expired", f"too old resource version: {rv} ({self._oldest})"
                            ).status(),
                        }
                    ]
                    yield from initial
                    return
                initial = []
        yield from initial
        pos = start
        while True:
            batch: list[Obj] = []
            with self._lock:
                if self._stopping:
                    return
                if pos < self._oldest:
                    yield APIError(410, "Expired", f"too old resource version: {pos} ({self._oldest})").status() | {
                        "_error": True
                    }
                    return
                first = bisect.bisect_right(self._events, pos, key=lambda e: e[0])
                for erv, p, ens, etype, o in self._events[first:]:
                    pos = erv
                    if p == plural and (ns is None or ens == ns) and _matches(o, ls, fs):
                        batch.append({"type": etype, "object": o})
                if not batch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._lock.wait(min(left, 0.5))
            if batch:
                yield from batch
            else:
                yield None


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that went away (connection pools are dropped with their ApiClient)
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out as separate writes: without TCP_NODELAY, Nagle's algorithm and
        # the peer's delayed ACK hold each keep-alive response back by ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    server_api: KubeAPI

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise APIError(400, "BadRequest", "body is not JSON") from None

    def _handle(self, method: str) -> None:
        api = self.server_api
        u = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        ctype = self.headers.get("Content-Type", "")
        with api._lock:
            api.requests.append((method, self.path, ctype))
        if api.latency_s:
            time.sleep(api.latency_s)
        try:
            fault = api._fault(method, u.path)
            if fault:
                self._body()
                raise APIError(fault, "InjectedFault", f"injected {fault} on {method} {u.path}")
            r = _route(u.path)
            if r is None:
                raise APIError(404, "NotFound", f"the server could not find the requested resource ({u.path})")
            ns_scope: str | None = r.namespace if r.namespace else None
            if r.plural in CLUSTER_SCOPED:
                ns_scope = None
            if method == "GET" and not r.name:
                if q.get("watch") in ("true", "1"):
                    self._watch(r.plural, ns_scope, q)
                    return
                items, rv = api.list(r.plural, ns_scope, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                kind, av = api._kind(r.plural, r.api_version)
                self._send(
                    200,
                    {"kind": kind + "List", "apiVersion": av, "metadata": {"resourceVersion": str(rv)}, "items": items},
                )
                return
            if method == "GET":
                self._send(200, api.get(r.plural, r.name, r.namespace))
                return
            body = self._body()
            if method == "POST" and not r.name:
                self._send(201, api.create(r.plural, body or {}, r.namespace, r.api_version))
            elif method == "POST" and r.sub == "binding" and r.plural == "pods":
                node = ((body or {}).get("target") or {}).get("name", "")
                if not node:
                    raise APIError(422, "Invalid", "binding: target.name: Required value")
                bmeta = (body or {}).get("metadata") or {}
                api.bind(
                    r.name,
                    r.namespace or "default",
                    node,
                    bmeta.get("annotations"),
                    bmeta.get("uid") or "",
                    bmeta.get("resourceVersion") or "",
                )
                self._send(
                    201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
                )
            elif method == "PUT" and r.name:
                obj = body or {}
                obj.setdefault("metadata", {})["name"] = r.name
                self._send(200, api.update(r.plural, obj, r.namespace))
            elif method == "PATCH" and r.name:
                if "json-patch" in ctype:
                    kind = "json"
                elif "strategic-merge-patch" in ctype:
                    kind = "strategic"
                elif "merge-patch" in ctype:
                    kind = "merge"
                else:
                    raise APIError(
                        415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}"
                    )
                self._send(200, api.patch(r.plural, r.name, body, r.namespace, kind))
            elif method == "DELETE" and r.name:
                self._send(200, api.delete(r.plural, r.name, r.namespace))
            else:
                raise APIError(405, "MethodNotAllowed", f"{method} {u.path}")
        except APIError as e:
            self._send(e.code, e.status())

    def _watch(self, plural: str, ns: str | None, q: dict[str, str]) -> None:
        api = self.server_api
        timeout = float(q.get("timeoutSeconds") or 300)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        try:
            for ev in api.watch(
                plural,
                ns,
                q.get("resourceVersion", ""),
                q.get("labelSelector", ""),
                q.get("fieldSelector", ""),
                timeout,
            ):
                if ev is None:
                    continue
                if ev.get("_error"):
                    ev = {"type": "ERROR", "object": {k: v for k, v in ev.items() if k != "_error"}}
                chunk(json.dumps(ev).encode() + b"\n")
            chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


@contextmanager
def running(**kw: Any) -> Iterator[KubeAPI]:
    api = KubeAPI(**kw).start()
    try:
        yield api
    finally:
        api.stop()


# ----- object builders for tests -----
def use_kubeconfig(monkeypatch: Any, path: str | Path) -> None:
    """In-process Kubernetes clients of the code under test load this kubeconfig: KUBECONFIG set,
    the in-cluster environment (KUBERNETES_SERVICE_HOST) removed."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(path))


def node_object(
    name: str, annotations: dict[str, str] | None = None, gpus: int = 0, labels: dict[str, str] | None = None
) -> Obj:
    """A Ready Node; `gpus`: allocatable nvidia.com/gpu (vGPU slots the device plugin registered)."""
    return {
        "metadata": {
            "name": name,
            "labels": labels or {"kubernetes.io/hostname": name},
            "annotations": annotations or {},
        },
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "250", "nvidia.com/gpu": str(gpus)},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "250", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def pod_object(
    name: str,
    containers: list[tuple[str, dict[str, str]]],
    init: list[tuple[str, dict[str, str]]] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
    scheduler: str = "",
) -> Obj:
    """A Pod whose containers ask for `limits` (name, {resource: quantity})."""

    def c(n: str, lim: dict[str, str]) -> Obj:
        return {"name": n, "image": "busybox", "resources": {"limits": dict(lim)} if lim else {}}

    spec: Obj = {"containers": [c(n, lim) for n, lim in containers]}
    if init:
        spec["initContainers"] = [c(n, lim) for n, lim in init]
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}}, "spec": spec}


def main(argv: list[str] | None = None) -> int:
    """`python -m sim.kubeapi`: serve the stand-in in its own process until SIGTERM.

    Prints `kubeapi: serving on <url>` once listening (benchmarks keep it off their own GIL).
    """
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="kubeapi", description="Kubernetes API stand-in (tests only)")
    ap.add_argument("--history", type=int, default=20_000, help="watch events kept (older versions get 410)")
    args = ap.parse_args(argv)
    api = KubeAPI(history=args.history).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"kubeapi: serving on {api.url}", flush=True)
    done.wait()
    api.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
