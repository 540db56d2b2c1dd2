"""Follow mode (the extender serves iff its own pod's kube-scheduler holds kube-scheduler's Lease)
and --serve (a webhook-only process answers no extender verb).

The "kube-scheduler" here is the stand-in of sim/kubescheduler.py; its leader election
is played by the test writing the Lease as client-go would (holder `<hostname>_<uuid>`,
renewTime, leaseDurationSeconds) into the API stand-in."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid as uuidlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sim.admission import admission_review
from sim.kubeapi import KubeAPI, pod_object
from sim.kubescheduler import ExtenderConfig, KubeScheduler
from tests.support.http import post_json
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import (
    GiB,
    Running,
    api_usage,
    decision_of,
    gpu_node,
    start_scheduler,
    state_usage,
    vgpu_pod,
)
from vgpu import scheduling as sc
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.follow import LeaseFollower, holder_host, parse_micro_time
from vgpu_scheduler.kube import Kube, micro_time

NS, LEASE = "kube-system", "vgpu-kube-scheduler"


def write_lease(api: KubeAPI, holder: str, duration: int = 2, renew: float | None = None) -> None:
    spec = {
        "holderIdentity": holder,
        "leaseDurationSeconds": duration,
        "renewTime": micro_time(time.time() if renew is None else renew),
        "acquireTime": micro_time(time.time()),
    }
    try:
        cur = api.get("leases", LEASE, NS)
    except Exception:
        api.create("leases", {"metadata": {"name": LEASE, "namespace": NS}, "spec": spec}, NS, "coordination.k8s.io/v1")
        return
    cur["spec"] = spec
    api.update("leases", cur, NS)


def ks_id(host: str) -> str:
    """kube-scheduler's identity: hostname + "_" + uuid (cmd/kube-scheduler/app/options)."""
    return f"{host}_{uuidlib.uuid4()}"


def follow_cfg(host: str, **kw: Any) -> SchedulerConfig:
    return SchedulerConfig(
        serve="extender",
        follow_lease=f"{NS}/{LEASE}",
        follow_hostname=host,
        retry_period_s=0.05,
        handover_s=kw.pop("handover_s", 0.2),
        **kw,
    )


def test_identity_and_time_parsing() -> None:
    assert holder_host("vgpu-scheduler-7d9f-abcde_0b3c1f9e-6d1a-4f7e-9c52-1f0d2a3b4c5d") == "vgpu-scheduler-7d9f-abcde"
    assert holder_host("no-uuid-here") == ""  # not kube-scheduler's form: never ours
    assert holder_host("") == ""
    assert parse_micro_time("2026-12-01T23:00:00.250000Z") == pytest.approx(1796166000.25)
    assert parse_micro_time("2026-12-01T23:00:00Z") == 1796166000.0
    assert parse_micro_time("2026-12-02T00:00:00.000000+01:00") == 1796166000.0
    for bad in ("", "yesterday", "2026-12-01T23:00:00", "2026-13-01T00:00:00Z"):
        assert parse_micro_time(bad) is None, bad


def test_follower_serves_only_while_its_pod_holds_the_lease(kubeapi: KubeAPI) -> None:
    now = [time.time()]
    started: list[int] = []
    stopped: list[int] = []
    f = LeaseFollower(
        Kube(kubeapi.api_client()),
        NS,
        LEASE,
        "sched-a",
        handover_s=1.0,
        on_started=lambda: started.append(1),
        on_stopped=lambda: stopped.append(1),
        clock=lambda: now[0],
        pause=lambda _t: False,  # the handover wait, without sleeping
    )
    f.poll_once()
    assert not f.is_leader()  # no Lease yet
    write_lease(kubeapi, ks_id("sched-b"), 15, now[0])
    f.poll_once()
    assert not f.is_leader() and not started  # another pod's kube-scheduler leads
    for other in ("sched-a", "sched-a-2_" + str(uuidlib.uuid4()), "xsched-a_1", "sched_a_1"):
        write_lease(kubeapi, other, 15, now[0])
        f.poll_once()
        assert not f.is_leader(), other
    write_lease(kubeapi, ks_id("sched-a"), 15, now[0] - 20)
    f.poll_once()
    assert not f.is_leader()  # ours, but expired (renewTime + 15 s is past)
    write_lease(kubeapi, ks_id("sched-a"), 15, now[0])
    f.poll_once()
    assert f.is_leader() and started == [1]  # relisted before serving
    # kube-scheduler restarts in the same pod: a new uuid, the same host: still ours, no relist
    write_lease(kubeapi, ks_id("sched-a"), 15, now[0])
    f.poll_once()
    assert f.is_leader() and started == [1]
    # no renewal: serving ends by itself handover_s before the Lease expires, with no poll
    now[0] += 13.9
    assert f.is_leader()
    now[0] += 0.2
    assert not f.is_leader() and stopped == [1]
    # renewed again, then taken by the other pod (a release: at once, not waiting for expiry)
    write_lease(kubeapi, ks_id("sched-a"), 15, now[0])
    f.poll_once()
    assert f.is_leader() and started == [1, 1] and f.transitions == 2
    write_lease(kubeapi, ks_id("sched-b"), 15, now[0])
    f.poll_once()
    assert not f.is_leader() and stopped == [1, 1]
    # an API failure keeps the last view (it does not flip serving either way)
    write_lease(kubeapi, ks_id("sched-a"), 15, now[0])
    f.poll_once()
    assert f.is_leader()
    kubeapi.fail_next("GET", "/leases/", 500)
    f.poll_once()
    assert f.is_leader()


