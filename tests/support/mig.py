"""MIG layouts of a simulated node as the node core reads them (nodecore.mig.discover in a child
process: NVML is loaded from the simulator's LD_LIBRARY_PATH at process start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from nodecore.mig import MigDevice, MigLayout
from vgpu.nvml import GPUInfo

ROOT = Path(__file__).resolve().parents[2]

_CODE = """
import dataclasses, json
from nodecore import mig
from vgpu import nvml
nvml.init(attempts=1)
gpus = nvml.inventory()
lay = mig.discover(gpus)
print(json.dumps({"gpus": [dataclasses.asdict(g) for g in gpus], "mode": lay.mode,
                  "devices": [dict(dataclasses.asdict(d), parent=d.parent.uuid) for d in lay.devices]}))
"""


def discover(env: dict[str, str]) -> MigLayout:
    r = subprocess.run(
        [sys.executable, "-c", _CODE], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    data: dict[str, Any] = json.loads(r.stdout)
    gpus = [GPUInfo(**g) for g in data["gpus"]]
    by_uuid = {g.uuid: g for g in gpus}
    devices = []
    for d in data["devices"]:
        d["parent"] = by_uuid[d["parent"]]
        d["placement"] = tuple(d["placement"])
        devices.append(MigDevice(**d))
    return MigLayout(gpus=gpus, mode=data["mode"], devices=devices)
