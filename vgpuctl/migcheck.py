"""`vgpuctl doctor`'s MIG checks: the GPUs' MIG modes, their MIG devices and who uses them, and
whether `device_plugin.mig_strategy` can serve the layout (the rules NVIDIA's plugin applies,
device_plugin/mig.py; docs/operators/mig.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from device_plugin import mig as dp_mig
from nodecore.devices import Slicing
from nodecore.mig import MigLayout
from vgpu.config import NodeConfig

MigProbe = Callable[[], MigLayout]
Finding = tuple[str, str, str]  # (status, message, fix)


def mig_probe() -> MigLayout:
    from nodecore import mig
    from vgpu import nvml

    nvml.init(attempts=1)
    try:
        return mig.discover(nvml.inventory())
    finally:
        nvml.shutdown()


def users(status: dict[str, Any] | None) -> dict[str, list[str]]:
    """Device UUID -> `namespace/pod` (or claim) of the vGPU containers the monitor sees on it."""
    out: dict[str, list[str]] = {}
    for g in (status or {}).get("gpus", []) or []:
        names = []
        for r in [*(g.get("containers") or []), *(g.get("allocated") or [])]:
            who = f"claim {r['claim']}" if r.get("claim") else f"{r.get('namespace') or '-'}/{r.get('pod') or '-'}"
            if who not in names:
                names.append(who)
        out[str(g.get("uuid"))] = names
    return out


def check(layout: MigLayout, cfg: NodeConfig, status: dict[str, Any] | None) -> list[Finding]:
    found: list[Finding] = []
    dp = cfg.device_plugin
    enabled = [g for g in layout.gpus if layout.enabled(g.uuid)]
    for g in layout.gpus:
        cur, pend = layout.mode.get(g.uuid), layout.pending.get(g.uuid)
        if cur is not None and pend is not None and cur != pend:
            fix = "stop the GPU's processes, then `nvidia-smi -i <gpu> -mig <mode>` again (or reset the GPU)"
            found.append(("WARN", f"GPU {g.index} {g.uuid}: MIG mode {cur} pending {pend}", fix))
    if not enabled:
        found.append(("OK", "no GPU in MIG mode", ""))
        return found
    who = users(status)
    for g in enabled:
        devs = layout.of(g.uuid)
        if not devs and dp.mig_strategy == "dynamic":
            found.append(("OK", f"GPU {g.index} {g.uuid}: MIG on, no instance: made per scheduled container "
                          "(mig_strategy dynamic)", ""))  # fmt: skip
            continue
        if not devs:
            found.append(("WARN", f"GPU {g.index} {g.uuid}: MIG mode on without MIG devices: nothing of it is usable",
                          "create instances (nvidia-smi mig -cgi <profiles> -C) or disable MIG"))  # fmt: skip
            continue
        parts = []
        for d in devs:
            used = ", ".join(who.get(d.uuid, [])) or "unused"
            parts.append(f"{d.profile} {d.uuid} (gi {d.gi} ci {d.ci}; {used})")
        found.append(("OK", f"GPU {g.index} {g.uuid}: MIG on: " + "; ".join(parts), ""))
    if dp.mig_strategy == "none":
        found.append(("WARN", f"{len(enabled)} GPU(s) in MIG mode but device_plugin.mig_strategy = none: each is "
                      "offered whole and CUDA cannot use it", "set device_plugin.mig_strategy to single, mixed, "
                      "vgpu or dynamic (docs/operators/mig.md)"))  # fmt: skip
        return found
    slicing = Slicing(dp.device_split_count, dp.device_memory_scaling, dp.device_cores_scaling)
    try:
        res = dp_mig.plan(
            dp.mig_strategy, layout, resource_name=dp.resource_name, socket_name=dp.socket_name, slicing=slicing
        )
    except dp_mig.MigConfigError as e:
        found.append(("FAIL", f"mig_strategy {dp.mig_strategy}: {e}: vgpu-device-plugin does not start",
                      "change the instances or choose another mig_strategy (docs/operators/mig.md)"))  # fmt: skip
        return found
    offer = ", ".join(f"{n}: {c}" for n, c in dp_mig.offered(res).items())
    found.append(("OK", f"mig_strategy {dp.mig_strategy} offers {offer}", ""))
    if dp.mig_strategy == "dynamic" and dp.device_split_count < 7:
        found.append(("WARN", f"device_split_count {dp.device_split_count}: at most that many MIG instances per GPU "
                      "under mig_strategy dynamic (a GPU holds up to 7)",
                      "set device_split_count to 7 or more"))  # fmt: skip
    if dp.mig_strategy == "vgpu":
        found.append(("WARN", "compute shares are not enforced on MIG devices (NVML has no per-process "
                      "utilisation on MIG); their memory slices are", ""))  # fmt: skip
    return found
