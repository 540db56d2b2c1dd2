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


def request_bytes(record: dict[str, Any], newline: bool) -> bytes:
    """The HTTP request a recording holds (request_line, headers in order, body), as bytes.

    Bodies were stored re-indented with key order kept: compact JSON gives back the bytes that
    were sent. Go's JSON encoder (what kube-apiserver sends webhooks) ends with a newline;
    kube-scheduler's json.Marshal (extender calls) does not. The recorded Content-Length must
    match: a check that the bytes are the real ones.
    """
    body = json.dumps(record["body"], separators=(",", ":"), ensure_ascii=False).encode()
    if newline:
        body += b"\n"
    headers = [(k, v) for k, v in record["headers"]]
    length = [v for k, v in headers if k.lower() == "content-length"]
    if length != [str(len(body))]:
        raise ValueError(f"rebuilt body is {len(body)} bytes, recorded Content-Length {length}")
    head = record["request_line"] + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode() + body
