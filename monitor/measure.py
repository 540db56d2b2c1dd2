"""Per-process SM use over a sliding window, from NVML utilisation samples.

A sample says "pid used sm% of the GPU during the last sample period".  The
period is not documented and processes at 0 % may be absent, so each sample
is weighted by the gap to the same pid's previous sample, capped at the
typical gap (the median over recent samples of the GPU): a pid that
reappears after an idle spell is not credited for the idle time.

The window is anchored in NVML's own time base (the newest timestamp it
returned), so it always spans whole sample periods and nothing depends on
NVML's clock base; when no new sample arrives for longer than a period and a
half (the GPU went idle, NVML answers NOT_FOUND) it advances with wall time,
so old use ages out.
"""

from __future__ import annotations

import statistics
from collections import deque

from monitor.observe import UtilSample

DEFAULT_GAP_US = 100_000
MAX_GAP_US = 1_000_000


class UtilWindow:
    def __init__(self, window_s: float) -> None:
        self.window_us = int(window_s * 1e6)
        self.samples: dict[int, deque[tuple[int, float]]] = {}  # pid -> (ts, sm * weight_us)
        self.last_ts: dict[int, int] = {}
        self.first_ts: dict[int, int] = {}  # start of the first period seen for a pid
        self.gaps: deque[int] = deque(maxlen=64)
        self.newest = 0
        self.newest_at = 0.0  # monotonic seconds when `newest` arrived
        self.started_at: float | None = None
        self._typical: int | None = None

    def typical_gap(self) -> int:
        if self._typical is None:
            g = int(statistics.median(self.gaps)) if self.gaps else DEFAULT_GAP_US
            self._typical = max(1000, min(MAX_GAP_US, g))
        return self._typical

    def add(self, samples: list[UtilSample], now: float) -> None:
        if self.started_at is None:
            self.started_at = now
        typical = self.typical_gap()  # once per batch
        new_gaps = False
        for s in sorted(samples, key=lambda x: x.ts):
            prev = self.last_ts.get(s.pid)
            if prev is not None and s.ts > prev:
                gap = s.ts - prev
                if gap <= MAX_GAP_US:
                    self.gaps.append(gap)
                    new_gaps = True
                weight = min(gap, typical)
            else:
                weight = typical
            self.last_ts[s.pid] = s.ts
            self.first_ts.setdefault(s.pid, s.ts - weight)
            self.samples.setdefault(s.pid, deque()).append((s.ts, s.sm * weight))
            if s.ts > self.newest:
                self.newest = s.ts
                self.newest_at = now
        if new_gaps:
            self._typical = None

    def end(self, now: float) -> int:
        """The window's end in NVML time: the newest sample, so the window always holds whole
        sample periods; it moves on with wall time only once the next sample is overdue
        (nothing new: the GPU went idle), so stale use ages out."""
        overdue = (now - self.newest_at) * 1e6 - 1.5 * self.typical_gap()
        return self.newest + int(max(0.0, overdue))

    def use(self, pid: int, now: float) -> float:
        """Percent of the GPU used by `pid` over the window ending now."""
        q = self.samples.get(pid)
        if not q:
            return 0.0
        end = self.end(now)
        lo = end - self.window_us
        while q and q[0][0] <= lo:
            q.popleft()
        # a process seen for less than the window is measured over the time it was seen
        span = max(self.typical_gap(), min(self.window_us, end - self.first_ts.get(pid, lo)))
        return sum(v for _, v in q) / span

    def stale(self, now: float) -> bool:
        """True when NVML has returned nothing new for more than two sample periods."""
        return self.newest > 0 and (now - self.newest_at) * 1e6 > 2 * self.typical_gap()

    def full(self, now: float) -> bool:
        """True once the window has been observed for its whole length."""
        return self.started_at is not None and now - self.started_at >= self.window_us / 1e6

    def retain(self, pids: set[int]) -> None:
        for pid in list(self.samples):
            if pid not in pids:
                del self.samples[pid]
                self.last_ts.pop(pid, None)
                self.first_ts.pop(pid, None)
