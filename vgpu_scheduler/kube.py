"""The scheduler's API edge: the few Kubernetes calls it makes, as raw JSON over HTTP/1.1.

The kubernetes Python client loads the configuration (in-cluster service account or kubeconfig:
server, CA, client certificate, bearer token and its refresh hook for rotated tokens and exec
plugins). The calls themselves go through `Transport`, a small HTTP/1.1 client on one keep-alive
connection per thread: the generated client spends about 0.8 ms of CPU per call (argument
validation, serialisation, urllib3), ten times what the request itself needs, and every
millisecond a bind or a watch holds the interpreter is a millisecond the filter may wait for it
(make bench-scheduler, docs/developers/scheduler.md "Scale"). Bodies are JSON read with msgspec; watch
events and lists of pods and nodes are decoded into the few fields the scheduler keeps
(snapshot.py), never into whole objects. A kubeconfig with a proxy goes through the client's own
connection pool instead (urllib3 speaks to proxies).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import msgspec
import urllib3

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MAX_HEADER = 64 << 10
MAX_BODY = 1 << 30  # a list of every pod of a large cluster


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


def _failure(status: int, body: bytes) -> APIFailure:
    """The Status the API server answered (its `message`), as an APIFailure of that code."""
    msg = ""
    try:
        doc = json.loads(body or b"{}")
        if isinstance(doc, dict):
            msg = str(doc.get("message") or doc.get("reason") or "")
    except ValueError:
        msg = body[:200].decode("utf-8", "replace")
    cls = {409: Conflict, 404: NotFound, 410: Expired}.get(status, APIFailure)
    return cls(status, f"{status}: {msg}")


def load_api_client(kubeconfig: str = "") -> Any:
    """An ApiClient by vgpu.kube's rule; a scheduler without any configuration cannot run."""
    from vgpu import kube

    api = kube.load(kubeconfig)
    if api is None:
        raise kube.KubeConfigError("no kubeconfig ($KUBECONFIG, ~/.kube/config) and not running in a cluster")
    return api


