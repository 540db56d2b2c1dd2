"""UtilWindow: weights, whole periods, ageing out when NVML goes quiet."""

from __future__ import annotations

from monitor.measure import UtilWindow
from monitor.observe import UtilSample

P = 100_000  # 100 ms sample period, in NVML microseconds


def _feed(w: UtilWindow, t0: int, n: int, per_pid: dict[int, int], now0: float) -> float:
    now = now0
    for i in range(n):
        ts = t0 + (i + 1) * P
        now = now0 + (i + 1) * 0.1
        w.add([UtilSample(pid=p, ts=ts, sm=sm) for p, sm in per_pid.items() if sm > 0], now)
    return now


def test_steady_use_is_exact_whatever_the_phase() -> None:
    w = UtilWindow(0.5)
    now = _feed(w, 10**12, 20, {1: 30, 2: 70}, 100.0)
    for dt in (0.0, 0.05, 0.12):  # reading at any moment within the next period
        assert abs(w.use(1, now + dt) - 30) < 0.01
        assert abs(w.use(2, now + dt) - 70) < 0.01


def test_absent_samples_count_as_idle_and_gaps_are_capped() -> None:
    w = UtilWindow(0.5)
    now = _feed(w, 0, 10, {1: 50, 2: 50}, 0.0)
    # pid 2 goes idle (no samples): after 5 periods it reads 0, pid 1 keeps its 100
    now = _feed(w, 10 * P, 5, {1: 100, 2: 0}, now)
    assert abs(w.use(1, now) - 100) < 0.01 and w.use(2, now) == 0
    # pid 2 comes back after a long gap: credited one period, not the whole gap
    w.add([UtilSample(pid=2, ts=16 * P, sm=100), UtilSample(pid=1, ts=16 * P, sm=0 + 1)], now + 0.1)
    assert abs(w.use(2, now + 0.1) - 20) < 0.01


def test_use_ages_out_when_nvml_goes_quiet() -> None:
    w = UtilWindow(0.5)
    now = _feed(w, 0, 10, {1: 80}, 0.0)
    assert w.use(1, now) > 79
    assert w.use(1, now + 0.3) < 70  # no new samples for 3 periods: the window moves on
    assert w.use(1, now + 1.0) == 0
    assert w.full(now)