def test_service_in_follow_mode_refuses_until_its_kube_scheduler_leads(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=4))
    kubeapi.create("pods", vgpu_pod("p", mem=1000))
    write_lease(kubeapi, ks_id("sched-b"), 15)
    r = start_scheduler(kubeapi, follow_cfg("sched-a"))
    try:
        args = {"Pod": kubeapi.get("pods", "p"), "Nodes": None, "NodeNames": ["n1"]}
        time.sleep(0.3)  # several polls
        assert post_json(r.url + "/filter", args)[1]["Error"] == "vgpu-scheduler: not the leader"
        code, out = post_json(r.url + "/bind", {"PodName": "p", "PodNamespace": "default", "Node": "n1"})
        assert code == 200 and out["Error"] == "vgpu-scheduler: not the leader"
        assert decision_of(kubeapi, "p") is None
        relists = r.service.state.relists
        write_lease(kubeapi, ks_id("sched-a"), 15)
        wait_for(r.service.is_leader, what="serving once its kube-scheduler leads")
        assert r.service.state.relists > relists  # rebuilt from the API before serving
        out = post_json(r.url + "/filter", args)[1]
        assert out["Error"] == "" and out["NodeNames"] == ["n1"]
        bind = {"PodName": "p", "PodNamespace": "default", "PodUID": args["Pod"]["metadata"]["uid"], "Node": "n1"}
        assert post_json(r.url + "/bind", bind)[1] == {"Error": ""}
        assert decision_of(kubeapi, "p") is not None
        # /readyz says who serves
        with urllib.request.urlopen(r.url + "/readyz", timeout=5) as resp:
            assert json.loads(resp.read()) == {"ready": True, "leader": True}
    finally:
        r.stop()


class Elector:
    """The kube-schedulers' election as client-go runs it: the holder renews; switch or crash."""

    def __init__(self, api: KubeAPI, host: str, duration: int = 1) -> None:
        self.api, self.duration = api, duration
        self.holder: str | None = ks_id(host)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        write_lease(api, self.holder, duration)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            with self.lock:
                if self.holder is not None:
                    write_lease(self.api, self.holder, self.duration)

    def release_to(self, host: str) -> None:
        """The leader steps down (ReleaseOnCancel) and the other one takes the Lease at once."""
        with self.lock:
            self.holder = ks_id(host)
            write_lease(self.api, self.holder, self.duration)

    def crash_then(self, host: str) -> None:
        """The leader stops renewing (killed); the other one takes over once the Lease expired."""
        with self.lock:
            self.holder = None
        time.sleep(self.duration + 0.1)
        with self.lock:
            self.holder = ks_id(host)
            write_lease(self.api, self.holder, self.duration)


