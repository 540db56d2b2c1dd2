"""Process helpers shared by the tests, the benchmarks and the demo."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def terminate(p: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """Stop a daemon as its service manager would: SIGTERM, wait, then SIGKILL."""
    if p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
