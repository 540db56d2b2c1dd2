"""Follow mode: the extender serves iff the kube-scheduler of its own pod leads (read-only Lease).

kube-scheduler calls only the extender of its own pod (127.0.0.1), so the replica that may decide
is the one next to the leading kube-scheduler, never a second election of ours: two independent
elections could put the two leaders in different pods, and then no vGPU pod is ever scheduled.

Which holder is "ours": kube-scheduler builds its identity in makeLeaderElectionConfig
(cmd/kube-scheduler/app/options/options.go) as `id := hostname + "_" + string(uuid.NewUUID())`,
hostname = os.Hostname(). Containers of one pod share the UTS namespace, so this process's
socket.gethostname() *is* that hostname (the pod's name, as the kubelet sets it: at most 63
characters). A hostname (a DNS label) and a UUID contain no "_", so the holder's part before its
last "_" is compared with ours; the UUID part changes on every kube-scheduler restart and does not
matter: any kube-scheduler process of this pod calls this extender.

Expiry: served only while now < renewTime + leaseDurationSeconds - handover_s on the wall clock.
Comparing a time another process wrote is sound here only because the writer is our own pod's
kube-scheduler, on this node's clock; for a holder in another pod the holder name alone says "not
ours". The handover_s margin stops us before any other kube-scheduler may take the Lease (client-go
takes it only after leaseDurationSeconds without a renewal), so writes we started land first. On
becoming the serving one we wait handover_s (a released Lease is taken at once, while the previous
extender may still be finishing a filter), then relist, and only then serve (docs/developers/scheduler.md,
"Failover").
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable

from vgpu_scheduler.kube import APIFailure, Kube, NotFound

log = logging.getLogger(__name__)


def parse_micro_time(text: str) -> float | None:
    """A Lease MicroTime (RFC 3339, 'Z' or an offset, optional fraction) as a Unix time; None if bad."""
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    if t.tzinfo is None:
        return None
    return t.timestamp()


def holder_host(holder: str) -> str:
    """The hostname part of a client-go holder identity `<hostname>_<uuid>` ('' if not that form)."""
    host, sep, _uuid = holder.rpartition("_")
    return host if sep else ""


class LeaseFollower:
    """Polls kube-scheduler's Lease; `is_leader()` is true while this pod's kube-scheduler holds it."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        hostname: str = "",
        retry_period_s: float = 2.0,
        handover_s: float = 2.0,
        on_started: Callable[[], None] = lambda: None,
        on_stopped: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        pause: Callable[[float], bool] | None = None,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.hostname = hostname or socket.gethostname()
        self.identity = self.hostname  # what /readyz and the logs show
        self.retry_period_s, self.handover_s = retry_period_s, handover_s
        self.on_started, self.on_stopped, self.clock = on_started, on_stopped, clock
        self._serving = threading.Event()
        self._until = 0.0  # wall-clock time after which we stop serving unless a renewal is seen
        self._stop = threading.Event()
        self._pause = pause or self._stop.wait  # the handover wait; True: stopped meanwhile
        self._lock = threading.Lock()
        self.transitions = 0
        self._thread: threading.Thread | None = None

    def is_leader(self) -> bool:
        if self._serving.is_set() and self.clock() >= self._until:
            self._step_down("the Lease was not renewed in time")
        return self._serving.is_set()

    def observe(self) -> float:
        """Read the Lease once: the time until which it says we may serve (0: not ours or expired)."""
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
        except NotFound:
            return 0.0
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        if not holder or holder_host(holder) != self.hostname:
            return 0.0
        renew = parse_micro_time(str(spec.get("renewTime") or ""))
        try:
            duration = float(spec.get("leaseDurationSeconds") or 0)
        except (TypeError, ValueError):
            duration = 0.0
        if renew is None or duration <= 0:
            return 0.0
        until = renew + duration - self.handover_s
        return until if until > self.clock() else 0.0

    def _step_down(self, why: str) -> None:
        with self._lock:
            if not self._serving.is_set():
                return
            self._serving.clear()
        log.warning("follow %s/%s: %s stops serving (%s)", self.namespace, self.name, self.hostname, why)
        self.on_stopped()

    def poll_once(self) -> None:
        try:
            until = self.observe()
        except APIFailure as e:
            log.info("follow %s/%s: %s", self.namespace, self.name, e)
            return  # keep the last deadline: an API hiccup alone does not flip serving
        if not until:
            self._step_down("kube-scheduler of this pod does not hold the Lease")
            return
        self._until = until
        if self._serving.is_set():
            return
        # Becoming the serving one: let the previous one's last writes land, then relist.
        if self._pause(self.handover_s):
            return
        try:
            until = self.observe()
        except APIFailure as e:
            log.info("follow %s/%s: %s", self.namespace, self.name, e)
            return
        if not until:
            return
        try:
            self.on_started()
        except Exception as e:  # the relist failed: do not serve on a partial view
            log.warning("follow %s/%s: start-up failed: %s", self.namespace, self.name, e)
            return
        self._until = until
        self.transitions += 1
        self._serving.set()
        log.info("follow %s/%s: %s serves (its kube-scheduler leads)", self.namespace, self.name, self.hostname)

    def run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.retry_period_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="vgpu-follow", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        """Stop following; `release` is accepted for LeaderElector's interface (nothing to release)."""
        self._serving.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