def micro_time(t: float) -> str:
    """A MicroTime (RFC 3339 with microseconds, UTC), as Lease spec times are written."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


# ----- HTTP/1.1 -----
class _Conn:
    """One connection: a socket and what was read past the last answer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.used = False  # served a request already (a failure may be a stale keep-alive)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("connection closed by the API server")
        self.buf += data

    def head(self) -> tuple[int, dict[bytes, bytes]]:
        """Status and headers (names lower-case) of the next answer."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buf) > MAX_HEADER:
                raise APIFailure(0, "answer headers too large")
            self._more()
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise APIFailure(0, f"not an HTTP answer: {lines[0][:80]!r}")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        status = int(parts[1])
        if status == 100:
            return self.head()
        return status, headers

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return out
            if len(self.buf) > MAX_HEADER:
                raise APIFailure(0, "malformed chunk")
            self._more()

    def chunks(self) -> Iterator[bytes]:
        """The data of a chunked body, chunk by chunk, as it arrives."""
        while True:
            size_text = self.line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise APIFailure(0, f"malformed chunk size {size_text[:20]!r}") from None
            if size == 0:
                while self.line():  # trailers, then the empty line
                    pass
                return
            if size > MAX_BODY:
                raise APIFailure(0, "chunk too large")
            yield self.exact(size)
            if self.exact(2) != b"\r\n":
                raise APIFailure(0, "malformed chunk end")

    def body(self, headers: dict[bytes, bytes]) -> bytes:
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            out = bytearray()
            for c in self.chunks():
                out += c
                if len(out) > MAX_BODY:
                    raise APIFailure(0, "answer too large")
            return bytes(out)
        n = int(headers.get(b"content-length", b"0") or 0)
        if n > MAX_BODY:
            raise APIFailure(0, "answer too large")
        return self.exact(n)


def _closed(sock: socket.socket) -> bool:
    """Whether an idle connection was closed by the server (or sent something unasked)."""
    try:
        r, _, _ = select.select([sock], [], [], 0)
        if not r:
            return False
        sock.setblocking(False)
        try:
            if isinstance(sock, ssl.SSLSocket):
                sock.recv(1)  # TLS records only (a session ticket) raise SSLWantReadError
            else:
                sock.recv(1, socket.MSG_PEEK)
            return True  # end of stream, or bytes nobody asked for
        except (ssl.SSLWantReadError, BlockingIOError):
            return False
    except (OSError, ValueError):
        return True


class Transport:
    """Requests to the API server with the client configuration's address, TLS settings and
    credentials, on one keep-alive connection per thread (a watch gets a connection of its own).

    Credentials are read for every request (`auth_settings`, which calls the configuration's
    refresh hook: rotated service-account tokens, kubeconfig exec plugins). The server's
    certificate is checked against the configured CA (or the system's) and host name, unless the
    configuration says `verify_ssl = False` (kubeconfig `insecure-skip-tls-verify`)."""

    def __init__(self, cfg: Any, timeout_s: float) -> None:
        u = urlsplit(str(cfg.host))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"API server address {cfg.host!r} is not http(s)://host[:port]")
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.base = u.path.rstrip("/")
        self.host_header = (u.netloc.rsplit("@", 1)[-1]).encode()
        self.ctx: ssl.SSLContext | None = None
        if self.https:
            ctx = ssl.create_default_context(cafile=getattr(cfg, "ssl_ca_cert", None) or None)
            if getattr(cfg, "cert_file", None):
                ctx.load_cert_chain(cfg.cert_file, getattr(cfg, "key_file", None) or None)
            if not getattr(cfg, "verify_ssl", True):
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self.ctx = ctx
        self.server_name = getattr(cfg, "tls_server_name", None) or self.host
        self._local = threading.local()

    def _auth(self) -> bytes:
        out = b""
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                out += f"{auth['key']}: {auth['value']}\r\n".encode()
        return out

    def _connect(self, timeout: float) -> _Conn:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ctx is not None:
            sock = self.ctx.wrap_socket(sock, server_hostname=self.server_name)
        return _Conn(sock)

    def _send(self, c: _Conn, method: str, path: str, body: bytes | None, ctype: str) -> None:
        head = (
            f"{method} {self.base}{path} HTTP/1.1\r\n".encode()
            + b"Host: "
            + self.host_header
            + b"\r\nUser-Agent: vgpu-scheduler\r\nAccept: application/json\r\n"
            + self._auth()
        )
        if body is not None:
            head += f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n".encode()
        c.sock.sendall(head + b"\r\n" + (body or b""))

    def request(
        self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"
    ) -> tuple[int, bytes]:
        """(status, body). A reused connection the server closed meanwhile is replaced once:
        when sending failed (nothing was read), or for a GET when the answer never began."""
        for attempt in (0, 1):
            c: _Conn | None = getattr(self._local, "conn", None)
            if c is not None and not c.buf and _closed(c.sock):
                # An idle keep-alive connection the server closed (it sends nothing unasked): a
                # new one, rather than a write whose fate is unknown (as urllib3 checks).
                c.close()
                c = self._local.conn = None
            fresh = c is None
            try:
                if c is None:
                    c = self._local.conn = self._connect(self.timeout_s)
                c.sock.settimeout(self.timeout_s)
            except OSError as e:
                self._local.conn = None
                raise APIFailure(0, f"cannot connect to the API server: {e}") from None
            sent = False
            try:
                self._send(c, method, path, body, ctype)
                sent = True
                status, headers = c.head()
                data = c.body(headers)
                c.used = True
                if headers.get(b"connection", b"").lower() == b"close":
                    c.close()
                    self._local.conn = None
                return status, data
            except (OSError, APIFailure) as e:
                c.close()
                self._local.conn = None
                stale = not fresh and c.used and not c.buf and (not sent or method == "GET")
                if attempt == 0 and stale and not isinstance(e, (socket.timeout, APIFailure)):
                    continue
                raise APIFailure(0, f"{method} {path}: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def stream(self, path: str, read_timeout: float) -> Iterator[bytes]:
        """GET on a connection of its own; the answer's lines (a watch: one event per line)."""
        try:
            c = self._connect(self.timeout_s)
        except OSError as e:
            raise APIFailure(0, f"cannot connect to the API server: {e}") from None
        try:
            try:
                self._send(c, "GET", path, None, "")
                status, headers = c.head()
                c.sock.settimeout(read_timeout)
                if status != 200:
                    raise _failure(status, c.body(headers))
                if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                    source: Iterator[bytes] = c.chunks()
                else:
                    source = iter([c.body(headers)])
                yield from _lines(source)
            except OSError as e:
                raise APIFailure(0, f"watch {path}: {type(e).__name__}: {e}") from None
        finally:
            c.close()


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The non-blank lines of a watch stream (one JSON event per line), however it is chunked."""
    pending = b""
    for data in chunks:
        if pending:
            data = pending + data
        lines = data.split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


class _PoolTransport:
    """The same requests through the kubernetes client's urllib3 pool (proxies)."""

    def __init__(self, cfg: Any, pool: Any, timeout_s: float) -> None:
        self.cfg, self.pool, self.timeout_s = cfg, pool, timeout_s
        self.base = str(cfg.host).rstrip("/")

    def _headers(self, ctype: str = "") -> dict[str, str]:
        out = {"Accept": "application/json", "User-Agent": "vgpu-scheduler"}
        if ctype:
            out["Content-Type"] = ctype
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                out[auth["key"]] = auth["value"]
        return out

    def request(
        self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"
    ) -> tuple[int, bytes]:
        try:
            r = self.pool.request(
                method,
                self.base + path,
                body=body,
                headers=self._headers(ctype if body else ""),
                timeout=self.timeout_s,
            )
        except Exception as e:  # urllib3 errors: connection refused, timeouts, TLS
            raise APIFailure(0, f"{method} {path}: {type(e).__name__}: {e}") from None
        return int(r.status), bytes(r.data)

    def stream(self, path: str, read_timeout: float) -> Iterator[bytes]:
        try:
            r = self.pool.request(
                "GET",
                self.base + path,
                headers=self._headers(),
                preload_content=False,
                timeout=urllib3.Timeout(connect=self.timeout_s, read=read_timeout),
            )
        except Exception as e:
            raise APIFailure(0, f"watch {path}: {type(e).__name__}: {e}") from None
        try:
            if r.status != 200:
                raise _failure(int(r.status), r.read())
            yield from _lines(r.stream(1 << 16, decode_content=False))
        except APIFailure:
            raise
        except Exception as e:
            raise APIFailure(0, f"watch {path}: {type(e).__name__}: {e}") from None
        finally:
            r.release_conn()


class _Status(msgspec.Struct):
    code: int = 0
    message: str = ""


class _EventHead(msgspec.Struct):
    """A watch event with its object left undecoded (decoded by kind, or not at all)."""

    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"null")


