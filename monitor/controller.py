"""The compute-share control law (per GPU).

Actuation: each container on a GPU gets a duty cycle d in [d_min, 1] over a
per-GPU cycle of ~`duty_period` (jittered).  All containers start a cycle
running; container c is stopped (SIGSTOP) for the last (1 - d_c) of it.  Every
container's off-phase therefore sits at the same end of the cycle, which makes
the measured share a deterministic, monotone function of the duties (no
random phase beating between containers) and lets the feedback below settle
to a fixed point.

Control: once per cycle, from the container's measured SM use u (percent of
the GPU over the last window) and its effective target t,

    d <- clamp(d * clamp((t / u) ** gain, 1 - max_step, 1 + max_step), d_min, 1)

a multiplicative ("ratio") integral law as in cpulimit.  It normalises itself to
the plant's unknown gain: where use is proportional to duty (a saturating
process sharing the GPU), one step with gain 1 lands on the target; queued
kernels that keep draining while a process is stopped only make the plant
less sensitive, which the integral action absorbs.  The state d is itself
clamped, so there is no wind-up: a container that uses less than its share
climbs back to d = 1 within a few cycles and stays there.  The step limit
keeps one noisy measurement from moving the duty by more than max_step.

Policy: `strict` holds every container to its share; `contended` only
throttles a container while another container on the same GPU is
*demanding* (it uses at least 80 % of what it could get: min(its share, an
equal split among the active containers)); otherwise the effective target
is 100 % and an idle GPU is never wasted; `off` never throttles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVE_PCT = 1.0
DEMAND_FRACTION = 0.8


@dataclass
class MemberInput:
    target: float  # share, percent of the GPU
    util: float  # measured SM use over the window, percent of the GPU
    measured: bool = True  # False while the window holds no data yet


@dataclass
class ControlParams:
    policy: str = "contended"
    gain: float = 0.5
    gain_far: float = 1.0  # used while |error| > far_pp: reach the target fast, then settle gently
    far_pp: float = 10.0
    max_step: float = 0.3
    max_step_far: float = 0.6  # step limit while far from the target
    d_min: float = 0.02
    deadband_pp: float = 0.5
    elasticity_min: float = 0.4
    elasticity_max: float = 1.0  # use = a*d + drain (drain >= 0): never more than proportional


def demanding(m: MemberInput, n_active: int) -> bool:
    if m.util < ACTIVE_PCT:
        return False
    fair = 100.0 / max(n_active, 1)
    return m.util >= DEMAND_FRACTION * min(m.target, fair)


def effective_targets(members: dict[str, MemberInput], policy: str) -> dict[str, float]:
    """The share each container is held to this cycle (100 = not throttled)."""
    if policy == "off":
        return {c: 100.0 for c in members}
    if policy == "strict":
        return {c: max(0.0, min(100.0, m.target)) for c, m in members.items()}
    n_active = sum(1 for m in members.values() if m.util >= ACTIVE_PCT)
    demand = {c: demanding(m, n_active) for c, m in members.items()}
    out: dict[str, float] = {}
    for c, m in members.items():
        contended = any(d for o, d in demand.items() if o != c)
        out[c] = max(0.0, min(100.0, m.target)) if contended else 100.0
    return out


def next_duty(d: float, target: float, util: float, p: ControlParams, elasticity: float = 1.0) -> float:
    if target >= 100.0:
        return 1.0 if d >= 1.0 - 1e-9 else min(1.0, d * (1 + p.max_step))
    if util < ACTIVE_PCT:
        return 1.0  # idle: nothing to hold back, and stopping it would only stall its CPU side
    if abs(util - target) <= p.deadband_pp:
        return d
    far = abs(util - target) > p.far_pp
    gain = (p.gain_far if far else p.gain) / elasticity
    step = min(0.8, (p.max_step_far if far else p.max_step) / elasticity)
    ratio = (target / max(util, 0.5)) ** gain
    ratio = min(1 + step, max(1 - step, ratio))
    return min(1.0, max(p.d_min, d * ratio))


class GpuController:
    """Duties of the containers on one GPU."""

    def __init__(self, params: ControlParams) -> None:
        self.p = params
        self.duty: dict[str, float] = {}
        self.targets: dict[str, float] = {}
        self.last: dict[str, tuple[float, float]] = {}  # (duty of the last cycle, use measured over it)
        self.elasticity: dict[str, float] = {}

    def step(self, members: dict[str, MemberInput]) -> dict[str, float]:
        for c in list(self.duty):
            if c not in members:
                del self.duty[c]
                self.last.pop(c, None)
                self.elasticity.pop(c, None)
        measured = {c: m for c, m in members.items() if m.measured}
        targets = effective_targets(measured, self.p.policy)
        self.targets = targets
        for c in members:
            d = self.duty.get(c, 1.0)
            if c in measured:
                u = measured[c].util
                e = self._learn(c, d, u)
                d = next_duty(d, targets[c], u, self.p, e)
            self.duty[c] = d
        return dict(self.duty)

    def _learn(self, c: str, d: float, u: float) -> float:
        """Elasticity of use to duty (d log u / d log d), learnt from the last two cycles.

        Saturating processes sharing a GPU give ~1; queued kernels that drain
        while stopped give less (the duty must move further for the same
        change in use), and the law's gain is divided by it.  Only clear moves
        of the duty are used, smoothed, and bounded."""
        e = self.elasticity.get(c, 1.0)
        prev = self.last.get(c)
        self.last[c] = (d, u)
        if prev is not None and u > 1.0 and prev[1] > 1.0 and d > 0 and prev[0] > 0:
            dl = math.log(d / prev[0])
            if abs(dl) > 0.05:
                obs = math.log(u / prev[1]) / dl
                if 0.0 < obs < 3.0:
                    e = min(self.p.elasticity_max, max(self.p.elasticity_min, 0.5 * e + 0.5 * obs))
                    self.elasticity[c] = e
        return e
