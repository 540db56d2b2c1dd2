"""What a pod asks for (pure): quantities, defaults left to the filter, annotation aliases."""

from __future__ import annotations

import pytest

from tests.support.kubeapi import pod_object
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
