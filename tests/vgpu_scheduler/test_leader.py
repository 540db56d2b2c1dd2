"""Two replicas with Lease-based leader election: one decides, failover loses no decision."""

from __future__ import annotations

from sim.kubeapi import KubeAPI
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.support.http import post_ok
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import GiB, Running, api_usage, gpu_node, start_scheduler, state_usage, vgpu_pod
from vgpu_scheduler.config import SchedulerConfig


def cfg(ident: str) -> SchedulerConfig:
    return SchedulerConfig(
        leader_elect=True, identity=ident, lease_duration_s=1.5, renew_deadline_s=1.0, retry_period_s=0.2
    )


def leader_of(reps: list[Running]) -> Running:
    wait_for(lambda: sum(r.service.is_leader() for r in reps) == 1, what="exactly one leader")
    [lead] = [r for r in reps if r.service.is_leader()]
    return lead


def test_one_leader_decides_and_failover_keeps_every_decision(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=2, mem_gib=16, split=8))
    names = [f"p{i:02d}" for i in range(16)]
    for n in names:
        kubeapi.create("pods", vgpu_pod(n, mem=3000))
    reps = [start_scheduler(kubeapi, cfg("a")), start_scheduler(kubeapi, cfg("b"))]
    try:
        lead = leader_of(reps)
        follower = next(r for r in reps if r is not lead)
        out = post_ok(
            follower.url + "/filter", {"Pod": kubeapi.get("pods", names[0]), "Nodes": None, "NodeNames": ["n1"]}
        )
        assert out["Error"] == "vgpu-scheduler: not the leader"
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(lead.url)])
        done = [ks.schedule_one("default", n).status for n in names[:6]]
        assert done == ["Scheduled"] * 6
        # the leader crashes: no release, its Lease has to expire
        lead.stop(release=False)
        wait_for(lambda: follower.service.is_leader(), timeout=15, what="failover")
        lease = kubeapi.get("leases", "vgpu-scheduler", "kube-system")
        assert lease["spec"]["holderIdentity"] == follower.service.leader.identity  # type: ignore[union-attr]
        assert lease["spec"]["leaseTransitions"] >= 1
        assert state_usage(follower.service) == api_usage(kubeapi)  # rebuilt before serving
        ks2 = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(follower.url)])
        rest = [ks2.schedule_one("default", n).status for n in names[6:]]
        # 2 GPUs x 5 pods of 3000 MiB (16 GiB each): 10 in all, whoever decided them
        assert rest.count("Scheduled") == 4
        for mem, _c, slots in api_usage(kubeapi)["n1"].values():
            assert mem <= 16 * GiB and slots <= 8
        wait_for(lambda: state_usage(follower.service) == api_usage(kubeapi), what="no drift")
    finally:
        for r in reps:
            r.stop()


def test_graceful_release_hands_over_at_once(kubeapi: KubeAPI) -> None:
    reps = [start_scheduler(kubeapi, cfg("a")), start_scheduler(kubeapi, cfg("b"))]
    try:
        lead = leader_of(reps)
        other = next(r for r in reps if r is not lead)
        lead.stop(release=True)
        assert kubeapi.get("leases", "vgpu-scheduler", "kube-system")["spec"]["holderIdentity"] == ""
        wait_for(lambda: other.service.is_leader(), timeout=5, what="takeover after release")
    finally:
        for r in reps:
            r.stop()
