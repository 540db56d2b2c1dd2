"""What the monitor keeps per GPU between observations: its controller and utilisation window,
the containers with processes on it, and the duty cycle it actuates."""

from __future__ import annotations

from dataclasses import dataclass, field

from monitor.controller import GpuController
from monitor.measure import UtilWindow
from monitor.observe import GpuObs
from monitor.procs import ProcKey


@dataclass
class GpuState:
    uuid: str
    index: int
    ctl: GpuController
    window: UtilWindow
    name: str = ""
    up: bool = False
    error: str = ""
    obs: GpuObs | None = None
    members: dict[str, dict[ProcKey, int]] = field(default_factory=dict)  # container -> key -> bytes
    pid_cid: dict[int, str] = field(default_factory=dict)
    use: dict[str, float] = field(default_factory=dict)  # as of the last control step / snapshot
    cycle_start: float = 0.0
    cycle_len: float = 0.5
    duty: dict[str, float] = field(default_factory=dict)
    stale_since: float | None = None
    restart: bool = False  # start a new cycle (and control step) now: a container began using the GPU

    def update_use(self, now: float) -> None:
        """Containers' use over the window (computed when needed: control steps, snapshots)."""
        use: dict[str, float] = {}
        for pid, cid in self.pid_cid.items():
            use[cid] = use.get(cid, 0.0) + self.window.use(pid, now)
        self.use = {cid: min(100.0, u) for cid, u in use.items()}
