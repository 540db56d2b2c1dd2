"""The scheduler's HTTP/1.1 client to the API server (vgpu_scheduler/kube.py `Transport`), against
servers that answer exactly as scripted: TLS with the configured CA, server name and client
certificate, the bearer token read (and refreshed) for every request, keep-alive, Content-Length
and chunked answers, a keep-alive connection the server closed, and watch streams split anywhere."""

from __future__ import annotations

import itertools
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from vgpu_scheduler.kube import APIFailure, Expired, Kube, NotFound, _PoolTransport

Handler = Callable[["Peer", bytes, dict[str, str], bytes], None]


class Peer:
    """One accepted connection of the scripted server."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.closing = False  # set by a handler: the connection ends after its answer
        self.closed = threading.Event()

    def request(self) -> tuple[bytes, dict[str, str], bytes] | None:
        while b"\r\n\r\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buf += data
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.decode().partition(":") for x in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(self.buf) < n:
            self.buf += self.sock.recv(65536)
        body, self.buf = self.buf[:n], self.buf[n:]
        return lines[0], headers, body

    def answer(self, status: int, body: bytes, chunks: list[bytes] | None = None) -> None:
        if chunks is None:
            self.sock.sendall(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            return
        out = f"HTTP/1.1 {status} X\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        for c in chunks:
            out += f"{len(c):x}\r\n".encode() + c + b"\r\n"
        self.sock.sendall(out + b"0\r\n\r\n")


class Scripted:
    """A TCP (or TLS) server; `handler(peer, request line, headers, body)` answers each request."""

    def __init__(self, handler: Handler, ctx: ssl.SSLContext | None = None) -> None:
        self.handler, self.ctx = handler, ctx
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.connections = 0
        self.requests: list[tuple[bytes, dict[str, str], bytes]] = []
        self.peer_certs: list[Any] = []
        self.closes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        try:
            if self.ctx is not None:
                s = self.ctx.wrap_socket(s, server_side=True)
                self.peer_certs.append(s.getpeercert())
            peer = Peer(s)
            while not peer.closing and (req := peer.request()) is not None:
                self.requests.append(req)
                self.handler(peer, *req)
        except (OSError, ssl.SSLError):
            pass
        finally:
            s.close()
            self.closes += 1

    def settle(self) -> None:
        """Wait until the server closed every connection it was going to close."""
        deadline = time.monotonic() + 5
        while self.closes < self.connections and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.lsock.close()


def _openssl_cert(d: Path, name: str, cn: str, san: str) -> tuple[str, str]:
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={cn}"]
        + (["-addext", f"subjectAltName={san}"] if san else [])
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def _client(host: str, **cfg_kw: Any) -> Any:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = host
    for k, v in cfg_kw.items():
        setattr(cfg, k, v)
    return client.ApiClient(cfg)


POD = {"kind": "Pod", "metadata": {"name": "p", "namespace": "default", "uid": "u1", "resourceVersion": "7"}}


def test_tls_ca_server_name_client_certificate_and_a_refreshed_token(tmp_path: Path) -> None:
    srv_cert, srv_key = _openssl_cert(tmp_path, "server", "kubernetes", "DNS:kubernetes.default.svc")
    cli_cert, cli_key = _openssl_cert(tmp_path, "client", "system:vgpu-scheduler", "")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cli_cert)
    ctx.load_cert_chain(srv_cert, srv_key)
    ctx.verify_mode = ssl.CERT_REQUIRED

    def handler(peer: Peer, line: bytes, headers: dict[str, str], body: bytes) -> None:
        if line.startswith(b"GET /api/v1/namespaces/default/pods/p "):
            peer.answer(
                200,
                json.dumps(POD).encode(),
                chunks=[
                    b'{"kind":"Pod","metadata":',
                    json.dumps(POD["metadata"]).encode()[:5],
                    json.dumps(POD["metadata"]).encode()[5:] + b"}",
                ],
            )
        else:
            peer.answer(404, b'{"kind":"Status","message":"pods \\"q\\" not found","code":404}')

    server = Scripted(handler, ctx)
    tokens = iter(["t1", "t2", "t3"])

    def refresh(cfg: Any) -> None:
        cfg.api_key = {"authorization": next(tokens)}

    api = _client(
        f"https://127.0.0.1:{server.port}",
        ssl_ca_cert=srv_cert,
        cert_file=cli_cert,
        key_file=cli_key,
        tls_server_name="kubernetes.default.svc",
        api_key={"authorization": "t0"},  # as load_kube_config leaves it; the hook rotates it
        api_key_prefix={"authorization": "Bearer"},
        refresh_api_key_hook=refresh,
    )
    kube = Kube(api, 5)
    assert kube.get_pod("default", "p") == POD  # a chunked answer, assembled
    with pytest.raises(NotFound, match='404: pods "q" not found'):
        kube.get_pod("default", "q")
    assert [h.get("authorization") for _, h, _ in server.requests] == ["Bearer t1", "Bearer t2"]
    assert server.connections == 1  # one keep-alive connection
    assert dict(x[0] for x in server.peer_certs[0]["subject"])["commonName"] == "system:vgpu-scheduler"
    # the server's certificate is checked: another name, or another CA, fails
    for kw in ({"tls_server_name": "elsewhere.example"}, {"ssl_ca_cert": cli_cert}):
        bad = Kube(
            _client(
                f"https://127.0.0.1:{server.port}",
                cert_file=cli_cert,
                key_file=cli_key,
                **{"ssl_ca_cert": srv_cert, "tls_server_name": "kubernetes.default.svc", **kw},
            ),
            5,
        )
        with pytest.raises(APIFailure, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            bad.get_pod("default", "p")
    server.close()


def test_a_keep_alive_connection_the_server_closed_is_replaced_and_a_write_is_never_repeated() -> None:
    seen: list[bytes] = []

    def handler(peer: Peer, line: bytes, headers: dict[str, str], body: bytes) -> None:
        seen.append(line)
        peer.answer(200, json.dumps(POD).encode())
        peer.closing = True  # closes after each answer, without saying so

    server = Scripted(handler)
    kube = Kube(_client(f"http://127.0.0.1:{server.port}"), 5)
    for _ in range(3):
        assert kube.get_pod("default", "p")["metadata"]["uid"] == "u1"  # a GET is retried
    kube.get_pod("default", "p")
    server.settle()  # the connection is idle and closed by the server when the write comes
    kube.bind("default", "p", "u1", "n1", {"a": "b"}, "7")
    assert server.connections == len(seen) == 5
    assert json.loads(server.requests[-1][2]) == {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {
            "name": "p",
            "namespace": "default",
            "uid": "u1",
            "resourceVersion": "7",
            "annotations": {"a": "b"},
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }

    # a write whose answer never comes is an error, not a second write
    def silent(peer: Peer, line: bytes, headers: dict[str, str], body: bytes) -> None:
        peer.closing = True

    server.handler = silent
    server.settle()
    with pytest.raises(APIFailure) as e:
        kube.bind("default", "p", "u1", "n1")
    assert e.value.status == 0 and sum(1 for r in server.requests if r[0].startswith(b"POST")) == 2
    server.close()


def _events(*evs: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in evs)


def test_watch_lines_split_anywhere_bookmarks_and_410() -> None:
    pod = {**POD, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}
    stream = _events(
        {"type": "ADDED", "object": pod},
        {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "12"}}},
        {"type": "DELETED", "object": {**pod, "metadata": {**pod["metadata"], "resourceVersion": "13"}}},
    )
    expired = _events(
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
    )

    def handler(peer: Peer, line: bytes, headers: dict[str, str], body: bytes) -> None:
        if b"resourceVersion=1&" in line:
            cuts = [0, 7, 8, 200, len(stream) - 3, len(stream)]  # events split across chunks and joined
            peer.answer(200, b"", chunks=[stream[a:b] for a, b in itertools.pairwise(cuts)])
        else:
            peer.answer(200, b"", chunks=[expired])

    server = Scripted(handler)
    kube = Kube(_client(f"http://127.0.0.1:{server.port}"), 5)
    got = [
        (t, rv, json.loads(bytes(raw))["metadata"]["name"] if t != "BOOKMARK" else "")
        for t, rv, raw in kube.watch_raw("pods", "1", 30)
    ]
    assert got == [("ADDED", "7", "p"), ("BOOKMARK", "12", ""), ("DELETED", "13", "p")]
    line = server.requests[0][0].decode()
    assert "watch=true" in line and "allowWatchBookmarks=true" in line and "timeoutSeconds=30" in line
    with pytest.raises(Expired):
        list(kube.watch_raw("pods", "2", 30))
    server.close()


def test_through_the_clients_own_pool_too() -> None:
    """With a proxy configured the calls go through the kubernetes client's urllib3 pool."""

    def handler(peer: Peer, line: bytes, headers: dict[str, str], body: bytes) -> None:
        if b"watch=true" in line:
            peer.answer(200, b"", chunks=[_events({"type": "ADDED", "object": POD})])
        else:
            peer.answer(200, json.dumps(POD).encode())

    server = Scripted(handler)
    api = _client(
        f"http://127.0.0.1:{server.port}", api_key={"authorization": "tok"}, api_key_prefix={"authorization": "Bearer"}
    )
    kube = Kube(api, 5)
    kube.http = _PoolTransport(api.configuration, urllib3.PoolManager(), 5)
    assert kube.get_pod("default", "p") == POD
    assert [t for t, _, _ in kube.watch_raw("pods", "1", 30)] == ["ADDED"]
    assert all(h.get("authorization") == "Bearer tok" for _, h, _ in server.requests)
    server.close()


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(k, raising=False)
    yield
