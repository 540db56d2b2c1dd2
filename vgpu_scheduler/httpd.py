"""A small HTTP/1.1 server: the extender verbs, the webhook and health on one port.

kube-scheduler calls the filter of every pod inside its one-pod-at-a-time scheduling cycle, so a
filter's round trip is on the cluster's critical path, and in this process every millisecond
another thread holds the interpreter is a millisecond the filter may wait for it. The standard
library's http.server spends about 0.4 ms of CPU per request of its own (header parsing through
the email package, buffered file objects, a reason phrase table); this server reads a request
with a few recv calls into one buffer, parses only the headers it needs, and answers with one
send: a tenth of that (make bench-scheduler, docs/developers/scheduler.md "Scale").

What it accepts is what its callers send: kube-scheduler's extender client and kube-apiserver's
webhook client (Go net/http: a body of known length, `Content-Length`; recorded in
tests/data/real-traces/extender and webhook), health probes (no body). A body sent chunked gets
411 Length Required, one over `max_body` 413, a head over MAX_HEAD 431, anything unparsable 400;
each closes the connection. `Expect: 100-continue` is answered. Connections are kept alive
(HTTP/1.1 unless `Connection: close`; an HTTP/1.0 request is answered and closed) and closed
after `idle_timeout` without a request, so no thread is held forever. With an SSL context the
handshake runs in the connection's thread, never in the accept loop.
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_HEAD = 64 << 10
REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}

# (method, target as sent: path and query, body) -> (status, JSON body)
Handler = Callable[[str, str, bytes], tuple[int, bytes]]


def _answer(status: int, body: bytes, close: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    if close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n" + body


class _Refused(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class Server:
    """Threads per connection, like socketserver.ThreadingMixIn; the same serve_forever /
    shutdown / server_close / server_address."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: Handler,
        ssl_context: ssl.SSLContext | None = None,
        idle_timeout: float = 60.0,
        max_body: int = 32 << 20,
    ) -> None:
        self.handler = handler
        self.ssl_context = ssl_context
        self.idle_timeout = idle_timeout
        self.max_body = max_body
        self.socket = socket.create_server(address, backlog=128)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()

    # ----- accepting -----
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.socket, selectors.EVENT_READ)
                while not self._stop.is_set():
                    if not sel.select(poll_interval):
                        continue
                    try:
                        conn, _addr = self.socket.accept()
                    except OSError:
                        continue
                    threading.Thread(target=self._serve, args=(conn,), name="http-conn", daemon=True).start()
        finally:
            self._stop.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    # ----- one connection -----
    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.idle_timeout)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
            buf = bytearray()
            while self._one(sock, buf):
                pass
        except (OSError, ssl.SSLError, ValueError) as e:  # peers going away, timeouts, TLS failures
            log.debug("connection ended: %s", e)
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def _one(self, sock: socket.socket, buf: bytearray) -> bool:
        """Serve one request from `buf` and the socket; False when the connection is to end."""
        try:
            end = buf.find(b"\r\n\r\n")
            while end < 0:
                if len(buf) > MAX_HEAD:
                    raise _Refused(431, "request head too large")
                data = sock.recv(1 << 16)
                if not data:
                    return False  # the peer closed (between requests: normal)
                buf += data
                end = buf.find(b"\r\n\r\n", max(0, len(buf) - len(data) - 3))
            if end > MAX_HEAD:
                raise _Refused(431, "request head too large")
            lines = bytes(buf[:end]).split(b"\r\n")
            del buf[: end + 4]
            parts = lines[0].split(b" ")
            if len(parts) != 3:
                raise _Refused(400, "malformed request line")
            method, target, version = parts[0].decode("ascii"), parts[1].decode("ascii"), parts[2]
            if version not in (b"HTTP/1.1", b"HTTP/1.0"):
                raise _Refused(505, "HTTP/1.0 or HTTP/1.1 only")
            length = b"0"
            conn_hdr = expect = b""
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep:
                    raise _Refused(400, "malformed header")
                name = name.strip().lower()
                if name == b"content-length":
                    length = value.strip()
                elif name == b"transfer-encoding":
                    raise _Refused(411, "a body of known length (Content-Length) is required")
                elif name == b"connection":
                    conn_hdr = value.strip().lower()
                elif name == b"expect":
                    expect = value.strip().lower()
            if not length.isdigit():
                raise _Refused(400, "invalid Content-Length")
            n = int(length)
            if n > self.max_body:
                raise _Refused(413, "body too large")
        except (UnicodeDecodeError, _Refused) as e:
            status, why = (e.status, str(e)) if isinstance(e, _Refused) else (400, "request line is not ASCII")
            sock.sendall(_answer(status, b'{"Error":"' + why.encode() + b'"}', close=True))
            return False
        if expect == b"100-continue" and len(buf) < n:
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if len(buf) < n:
            body = bytearray(n)
            have = len(buf)
            body[:have] = buf
            buf.clear()
            view = memoryview(body)
            while have < n:
                got = sock.recv_into(view[have:])
                if not got:
                    return False  # the peer went away mid-request
                have += got
            data = bytes(body)
        else:
            data = bytes(buf[:n])
            del buf[:n]
        keep = version == b"HTTP/1.1" and conn_hdr != b"close"
        try:
            status, out = self.handler(method, target, data)
        except Exception:  # a bug must not kill the connection's thread silently
            log.exception("%s %s failed", method, target.split("?", 1)[0][:100])
            status, out = 500, b'{"Error":"internal error"}'
        sock.sendall(_answer(status, out, close=not keep))
        return keep
