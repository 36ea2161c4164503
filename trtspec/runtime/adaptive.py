"""Adaptive k: each round, the draft length that maximises the expected speedup measured so far.

S(k) = E(alpha, k) / (k * c + v(k)) with c = draft call / target decode call and
v(k) = target call over k+1 tokens / target decode call (DESIGN.md §4). alpha is
the acceptance rate observed so far; the costs are running means of the calls
actually made, with a linear fit in T for call sizes not measured yet.
"""

from __future__ import annotations

import numpy as np

from .speculative import expected_speedup

# Before anything is measured: alpha 0.5 worth a few rounds, and a verify call
# costing 5 % more per extra token (DESIGN.md §6 measured 15-35 % for 5-9 tokens).
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.5, 8.0
_PRIOR_SLOPE = 0.05
_PROBE_EVERY = 16  # with k = 0 chosen, try k = 1 this often to keep measuring alpha


class AdaptiveK:
    def __init__(self, k_max: int, allowed: list[int]):
        self.k_max = k_max
        self.allowed = allowed  # the k values the engines can verify, ascending
        self.proposed = 0
        self.accepted = 0
        self.target_time: dict[int, list[float]] = {}  # T -> [sum seconds, calls]
        self.draft_time = [0.0, 0]
        self.rounds_since_probe = 0

    def record_round(self, proposed: int, accepted: int):
        # alpha is per checked draft: drafts after the first rejection were never checked
        self.proposed += accepted + (accepted < proposed)
        self.accepted += accepted

    def record_target(self, t: int, seconds: float):
        acc = self.target_time.setdefault(t, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1

    def record_draft(self, seconds: float, calls: int):
        self.draft_time[0] += seconds
        self.draft_time[1] += calls

    @property
    def alpha(self) -> float:
        return (self.accepted + _PRIOR_ALPHA * _PRIOR_WEIGHT) / (self.proposed + _PRIOR_WEIGHT)

    def target_cost(self, t: int) -> float | None:
        """Seconds of a target call over t tokens: measured mean, else a linear fit, else None."""
        if t in self.target_time:
            s, n = self.target_time[t]
            return s / n
        pts = sorted((tt, s / n) for tt, (s, n) in self.target_time.items())
        if not pts:
            return None
        if len(pts) == 1:
            t0, c0 = pts[0]
            return c0 * (1 + _PRIOR_SLOPE * (t - 1)) / (1 + _PRIOR_SLOPE * (t0 - 1))
        slope, intercept = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
        return max(intercept + slope * t, 1e-9)

    def speedup(self, k: int) -> float:
        decode = self.target_cost(1)
        if decode is None or self.draft_time[1] == 0:
            return expected_speedup(self.alpha, k, 0.1, 1 + _PRIOR_SLOPE * k)
        c = self.draft_time[0] / self.draft_time[1] / decode
        return expected_speedup(self.alpha, k, c, self.target_cost(k + 1) / decode)

    def choose(self, limit: int) -> int:
        """The best k <= limit (0 means plain decoding this round)."""
        candidates = [k for k in self.allowed if k <= min(limit, self.k_max)]
        if not candidates:
            return 0
        best = max(candidates, key=self.speedup)
        if self.speedup(best) >= 1.0:
            self.rounds_since_probe = 0
            return best
        self.rounds_since_probe += 1
        if self.rounds_since_probe >= _PROBE_EVERY:
            self.rounds_since_probe = 0
            return candidates[0]
        return 0
