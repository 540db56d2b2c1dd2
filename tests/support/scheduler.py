"""vgpu-scheduler as a process beside the demo's harness, and pods admitted through its webhook,
for the end-to-end tests."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from sim.admission import admission_review
from sim.kubeapi import apply_json_patch
from tests.support.http import post_ok
from tests.support.poll import wait_for


def start(demo: Any, kubeconfig: Path, name: str = "vgpu-scheduler") -> tuple[subprocess.Popen[bytes], str]:
    """vgpu-scheduler (extender + webhook) on a free loopback port, spawned by the demo harness
    (`demo._spawn`, logs under `name`); returns the process and its base URL once it serves."""
    cmd = [sys.executable, "-m", "vgpu_scheduler", "--bind", "127.0.0.1:0", "--kubeconfig", str(kubeconfig)]
    proc = demo._spawn(cmd, name)

    def port() -> int:
        assert proc.poll() is None, demo.tail(name)
        m = re.search(r"serving on 127\.0\.0\.1:(\d+)", demo.tail(name, 50))
        return int(m.group(1)) if m else 0

    return proc, f"http://127.0.0.1:{wait_for(port, 30, 'vgpu-scheduler to serve', step=0.1)}"


def admit(url: str, pod: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    """The pod as the webhook at `url` admits it (its JSON patch applied); fails when refused."""
    review: dict[str, Any] = post_ok(f"{url}/webhook", admission_review(pod, namespace))["response"]
    assert review["allowed"], review
    if review.get("patch"):
        pod = apply_json_patch(pod, json.loads(base64.b64decode(review["patch"])))
    return pod