class _Meta(msgspec.Struct):
    resourceVersion: str = ""


class _RVOnly(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


_event_head = msgspec.json.Decoder(_EventHead)
_status = msgspec.json.Decoder(_Status)
_rv_only = msgspec.json.Decoder(_RVOnly)


class Kube:
    """Thin, typed wrappers; every failure is an APIFailure (Conflict, NotFound, Expired)."""

    def __init__(self, api_client: Any, timeout_s: float = 10.0) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s
        cfg = api_client.configuration
        self.http: Transport | _PoolTransport
        if getattr(cfg, "proxy", None):
            self.http = _PoolTransport(cfg, api_client.rest_client.pool_manager, timeout_s)
        else:
            self.http = Transport(cfg, timeout_s)

    def _call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> bytes:
        data = msgspec.json.encode(body) if body is not None else None
        status, out = self.http.request(method, path, data, ctype)
        if status >= 300:
            raise _failure(status, out)
        return out

    def _obj(self, method: str, path: str, body: Any = None) -> Obj:
        out = self._call(method, path, body)
        return _decode(out) if out else {}

    # ----- pods and nodes -----
    def list_raw(self, kind: str, label_selector: str = "") -> bytes:
        """The list of pods (all namespaces) or nodes as the API server answered it (decoded by the
        caller into what it keeps: snapshot.decode_pod_list, decode_node_list)."""
        q = f"?{urlencode({'labelSelector': label_selector})}" if label_selector and kind == "nodes" else ""
        return self._call("GET", f"/api/v1/{kind}{q}")

    def list_pods(self) -> tuple[list[Obj], str]:
        doc = _decode(self.list_raw("pods"))
        return doc.get("items") or [], (doc.get("metadata") or {}).get("resourceVersion") or ""

    def list_nodes(self, label_selector: str = "") -> tuple[list[Obj], str]:
        doc = _decode(self.list_raw("nodes", label_selector))
        return doc.get("items") or [], (doc.get("metadata") or {}).get("resourceVersion") or ""

    def watch_raw(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = ""
    ) -> Iterator[tuple[str, str, msgspec.Raw]]:
        """(type, resourceVersion, the object's JSON) of pod or node events from resource_version
        (with bookmarks); Expired on 410. Only the type and the version are decoded here."""
        q: dict[str, str] = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(int(timeout_s)),
            "allowWatchBookmarks": "true",
        }
        if label_selector and kind == "nodes":
            q["labelSelector"] = label_selector
        for line in self.http.stream(f"/api/v1/{kind}?{urlencode(q)}", timeout_s + self.timeout_s):
            try:
                ev = _event_head.decode(line)
                if ev.type == "ERROR":
                    st = _status.decode(ev.object)
                    if st.code == 410:
                        raise Expired(410, st.message or "resource version too old")
                    raise APIFailure(st.code, st.message or "watch error")
                rv = _rv_only.decode(ev.object).metadata.resourceVersion
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise APIFailure(0, f"watch event is not JSON: {e}") from None
            yield ev.type, rv, ev.object

    def watch(
        self, kind: str, resource_version: str, timeout_s: int, label_selector: str = ""
    ) -> Iterator[tuple[str, Obj]]:
        """(type, object) events of pods or nodes from resource_version; Expired on 410."""
        for et, _rv, raw in self.watch_raw(kind, resource_version, timeout_s, label_selector):
            yield et, _decode(raw)

    def get_pod(self, namespace: str, name: str) -> Obj:
        return self._obj("GET", f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}")

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
        ns, n = quote(namespace, safe=""), quote(name, safe="")
        self._call("POST", f"/api/v1/namespaces/{ns}/pods/{n}/binding", body)

    # ----- leases -----
    def _lease_path(self, namespace: str, name: str = "") -> str:
        p = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}/leases"
        return f"{p}/{quote(name, safe='')}" if name else p

    def get_lease(self, namespace: str, name: str) -> Obj:
        return self._obj("GET", self._lease_path(namespace, name))

    def create_lease(self, namespace: str, body: Obj) -> Obj:
        return self._obj("POST", self._lease_path(namespace), body)

    def replace_lease(self, namespace: str, name: str, body: Obj) -> Obj:
        return self._obj("PUT", self._lease_path(namespace, name), body)
