"""The control law against a simulated plant (tests/monitor/plant.py): queued kernels
that drain while a process is stopped, lagged window measurements."""

from __future__ import annotations

import statistics

import pytest

from monitor.controller import ControlParams, GpuController, MemberInput, effective_targets, next_duty
from tests.monitor.plant import simulate

pytestmark = pytest.mark.timeout(120)


def _errors(shares: dict[str, list[float]], targets: dict[str, float], skip: int = 5) -> list[float]:
    return [abs(v - targets[n]) for n, vs in shares.items() for v in vs[skip:]]


@pytest.mark.parametrize(
    "targets", [{"a": 30.0, "b": 70.0}, {"a": 20.0, "b": 30.0, "c": 50.0}], ids=["30-70", "20-30-50"]
)
def test_strict_shares_track_targets_on_plant(targets: dict[str, float]) -> None:
    shares = simulate(targets, policy="strict", seconds=15, queue_depth=20)
    errs = _errors(shares, targets)
    assert statistics.mean(errs) < 3.0, shares
    assert max(errs) < 8.0, shares


def test_contended_lone_container_gets_whole_gpu() -> None:
    shares = simulate({"a": 30.0}, policy="contended", seconds=6)
    assert min(shares["a"][2:]) > 95.0


def test_contended_does_not_throttle_for_a_light_neighbour() -> None:
    # b wants ~10 % of the GPU: a (share 30) may use the rest
    shares = simulate({"a": 30.0, "b": 70.0}, policy="contended", seconds=8, demand={"b": 0.1})
    assert statistics.mean(shares["a"][3:]) > 80.0, shares


def test_contended_throttles_when_both_demand() -> None:
    targets = {"a": 30.0, "b": 70.0}
    shares = simulate(targets, policy="contended", seconds=12)
    assert statistics.mean(_errors(shares, targets)) < 3.0, shares


def test_off_policy_never_throttles() -> None:
    shares = simulate({"a": 30.0, "b": 70.0}, policy="off", seconds=5)
    assert all(abs(v - 50.0) < 3 for v in shares["a"][1:]), shares


def test_duty_law_properties() -> None:
    p = ControlParams(policy="strict")
    assert next_duty(1.0, 100.0, 100.0, p) == 1.0
    # one step never moves more than max_step, never below d_min, never above 1
    assert next_duty(1.0, 1.0, 100.0, p) == pytest.approx(1 - p.max_step_far)
    assert next_duty(1.0, 45.0, 50.0, p) >= 1 - p.max_step
    assert next_duty(p.d_min, 1.0, 100.0, p) == p.d_min
    assert next_duty(0.9, 50.0, 0.0, p) == 1.0
    # within the deadband nothing moves
    assert next_duty(0.5, 30.0, 30.2, p) == 0.5


def test_effective_targets_policies() -> None:
    m = {"a": MemberInput(target=30, util=60), "b": MemberInput(target=70, util=40)}
    assert effective_targets(m, "off") == {"a": 100.0, "b": 100.0}
    assert effective_targets(m, "strict") == {"a": 30.0, "b": 70.0}
    assert effective_targets(m, "contended") == {"a": 30.0, "b": 70.0}
    idle_b = {"a": MemberInput(target=30, util=95), "b": MemberInput(target=70, util=0.2)}
    assert effective_targets(idle_b, "contended")["a"] == 100.0


def test_controller_forgets_departed_containers() -> None:
    c = GpuController(ControlParams(policy="strict"))
    c.step({"a": MemberInput(target=10, util=90), "b": MemberInput(target=90, util=10)})
    assert c.duty["a"] < 1.0
    out = c.step({"b": MemberInput(target=90, util=10)})
    assert "a" not in out
