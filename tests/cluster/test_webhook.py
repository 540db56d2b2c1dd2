"""The mutating webhook as the real API server calls it: GPU pods are sent to the scheduler, sizes
that are not whole numbers are refused with the webhook's reason, pods that ask for no GPU are
left alone, and (VGPU_TEST_DISRUPTIVE=1) while the webhook is down a GPU-less pod is still created
and a GPU pod is refused with the reason (docs/operators/scheduling.md, "Webhook failure modes")."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.conftest import Pods
from tests.cluster.kube import Cluster, Obj, pod_body, wait
from vgpu import scheduling as sc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SCHEDULER_SELECTOR = "app.kubernetes.io/name=vgpu-scheduler"


def _message(e: ApiException) -> str:
    """The Status message of a refused request (the API server's own words)."""
    try:
        return str(json.loads(e.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(e.body)


def _dry_run(cluster: Cluster, body: Obj) -> Obj:
    resp = cluster.core.create_namespaced_pod(cluster.namespace, body, dry_run="All", _preload_content=False)
    out: Obj = json.loads(resp.data)
    return out


def test_a_gpu_pod_is_sent_to_the_scheduler(cluster: Cluster) -> None:
    s = cluster.settings
    out = _dry_run(cluster, pod_body(s, "mutated", {sc.RESOURCE_MEM: "3000"}))
    assert out["spec"]["schedulerName"] == s.scheduler_name
    limits = out["spec"]["containers"][0]["resources"]["limits"]
    assert limits[s.resource] == "1"  # filled in: gpumem alone means one GPU
    assert limits[sc.RESOURCE_MEM] == "3k"
    # The node-level total kube-scheduler counts, in the form the API server stores.
    requests = out["spec"]["containers"][0]["resources"]["requests"]
    assert limits[sc.RESOURCE_NODE_MEM] == requests[sc.RESOURCE_NODE_MEM] == "3k"
    assert sc.RESOURCE_NODE_CORES not in limits  # no gpucores asked: nothing to count


def test_a_pod_without_gpu_is_left_alone(cluster: Cluster, pods: Pods) -> None:
    s = cluster.settings
    body = pod_body(s, "no-gpu", {"cpu": "10m", "memory": "64Mi"}, command=["sleep", "infinity"])
    body["spec"].pop("runtimeClassName", None)
    created = pods.create_body(body)
    assert created["spec"]["schedulerName"] == "default-scheduler"
    assert not (created["metadata"].get("annotations") or {})


def test_a_size_that_is_not_whole_is_refused_with_the_webhooks_reason(cluster: Cluster) -> None:
    """kube-apiserver sends "0.5" as "500m" to the webhook, before its own validation."""
    s = cluster.settings
    with pytest.raises(ApiException) as e:
        cluster.create_pod(pod_body(s, "half", {s.resource: "1", sc.RESOURCE_MEM: "0.5"}))
    msg = _message(e.value)
    assert 'admission webhook "pods.vgpu.k8s.io" denied the request' in msg, msg
    assert "nvidia.com/gpumem='500m' is not a whole number" in msg, msg


@pytest.fixture
def webhook_down(cluster: Cluster) -> Iterator[None]:
    """The scheduler Deployment(s) (extender and webhook) scaled to 0, and back afterwards."""
    if not cluster.settings.disruptive:
        pytest.skip("takes the webhook down: set VGPU_TEST_DISRUPTIVE=1")
    deps = cluster.deployments(SCHEDULER_SELECTOR)
    if not deps:
        pytest.skip(f"no Deployment labelled {SCHEDULER_SELECTOR}")
    saved = [(d["metadata"]["namespace"], d["metadata"]["name"], int(d["spec"]["replicas"])) for d in deps]

    def pods_of_scheduler() -> int:
        return len(cluster.core.list_pod_for_all_namespaces(label_selector=SCHEDULER_SELECTOR).items)

    try:
        for ns, name, _r in saved:
            cluster.scale(ns, name, 0)
        wait(lambda: pods_of_scheduler() == 0, cluster.settings.timeout_s, "the scheduler pods to be gone")
        yield
    finally:
        for ns, name, replicas in saved:
            cluster.scale(ns, name, replicas)

        def available() -> bool:
            for ns, name, replicas in saved:
                st = cluster.deployment(ns, name).get("status") or {}
                if int(st.get("availableReplicas") or 0) < replicas:
                    return False
            return True

        wait(available, cluster.settings.timeout_s, "the scheduler Deployment to be available again")

        def answers() -> bool:  # the webhook serves again: a GPU pod is mutated (dry run)
            try:
                out = _dry_run(cluster, pod_body(cluster.settings, "probe", {cluster.settings.resource: "1"}))
            except ApiException:
                return False
            return bool(out["spec"]["schedulerName"] == cluster.settings.scheduler_name)

        wait(answers, cluster.settings.timeout_s, "the webhook to answer again")


def test_with_the_webhook_down(cluster: Cluster, pods: Pods, webhook_down: None) -> None:
    s = cluster.settings
    body = pod_body(s, "no-gpu-while-down", {"cpu": "10m"}, command=["sleep", "infinity"])
    body["spec"].pop("runtimeClassName", None)
    created = pods.create_body(body)  # never sent to the webhook (matchConditions)
    assert created["spec"]["schedulerName"] == "default-scheduler"
    with pytest.raises(ApiException) as e:
        cluster.create_pod(pod_body(s, "gpu-while-down", {s.resource: "1", sc.RESOURCE_MEM: "1024"}))
    msg = _message(e.value)
    assert 'failed calling webhook "pods.vgpu.k8s.io"' in msg, msg