@pytest.fixture
def two_pods(kubeapi: KubeAPI) -> Iterator[tuple[Running, Running]]:
    a = start_scheduler(kubeapi, follow_cfg("sched-a"))
    b = start_scheduler(kubeapi, follow_cfg("sched-b"))
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_failover_mid_stream_of_binds_loses_no_decision_and_over_commits_nothing(
    kubeapi: KubeAPI, two_pods: tuple[Running, Running]
) -> None:
    """Two scheduler pods; kube-scheduler (four binding workers) calls only its own pod's extender.

    The lead moves A -> B by release while filters and binds are in flight, then B crashes and A
    takes over after expiry. 2 nodes x 2 GPUs of 16 GiB hold 5 pods of 3000 MiB each: exactly 20
    of the 40 pods may be placed, whichever replica decided them."""
    for n in ("n1", "n2"):
        kubeapi.create("nodes", gpu_node(n, n=2, mem_gib=16, split=8))
    names = [f"p{i:02d}" for i in range(40)]
    for n in names:
        kubeapi.create("pods", vgpu_pod(n, mem=3000))
    a, b = two_pods
    ks = {
        "sched-a": KubeScheduler(kubeapi.api_client(), [ExtenderConfig(a.url)]),
        "sched-b": KubeScheduler(kubeapi.api_client(), [ExtenderConfig(b.url)]),
    }
    elector = Elector(kubeapi, "sched-a")
    wait_for(a.service.is_leader, what="A serves")
    leading = ["sched-a"]
    results: dict[str, str] = {}
    errors: list[str] = []
    scheduled = threading.Semaphore(0)

    by: list[str] = []  # which pod's kube-scheduler placed each pod, in order

    def one(name: str) -> None:
        who = leading[0]
        if not who:  # no kube-scheduler leads (one crashed, the other waits for its Lease to expire)
            results[name] = "NoLeader"
            time.sleep(0.02)
            return
        res = ks[who].schedule_one("default", name)  # kube-scheduler calls its own pod's extender
        results[name] = res.status
        if res.status == "Scheduled":
            by.append(who)
            scheduled.release()
        elif res.status == "Error":
            errors.append(res.message)

    def switcher() -> None:
        for _ in range(6):
            scheduled.acquire()
        leading[0] = "sched-b"  # B's kube-scheduler leads from now on (A's is stepping down)
        elector.release_to("sched-b")
        for _ in range(6):
            scheduled.acquire()
        leading[0] = ""  # B's kube-scheduler is killed: it calls no more (its last calls may still land)
        elector.crash_then("sched-a")
        leading[0] = "sched-a"

    sw = threading.Thread(target=switcher, daemon=True)
    sw.start()
    try:
        for _round in range(80):
            pending = [n for n in names if not kubeapi.get("pods", n)["spec"].get("nodeName")]
            if _round and not sw.is_alive() and all(results.get(n) == "Unschedulable" for n in pending):
                break
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(one, pending))
            if not sw.is_alive():
                wait_for(lambda: a.service.is_leader() or b.service.is_leader(), what="someone serves")
        else:
            raise AssertionError(f"never settled: {results}")
    finally:
        elector.stop.set()
    sw.join(timeout=5)
    assert not sw.is_alive()
    assert all("not the leader" in e for e in errors), errors  # refused while not serving, nothing else
    # placed by A, then B, then A again: the stream really crossed both switches
    assert by[0] == "sched-a" and "sched-b" in by and by[-1] == "sched-a", by
    assert a.service.leader is not None and a.service.leader.transitions >= 2
    assert b.service.leader is not None and b.service.leader.transitions >= 1
    pods = {n: kubeapi.get("pods", n) for n in names}
    bound = {n: p["spec"]["nodeName"] for n, p in pods.items() if p["spec"].get("nodeName")}
    assert len(bound) == 20  # every GPU filled to 5, none beyond
    for n, node in bound.items():
        d = decision_of(kubeapi, n)
        assert d is not None and d.node == node, n  # no pod bound without (or against) its decision
    usage = api_usage(kubeapi)
    for node in ("n1", "n2"):
        assert len(usage[node]) == 2
        for mem, _cores, slots in usage[node].values():
            assert mem == 5 * 3000 * (1 << 20) <= 16 * GiB and slots == 5
    # no drift, on either replica (the one not serving keeps watching)
    wait_for(lambda: state_usage(a.service) == usage and state_usage(b.service) == usage, what="no drift")


