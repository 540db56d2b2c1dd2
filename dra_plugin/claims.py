"""The part of a `resource.k8s.io/v1` ResourceClaim that NodePrepareResources reads, and the
rules that turn its allocation into the slices of our GPUs.

The Structs model k8s.io/api/resource/v1/types.go (`ResourceClaim`, `ResourceClaimStatus`,
`AllocationResult`, `DeviceAllocationResult`, `DeviceRequestAllocationResult`,
`ResourceClaimConsumerReference`) with their JSON names; fields we do not read are ignored.
`shares()` is pure: it checks the claim against the one named by the kubelet and against our
inventory, and gives one `Share` per result of our driver, or raises ClaimError with the text
that goes into that claim's entry of the response (the other claims of the call go on).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from vgpu import quantity
from vgpu.paths import valid_claim_uid

CAPACITY_MEMORY = "memory"
CAPACITY_CORES = "cores"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class ClaimError(ValueError):
    """This claim cannot be prepared; the message goes to the kubelet (and the pod's events)."""


class ObjectMeta(msgspec.Struct, kw_only=True, rename="camel"):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    deletion_timestamp: str | None = None


class ConsumerReference(msgspec.Struct, kw_only=True, rename="camel"):
    api_group: str = ""
    resource: str = ""
    name: str = ""
    uid: str = ""


class RequestResult(msgspec.Struct, kw_only=True, rename={"share_id": "shareID"}):
    """DeviceRequestAllocationResult (`consumedCapacity` keys are the device's capacity names)."""

    request: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""
    admin_access: bool | None = msgspec.field(default=None, name="adminAccess")
    share_id: str | None = None
    consumed_capacity: dict[str, str] | None = msgspec.field(default=None, name="consumedCapacity")


class DeviceAllocation(msgspec.Struct, kw_only=True):
    results: list[RequestResult] = msgspec.field(default_factory=list)


class Allocation(msgspec.Struct, kw_only=True):
    devices: DeviceAllocation = msgspec.field(default_factory=DeviceAllocation)


class ClaimStatus(msgspec.Struct, kw_only=True, rename="camel"):
    allocation: Allocation | None = None
    reserved_for: list[ConsumerReference] = msgspec.field(default_factory=list)


class ResourceClaim(msgspec.Struct, kw_only=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    status: ClaimStatus = msgspec.field(default_factory=ClaimStatus)


def decode(data: bytes) -> ResourceClaim:
    """A ResourceClaim from the API server's JSON; ClaimError when it is not one."""
    try:
        return msgspec.json.decode(data, type=ResourceClaim)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ClaimError(f"malformed ResourceClaim from the API server: {e}") from None


def valid_uid(uid: str) -> bool:
    """A claim UID is a path component and a CDI device name here: lowercase RFC 4122 as the API
    server makes them (validation.go validateUID); anything else is refused."""
    return valid_claim_uid(uid)


@dataclass(frozen=True)
class DeviceCapacity:
    """What one of our devices offers (its published capacity)."""

    uuid: str
    memory: int  # bytes, scaled (the `memory` capacity)
    cores: int  # percent (the `cores` capacity)


@dataclass(frozen=True)
class Share:
    """One allocation result of our driver: a share of one GPU."""

    request: str
    pool: str
    device: str
    share_id: str | None
    uuid: str
    memory: int
    cores: int


def shares(
    claim: ResourceClaim,
    *,
    namespace: str,
    name: str,
    uid: str,
    driver: str,
    pool: str,
    devices: Mapping[str, DeviceCapacity],
) -> list[Share]:
    """Our driver's results of `claim`, which the kubelet named (namespace, name, uid).

    As the kubelet plugin helper (dynamic-resource-allocation kubeletplugin/draplugin.go
    getResourceClaims): the claim must be allocated and still the one with that UID. Then each
    result of our driver must name our pool and a device we publish; its share is the
    `consumedCapacity` the scheduler recorded (already rounded by the requestPolicy), or the whole
    device when there is none (an exclusive allocation: the field "is populated only for devices
    that allow multiple allocations", types.go).
    """
    meta = claim.metadata
    if meta.uid != uid:
        raise ClaimError(
            f"ResourceClaim {namespace}/{name} got replaced: the API server has UID {meta.uid[:64]!r}, "
            f"the kubelet asked for {uid[:64]!r}"
        )
    if (meta.namespace and meta.namespace != namespace) or (meta.name and meta.name != name):
        raise ClaimError(f"the API server answered for {meta.namespace[:64]}/{meta.name[:64]}, not {namespace}/{name}")
    alloc = claim.status.allocation
    if alloc is None:
        raise ClaimError(f"ResourceClaim {namespace}/{name} is not allocated")
    ours = [r for r in alloc.devices.results if r.driver == driver]
    if not ours:
        raise ClaimError(f"ResourceClaim {namespace}/{name} has no device of driver {driver}")
    out: list[Share] = []
    for r in ours:
        where = f"ResourceClaim {namespace}/{name} request {r.request[:64]!r}"
        if r.pool != pool:
            raise ClaimError(f"{where}: device {r.device[:64]} of pool {r.pool[:64]!r}, not this node's pool {pool!r}")
        cap = devices.get(r.device)
        if cap is None:
            raise ClaimError(f"{where}: unknown device {r.device[:64]!r} in pool {pool!r}")
        if r.admin_access:
            # Admin access hands the device over without a share of it: nothing to enforce, so
            # no isolation could be promised. Refused (fail closed) rather than unlimited.
            raise ClaimError(f"{where}: admin access to {r.device} is not supported by {driver}")
        share_id = r.share_id
        if share_id is not None and not valid_uid(share_id):
            raise ClaimError(f"{where}: invalid shareID {share_id[:64]!r}")
        memory, cores = _consumed(where, r.consumed_capacity, cap)
        out.append(Share(r.request, r.pool, r.device, share_id, cap.uuid, memory, cores))
    return out


def _consumed(where: str, consumed: dict[str, str] | None, cap: DeviceCapacity) -> tuple[int, int]:
    if consumed is None:
        return cap.memory, cap.cores
    values: dict[str, int] = {}
    for key, limit in ((CAPACITY_MEMORY, cap.memory), (CAPACITY_CORES, cap.cores)):
        text = consumed.get(key)
        if text is None:
            # The allocator records every capacity of the device (GetConsumedCapacityFromRequest).
            raise ClaimError(f"{where}: consumedCapacity has no {key!r}")
        try:
            v = quantity.value(text)
        except quantity.QuantityError as e:
            raise ClaimError(f"{where}: consumedCapacity {key}: {e}") from None
        if not 0 <= v <= limit:
            raise ClaimError(f"{where}: consumedCapacity {key} {text[:40]} is outside 0..{limit} of {cap.uuid}")
        values[key] = v
    if values[CAPACITY_MEMORY] == 0:
        raise ClaimError(f"{where}: consumedCapacity memory is 0")
    return values[CAPACITY_MEMORY], values[CAPACITY_CORES]


def reserved_pods(claim: ResourceClaim) -> list[ConsumerReference]:
    """The pods the claim is reserved for (status.reservedFor, core group `pods`)."""
    return [r for r in claim.status.reserved_for if r.api_group == "" and r.resource == "pods"]


def request_names(results: Sequence[Share]) -> list[str]:
    """Request names as the kubelet matches them against a container's claims: a subrequest
    `<main>/<sub>` counts as its main request (kubeletplugin draplugin.go stripSubrequestNames)."""
    out: list[str] = []
    for s in results:
        main = s.request.split("/", 1)[0]
        if main not in out:
            out.append(main)
    return out


def valid_device_name(name: str) -> bool:
    return bool(_DNS_LABEL.fullmatch(name))
