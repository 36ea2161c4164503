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


SPECULATIVE_SAMPLING = ("coupled", "rejection")


class RowSampler:
    """One request's token choices, with randomness of its own (never shared with other requests).

    Sampled requests draw in one of two ways (``mode``):
    - "coupled": the token at sequence position i is argmax(log p + G_i), where G_i is Gumbel noise
      drawn from (seed, i) alone (the Gumbel-max trick: an exact sample of p). A draft proposes with
      the same G_i, and a draft token is accepted iff the target picks the same token. Every emitted
      token is exactly the target's own sample at that position, so the output is identical to
      target-only sampling with the same seed, whatever k, drafter or batch produced it.
    - "rejection": modified rejection sampling (accept x with min(1, p(x)/q(x)), else draw from
      norm(max(0, p - q))) with one random stream per request: the highest acceptance, the target's
      exact distribution, but which sample a seed gives depends on the draft lengths used.
    """

    def __init__(self, params: SamplingParams, mode: str = "coupled"):
        if mode not in SPECULATIVE_SAMPLING:
            raise ValueError(f"unknown speculative sampling {mode!r}; choose one of {', '.join(SPECULATIVE_SAMPLING)}")
        self.params = params
        self.mode = "greedy" if params.greedy else mode
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.key = int(seed) % (1 << 64)
        self.rng = np.random.default_rng(self.key)

    def _noise(self, position: int, size: int) -> np.ndarray:
        return np.random.default_rng([self.key, position]).gumbel(size=size)

    def choose(self, logits: np.ndarray, position: int) -> int:
        """The token at sequence ``position`` from the distribution these logits give."""
        # logits [V]
        if self.mode == "greedy":
            return int(logits.argmax())
        p = self.params.probs(logits)
        if self.mode == "rejection":
            return sample(p, self.rng)
        with np.errstate(divide="ignore"):
            return int((np.log(p) + self._noise(position, p.size)).argmax())

    def propose(self, logits: np.ndarray, position: int) -> tuple[int, np.ndarray | None]:
        """A draft token for ``position`` and, for rejection sampling, the draft distribution q it came from."""
        if self.mode != "rejection":
            return self.choose(logits, position), None
        q = self.params.probs(logits)
        return sample(q, self.rng), q

    def verify(self, drafts: np.ndarray, draft_probs, target_logits: np.ndarray, position: int) -> tuple[int, int]:
        """How many drafts the target accepts, and its own token after them (DESIGN.md §4)."""
        # drafts [m], draft_probs [m, V] or None, target_logits [m + 1, V]; drafts[0] is at ``position``
        from .speculative import accept_chosen, accept_sampling

        m = drafts.size
        if m == 0 and self.mode == "greedy":  # plain decoding: the target's argmax, every round
            return 0, int(target_logits[0].argmax())
        if self.mode == "rejection":
            return accept_sampling(drafts, draft_probs, self.params.probs(target_logits[: m + 1]), self.rng)
        if self.mode == "greedy":
            return accept_chosen(drafts, target_logits[: m + 1].argmax(axis=-1))
        chosen = []
        for j in range(m + 1):  # stop at the first disagreement: later positions need no noise
            chosen.append(self.choose(target_logits[j], position + j))
            if j < m and chosen[j] != drafts[j]:
                break
        return accept_chosen(drafts, np.asarray(chosen))
