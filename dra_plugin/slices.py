"""ResourceSlice and DeviceClass objects (`resource.k8s.io/v1`), built as plain JSON dicts.

Pure functions: the publisher (publisher.py) sends what `build` returns. Layout, after the
kubelet plugin helper's ResourceSlice controller (dynamic-resource-allocation
resourceslice/resourceslicecontroller.go syncPool): one pool per node, named after the node,
`spec.nodeName` set, an owner reference to the Node (the slices go with it), at most
128 devices per slice (ResourceSliceMaxDevices).

Each GPU is one device `gpu-<index>` with `allowMultipleAllocations: true` (DRAConsumableCapacity)
and two capacities, each with a requestPolicy (types.go CapacityRequestPolicy); a GPU in MIG mode
is not a device, each of its MIG devices is, `gpu-<index>-mig-<gi>-<ci>` with `type: mig`, its
`profile` (`1g.18gb`), `parentUUID` and `parentIndex` (static MIG: instances made by the admin):

- `memory`: floor(S x M) bytes; default the 1/K share rounded down to the step grid;
  validRange{min, step, max = the capacity rounded down to the grid}.
- `cores`: floor(100 x C) percent; the same with its own min and step.

Capacities and the 1/K share are the node core's `Slicing` (nodecore/devices.py), the same
numbers the device plugin's vGPUs and node annotation carry.

Every value satisfies pkg/apis/resource/validation/validation.go validateRequestPolicyRange:
min <= default <= max <= capacity, min + step <= capacity, (default - min) and (max - min)
multiples of step.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dra_plugin import claims
from dra_plugin.config import Settings
from vgpu import quantity
from vgpu.nvml import GPUInfo

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128  # types.go ResourceSliceMaxDevices
MAX_ATTRIBUTE_STRING = 64  # types.go DeviceAttributeMaxValueLength
_NAME_MAX = 253


class PolicyError(ValueError):
    """The configured request policy cannot describe this GPU."""


@dataclass(frozen=True)
class Policy:
    """One capacity and its requestPolicy, in integers (bytes or percent)."""

    capacity: int
    default: int
    min: int
    step: int
    max: int

    def to_api(self, fmt: Any) -> dict[str, Any]:
        return {
            "value": fmt(self.capacity),
            "requestPolicy": {
                "default": fmt(self.default),
                "validRange": {"min": fmt(self.min), "max": fmt(self.max), "step": fmt(self.step)},
            },
        }


def policy(capacity: int, share: int, minimum: int, step: int, what: str) -> Policy:
    """The requestPolicy of a capacity whose default share is `share` (before rounding)."""
    if capacity < minimum + step:
        raise PolicyError(f"{what}: capacity {capacity} is smaller than min {minimum} + step {step}")
    top = minimum + (capacity - minimum) // step * step
    default = minimum + max(0, share - minimum) // step * step
    return Policy(capacity=capacity, default=min(default, top), min=minimum, step=step, max=top)


def memory_policy(gpu: GPUInfo, cfg: Settings) -> Policy:
    s = cfg.slicing
    share = s.memory_per_vgpu(gpu.memory_total)
    return policy(s.memory_capacity(gpu.memory_total), share, cfg.memory_min, cfg.memory_step, f"{gpu.uuid} memory")


def cores_policy(cfg: Settings) -> Policy:
    # floor(100 x C) in all, floor(100 x C / K) per share: a vGPU's share on the device-plugin path.
    s = cfg.slicing
    return policy(s.cores_capacity, s.cores_for(1), cfg.cores_min, cfg.cores_step, "cores")


def device_name(gpu: GPUInfo) -> str:
    """`gpu-<index>`; a MIG device (nodecore/mig.py) `gpu-<index>-mig-<gi>-<ci>`."""
    if gpu.is_mig:
        return f"gpu-{gpu.index}-mig-{gpu.mig_gi}-{gpu.mig_ci}"
    return f"gpu-{gpu.index}"


def semver(text: str | None, parts: int = 3) -> str | None:
    """A version attribute must be semver 2.0 (validation.go semverRe): NVML's "580.65.06" and
    "8.6" become "580.65.6" and "8.6.0"; anything else is left out."""
    if not text:
        return None
    nums = text.strip().split(".")
    if not all(n.isdigit() and len(n) <= 9 for n in nums) or not 1 <= len(nums) <= parts:
        return None
    nums = [str(int(n)) for n in nums] + ["0"] * (parts - len(nums))
    return ".".join(nums)


def _string(value: str) -> dict[str, str]:
    return {"string": value[:MAX_ATTRIBUTE_STRING]}


def attributes(gpu: GPUInfo) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "type": _string("mig" if gpu.is_mig else "gpu"),
        "uuid": _string(gpu.uuid),
        "productName": _string(gpu.name),
        "index": {"int": gpu.index},
    }
    if gpu.is_mig:
        # NVIDIA's DRA driver's names for a MIG device: its profile and its GPU; a claim picks a
        # profile by CEL: device.attributes["<driver>"].profile == "1g.18gb"
        attrs["profile"] = _string(gpu.mig_profile or "")
        attrs["parentUUID"] = _string(gpu.parent_uuid or "")
        attrs["parentIndex"] = {"int": gpu.index}
        if gpu.mig_index is not None:
            attrs["index"] = {"int": gpu.mig_index}
    if gpu.numa_node is not None:
        attrs["numaNode"] = {"int": gpu.numa_node}
    if gpu.pci_bus_id:
        attrs["pciBusID"] = _string(gpu.pci_bus_id.lower())
    cc = semver(f"{gpu.cc_major}.{gpu.cc_minor}") if gpu.cc_major is not None and gpu.cc_minor is not None else None
    if cc:
        attrs["cudaComputeCapability"] = {"version": cc}
    drv = semver(gpu.driver_version)
    if drv:
        attrs["driverVersion"] = {"version": drv}
    if gpu.cuda_driver_version:
        v = gpu.cuda_driver_version
        attrs["cudaDriverVersion"] = {"version": f"{v // 1000}.{v % 1000 // 10}.0"}
    return attrs


def device(gpu: GPUInfo, cfg: Settings) -> dict[str, Any]:
    return {
        "name": device_name(gpu),
        "attributes": attributes(gpu),
        "capacity": {
            claims.CAPACITY_MEMORY: memory_policy(gpu, cfg).to_api(quantity.format_binary),
            claims.CAPACITY_CORES: cores_policy(cfg).to_api(quantity.format_decimal),
        },
        "allowMultipleAllocations": True,
    }


def capacities(gpus: Sequence[GPUInfo], cfg: Settings) -> dict[str, claims.DeviceCapacity]:
    """What Prepare checks a claim's consumedCapacity against: device name -> capacity."""
    cores = cores_policy(cfg).capacity
    return {
        device_name(g): claims.DeviceCapacity(uuid=g.uuid, memory=memory_policy(g, cfg).capacity, cores=cores)
        for g in gpus
    }


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`, a DNS subdomain of at most 253 characters (long node names are
    cut and made unique with a hash)."""
    tail = f"-{driver}-{index}"
    name = node + tail
    if len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    head = re.sub(r"[-.]+$", "", node[: _NAME_MAX - len(tail) - len(digest) - 1])
    return f"{head}-{digest}{tail}"


def build(
    node: str,
    gpus: Sequence[GPUInfo],
    cfg: Settings,
    *,
    generation: int,
    node_uid: str = "",
) -> list[dict[str, Any]]:
    """The node's ResourceSlices with the devices of `gpus` (the caller passes the healthy ones:
    an unhealthy GPU is withdrawn until it recovers), in index order, at most 128 per slice; every
    slice of the pool carries the same generation and the slice count."""
    devs = [device(g, cfg) for g in sorted(gpus, key=lambda g: g.index)]
    chunks = [devs[i : i + MAX_DEVICES_PER_SLICE] for i in range(0, len(devs), MAX_DEVICES_PER_SLICE)] or [[]]
    out = []
    for i, chunk in enumerate(chunks):
        meta: dict[str, Any] = {"name": slice_name(node, cfg.driver_name, i)}
        if node_uid:
            meta["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
            ]
        spec: dict[str, Any] = {
            "driver": cfg.driver_name,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
            "nodeName": node,
        }
        if chunk:
            spec["devices"] = chunk
        out.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": meta, "spec": spec})
    return out


def device_class(driver: str, extended_resource_name: str | None = None) -> dict[str, Any]:
    """The DeviceClass that selects our devices (CEL `device.driver`); with
    `extended_resource_name` (DRAExtendedResource) classic `<name>: n` requests are served from
    it, each taking the default share."""
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}
    if extended_resource_name:
        spec["extendedResourceName"] = extended_resource_name
    return {"apiVersion": API_VERSION, "kind": "DeviceClass", "metadata": {"name": driver}, "spec": spec}
