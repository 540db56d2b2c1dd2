"""HTTP(S) front of the scheduler: the extender verbs, the webhook and health on one port.

Routes: POST /filter, /prioritize, /bind, /preempt (kube-scheduler extender), POST /webhook
(AdmissionReview v1), GET /healthz (process alive), GET /readyz (state synced; 503 otherwise;
a follower is ready too: kube-scheduler's own leader election decides who calls). `--serve`
limits the POST routes to the extender verbs or to the webhook (others answer 404).
Routing looks at the URL's path only: kube-apiserver calls `POST /webhook?timeout=10s` (client-go
adds `timeout` from the webhook's timeoutSeconds; tests/data/real-traces/webhook), and an
extender's urlPrefix may carry a query too.
Bodies are capped (MAX_BODY); a body that does not decode is answered as the verb's result
with `Error` set (HTTP 200, as kube-scheduler expects), never a traceback. The HTTP itself is
httpd.py's (a lean HTTP/1.1 server: the filter's round trip is on kube-scheduler's critical path).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading

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
from vgpu_scheduler.httpd import Server
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


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def dispatch(service: Service, method: str, target: str, body: bytes) -> tuple[int, bytes]:
    """(status, JSON body) of one request. Routing looks at the path only (`target` may carry a
    query: kube-apiserver calls `/webhook?timeout=10s`), without a trailing slash."""
    path = target.split("?", 1)[0].split("#", 1)[0].rstrip("/") or "/"
    if method == "GET":
        if path == "/healthz":
            return 200, b'{"status":"ok"}'
        if path == "/readyz":
            ok = service.state.ready.is_set()
            return (200 if ok else 503), _json({"ready": ok, "leader": service.is_leader()})
        return 404, b'{"error":"not found"}'
    if method != "POST":
        return 405, _json({"Error": f"{method} not allowed"})
    ext = service.extender
    if path in ("/filter", "/prioritize", "/bind", "/preempt", "/webhook") and not service.serves(path):
        # --serve: e.g. the webhook's port is reachable from the cluster network; the extender
        # verbs (which write decisions and Bindings) do not exist there at all.
        return 404, _json({"Error": f"{path} is not served here (--serve {service.cfg.serve})"})
    if path == "/filter":
        try:
            args = _args.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return 200, _enc.encode(ExtenderFilterResult(Error=f"bad ExtenderArgs: {e}"))
        return 200, _enc.encode(ext.filter(args))
    if path == "/prioritize":
        try:
            args = _args.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return 400, b'{"Error":"bad ExtenderArgs"}'
        return 200, _enc.encode(ext.prioritize(args))
    if path == "/bind":
        try:
            bargs = _bind_args.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return 200, _enc.encode(ExtenderBindingResult(Error=f"bad ExtenderBindingArgs: {e}"))
        return 200, _enc.encode(ext.bind(bargs))
    if path == "/preempt":
        # ExtenderPreemptionResult has no Error field: kube-scheduler reports a non-200 answer as
        # the extender's error (extender.go send) and retries the pod.
        try:
            pargs = _preempt_args.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return 400, _json({"Error": f"bad ExtenderPreemptionArgs: {e}"})
        try:
            return 200, _enc.encode(ext.preempt(pargs))
        except PreemptError as e:
            return 503, _json({"Error": str(e)})
    if path == "/webhook":
        # The `timeout` query (e.g. 10s) is the API server's deadline; a review takes
        # milliseconds, so it is not consulted.
        try:
            review = json.loads(body)
            webhook.check_request(review)
        except ValueError as e:
            # Not an AdmissionReview v1 we could answer (no uid to echo): a non-2xx status is a
            # failed call to the API server, decided by the webhook's failurePolicy.
            return 400, _json({"error": f"bad AdmissionReview: {e}"})
        return 200, _json(webhook.review(review, service.cfg, service.state.limits))
    return 404, b'{"Error":"unknown verb"}'


def make_server(
    service: Service, host: str = "127.0.0.1", port: int = 0, cert_file: str = "", key_file: str = ""
) -> Server:
    """The server (not yet serving); TLS when cert_file/key_file are given (the webhook needs it)."""
    ctx: ssl.SSLContext | None = None
    if cert_file:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert_file, key_file or None)
    return Server((host, port), lambda m, t, b: dispatch(service, m, t, b), ctx, max_body=MAX_BODY)


def serve_in_thread(srv: Server) -> threading.Thread:
    t = threading.Thread(target=srv.serve_forever, name="vgpu-scheduler-http", daemon=True)
    t.start()
    return t
