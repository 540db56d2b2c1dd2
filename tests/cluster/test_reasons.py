"""Reasons read right where users read them. kube-scheduler records the whole failure message as
the *format* of the FailedScheduling event (schedule_one.go handleSchedulingFailure, client-go's
events recorder: fmt.Sprintf(note)), so a `%` in an extender's reason turned into a Go verb:
`20% compute free < 25% asked` read `20%!c(MISSING)ompute free < 25%!a(MISSING)sked`. The
extender's reasons hold no `%`: the event and the PodScheduled condition say the same.

Runs after test_preemption (file order), so the last test sees that run's events too."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, gpu_is_free, offered_gpus
from vgpu import scheduling as sc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def test_a_pod_short_of_compute_reads_percent(cluster: Cluster, pods: Pods) -> None:
    """Two pods pinned to one GPU: the first takes 80 percent of its compute, the second asks 30:
    Pending, and the event says `20 percent compute free < 30 percent asked`, word for word as the
    PodScheduled condition does."""
    s = cluster.settings
    free = [(n, g) for n, g in offered_gpus(cluster.view()) if gpu_is_free(g) and g.slots >= 2 and g.cores == 100]
    if not free:
        pytest.skip("no free GPU of 100 percent compute with two vGPU slots")
    node, gpu = free[0]
    pin = {sc.USE_GPUUUID_ANNOTATION: gpu.uuid}
    pods.create("busy", {s.resource: "1", sc.RESOURCE_MEM: "1024", sc.RESOURCE_CORES: "80"}, annotations=pin, node=node)
    cluster.wait_running("busy")
    pods.create("more", {s.resource: "1", sc.RESOURCE_MEM: "1024", sc.RESOURCE_CORES: "30"}, annotations=pin, node=node)
    want = f"{gpu.uuid}: 20 percent compute free < 30 percent asked"
    messages = cluster.wait_failed_scheduling("more")
    # kube-scheduler's own count of the node's compute may speak first where the node has no
    # other GPU; the extender's reason is the one this test is about.
    if not any(want in m for m in messages):
        if all("Insufficient vgpu.k8s.io/gpucores-total" in m for m in messages):
            pytest.skip("the node's compute total is what kube-scheduler refused (a one-GPU node)")
    assert any(want in m for m in messages), messages
    cond = cluster.condition("more")
    assert want in cond.get("message", ""), cond
    assert [m for m in messages if "%" in m] == [], messages


def test_no_failed_scheduling_event_holds_a_format_verb(cluster: Cluster) -> None:
    """Every FailedScheduling event of this run (the preemption tests' Pending pods included)."""
    evs = cluster.all_events("FailedScheduling")
    if not evs:
        pytest.skip("no FailedScheduling event in this run")
    bad = [(e["involvedObject"]["name"], e.get("message")) for e in evs if "%!" in (e.get("message") or "")]
    assert bad == []
