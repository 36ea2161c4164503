"""Turning logits into token choices: greedy, or temperature / top-k / top-p sampling.

Speculative sampling needs the draft's and the target's distributions processed
identically (DESIGN.md §4), so both go through ``SamplingParams.probs`` — after the request's own logits
processing (logit_bias, min_tokens, penalties, grammar: runtime/logits.py), applied alike to both.
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
    # logits processing (runtime/logits.py), OpenAI's and vLLM's meanings
    presence_penalty: float = 0.0  # minus this for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often a token was generated
    repetition_penalty: float = 1.0  # tokens of the prompt or the output: logit / r if > 0, else logit * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), each in [-100, 100]
    min_tokens: int = 0  # no EOS before this many tokens
    logprobs: int | None = None  # None: none; N >= 0: each token's log-probability and the N most likely

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 disables it), got {v!r}")
        r = self.repetition_penalty
        if not _number(r) or not 0 < r <= 10:
            raise ValueError(f"repetition_penalty must be a number in (0, 10] (1 disables it), got {r!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if not isinstance(self.min_tokens, (int, np.integer)) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, (int, np.integer)) or isinstance(lp, bool) or not 0 <= lp <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20] (alternatives per token) or None, got {lp!r}")

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before temperature (runtime/logits.py has work to do)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

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
            flat = p.reshape(-1, v)
            for row in flat:
                keep = np.zeros(v, dtype=bool)
                keep[_nucleus(row, self.top_p)] = True
                row[~keep] = 0.0
            p = flat.reshape(p.shape)
            p /= p.sum(axis=-1, keepdims=True)
        return p

    def support(self, logits: np.ndarray) -> np.ndarray:
        """``np.flatnonzero(self.probs(logits))`` for one row [V]: the ids a token can be drawn from, ascending.

        The same float64 steps, without the masked copy, the second normalisation and the search of a float array
        for its nonzeros. top-k: its k-th largest from the tokens near the maximum (every token at or above the k-th
        is there: the full partition's value), then the kept tokens alone (the exponentials of the others are 0, as
        exp(-inf) is, and numpy's exp of -inf is its slow path). On SmolLM2's logits: 0.14 ms against 0.32 for
        top-p 0.9, 0.13 against 0.78 for top-k 50 (benchmarks/bench_picks.py --engine)."""
        x = logits.astype(np.float64) / self.temperature
        v = x.size
        top = x.max()
        if not np.isfinite(top):  # a NaN or +inf (or nothing drawable): the definition's own steps
            with np.errstate(invalid="ignore"):
                return np.flatnonzero(self.probs(logits))
        kept = None
        if self.top_k is not None and self.top_k < v:
            kept = np.flatnonzero(x >= _kth_largest(x, self.top_k, top))
            full = np.zeros(v)  # (the sum over the whole row, zeros in place: the definition's bits)
            full[kept] = q = np.exp(x[kept] - top)
            q /= full.sum()  # the kept tokens' probabilities
        else:
            x -= top
            q = np.exp(x, out=x)
            q /= q.sum()
        if self.top_p is not None and self.top_p < 1:
            # (top-k's kept ids ascend, so ties in q keep the ids' order, as in the whole row)
            ids = np.sort(_nucleus(q, self.top_p))
            ids = ids[q[ids] > 0]
        else:
            ids = np.flatnonzero(q > 0)
        return ids if kept is None else kept[ids]


def _kth_largest(x: np.ndarray, k: int, top: float) -> float:
    """``np.partition(x, x.size - k)[x.size - k]`` for x [V] float64 with a finite maximum ``top``: partitioned among
    the tokens within a margin of the maximum that holds k to 8k of them (all those at or above the k-th largest are
    there), else over the whole row."""
    lo, hi = 0.0, 1.0  # margins holding fewer than k tokens, and to try
    while hi <= 64.0:
        n = np.count_nonzero(x >= top - hi)
        if n >= k:
            for _ in range(4):  # narrower, while it holds k
                if n <= 8 * k:
                    break
                mid = (lo + hi) / 2
                m = np.count_nonzero(x >= top - mid)
                lo, hi, n = (mid, hi, n) if m < k else (lo, mid, m)
            near = x[x >= top - hi]
            return np.partition(near, near.size - k)[near.size - k]
        lo, hi = hi, 2 * hi
    return np.partition(x, x.size - k)[x.size - k]


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The ids of the smallest prefix of p in descending order (ties by id) whose mass reaches top_p, in that order.

    Token j of that order is dropped where (cumsum_j - p_j) >= top_p. Only the tokens above a threshold holding
    top_p + 1e-9 of the mass are sorted (V = 49,152: probs took 217 us against 5.1 ms with a full stable sort,
    benchmarks/bench_picks.py): np.cumsum adds in order, so their prefix sums are the full order's to the bit, and
    every token below the threshold comes after them with at least top_p + 1e-9 - 2 ulp before it, which the full
    order drops too."""
    # p [V] float64 summing to 1 -> ids [n] int64
    top, threshold = p.max(), 0.0
    for shift in (6, 12, 20, 30, 45):
        cut = top * 2.0**-shift
        ids = np.flatnonzero(p > cut)
        if p[ids].sum() >= top_p + 1e-9:
            threshold = cut
            break
    if threshold == 0.0:
        ids = np.arange(p.size)
    order = ids[np.argsort(-p[ids], kind="stable")]  # (ids ascending: ties keep id order, as in the full sort)
    sorted_p = p[order]
    return order[(np.cumsum(sorted_p) - sorted_p) < top_p]


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and bool(np.isfinite(v))


def log_probs(params: SamplingParams, logits: np.ndarray) -> np.ndarray:
    """The log-probabilities a request reports (logprobs): those of the distribution its tokens are drawn from —
    after its logits processing, temperature, top-k and top-p — and for greedy requests the log-softmax of
    the processed logits (temperature 1, nothing filtered)."""
    # logits [V] -> [V] float64 (-inf where a token cannot be drawn)
    if params.greedy:
        x = logits.astype(np.float64)
        x = x - x.max()
        return x - np.log(np.exp(x).sum())
    with np.errstate(divide="ignore"):
        return np.log(params.probs(logits))


def logprob_entry(lp: np.ndarray, token: int, n: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, its log-probability, the n most likely tokens with theirs, most likely first) from lp [V]."""
    top = []
    if n:
        ids = np.argpartition(-lp, n - 1)[:n] if n < lp.size else np.arange(lp.size)
        ids = ids[np.argsort(-lp[ids], kind="stable")]
        top = [(int(t), float(lp[t])) for t in ids]
    return int(token), float(lp[token]), top


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    # probs [V] -> one token id, by inverse CDF (exact for float64 probabilities)
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))