def test_webhook_only_serves_no_extender_verb(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=4))
    kubeapi.create("pods", vgpu_pod("p", mem=1000))
    r = start_scheduler(kubeapi, SchedulerConfig(serve="webhook", refuse_oversized=True))
    try:
        assert r.service.leader is None  # no Lease at all
        args = {"Pod": kubeapi.get("pods", "p"), "Nodes": None, "NodeNames": ["n1"]}
        for verb, body in (
            ("/filter", args),
            ("/prioritize", args),
            ("/bind", {"PodName": "p", "PodNamespace": "default", "Node": "n1"}),
            ("/bind/", {"PodName": "p", "PodNamespace": "default", "Node": "n1"}),
        ):
            code, out = post_json(r.url + verb, body)
            assert code == 404 and "not served here (--serve webhook)" in out["Error"], verb
        assert decision_of(kubeapi, "p") is None and not kubeapi.get("pods", "p")["spec"].get("nodeName")
        assert r.service.state.pods == {} and r.service.state.nodes  # Nodes only: no pod state
        big = pod_object("big", [("main", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000"})])
        review = admission_review(big, "default")
        code, out = post_json(r.url + "/webhook", review)
        assert code == 200 and out["response"]["allowed"] is False  # sized against the Node view
        assert "no GPU has more than 16384 MiB" in out["response"]["status"]["message"]
        with urllib.request.urlopen(r.url + "/readyz", timeout=5) as resp:
            assert json.loads(resp.read())["ready"] is True
    finally:
        r.stop()


def test_extender_only_serves_no_webhook(kubeapi: KubeAPI) -> None:
    r = start_scheduler(kubeapi, SchedulerConfig(serve="extender"))
    try:
        code, out = post_json(r.url + "/webhook", {"request": {"uid": "u"}})
        assert code == 404 and "--serve extender" in out["Error"]
    finally:
        r.stop()


def test_config_rejects_two_gates() -> None:
    import msgspec

    from vgpu_scheduler.__main__ import config_from, parser

    with pytest.raises(msgspec.ValidationError, match="exclude each other"):
        config_from(parser().parse_args(["--leader-elect", "--follow-lease=kube-system/x"]))
    with pytest.raises(msgspec.ValidationError):
        config_from(parser().parse_args(["--serve=everything"]))
    with pytest.raises(msgspec.ValidationError, match="handover_s > retry_period_s"):
        config_from(parser().parse_args(["--follow-lease=kube-system/x", "--handover-s=1", "--retry-period-s=2"]))
    cfg = config_from(parser().parse_args(["--serve=webhook"]))
    assert cfg.serve == "webhook"


def test_lead_lost_before_the_write_writes_nothing(kubeapi: KubeAPI) -> None:
    """The failover window on the old replica: its gate passed when bind arrived, serving ended
    before the write: nothing is written (the Binding is the only write, and it carries the
    decision: a pod is never bound without it, nor decided without being bound)."""
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=4))
    kubeapi.create("pods", vgpu_pod("p", mem=8000))
    r = start_scheduler(kubeapi)
    try:
        ext = r.service.extender
        assert ext.kube is not None
        real = ext.kube.bind
        calls: list[str] = []

        def bind(*a: Any, **kw: Any) -> None:
            calls.append(a[1])
            real(*a, **kw)

        ext.kube.bind = bind  # type: ignore[method-assign]
        pod = kubeapi.get("pods", "p")
        assert post_json(r.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["n1"]})[1]["NodeNames"] == ["n1"]
        asked: list[int] = []

        def first_only() -> bool:  # serving at the request's first check, not at the write
            asked.append(1)
            return len(asked) == 1

        ext.is_leader = first_only
        body = {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"}
        out = post_json(r.url + "/bind", body)[1]
        assert out["Error"] == "vgpu-scheduler: not the leader" and calls == [] and len(asked) == 2
        assert decision_of(kubeapi, "p") is None and api_usage(kubeapi) == {}
        assert not kubeapi.get("pods", "p")["spec"].get("nodeName")
        # serving again: the same choice is written and bound in one write
        ext.is_leader = lambda: True
        assert post_json(r.url + "/bind", body)[1] == {"Error": ""} and calls == ["p"]
        d = decision_of(kubeapi, "p")
        assert d is not None and kubeapi.get("pods", "p")["spec"]["nodeName"] == "n1"
        assert kubeapi.get("pods", "p")["metadata"]["annotations"][sc.BIND_PHASE_ANNOTATION] == sc.PHASE_ALLOCATING
        wait_for(lambda: state_usage(r.service) == api_usage(kubeapi) != {}, what="counted once")
    finally:
        r.stop()
