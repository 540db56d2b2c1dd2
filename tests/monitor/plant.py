"""A simulated GPU plant for the control law: one kernel at a time, round-robin over
processes with queued work, bounded launch queues that keep draining while a
process is stopped, and a lagged sliding-window measurement (like NVML samples).
Pure Python, deterministic; used by the controller unit tests."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from monitor.controller import ControlParams, GpuController, MemberInput


@dataclass
class Proc:
    name: str
    target: float
    queue_depth: int
    demand: float = 1.0  # fraction of time it wants to launch (1 = saturating)
    queued: int = 0
    stopped: bool = False
    executed: float = 0.0
    history: deque = field(default_factory=deque)  # (t, executed) for windows


def simulate(
    targets: dict[str, float],
    *,
    policy: str = "strict",
    seconds: float = 20.0,
    kernel_ms: float = 1.0,
    queue_depth: int = 8,
    cycle_s: float = 0.5,
    window_s: float = 0.5,
    lag_s: float = 0.1,
    params: ControlParams | None = None,
    demand: dict[str, float] | None = None,
    seed: int = 1,
) -> dict[str, list[float]]:
    """Returns per-process shares (percent) over consecutive 1 s windows of ground truth."""
    rng = random.Random(seed)
    p = params or ControlParams(policy=policy)
    p.policy = policy
    ctl = GpuController(p)
    procs = [Proc(n, t, queue_depth, (demand or {}).get(n, 1.0)) for n, t in targets.items()]
    dt = kernel_ms / 1000.0
    t = 0.0
    rr = 0
    duty = {pr.name: 1.0 for pr in procs}
    cycle_start, cycle_len = 0.0, cycle_s
    exec_log: list[tuple[float, str]] = []  # (time, who) for each executed kernel
    shares: dict[str, list[float]] = {pr.name: [] for pr in procs}
    win_exec = {pr.name: 0.0 for pr in procs}
    next_win = 1.0
    while t < seconds:
        # actuator
        if t >= cycle_start + cycle_len:
            cycle_start = t
            cycle_len = cycle_s * (1 + rng.uniform(-0.05, 0.05))
            # measurement: executed kernel time in [t-lag-window, t-lag]
            lo, hi = t - lag_s - window_s, t - lag_s
            members = {}
            for pr in procs:
                busy = sum(kernel_ms / 1000.0 for (tt, who) in exec_log if who == pr.name and lo <= tt < hi)
                members[pr.name] = MemberInput(target=pr.target, util=100.0 * busy / window_s, measured=hi > window_s)
            duty = ctl.step(members)
        for pr in procs:
            pr.stopped = t >= cycle_start + duty[pr.name] * cycle_len
            if not pr.stopped:
                if pr.demand >= 1.0:
                    pr.queued = pr.queue_depth
                elif rng.random() < pr.demand:
                    pr.queued = min(pr.queue_depth, pr.queued + 1)
        # GPU: one kernel, round robin over non-empty queues
        n = len(procs)
        for i in range(n):
            pr = procs[(rr + i) % n]
            if pr.queued > 0:
                pr.queued -= 1
                pr.executed += dt
                win_exec[pr.name] += dt
                exec_log.append((t, pr.name))
                rr = (rr + i + 1) % n
                break
        t += dt
        if len(exec_log) > 20000:
            del exec_log[:10000]
        if t >= next_win:
            total = 1.0
            for pr in procs:
                shares[pr.name].append(100.0 * win_exec[pr.name] / total)
                win_exec[pr.name] = 0.0
            next_win += 1.0
    return shares
