"""The DRA plugin's parts against what a real v1.36.2 cluster did (tests/data/dra, README there):
the claims kube-scheduler allocated from our published slice parse into the shares we applied, our
model of the scheduler's arithmetic makes the same choices, the stored objects pass our validator
model, and the kubelet stand-in speaks as the recorded kubelet did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import ParseDict

from dra_plugin import claims
from dra_plugin.api import dra_pb2
from sim import draallocator
from sim.drakubelet import DRA_PLUGIN_TYPE, SERVICES_SUPPORTED_BY_KUBELET
from tests.support import resourcevalidation
from vgpu import quantity

DATA = Path(__file__).resolve().parents[1] / "data" / "dra"
ORDER = ["p5-extended-resources-czdbl", "p1-gpu-b26hm", "p2-gpu-t762l", "p4-gpu-7nq4r", "p3-gpu-wnvfv"]
GIB = 1 << 30


def load(name: str) -> Any:
    return json.loads((DATA / name).read_bytes())


def calls() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / "kubelet-grpc-calls.jsonl").read_text().splitlines()]


SLICE = load("resourceslice.json")
CAPS = {
    d["name"]: claims.DeviceCapacity(
        uuid=d["attributes"]["uuid"]["string"],
        memory=quantity.value(d["capacity"]["memory"]["value"]),
        cores=quantity.value(d["capacity"]["cores"]["value"]),
    )
    for d in SLICE["spec"]["devices"]
}


@pytest.mark.parametrize(
    ("name", "device", "memory", "cores", "req_name"),
    [
        ("p5-extended-resources-czdbl", "gpu-0", 8 * GIB, 50, "container-0-request-0"),
        ("p1-gpu-b26hm", "gpu-0", 6 * GIB, 30, "gpu"),
        ("p2-gpu-t762l", "gpu-1", 6 * GIB, 30, "gpu"),
        ("p4-gpu-7nq4r", "gpu-1", 5888 << 20, 50, "gpu"),
    ],
)
def test_real_allocations_parse_into_the_shares_we_applied(
    name: str, device: str, memory: int, cores: int, req_name: str
) -> None:
    raw = (DATA / f"resourceclaim-{name}.json").read_bytes()
    obj = json.loads(raw)
    [s] = claims.shares(
        claims.decode(raw),
        namespace="default",
        name=name,
        uid=obj["metadata"]["uid"],
        driver="gpu.vgpu.k8s.io",
        pool="vm",
        devices=CAPS,
    )
    assert (s.device, s.memory, s.cores, s.request) == (device, memory, cores, req_name)
    assert s.share_id == obj["status"]["allocation"]["devices"]["results"][0]["shareID"]
    assert [p.name for p in claims.reserved_pods(claims.decode(raw))] == [name.split("-")[0]]


def test_unallocated_claim_is_refused() -> None:
    raw = (DATA / "resourceclaim-p3-gpu-wnvfv.json").read_bytes()
    uid = json.loads(raw)["metadata"]["uid"]
    with pytest.raises(claims.ClaimError, match="is not allocated"):
        claims.shares(
            claims.decode(raw),
            namespace="default",
            name="p3-gpu-wnvfv",
            uid=uid,
            driver="gpu.vgpu.k8s.io",
            pool="vm",
            devices=CAPS,
        )


def test_our_scheduler_model_makes_the_real_schedulers_choices() -> None:
    alloc = draallocator.Allocator([SLICE])
    for name in ORDER:
        c = load(f"resourceclaim-{name}.json")
        [req] = c["spec"]["devices"]["requests"]
        want = (req["exactly"].get("capacity") or {}).get("requests") or {}
        results = (c.get("status", {}).get("allocation") or {}).get("devices", {}).get("results")
        if results is None:  # the real scheduler found no room: neither does the model
            with pytest.raises(draallocator.NoFit):
                alloc.allocate(req["name"], want)
            continue
        got = alloc.allocate(req["name"], want)
        [real] = results
        assert (got["device"], got["request"]) == (real["device"], real["request"])
        assert got["consumedCapacity"] == real["consumedCapacity"]  # the same text, e.g. "5888Mi"


def test_stored_objects_pass_our_validator_model() -> None:
    assert resourcevalidation.validate(SLICE) == []
    assert resourcevalidation.validate(load("deviceclass.json")) == []
    assert SLICE["spec"]["devices"][0]["allowMultipleAllocations"] is True  # not dropped: the gate is on


def test_the_kubelet_stand_in_speaks_as_the_real_kubelet() -> None:
    seq = [c for c in calls() if "NodeWatchResources" not in c["method"]][1:]  # [0]: our own readiness probe
    assert [c["method"] for c in seq[:2]] == [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ]
    info = seq[0]["response"]
    assert info["type"] == DRA_PLUGIN_TYPE and info["supported_versions"][0] in SERVICES_SUPPORTED_BY_KUBELET
    assert seq[1]["request"] == {"plugin_registered": True}
    prepares = [c for c in seq if c["method"].endswith("/NodePrepareResources")]
    unprepares = [c for c in seq if c["method"].endswith("/NodeUnprepareResources")]
    assert len(prepares) == len(unprepares) == 4
    for c in prepares + unprepares:
        [claim] = c["request"]["claims"]
        assert set(claim) == {"namespace", "uid", "name"}  # what the stand-in sends too
        # Every claim asked about has an entry (kubelet manager.go checks it) and the answer
        # parses as the public message.
        assert set(c["response"]["claims"]) == {claim["uid"]}
        msg = (
            dra_pb2.NodePrepareResourcesResponse
            if "/NodePrepare" in c["method"]
            else dra_pb2.NodeUnprepareResourcesResponse
        )
        ParseDict(c["response"], msg())
    # The kubelet also tries the DRA health service, with an empty request (served since this
    # recording: test_health.py).
    assert any(c["method"] == "/v1alpha1.DRAResourceHealth/NodeWatchResources" for c in calls())


def test_extended_resource_request_maps_to_our_cdi_device() -> None:
    pod = load("pod-p5.json")
    [mapping] = pod["status"]["extendedResourceClaimStatus"]["requestMappings"]
    [call] = [
        c for c in calls() if c.get("request", {}).get("claims", [{}])[0].get("name") == "p5-extended-resources-czdbl"
    ][:1]
    [dev] = next(iter(call["response"]["claims"].values()))["devices"]
    assert dev["request_names"] == [mapping["requestName"]]
    assert dev["cdi_device_ids"][1].startswith("vgpu.k8s.io/claim=")
