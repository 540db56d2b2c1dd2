"""`device_plugin.mig_strategy`: which devices the plugin offers under which resource names.

`none`, `single` and `mixed` are NVIDIA's `--mig-strategy` with its rules (k8s-device-plugin
v0.20.0 `internal/rm/device_map.go`: buildDeviceMapFromConfigResources, buildGPUDeviceMap,
buildMigDeviceMap, assertAllMigDevicesAreValid; `internal/rm/rm.go`: AddDefaultResourcesToConfig):

- `none`: every GPU under the resource name; MIG is ignored (a GPU in MIG mode is offered whole,
  although CUDA cannot use it without a MIG device).
- `single`: GPUs in MIG mode are not offered; their MIG devices are, under the resource name
  (`nvidia.com/gpu`), one device each.  Refused, as NVIDIA's plugin refuses to start: a node with
  GPUs in MIG mode and GPUs not in it ("all devices on the node must be configured with the same
  migEnabled value"), a GPU in MIG mode without MIG devices ("device N has no MIG devices
  configured"), MIG devices of more than one kind ("more than one MIG device type present on
  node", compared by their attributes).
- `mixed`: GPUs not in MIG mode under the resource name; each MIG device, one device each, under
  `<domain>/mig-<profile>` (`+` written `.`: `nvidia.com/mig-1g.18gb`), one resource per profile;
  only profiles whose compute instance spans its GPU instance get a name, a MIG device of another
  profile is refused ("MIG profile '...' does not match any resource patterns"); a GPU in MIG mode
  without MIG devices is a warning.
- `vgpu` (ours): GPUs not in MIG mode and every MIG device under the resource name, each split
  into K vGPUs like a GPU (a vGPU of a MIG device gets floor(S x its memory / K)); GPUs in MIG
  mode are not offered themselves.
- `dynamic` (ours): every GPU under the resource name with K vGPU slots; a GPU in MIG mode makes
  a MIG instance for each container the scheduler places on it (its decision names the profile
  and placement: device_plugin/dynmig.py), and its slots are at most that many instances.
  Instances that exist already (the administrator's) are not offered; their slices stay taken.

NVIDIA offers every device whole (one device, one container): `single` and `mixed` offer MIG
devices whole (split count 1).  GPUs not in MIG mode keep the node's split count in every
strategy, so with `device_split_count = 1` the offer is NVIDIA's exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from nodecore.devices import Slicing
from nodecore.mig import MigDevice, MigLayout, resource_suffix
from vgpu.nvml import GPUInfo

log = logging.getLogger(__name__)

MigStrategy = Literal["none", "single", "mixed", "vgpu", "dynamic"]
STRATEGIES: tuple[str, ...] = ("none", "single", "mixed", "vgpu", "dynamic")
WHOLE = Slicing(1)


class MigConfigError(RuntimeError):
    """The node's MIG layout does not fit the strategy (the plugin does not start, as NVIDIA's)."""


@dataclass(frozen=True)
class Resource:
    """One extended resource the plugin registers: its devices and how each is sliced."""

    name: str
    socket_name: str
    devices: tuple[GPUInfo, ...]
    slicing: Slicing
    primary: bool  # the configured resource name: inventory, usage and scheduler decisions
    # registered even without devices (the plugin's behaviour on a node without GPUs); not in
    # `mixed`, where NVIDIA's plugin registers no resource without devices
    register_empty: bool = True
    # devices offered whole are named by their UUID, as NVIDIA's plugin names them
    plain_ids: bool = False
    # GPUs in MIG mode whose instances are made per container (`dynamic`)
    dynamic: tuple[str, ...] = ()


def _domain(resource_name: str) -> str:
    return resource_name.split("/", 1)[0]


def mig_socket(socket_name: str, suffix: str) -> str:
    """`vgpu.sock` -> `vgpu-mig-1g.18gb.sock`: one plugin socket per resource, as NVIDIA's plugin
    serves one per resource."""
    stem = socket_name[:-5] if socket_name.endswith(".sock") else socket_name
    return f"{stem}-{suffix}.sock"


def _kind(d: MigDevice) -> tuple[int, int, int, int]:
    """What NVIDIA compares for `single` (nvmlDeviceAttributes_t): SMs, slices, memory."""
    return (d.sm_count, d.gi_slices, d.ci_slices, d.memory)


def plan(
    strategy: str,
    layout: MigLayout,
    *,
    resource_name: str,
    socket_name: str,
    slicing: Slicing,
) -> list[Resource]:
    """The resources to register for this layout; MigConfigError when NVIDIA's plugin would refuse."""
    if strategy not in STRATEGIES:
        raise MigConfigError(f"unknown MIG strategy {strategy!r} (none, single, mixed, vgpu, dynamic)")
    if strategy == "none":
        return [Resource(resource_name, socket_name, tuple(layout.gpus), slicing, True)]
    if strategy == "dynamic":
        dyn = tuple(g.uuid for g in layout.gpus if layout.enabled(g.uuid))
        return [Resource(resource_name, socket_name, tuple(layout.gpus), slicing, True, dynamic=dyn)]
    plain = tuple(g for g in layout.gpus if not layout.enabled(g.uuid))
    migs = list(layout.devices)
    for g in layout.gpus:
        if layout.enabled(g.uuid) and not layout.of(g.uuid):
            if strategy == "single":
                raise MigConfigError(f"invalid MIG configuration: device {g.index} has no MIG devices configured")
            log.warning("GPU %d (%s) is in MIG mode without MIG devices: nothing of it is offered", g.index, g.uuid)
    if strategy == "single":
        if plain and migs:
            raise MigConfigError("all devices on the node must be configured with the same migEnabled value")
        kinds = {_kind(d) for d in migs}
        if len(kinds) > 1:
            raise MigConfigError("invalid MIG configuration: more than one MIG device type present on node")
        if not migs:
            return [Resource(resource_name, socket_name, plain, slicing, True)]
        return [Resource(resource_name, socket_name, tuple(d.as_gpu() for d in migs), WHOLE, True, plain_ids=True)]
    if strategy == "vgpu":
        return [Resource(resource_name, socket_name, plain + tuple(d.as_gpu() for d in migs), slicing, True)]
    # mixed
    out = [Resource(resource_name, socket_name, plain, slicing, True, register_empty=False)]
    by_profile: dict[str, list[MigDevice]] = {}
    for d in migs:
        if not d.whole_instance:
            raise MigConfigError(f"MIG profile '{d.profile}' does not match any resource patterns")
        by_profile.setdefault(d.profile, []).append(d)
    for profile in sorted(by_profile):
        suffix = resource_suffix(profile)
        out.append(
            Resource(
                f"{_domain(resource_name)}/{suffix}",
                mig_socket(socket_name, suffix),
                tuple(d.as_gpu() for d in by_profile[profile]),
                WHOLE,
                False,
                register_empty=False,
                plain_ids=True,
            )
        )
    return out


def offered(resources: list[Resource]) -> dict[str, int]:
    """Resource name -> device count the kubelet is told (each device times its split count)."""
    return {r.name: len(r.devices) * r.slicing.split_count for r in resources if r.devices or r.register_empty}
