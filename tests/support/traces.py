"""Recorded real traffic (kube-apiserver, kube-scheduler, kubelet v1.36.2; containerd 1.6.20 and
2.3.4; NVIDIA Container Toolkit 1.20): the ground truth our stand-ins are checked against.

The recordings live in the shared folder beside the repository (`../shared/real-traces`, read its
README); `tests/data/real-traces` is a byte-identical copy so that a clean clone (CI) has them.
`VGPU_REAL_TRACES` points elsewhere. Where a trace and a stand-in disagree, the trace wins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
COPY = REPO / "tests" / "data" / "real-traces"
SHARED = REPO.parent / "shared" / "real-traces"


def root() -> Path:
    env = os.environ.get("VGPU_REAL_TRACES")
    return Path(env) if env else COPY


def path(rel: str) -> Path:
    """The recorded file `rel` (e.g. "webhook/c-no-gpu.json"); a missing one is an error."""
    p = root() / rel
    if not p.is_file():
        raise FileNotFoundError(f"real trace {rel} not found under {root()}")
    return p


def load_json(rel: str) -> Any:
    return json.loads(path(rel).read_bytes())


def text(rel: str) -> str:
    return path(rel).read_text()
