"""Where a draft token is accepted: the verification rules of speculative decoding (DESIGN.md §4)."""

from __future__ import annotations

import numpy as np

from .sampling import sample


def accept_chosen(drafts: np.ndarray, chosen: np.ndarray) -> tuple[int, int]:
    """Longest prefix of ``drafts`` equal to the target's own choices, and the target's token after it.

    Greedy decoding chooses the argmax; coupled sampling the Gumbel-max sample (sampling.RowSampler).
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


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): mean tokens emitted per target call with k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """S = E / (k * c + v): costs relative to one target decode call (DESIGN.md §4)."""
    return expected_tokens_per_call(alpha, k) / (k * draft_cost + verify_cost)
