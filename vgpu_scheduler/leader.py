"""Lease-based leader election (coordination.k8s.io/v1), as client-go's leaderelection does it.

Own-lease mode (`--leader-elect`), for an extender without a kube-scheduler in its pod; the
chart follows kube-scheduler's own Lease instead (follow.py: one election, so one leader pod).

A candidate takes the Lease when it is free or its holder has not renewed it for
leaseDurationSeconds as observed on this replica's own clock (no cross-machine clock
comparison); writes are replaces conditioned on the Lease's resourceVersion, so two
candidates cannot both win one round. The leader renews every retry_period_s and steps down
by itself when it has not renewed for renew_deadline_s (< lease duration), before any other
replica may take over. `on_started` runs before `is_leader` turns true: the scheduler relists
there, so a new leader decides only on the annotations every earlier leader wrote.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vgpu_scheduler.kube import APIFailure, Conflict, Kube, NotFound, micro_time

log = logging.getLogger(__name__)


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        on_started: Callable[[], None] = lambda: None,
        on_stopped: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_duration_s, self.renew_deadline_s, self.retry_period_s = (
            lease_duration_s,
            renew_deadline_s,
            retry_period_s,
        )
        self.on_started, self.on_stopped, self.clock = on_started, on_stopped, clock
        self._leader = threading.Event()
        self._stop = threading.Event()
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._renewed_at = 0.0
        self.transitions = 0
        self._thread: threading.Thread | None = None

    def is_leader(self) -> bool:
        if self._leader.is_set() and self.clock() - self._renewed_at > self.renew_deadline_s:
            self._step_down("renew deadline passed")
        return self._leader.is_set()

    def _spec(self, acquire: str, transitions: int) -> dict[str, Any]:
        now = micro_time(time.time())
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_duration_s),
            "acquireTime": acquire or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """One round; True when this replica holds the Lease afterwards."""
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
        except NotFound:
            body = {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec("", 0)}
            try:
                self.kube.create_lease(self.namespace, body)
            except APIFailure as e:
                log.info("lease create: %s", e)
                return False
            self._renewed_at = self.clock()
            return True
        except APIFailure as e:
            log.info("lease read: %s", e)
            return False
        spec = lease.get("spec") or {}
        holder, renew = spec.get("holderIdentity") or "", spec.get("renewTime") or ""
        now = self.clock()
        if self._observed != (holder, renew):
            self._observed, self._observed_at = (holder, renew), now
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        mine = holder == self.identity
        if holder and not mine and now - self._observed_at < duration:
            return False  # held by another, renewed recently as far as we have seen
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        lease["spec"] = self._spec(spec.get("acquireTime", "") if mine else "", transitions)
        try:
            self.kube.replace_lease(self.namespace, self.name, lease)
        except Conflict:
            return False
        except APIFailure as e:
            log.info("lease update: %s", e)
            return False
        self._renewed_at = self.clock()
        return True

    def _step_down(self, why: str) -> None:
        if self._leader.is_set():
            self._leader.clear()
            log.warning("leader election: %s lost the lease (%s)", self.identity, why)
            self.on_stopped()

    def run(self) -> None:
        while not self._stop.is_set():
            held = self.try_acquire_or_renew()
            if held and not self._leader.is_set():
                try:
                    self.on_started()
                except Exception as e:  # the relist failed: do not lead on a partial view
                    log.warning("leader election: start-up failed: %s", e)
                    self._stop.wait(self.retry_period_s)
                    continue
                self.transitions += 1
                self._leader.set()
                log.info("leader election: %s is the leader", self.identity)
            elif not held:
                if self._leader.is_set() and self.clock() - self._renewed_at > self.renew_deadline_s:
                    self._step_down("renew deadline passed")
            self._stop.wait(self.retry_period_s)
        if self._leader.is_set():
            self.release()

    def release(self) -> None:
        """Give the Lease up (holder cleared) so another replica takes over at once."""
        self._leader.clear()
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                self.kube.replace_lease(self.namespace, self.name, lease)
        except APIFailure as e:
            log.info("lease release: %s", e)
        self.on_stopped()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="vgpu-leader", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        """Stop campaigning; `release=False` models a crash (the Lease is left to expire)."""
        if not release:
            self._leader.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
