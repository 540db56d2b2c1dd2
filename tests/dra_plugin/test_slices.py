"""ResourceSlice and DeviceClass objects: valid for Kubernetes 1.36 (our model of the API server's
validation.go, and the kubernetes client's resource.k8s.io/v1 models), and the requestPolicy
arithmetic: what kube-scheduler records for a request (its consumed-capacity code, modelled in
sim/draallocator.py) is what Prepare applies."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_plugin import claims, slices
from sim import draallocator
from tests.dra_plugin.conftest import GIB, NODE, gpus, make_cfg
from tests.dra_plugin.support import node_core
from tests.support import k8svalidate, resourcevalidation
from vgpu import quantity
from vgpu.nvml import GPUInfo

MIB = 1 << 20


def both(obj: dict) -> list[str]:
    return resourcevalidation.validate(obj) + k8svalidate.validate(obj)


def test_default_slice_is_valid_and_complete(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    [s] = slices.build(NODE, gpus(2), cfg, generation=3, node_uid="b4c1bc3e-7b3e-4f3e-9d2f-3d7c1a6a2a11")
    assert both(s) == []
    spec = s["spec"]
    assert spec["driver"] == "gpu.vgpu.k8s.io" and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert s["metadata"]["ownerReferences"][0]["kind"] == "Node"
    d0 = spec["devices"][0]
    assert d0["name"] == "gpu-0" and d0["allowMultipleAllocations"] is True
    assert d0["attributes"]["uuid"] == {"string": gpus(2)[0].uuid}
    assert d0["attributes"]["driverVersion"] == {"version": "580.65.6"}  # "580.65.06" is not semver
    assert d0["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert d0["capacity"]["memory"] == {
        "value": "16Gi",
        "requestPolicy": {"default": "8Gi", "validRange": {"min": "256Mi", "max": "16Gi", "step": "256Mi"}},
    }
    assert d0["capacity"]["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "50", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }


def test_device_class_is_valid() -> None:
    dc = slices.device_class("gpu.vgpu.k8s.io", "nvidia.com/gpu")
    assert both(dc) == []
    assert dc["spec"]["selectors"] == [{"cel": {"expression": 'device.driver == "gpu.vgpu.k8s.io"'}}]
    assert both(slices.device_class("gpu.vgpu.k8s.io")) == []
    assert resourcevalidation.validate(slices.device_class("gpu.vgpu.k8s.io", "kubernetes.io/gpu"))
    assert resourcevalidation.validate(slices.device_class("gpu.vgpu.k8s.io", "gpu"))


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda s: s["spec"]["devices"][0].update(allowMultipleAllocations=False), "allowMultipleAllocations"),
        (lambda s: s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"].update(default="8193Mi"), "step"),
        (
            lambda s: s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"].update(max="17Gi"),
            "max",
        ),
        (lambda s: s["spec"]["devices"][0]["attributes"].update(v={"version": "580.65.06"}), "semver"),
        (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "label"),
        (lambda s: s["spec"].update(allNodes=True), "exactly one"),
        (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "greater than zero"),
        (lambda s: s["spec"]["devices"][0]["attributes"].update(productName={"string": "x" * 65}), "Too long"),
    ],
)
def test_the_validator_model_catches_what_the_api_server_refuses(mutate: object, expect: str, tmp_path: Path) -> None:
    [s] = slices.build(NODE, gpus(1), make_cfg(tmp_path), generation=1)
    bad = copy.deepcopy(s)
    mutate(bad)  # type: ignore[operator]
    errs = resourcevalidation.validate(bad)
    assert any(expect in e for e in errs), errs


@settings(max_examples=200, deadline=None)
@given(
    memory=st.integers(min_value=1 * GIB, max_value=192 * GIB),
    split=st.integers(min_value=1, max_value=16),
    scaling=st.sampled_from([1.0, 1.5, 2.0, 0.5]),
    cores_scaling=st.sampled_from([1.0, 2.0, 0.5]),
    step_mib=st.sampled_from([1, 64, 256, 1024]),
)
def test_any_gpu_and_settings_give_valid_slices(
    memory: int,
    split: int,
    scaling: float,
    cores_scaling: float,
    step_mib: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cfg = make_cfg(
        tmp_path_factory.mktemp("c"),
        split_count=split,
        memory_scaling=scaling,
        cores_scaling=cores_scaling,
        memory_step=step_mib * MIB,
        memory_min=step_mib * MIB,
    )
    if int(memory * scaling) < 2 * step_mib * MIB:  # no room for min + one step
        with pytest.raises(slices.PolicyError):
            slices.build(NODE, gpus(1, memory), cfg, generation=1)
        return
    [s] = slices.build(NODE, gpus(1, memory), cfg, generation=1)
    assert resourcevalidation.validate(s) == []


def test_128_devices_per_slice_and_long_node_names(tmp_path: Path) -> None:
    many = [GPUInfo(i, f"GPU-{i}", "x", GIB, None, None) for i in range(130)]
    out = slices.build("n" * 250, many, make_cfg(tmp_path), generation=2)
    assert [len(s["spec"]["devices"]) for s in out] == [128, 2]
    assert all(s["spec"]["pool"]["resourceSliceCount"] == 2 for s in out)
    assert all(resourcevalidation.validate(s) == [] for s in out)
    assert len({s["metadata"]["name"] for s in out}) == 2


def test_unhealthy_gpus_are_withdrawn(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    g = gpus(2)
    core = node_core(cfg, g)
    core.table.mark_unhealthy(g[1].uuid, "xid 79")
    [s] = slices.build(NODE, core.healthy_gpus(), cfg, generation=1)
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]
    core.table.mark_unhealthy(g[0].uuid, "lost")
    [empty] = slices.build(NODE, core.healthy_gpus(), cfg, generation=1)
    assert "devices" not in empty["spec"] and resourcevalidation.validate(empty) == []


# --- requestPolicy rounding: what kube-scheduler records is what we apply ------------------------


@pytest.mark.parametrize(
    ("requested", "consumed"),
    [
        ("6Gi", "6Gi"),  # on the 256Mi grid already
        ("6G", "5888Mi"),  # 6e9 bytes: rounded up to min + n x step
        ("100Mi", "256Mi"),  # below min: min
        ("6145Mi", "6400Mi"),
        (None, "8Gi"),  # no request: the default, 1/K of the GPU
        ("16Gi", "16Gi"),
    ],
)
def test_memory_rounding(requested: str | None, consumed: str, tmp_path: Path) -> None:
    [s] = slices.build(NODE, gpus(1), make_cfg(tmp_path), generation=1)
    cap = s["spec"]["devices"][0]["capacity"]["memory"]
    got = draallocator.consumed(requested, cap)
    assert quantity.value(got) == quantity.value(consumed)
    assert not draallocator.violates(got, cap["requestPolicy"])


def test_request_over_max_does_not_fit(tmp_path: Path) -> None:
    [s] = slices.build(NODE, gpus(1), make_cfg(tmp_path), generation=1)
    alloc = draallocator.Allocator([s])
    with pytest.raises(draallocator.NoFit):
        alloc.allocate("gpu", {"memory": "17Gi"})


def test_two_6gi_shares_fit_one_16gi_gpu_the_third_goes_to_the_other(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    [s] = slices.build(NODE, gpus(2), cfg, generation=1)
    alloc = draallocator.Allocator([s])
    want = {"memory": "6Gi", "cores": "30"}
    placed = [alloc.allocate("gpu", want) for _ in range(3)]
    assert [r["device"] for r in placed] == ["gpu-0", "gpu-0", "gpu-1"]
    caps = slices.capacities(gpus(2), cfg)
    for r in placed:
        obj = draallocator.claim_object("c", "ns", [r], uid="00000000-0000-4000-8000-000000000001")
        claim = claims.decode(json.dumps(obj).encode())
        [share] = claims.shares(
            claim,
            namespace="ns",
            name="c",
            uid="00000000-0000-4000-8000-000000000001",
            driver=cfg.driver_name,
            pool=NODE,
            devices=caps,
        )
        assert (share.memory, share.cores) == (6 * GIB, 30)
