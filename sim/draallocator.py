"""A model of kube-scheduler's consumable-capacity arithmetic (DRAConsumableCapacity, v1.36), for
making the `status.allocation` of test ResourceClaims the way kube-scheduler would. NOT the
scheduler: it places one request at a time, first fit, and knows no constraints or taints.  A
request's CEL selectors are evaluated by cel-python against the device as the scheduler's CEL
environment presents it (staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go:
`device.driver`, `device.attributes[<domain>].<name>`, `device.capacity[<domain>].<name>`;
version attributes as strings and capacities as quantity strings here, which the real one types).

Written from staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/
consumable_capacity.go: `consumed` is calculateConsumedCapacity (fillEmptyRequest, roundUpRange,
roundUpValidValues) and `violates` is violatesPolicy; `fits` is CmpRequestOverCapacity
(a request naming a capacity the device lacks fails; each capacity: the consumed amount must
satisfy the policy and the running total must stay within the capacity's value). The quantity
texts are those the scheduler writes: a range rounded to a step becomes
`resource.NewQuantity(val, BinarySI)`, everything else is a copy of the policy's or the
request's quantity.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vgpu import quantity


def _exact(text: str) -> Fraction:
    return quantity.exact(quantity.parse(text))


def consumed(requested: str | None, cap: dict[str, Any]) -> str:
    """calculateConsumedCapacity: the quantity text the allocator records for one capacity."""
    policy = cap.get("requestPolicy")
    if requested is None:  # fillEmptyRequest
        if policy is not None and policy.get("default") is not None:
            return str(policy["default"])
        return str(cap["value"])
    if policy is None:
        return requested
    rng = policy.get("validRange")
    if rng is not None and rng.get("min") is not None:  # roundUpRange
        req, lo = _exact(requested), _exact(rng["min"])
        if req < lo:
            return str(rng["min"])
        if rng.get("step") is None:
            return requested
        r, s, m = quantity.value(requested), quantity.value(rng["step"]), quantity.value(rng["min"])
        n, mod = divmod(r - m, s)
        if mod:
            n += 1
        return quantity.format_binary(m + s * n)
    values = policy.get("validValues")
    if values is not None:  # roundUpValidValues
        req = _exact(requested)
        for v in values:
            if req <= _exact(v):
                return str(v)
    return requested


def violates(consumed_text: str, policy: dict[str, Any] | None) -> bool:
    """violatesPolicy."""
    if policy is None:
        return False
    if policy.get("default") is not None and _exact(consumed_text) == _exact(policy["default"]):
        return False
    rng = policy.get("validRange")
    if rng is not None:
        if rng.get("max") is not None and _exact(consumed_text) > _exact(rng["max"]):
            return True
        if rng.get("step") is not None:
            r, s, m = quantity.value(consumed_text), quantity.value(rng["step"]), quantity.value(rng["min"])
            return (r - m) % s != 0
        return False
    values = policy.get("validValues")
    if values:
        return not any(_exact(consumed_text) == _exact(v) for v in values)
    return False


@dataclass
class Device:
    pool: str
    name: str
    capacity: dict[str, Any]
    used: dict[str, Any] = field(default_factory=dict)  # capacity name -> Fraction consumed so far
    attributes: dict[str, Any] = field(default_factory=dict)


def _attr_value(v: dict[str, Any]) -> Any:
    for k in ("string", "int", "bool", "version"):
        if k in v:
            return v[k]
    return None


def selected(dev: Device, driver: str, selectors: list[str]) -> bool:
    """Every CEL selector is true for the device (compile.go's `device` variable)."""
    if not selectors:
        return True
    import celpy  # cel-python (dev dependency)

    domain = driver
    obj = {
        "driver": driver,
        "attributes": {domain: {k: _attr_value(v) for k, v in dev.attributes.items()}},
        "capacity": {domain: {k: v.get("value") for k, v in dev.capacity.items()}},
    }
    env = celpy.Environment()
    for expr in selectors:
        out = env.program(env.compile(expr)).evaluate({"device": celpy.json_to_cel(obj)})
        if isinstance(out, celpy.CELEvalError):
            raise ValueError(f"CEL {expr!r}: {out}")
        if not bool(out):
            return False
    return True


class NoFit(Exception):
    pass


def fits(dev: Device, requests: dict[str, str]) -> dict[str, str] | None:
    """CmpRequestOverCapacity: the consumedCapacity if the request fits on the device, else None."""
    if any(k not in dev.capacity for k in requests):
        return None
    out: dict[str, str] = {}
    for name, cap in dev.capacity.items():
        text = consumed(requests.get(name), cap)
        if violates(text, cap.get("requestPolicy")):
            return None
        if dev.used.get(name, 0) + _exact(text) > _exact(cap["value"]):
            return None
        out[name] = text
    return out


class Allocator:
    """First-fit over the devices of published ResourceSlices (multi-allocatable only)."""

    def __init__(self, resource_slices: list[dict[str, Any]]) -> None:
        self.devices: list[Device] = []
        self.driver = ""
        for s in resource_slices:
            self.driver = s["spec"]["driver"]
            for d in s["spec"].get("devices") or []:
                if d.get("allowMultipleAllocations"):
                    self.devices.append(
                        Device(
                            s["spec"]["pool"]["name"],
                            d["name"],
                            d.get("capacity") or {},
                            attributes=d.get("attributes") or {},
                        )
                    )

    def allocate(
        self, request: str, capacity_requests: dict[str, str], selectors: list[str] | None = None
    ) -> dict[str, Any]:
        """One DeviceRequestAllocationResult (JSON), or NoFit; `selectors`: the request's CEL."""
        for dev in self.devices:
            if not selected(dev, self.driver, selectors or []):
                continue
            got = fits(dev, capacity_requests)
            if got is None:
                continue
            for k, v in got.items():
                dev.used[k] = dev.used.get(k, 0) + _exact(v)
            return {
                "request": request,
                "driver": self.driver,
                "pool": dev.pool,
                "device": dev.name,
                "shareID": str(uuidlib.uuid4()),
                "consumedCapacity": got,
            }
        raise NoFit(f"no device fits {capacity_requests}")


def claim_object(
    name: str, namespace: str, results: list[dict[str, Any]], *, uid: str | None = None, pods: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) allocated with `results`, reserved for `pods`."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [
                    {"name": r["request"], "exactly": {"deviceClassName": r["driver"], "allocationMode": "ExactCount"}}
                    for r in results
                ]
            }
        },
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": str(uuidlib.uuid4())} for p in pods],
        },
    }
