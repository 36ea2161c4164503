"""Load-aware k: each round, the draft length that gives the most tokens per second at the current batch size.

A round with k drafts costs one draft call of catch-up plus k - 1 one-token draft
calls, and one target call over max(k + 1, prefill chunk) tokens per row; it
emits sum over decoding rows of E(alpha, k_r) tokens (DESIGN.md §4). Costs are
measured per (batch size, tokens per row) from the calls the scheduler makes,
and estimated for sizes not measured yet by a linear fit in the number of
tokens the call carries. k = 0 (plain decoding) competes on the same terms, so
when the batch is full enough that verify calls grow faster than acceptance
pays, the policy stops drafting. With k = 0 chosen it still tries k = 1 now and
then, to keep measuring.
"""

from __future__ import annotations

import numpy as np

from .speculative import expected_tokens_per_call

# Before anything is measured: alpha 0.5 worth a few rounds; a draft call a tenth of a target call; a
# target call costing 5 % more per extra token (DESIGN.md §6 measured 15-35 % for 5-9 tokens).
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.5, 8.0
_PRIOR_DRAFT_RATIO = 0.1
_PRIOR_SLOPE = 0.05
_PROBE_EVERY = 16  # rounds with k = 0 at one batch size before k = 1 is tried again
_MEMORY = 32  # a cost is the mean of at most this many recent calls (machines are shared and noisy)


class CallCosts:
    """Seconds per call by (batch, tokens per row): measured means, else a linear fit in batch * tokens."""

    def __init__(self):
        self.means: dict[tuple[int, int], list[float]] = {}  # (b, t) -> [mean seconds, calls counted]
        self._fit = None  # (slope, intercept) or False; refitted after _MEMORY records (a round's choice is cheap)
        self._records = 0

    def record(self, b: int, t: int, seconds: float):
        if (b, t) not in self.means or self._records % _MEMORY == 0:
            self._fit = None
        self._records += 1
        entry = self.means.setdefault((b, t), [0.0, 0])
        entry[1] = min(entry[1] + 1, _MEMORY)
        entry[0] += (seconds - entry[0]) / entry[1]

    def measured(self, b: int, t: int) -> bool:
        return (b, t) in self.means

    def estimate(self, b: int, t: int) -> float | None:
        if (b, t) in self.means:
            return self.means[(b, t)][0]
        if not self.means:
            return None
        sizes = np.array([bb * tt for bb, tt in self.means], dtype=float)
        costs = np.array([m for m, _ in self.means.values()])
        if self._fit is None:
            self._fit = False
            if np.unique(sizes).size >= 2:
                slope, intercept = np.polyfit(sizes, costs, 1)
                if slope > 0 and intercept > 0:
                    self._fit = (slope, intercept)
        if self._fit:
            slope, intercept = self._fit
            return float(intercept + slope * b * t)
        # one size measured (or a fit that makes no sense yet): scale the nearest by the prior slope
        i = int(np.argmin(np.abs(sizes - b * t)))
        return float(costs[i] * (1 + _PRIOR_SLOPE * (b * t - 1)) / (1 + _PRIOR_SLOPE * (sizes[i] - 1)))


class LoadAwareK:
    def __init__(self, k_max: int, allowed: list[int]):
        self.k_max = k_max
        self.allowed = allowed  # the k values the engines can verify, ascending
        self.checked = 0
        self.accepted = 0
        self.target = CallCosts()
        self.draft = CallCosts()
        self.rounds_at_zero: dict[int, int] = {}

    def record_round(self, proposed: int, accepted: int):
        # alpha is per checked draft: drafts after the first rejection were never checked
        self.checked += accepted + (accepted < proposed)
        self.accepted += accepted

    @property
    def alpha(self) -> float:
        return (self.accepted + _PRIOR_ALPHA * _PRIOR_WEIGHT) / (self.checked + _PRIOR_WEIGHT)

    def _round_cost(self, b: int, k: int, prefill_tokens: int) -> float:
        target = self.target.estimate(b, max(k + 1, prefill_tokens))
        if target is None:  # nothing measured: relative units, decode call = 1
            target = 1 + _PRIOR_SLOPE * (b * max(k + 1, prefill_tokens) - 1)
        if k == 0:
            return target
        draft = self.draft.estimate(b, 1)
        if draft is None:
            decode = self.target.estimate(b, 1)
            draft = _PRIOR_DRAFT_RATIO * (decode if decode is not None else 1.0)
        return target + k * draft

    def tokens_per_second(self, b: int, k: int, caps: np.ndarray, prefill_tokens: int = 0) -> float:
        """Expected tokens per second of a round with up to k drafts per decoding row (caps: each row's own limit)."""
        alpha = self.alpha
        tokens = sum(expected_tokens_per_call(alpha, int(min(k, c))) for c in caps)
        return tokens / self._round_cost(b, k, prefill_tokens)

    def choose(self, b: int, caps: np.ndarray, prefill_tokens: int = 0) -> int:
        """The best k for this round (0: plain decoding); ``caps`` [rows decoding] bounds each row's k."""
        top = min(int(caps.max()) if caps.size else 0, self.k_max)
        candidates = [0] + [k for k in self.allowed if k <= top]
        if len(candidates) == 1:
            return 0
        best = max(candidates, key=lambda k: self.tokens_per_second(b, k, caps, prefill_tokens))
        if best > 0:
            self.rounds_at_zero[b] = 0
            return best
        waited = self.rounds_at_zero.get(b, 0) + 1
        self.rounds_at_zero[b] = waited
        if waited >= _PROBE_EVERY:
            self.rounds_at_zero[b] = 0
            return candidates[1]
        return 0
