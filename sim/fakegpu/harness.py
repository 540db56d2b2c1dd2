"""Test harness for the simulated GPU node (sim/fakegpu).

A ``FakeGPU`` is one simulated node: a device config file and a shared state file of its own
under ``workdir``, and an environment (``env``) that makes child processes use the fake
``libcuda.so.1`` / ``libnvidia-ml.so.1`` from ``build/fakegpu``.  Programs must be started as
children with that environment: the dynamic loader reads LD_LIBRARY_PATH once, at process start.

    gpu = FakeGPU(tmp_path / "node", build_dir, gpus=2, memory=16 << 30, context_overhead=64 << 20)
    out = gpu.run([gpu.burn, "--alloc", "1g"])
    gpu.state()["processes"]

Keyword overrides apply to every device (device keys: uuid, name, memory, pci_bus_id, numa_node,
context_overhead, reserved, pci_device_id, sm_count, cc_major, cc_minor, minor_number,
memory_bandwidth, host_link_bandwidth, mig_profiles, mig_mode; `sim.fakegpu.mig.PRODUCTS` has the
MIG-capable products) or to the
node (queue_depth, timeslice_us, sample_period_ms, util_window_ms, driver_version, cuda_version).
See docs/developers/simulators.md for the file formats and the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid as uuidlib
from pathlib import Path
from typing import Any

NODE_KEYS = frozenset(
    {"queue_depth", "timeslice_us", "sample_period_ms", "util_window_ms", "driver_version", "cuda_version"}
)
DEVICE_KEYS = frozenset(
    {
        "uuid",
        "name",
        "memory",
        "pci_bus_id",
        "numa_node",
        "context_overhead",
        "reserved",
        "pci_device_id",
        "sm_count",
        "cc_major",
        "cc_minor",
        "minor_number",
        "memory_bandwidth",
        "host_link_bandwidth",
        "mig_profiles",
        "mig_mode",
    }
)


def render_config(devices: list[dict[str, Any]], settings: dict[str, Any] | None = None) -> str:
    """The FAKEGPU_CONFIG text for these devices and node settings."""
    lines = ["# fakegpu device configuration (written by sim/fakegpu/harness.py)"]
    for key, value in (settings or {}).items():
        if key not in NODE_KEYS:
            raise ValueError(f"unknown fakegpu node setting {key!r}")
        lines.append(f"{key} = {value}")
    for dev in devices:
        lines.append("[device]")
        for key, value in dev.items():
            if key not in DEVICE_KEYS:
                raise ValueError(f"unknown fakegpu device key {key!r}")
            text = str(value)
            if "\n" in text or "#" in text:
                raise ValueError(f"fakegpu device {key}: invalid value {text!r}")
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def new_uuid() -> str:
    return f"GPU-{uuidlib.uuid4()}"


class FakeGPU:
    """One simulated GPU node.  See the module docstring."""

    def __init__(
        self, workdir: Path, build_dir: Path, *, gpus: int = 2, memory: int = 16 << 30, **device_overrides: Any
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.build_dir = Path(build_dir)
        self.lib_dir = self.build_dir / "fakegpu"
        self.config_path = self.workdir / "fakegpu.conf"
        self.state_path = self.workdir / "fakegpu.state"
        self.burn = str(self.lib_dir / "fakegpu-burn")
        self.ctl_path = str(self.lib_dir / "fakegpu-ctl")
        self.uuids: list[str] = []
        self.settings: dict[str, Any] = {}
        self._children: list[subprocess.Popen[Any]] = []
        settings = {k: v for k, v in device_overrides.items() if k in NODE_KEYS}
        per_device = {k: v for k, v in device_overrides.items() if k not in NODE_KEYS}
        devices = []
        for i in range(gpus):
            dev: dict[str, Any] = {
                "uuid": new_uuid(),
                "name": "NVIDIA Fake GPU",
                "memory": memory,
                "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0",
                "minor_number": i,
            }
            dev.update(per_device)
            if "uuid" in per_device and gpus > 1:
                dev["uuid"] = new_uuid() if i else per_device["uuid"]
            devices.append(dev)
        self.configure(devices, **settings)

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = str(self.lib_dir) + (f":{old}" if old else "")
        env["FAKEGPU_CONFIG"] = str(self.config_path)
        env["FAKEGPU_STATE"] = str(self.state_path)
        return env

    def configure(self, devices: list[dict[str, Any]], **settings: Any) -> None:
        """Rewrites the config and starts a fresh state.  Call before starting processes."""
        devs = [dict(d) for d in devices]
        for d in devs:
            d.setdefault("uuid", new_uuid())
        self.config_path.write_text(render_config(devs, settings))
        self.settings = dict(settings)
        self.uuids = [str(d["uuid"]) for d in devs]
        self.state_path.unlink(missing_ok=True)
        self.ctl("init")

    def ctl(self, *args: str) -> str:
        proc = subprocess.run([self.ctl_path, *args], env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"fakegpu-ctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.ctl("dump"))
        return data

    def inject_xid(self, index: int, xid: int) -> None:
        self.ctl("xid", str(index), str(xid))

    def set_lost(self, index: int, lost: bool = True) -> None:
        self.ctl("lost", str(index), "1" if lost else "0")

    def inject_mig_xid(self, index: int, xid: int, gi: int, ci: int) -> None:
        """An XID attributed to the MIG device (gi, ci) of GPU `index`."""
        self.ctl("xid", str(index), str(xid), str(gi), str(ci))

    def mig_mode(self, index: int, enabled: bool = True) -> str:
        """nvidia-smi -i INDEX -mig 0|1: "" when applied, else "pending: <reason>"."""
        return self.ctl("mig-mode", str(index), "1" if enabled else "0").strip()

    def mig_create(self, index: int, *profiles: str, start: int | None = None) -> list[dict[str, Any]]:
        """GPU instances with their full compute instance (nvidia-smi mig -cgi P -C): one
        {gpu, gi, ci, profile, unit, uuid, start, size} per profile (a name such as 3g.71gb or an ID)."""
        args = ["mig-create", str(index), ",".join(profiles)]
        if start is not None:
            args.append(str(start))
        return [json.loads(line) for line in self.ctl(*args).splitlines() if line.strip()]

    def mig_destroy(self, index: int, gi: int | str = "all") -> None:
        self.ctl("mig-destroy", str(index), str(gi))

    def mig_devices(self) -> list[dict[str, Any]]:
        """Every MIG device of the node: {gpu, gi, ci, uuid, unit, name, profile (the GI's), memory, ...}."""
        out = []
        for g in self.state()["mig"]:
            for gi in g["gpu_instances"]:
                for ci in gi["compute_instances"]:
                    out.append(
                        {
                            **ci,
                            "gpu": g["index"],
                            "gi": gi["id"],
                            "ci": ci["id"],
                            "gi_profile": gi["profile"],
                            "memory": gi["memory"],
                            "placement": (gi["start"], gi["size"]),
                        }
                    )
        return out

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        kw.setdefault("env", self.env)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 120)
        return subprocess.run(argv, **kw)

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        kw.setdefault("env", self.env)
        proc: subprocess.Popen[Any] = subprocess.Popen(argv, **kw)
        self._children.append(proc)
        return proc

    def close(self) -> None:
        """Kills the processes started with popen() that are still running (resuming stopped ones)."""
        for proc in self._children:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        self._children.clear()
