"""Where a draft token is accepted: the verification rules of speculative decoding (DESIGN.md §4), and each
request's RowSampler, which applies them with the request's own parameters and randomness."""

from __future__ import annotations

import numpy as np

from .sampling import SamplingParams, sample


def accept_chosen(drafts: np.ndarray, chosen: np.ndarray) -> tuple[int, int]:
    """Longest prefix of ``drafts`` equal to the target's own choices, and the target's token after it.

    Greedy decoding chooses the argmax; coupled sampling the Gumbel-max sample (RowSampler below).
    ``chosen`` may stop at its first disagreement with ``drafts``: later choices are never needed.
    """
    # drafts [m] int64, chosen [<= m + 1] int64 (chosen[j]: the target's token after drafts[:j])
    m = min(drafts.size, chosen.size - 1)
    agree = chosen[:m] == drafts[:m]
    a = m if agree.all() else int(np.argmin(agree))
    return a, int(chosen[a])


def accept_sampling(
    drafts: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Modified rejection sampling: the emitted tokens are distributed exactly as the target's own samples.

    Draft token x is kept with probability min(1, p(x) / q(x)); at the first
    rejection the replacement is drawn from norm(max(0, p - q)); when all are kept
    a bonus token is drawn from the target's distribution after them.
    ``draft_probs`` None means a deterministic proposal (q is one-hot at x).
    """
    # drafts [m], draft_probs [m, V] or None, target_probs [m + 1, V] -> (accepted count, next token)
    for j, x in enumerate(drafts):
        p = target_probs[j]
        q_x = 1.0 if draft_probs is None else draft_probs[j, x]
        if rng.random() * q_x < p[x]:
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - draft_probs[j], 0.0)
        if residual.sum() <= 0:  # p <= q everywhere only when p == q, where rejection has probability 0
            residual = p
        return j, sample(residual, rng)
    return drafts.size, sample(target_probs[drafts.size], rng)


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


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): mean tokens emitted per target call with k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """S = E / (k * c + v): costs relative to one target decode call (DESIGN.md §4)."""
    return expected_tokens_per_call(alpha, k) / (k * draft_cost + verify_cost)
