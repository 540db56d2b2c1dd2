"""The scheduler's HTTP/1.1 server (vgpu_scheduler/httpd.py) over real sockets: what kube-scheduler
and kube-apiserver send (recorded headers), keep-alive and pipelining, bodies in pieces,
`Expect: 100-continue`, and each refusal with its status, closing the connection."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from sim.kubeapi import KubeAPI
from tests.support import traces
from tests.vgpu_scheduler.helpers import gpu_node
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.httpd import Server
from vgpu_scheduler.kube import Kube
from vgpu_scheduler.server import Service, make_server


def echo(method: str, target: str, body: bytes) -> tuple[int, bytes]:
    if target == "/boom":
        raise RuntimeError("a bug")
    return 200, json.dumps({"method": method, "target": target, "len": len(body)}).encode()


@pytest.fixture
def srv() -> Iterator[Server]:
    s = Server(("127.0.0.1", 0), echo, idle_timeout=1.0, max_body=1000)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield s
    s.shutdown()
    s.server_close()


def conn(s: Server) -> socket.socket:
    c = socket.create_connection(s.server_address, timeout=5)
    return c


def read_answer(c: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    while b"\r\n\r\n" not in buf:
        data = c.recv(65536)
        if not data:
            raise EOFError(bytes(buf))
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        rest += c.recv(65536)
    buf[:] = rest[n:]
    return int(lines[0].split()[1]), headers, rest[:n]


def closed(c: socket.socket) -> bool:
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_pipelined_requests_and_a_body_in_pieces(srv: Server) -> None:
    c = conn(srv)
    buf = bytearray()
    two = b"POST /filter?x=1 HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    c.sendall(two)
    assert read_answer(c, buf)[2] == b'{"method": "POST", "target": "/filter?x=1", "len": 3}'
    assert json.loads(read_answer(c, buf)[2]) == {"method": "GET", "target": "/healthz", "len": 0}
    # the head, then the body in pieces; Expect: 100-continue gets its interim answer first
    c.sendall(b"POST /bind HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 600\r\n\r\n")
    status, _, _ = read_answer(c, buf)
    assert status == 100
    for _ in range(6):
        c.sendall(b"x" * 100)
        time.sleep(0.01)
    status, headers, body = read_answer(c, buf)
    assert status == 200 and json.loads(body)["len"] == 600 and headers["content-type"] == "application/json"
    # a handler's bug is a 500, and the connection goes on
    c.sendall(b"GET /boom HTTP/1.1\r\n\r\n")
    assert read_answer(c, buf)[0] == 500
    c.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    status, headers, _ = read_answer(c, buf)
    assert status == 200 and headers["connection"] == "close" and closed(c)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /filter HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 411),
        (b"POST /filter HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", 413),
        (b"POST /filter HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /filter HTTP/1.1\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n", 431),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET /\xff HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno-colon\r\n\r\n", 400),
    ],
)
def test_refusals_close_the_connection(srv: Server, request_bytes: bytes, status: int) -> None:
    c = conn(srv)
    c.sendall(request_bytes)
    got, headers, body = read_answer(c, bytearray())
    assert got == status and headers["connection"] == "close" and json.loads(body)["Error"]
    assert closed(c)


def test_http_1_0_is_answered_and_closed_and_idle_connections_time_out(srv: Server) -> None:
    c = conn(srv)
    c.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert read_answer(c, bytearray())[0] == 200 and closed(c)
    idle = conn(srv)
    time.sleep(1.5)  # idle_timeout 1 s
    assert closed(idle)


def test_the_recorded_requests_of_kube_scheduler_are_served() -> None:
    """kube-scheduler's own requests (request line and headers as recorded, the body re-encoded
    compactly as Go does, Content-Length to match) to the real dispatch: every verb answers 200
    with its wire type."""
    recorded = traces.load_json("extender/requests-nodecache-true.json")
    with KubeAPI() as api:
        for n in ("node-1", "node-2"):
            api.create("nodes", gpu_node(n, n=1, mem_gib=16, split=4))
        svc = Service(SchedulerConfig(), Kube(api.api_client()))
        svc.start()
        assert svc.state.ready.wait(10)
        s = make_server(svc)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        try:
            c = conn(s)
            buf = bytearray()
            seen = set()
            for r in recorded:
                if r["verb"] not in ("filter", "prioritize", "preempt"):
                    continue
                body = json.dumps(r["body"], separators=(",", ":")).encode()
                line = r["request_line"].replace("/extender/", "/")
                head = line + "\r\n"
                for k, v in r["headers"]:
                    head += f"{k}: {len(body) if k.lower() == 'content-length' else v}\r\n"
                c.sendall(head.encode() + b"\r\n" + body)
                status, _, out = read_answer(c, buf)
                assert status == 200, (r["scenario"], r["verb"], out)
                doc = json.loads(out)
                want = {"filter": "NodeNames", "preempt": "NodeNameToMetaVictims"}.get(r["verb"])
                assert (want in doc) if want else isinstance(doc, list)
                seen.add(r["verb"])
            assert seen == {"filter", "prioritize", "preempt"}
        finally:
            s.shutdown()
            s.server_close()
            svc.stop()
