"""The NVML sampling thread: the main loop asks for an observation and never waits on NVML."""

from __future__ import annotations

import threading
import time
from typing import Any

from monitor.threadname import name_thread


class NvmlWorker:
    """Runs `source.observe()` on a thread of its own, one call at a time.

    NVML calls can hang (a GPU falling off the bus, a driver in trouble, or any
    lock another process holds — including a process we stopped).  The main loop
    never waits on NVML: it keeps resuming processes on time, and after
    NVML_HANG_S without an answer it resumes everything."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.busy = False
        self.since = 0.0
        self._req = threading.Event()
        self._done = threading.Event()
        self._result: tuple[Any, float] | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="nvml", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def request(self) -> None:
        self.busy = True
        self.since = time.monotonic()
        self._req.set()

    def wait(self, timeout: float) -> None:
        """Sleep until `timeout` passes or an observation is done."""
        self._done.wait(timeout)

    def take(self) -> tuple[Any, float] | None:
        if not self._done.is_set():
            return None
        self._done.clear()
        r, self._result = self._result, None
        if r is None:  # woken by stop(), not by a result
            return None
        self.busy = False
        return r

    def wake(self) -> None:
        self._done.set()

    def close(self) -> None:
        self._closing = True
        self._req.set()

    def _loop(self) -> None:
        name_thread("vgpu-nvml")
        while True:
            self._req.wait()
            self._req.clear()
            if self._closing:
                return
            t0 = time.perf_counter()
            try:
                result: Any = self.source.observe()
            except Exception as e:  # handed to the main loop, which counts and logs it
                result = e
            self._result = (result, time.perf_counter() - t0)
            self._done.set()
