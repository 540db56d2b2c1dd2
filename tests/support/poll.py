"""Polling for a condition that becomes true in another process or thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(pred: Callable[[], T], timeout: float, step: float = 0.02) -> T:
    """The first true value `pred` returns within `timeout` s, else its value at the deadline
    (false): for `assert poll(...), details` and for conditions that may not come."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def wait_for(pred: Callable[[], T | None], timeout: float = 10.0, what: str = "the condition", step: float = 0.02) -> T:
    """The first true value `pred` returns; AssertionError naming `what` after `timeout` s."""
    v = poll(pred, timeout, step)
    if not v:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return v
