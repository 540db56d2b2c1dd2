"""HTTP(S) front of the scheduler: the extender verbs, the webhook and health on one port.

Routes: POST /filter, /prioritize, /bind, /preempt (kube-scheduler extender), POST /webhook
(AdmissionReview v1), GET /healthz (process alive), GET /readyz (state synced; 503 otherwise;
a follower is ready too: kube-scheduler's own leader election decides who calls). `--serve`
limits the POST routes to the extender verbs or to the webhook (others answer 404).
Routing looks at the URL's path only: kube-apiserver calls `POST /webhook?timeout=10s` (client-go
adds `timeout` from the webhook's timeoutSeconds; tests/data/real-traces/webhook), and an
extender's urlPrefix may carry a query too.
Bodies are capped (MAX_BODY); a body that does not decode is answered as the verb's result
with `Error` set (HTTP 200, as kube-scheduler expects), never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import msgspec

from vgpu_scheduler import webhook
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.extender import (
    Extender,
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    PreemptError,
)
from vgpu_scheduler.follow import LeaseFollower
from vgpu_scheduler.kube import Kube
from vgpu_scheduler.leader import LeaderElector
from vgpu_scheduler.state import ClusterState

log = logging.getLogger(__name__)

MAX_BODY = 32 << 20  # a nodeCacheCapable:false filter carries every Node object

_enc = msgspec.json.Encoder()
_args = msgspec.json.Decoder(ExtenderArgs)
_bind_args = msgspec.json.Decoder(ExtenderBindingArgs)
_preempt_args = msgspec.json.Decoder(ExtenderPreemptionArgs)


class Service:
    """State + extender + optional leader election, wired to an API client."""

    def __init__(self, cfg: SchedulerConfig, kube: Kube | None) -> None:
        self.cfg = cfg
        self.kube = kube
        self.state = ClusterState(cfg, kube)
        self.leader: LeaderElector | LeaseFollower | None = None
        if cfg.serve == "webhook":
            pass  # no verbs: no gate and no pod state (start() watches the Nodes only)
        elif cfg.follow_lease:
            assert kube is not None
            ns, _, name = cfg.follow_lease.partition("/")
            self.leader = LeaseFollower(
                kube,
                ns,
                name,
                cfg.follow_hostname,
                cfg.retry_period_s,
                cfg.handover_s,
                on_started=self.state.resync,
            )
        elif cfg.leader_elect:
            assert kube is not None
            ident = cfg.identity or f"{socket.gethostname()}-{os.getpid()}"
            self.leader = LeaderElector(
                kube,
                cfg.lease_namespace,
                cfg.lease_name,
                ident,
                cfg.lease_duration_s,
                cfg.renew_deadline_s,
                cfg.retry_period_s,
                on_started=self.state.resync,
            )
        self.extender = Extender(cfg, self.state, kube, self.is_leader)

    def is_leader(self) -> bool:
        return self.leader.is_leader() if self.leader is not None else True

    def serves(self, path: str) -> bool:
        """Whether this process answers `path` (POST verbs) under --serve."""
        if path == "/webhook":
            return self.cfg.serve in ("all", "webhook")
        return self.cfg.serve in ("all", "extender")

    def start(self) -> None:
        if self.kube is not None:
            self.state.start(("nodes",) if self.cfg.serve == "webhook" else ("nodes", "pods"))
        else:
            self.state.ready.set()
        if self.leader is not None:
            self.leader.start()

    def stop(self, release: bool = True) -> None:
        if self.leader is not None:
            self.leader.stop(release)
        self.state.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out as separate writes: without TCP_NODELAY, Nagle's algorithm and
        # the peer's delayed ACK hold each keep-alive response back by ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    timeout = 60  # seconds a connection may stay idle or slow (no thread held forever)
    # Answers are buffered and sent in one write (handle_one_request flushes wfile): one system
    # call, and one wait to take the interpreter back after it, less per request (measured as
    # the larger part of a filter's round trip while binds run, make bench-scheduler).
    wbufsize = 1 << 16
    service: Service

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> str:
        """The request's path without query or fragment, and without a trailing slash."""
        return urlsplit(self.path).path.rstrip("/") or "/"

    def do_GET(self) -> None:
        path = self._route()
        if path == "/healthz":
            self._send(200, b'{"status":"ok"}')
        elif path == "/readyz":
            ok = self.service.state.ready.is_set()
            self._send(200 if ok else 503, json.dumps({"ready": ok, "leader": self.service.is_leader()}).encode())
        else:
            self._send(404, b'{"error":"not found"}')

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            self.close_connection = True
            self._send(413, b'{"Error":"body too large"}')
            return
        body = self.rfile.read(n)
        ext = self.service.extender
        path = self._route()
        if path in ("/filter", "/prioritize", "/bind", "/preempt", "/webhook") and not self.service.serves(path):
            # --serve: e.g. the webhook's port is reachable from the cluster network; the extender
            # verbs (which write decisions and Bindings) do not exist there at all.
            why = f"{path} is not served here (--serve {self.service.cfg.serve})"
            self._send(404, json.dumps({"Error": why}).encode())
            return
        try:
            if path == "/filter":
                try:
                    args = _args.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self._send(200, _enc.encode(ExtenderFilterResult(Error=f"bad ExtenderArgs: {e}")))
                    return
                self._send(200, _enc.encode(ext.filter(args)))
            elif path == "/prioritize":
                try:
                    args = _args.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self._send(400, b'{"Error":"bad ExtenderArgs"}')
                    return
                self._send(200, _enc.encode(ext.prioritize(args)))
            elif path == "/bind":
                try:
                    bargs = _bind_args.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self._send(200, _enc.encode(ExtenderBindingResult(Error=f"bad ExtenderBindingArgs: {e}")))
                    return
                self._send(200, _enc.encode(ext.bind(bargs)))
            elif path == "/preempt":
                # ExtenderPreemptionResult has no Error field: kube-scheduler reports a non-200
                # answer as the extender's error (extender.go send) and retries the pod.
                try:
                    pargs = _preempt_args.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self._send(400, json.dumps({"Error": f"bad ExtenderPreemptionArgs: {e}"}).encode())
                    return
                try:
                    self._send(200, _enc.encode(ext.preempt(pargs)))
                except PreemptError as e:
                    self._send(503, json.dumps({"Error": str(e)}).encode())
            elif path == "/webhook":
                # The `timeout` query (e.g. 10s) is the API server's deadline; a review takes
                # milliseconds, so it is not consulted.
                try:
                    review = json.loads(body)
                    webhook.check_request(review)
                except ValueError as e:
                    # Not an AdmissionReview v1 we could answer (no uid to echo): a non-2xx status
                    # is a failed call to the API server, decided by the webhook's failurePolicy.
                    self._send(400, json.dumps({"error": f"bad AdmissionReview: {e}"}).encode())
                    return
                out = webhook.review(review, self.service.cfg, self.service.state.limits)
                self._send(200, json.dumps(out).encode())
            else:
                self._send(404, b'{"Error":"unknown verb"}')
        except Exception as e:  # a bug must not kill the server thread silently
            log.exception("%s failed", path)
            self._send(500, json.dumps({"Error": f"internal error: {type(e).__name__}"}).encode())


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLError, TimeoutError)):
            log.debug("client %s: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)


def make_server(
    service: Service, host: str = "127.0.0.1", port: int = 0, cert_file: str = "", key_file: str = ""
) -> ThreadingHTTPServer:
    """The server (not yet serving); TLS when cert_file/key_file are given (the webhook needs it)."""
    handler = type("Handler", (_Handler,), {"service": service})
    srv = _Server((host, port), handler)
    srv.daemon_threads = True
    if cert_file:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert_file, key_file or None)
        # Handshakes happen on the first read, in the handler's thread, not in the accept loop.
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    return srv


def serve_in_thread(srv: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=srv.serve_forever, name="vgpu-scheduler-http", daemon=True)
    t.start()
    return t
