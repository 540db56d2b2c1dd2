"""What a pod asks for (pure): quantities, defaults left to the filter, annotation aliases."""

from __future__ import annotations

import pytest

from sim.kubeapi import pod_object
from vgpu import scheduling as sc
from vgpu_scheduler.requests import ContainerRequest, RequestError, container_requests, pod_options, wants_vgpu


def test_limits_win_over_requests_and_order_is_init_first() -> None:
    pod = pod_object(
        "p", [("a", {"nvidia.com/gpu": "2"}), ("plain", {"cpu": "1"})], init=[("i", {"nvidia.com/gpu": "1"})]
    )
    pod["spec"]["containers"][0]["resources"]["requests"] = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "100"}
    assert container_requests(pod) == [
        ContainerRequest("i", True, 1, None, None, None),
        ContainerRequest("a", False, 2, 100, None, None),
    ]
    assert wants_vgpu(pod) and not wants_vgpu(pod_object("q", [("c", {"cpu": "1"})]))


def test_gpu_zero_alone_asks_nothing_and_other_resource_names_count() -> None:
    assert container_requests(pod_object("p", [("a", {"nvidia.com/gpu": "0"})])) == []
    pod = pod_object("p", [("a", {"example.com/vgpu": "1", "nvidia.com/gpucores": "5"})])
    assert container_requests(pod, "example.com/vgpu") == [ContainerRequest("a", False, 1, None, None, 5)]
    with pytest.raises(RequestError, match=r"given without nvidia\.com/gpu"):
        container_requests(pod_object("p", [("a", {"nvidia.com/gpumem": "5"})]))


def test_options_defaults_aliases_and_precedence() -> None:
    o = pod_options({}, "binpack", "spread")
    assert (o.node_policy, o.gpu_policy, o.numa_bind, o.use_types) == ("binpack", "spread", False, ())
    o = pod_options(
        {
            "hami.io/node-scheduler-policy": "binpack",
            sc.NODE_POLICY_ANNOTATION: "spread",  # ours wins over the alias
            "nvidia.com/use-gputype": " A100 , H100 ",
            "nvidia.com/numa-bind": "yes",
            "nvidia.com/nouse-gpuuuid": "GPU-a,GPU-b",
        },
        "binpack",
        "spread",
    )
    assert o.node_policy == "spread" and o.use_types == ("a100", "h100") and o.numa_bind
    assert o.nouse_uuids == frozenset({"GPU-a", "GPU-b"})
    with pytest.raises(RequestError, match="must be true or false"):
        pod_options({sc.NUMA_BIND_ANNOTATION: "sometimes"}, "binpack", "spread")


def test_recorded_pods_read_as_the_api_server_stored_them() -> None:
    """The API server stores gpumem 3000 as "3k" (what the webhook and the
    extender of a real cluster were sent); it is 3000 MiB, not an error."""
    from tests.support import traces

    a = traces.load_json("webhook/a-one-container-gpu-gpumem-gpucores.json")[0]["body"]["request"]["object"]
    assert a["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "3k"
    assert container_requests(a) == [ContainerRequest("main", False, 1, 3000, None, 30)]
    b = traces.load_json("webhook/b-init-and-app-container-gpu.json")[0]["body"]["request"]["object"]
    assert container_requests(b) == [
        ContainerRequest("init", True, 1, None, None, None),
        ContainerRequest("app", False, 1, None, None, None),
    ]
    d = traces.load_json("webhook/d-job-created-pod-generateName.json")[0]["body"]["request"]["object"]
    assert container_requests(d) == [ContainerRequest("main", False, 1, 4096, None, None)]
    [rec] = [
        r
        for r in traces.load_json("extender/requests-nodecache-true.json")
        if r["scenario"] == "basic-a" and r["verb"] == "filter"
    ]
    assert container_requests(rec["body"]["Pod"]) == [ContainerRequest("main", False, 1, 3000, None, 30)]


@pytest.mark.parametrize(
    ("value", "mib"), [("1k", 1000), ("10k", 10000), ("4096", 4096), ("1e3", 1000), ("3000", 3000), (3000, 3000)]
)
def test_every_stored_form_of_a_size(value: object, mib: int) -> None:
    pod = pod_object("p", [("main", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": value})])  # type: ignore[dict-item]
    assert container_requests(pod)[0].mem_mib == mib


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("500m", "container main: nvidia.com/gpumem='500m' is not a whole number"),  # "0.5" as stored
        ("1500m", "container main: nvidia.com/gpumem='1500m' is not a whole number"),
        ("-1", "container main: nvidia.com/gpumem='-1' is negative"),
        ("3 k", "container main: nvidia.com/gpumem='3 k' is not a Kubernetes quantity (quantities must match"),
        ("1e30", "container main: nvidia.com/gpumem='1e30' is too large"),
    ],
)
def test_one_error_text_for_webhook_and_extender(value: str, why: str) -> None:
    pod = pod_object("p", [("main", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": value})])
    with pytest.raises(RequestError) as e:
        container_requests(pod)
    assert str(e.value).startswith(why)
