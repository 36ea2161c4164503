"""Turning logits into token choices: greedy, or temperature / top-k / top-p sampling.

Speculative sampling needs the draft's and the target's distributions processed
identically (DESIGN.md §4), so both go through ``SamplingParams.probs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, (int, np.integer)) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or None to disable it), got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (or None to disable it), got {self.top_p!r}")
        if self.greedy and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k/top_p only apply when sampling; set temperature > 0 to sample")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """Processed next-token distributions: temperature, then top-k, then top-p (as HF applies them)."""
        # logits [..., V] -> probs [..., V] float64, each row summing to 1
        x = logits.astype(np.float64) / self.temperature
        v = x.shape[-1]
        if self.top_k is not None and self.top_k < v:
            kth = np.partition(x, v - self.top_k, axis=-1)[..., v - self.top_k : v - self.top_k + 1]
            x = np.where(x < kth, -np.inf, x)
        x = x - x.max(axis=-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(axis=-1, keepdims=True)
        if self.top_p is not None and self.top_p < 1:
            order = np.argsort(-p, axis=-1, kind="stable")
            sorted_p = np.take_along_axis(p, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
            drop_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) >= self.top_p
            drop = np.zeros_like(drop_sorted)
            np.put_along_axis(drop, order, drop_sorted, axis=-1)
            p = np.where(drop, 0.0, p)
            p /= p.sum(axis=-1, keepdims=True)
        return p


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    # probs [V] -> one token id, by inverse CDF (exact for float64 probabilities)
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))
