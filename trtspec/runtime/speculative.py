"""Where a draft token is accepted: the verification rules of speculative decoding (DESIGN.md §4), and each
request's RowSampler, which applies them with the request's own parameters and randomness."""

from __future__ import annotations

import functools

import numpy as np

from .request import RowFault
from .sampling import SamplingParams, log_probs, logprob_entry, sample


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


def _owned(method):
    """A RowSampler method whose failure is its request's own: re-raised as a RowFault naming the sampler, so the
    scheduler can tell which row of a batched step (a drafter's, whose loop calls every row's sampler) failed."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RowFault:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the scheduler with its owner
            raise RowFault(self, exc) from exc

    return call


def gumbel(rng: np.random.Generator, size: int) -> np.ndarray:
    """Standard Gumbel noise [size] float64: -log(-log(1 - U)), numpy's own formula for ``rng.gumbel``, vectorised
    (numpy's loops per element: 124 us for 8192 values here against 54 us; equal to within one ulp)."""
    u = rng.random(size)
    np.subtract(1.0, u, out=u)
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    return np.negative(u, out=u)


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

    ``processor`` (runtime/logits.py: logit_bias, min_tokens, penalties, grammar) processes the logits of every
    position, target's and draft's alike, with the state after the tokens before it. With ``params.logprobs``
    set, each emitted token's log-probability (sampling.log_probs) is kept for the output (``take_logprobs``).
    A ``plain`` sampler (neither) lets the engines' greedy loops run without it.

    Lazy masking: a greedy or coupled row under a grammar (no top-k/top-p, no logprobs) picks from the logits
    processed without the grammar's mask, then asks the grammar whether it allows that token. If so it is also the
    pick under the mask (an argmax over a subset that holds the unmasked argmax), and the mask is never computed;
    only where the grammar forbids the pick is the mask applied and the pick made again.
    """

    def __init__(self, params: SamplingParams, mode: str = "coupled", processor=None):
        if mode not in SPECULATIVE_SAMPLING:
            raise ValueError(f"unknown speculative sampling {mode!r}; choose one of {', '.join(SPECULATIVE_SAMPLING)}")
        self.params = params
        self.mode = "greedy" if params.greedy else mode
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.key = int(seed) % (1 << 64)
        self.rng = np.random.default_rng(self.key)
        self.processor = processor
        self.plain = processor is None and params.logprobs is None
        self._logprobs: list = []  # (token, logprob, [(token, logprob), ...]) of tokens not yet taken
        self._gumbel: dict[int, np.ndarray] = {}  # coupled sampling's noise of this round's positions
        p = params
        self._lazy = (processor is not None and processor.constraint is not None and p.logprobs is None
                      and (self.mode == "greedy" or (self.mode == "coupled" and p.top_k is None
                                                     and (p.top_p is None or p.top_p >= 1))))

    def _noise(self, position: int, size: int) -> np.ndarray:
        # G_position: drawn once, when the draft proposes there, and read again when the target verifies it
        noise = self._gumbel.get(position)
        if noise is None or noise.size != size:
            noise = gumbel(np.random.default_rng([self.key, position]), size)
            if len(self._gumbel) >= 64:  # positions far behind are never asked for again
                self._gumbel = {p: g for p, g in self._gumbel.items() if p > position - 32}
            self._gumbel[position] = noise
        return noise

    def _process(self, logits: np.ndarray) -> np.ndarray:
        return logits if self.processor is None else self.processor.apply(logits)

    def _pick(self, x: np.ndarray, position: int) -> int:
        # x: processed logits [V]
        if self.mode == "greedy":
            return int(x.argmax())
        prm = self.params
        if self.mode == "rejection":
            return sample(prm.probs(x), self.rng)
        # Gumbel-max over p's support: argmax(log p + G) = argmax(x / T + G), log p and x / T differing by a
        # constant there (so a masked and an unmasked pick score every allowed token alike)
        score = x.astype(np.float64) / prm.temperature + self._noise(position, x.size)
        if prm.top_k is not None or (prm.top_p is not None and prm.top_p < 1):
            score[prm.probs(x) == 0] = -np.inf
        return int(score.argmax())

    def _choose(self, logits: np.ndarray, position: int) -> tuple[int, np.ndarray]:
        """The token at ``position`` and the processed logits it came from; with lazy masking those may lack the
        grammar's mask (the token is the pick under it all the same)."""
        if not self._lazy:
            x = self._process(logits)
            return self._pick(x, position), x
        proc = self.processor
        x = proc.apply(logits, grammar=False)
        token = self._pick(x, position)
        if proc.allows(token):
            return token, x
        proc.mask(x)
        return self._pick(x, position), x

    def _record(self, x: np.ndarray, token: int) -> None:
        if self.params.logprobs is not None:
            self._logprobs.append(logprob_entry(log_probs(self.params, x), token, self.params.logprobs))

    def take_logprobs(self, n: int) -> list:
        """The log-probability entries of the next n emitted tokens (the rest of this round's are dropped)."""
        taken, self._logprobs = self._logprobs[:n], []
        return taken

    @_owned
    def choose(self, logits: np.ndarray, position: int) -> int:
        """The token at sequence ``position`` from the distribution these logits give."""
        # logits [V]
        token, x = self._choose(logits, position)
        self._record(x, token)
        return token

    @_owned
    def propose(self, logits: np.ndarray, position: int) -> tuple[int, np.ndarray | None]:
        """A draft token for ``position`` and, for rejection sampling, the draft distribution q it came from.
        -1: the draft has no token the request allows here (a head's reduced vocabulary under a grammar), so the
        chain ends before this position."""
        if self.mode == "rejection":
            x = self._process(logits)
            if x.max() == -np.inf:
                return -1, None
            q = self.params.probs(x)
            token = sample(q, self.rng)
        else:
            token, x = self._choose(logits, position)
            if x[token] == -np.inf:  # (a pick is on the support unless nothing is: no pass over V for the check)
                return -1, None
            q = None
        if self.processor is not None:
            self.processor.push(token)  # the next position is processed after it
        return token, q

    @_owned
    def propose_branches(self, logits: np.ndarray, position: int, width: int) -> tuple[int, float, list]:
        """A draft token for ``position`` (as ``propose`` picks it) with its log-probability under the draft, and
        the ``width - 1`` likeliest other tokens with theirs: the siblings a draft tree adds beside it.
        (-1, -inf, []): nothing the request allows, as for ``propose``."""
        x = self._process(logits)
        if x.max() == -np.inf:
            return -1, -np.inf, []
        if self.mode == "greedy":
            lp = log_probs(self.params, x)
            token = int(lp.argmax())
        else:
            with np.errstate(divide="ignore"):
                lp = np.log(self.params.probs(x))
            token = sample(np.exp(lp), self.rng) if self.mode == "rejection" else self._pick(x, position)
        others = []
        if width > 1:
            top = np.argpartition(-lp, width)[: width + 1] if width + 1 < lp.size else np.arange(lp.size)
            top = top[np.argsort(-lp[top], kind="stable")]
            others = [(int(t), float(lp[t])) for t in top if t != token and np.isfinite(lp[t])][: width - 1]
        if self.processor is not None:
            self.processor.push(token)
        return token, float(lp[token]), others

    @_owned
    def verify(self, drafts: np.ndarray, draft_probs, target_logits: np.ndarray, position: int) -> tuple[int, int]:
        """How many drafts the target accepts, and its own token after them (DESIGN.md §4)."""
        # drafts [m], draft_probs [m, V] or None, target_logits [m + 1, V]; drafts[0] is at ``position``
        m = drafts.size
        if not self.plain:
            return self._verify_processed(drafts, draft_probs, target_logits, position)
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

    def _verify_processed(self, drafts, draft_probs, target_logits, position):
        # position j is processed after drafts[:j] (pushed as the verdict reaches it), then the round's tokens
        # are dropped again: the scheduler commits what the output takes
        proc = self.processor
        if proc is not None:
            proc.rollback()  # the drafter pushed its own proposals
        processed = _ProcessedRows(self, target_logits, drafts)
        if self.mode == "rejection":
            a, token = accept_sampling(drafts, draft_probs, processed, self.rng)
        else:
            m, chosen = drafts.size, []
            for j in range(m + 1):
                chosen.append(processed.choose(j, position + j))
                if j < m and chosen[j] != drafts[j]:
                    break
            a, token = accept_chosen(drafts, np.asarray(chosen))
        if self.params.logprobs is not None:
            for j, t in enumerate([*drafts[:a].tolist(), token]):
                self._record(processed.logits(j), t)
        if proc is not None:
            proc.rollback()
        return a, token


    @_owned
    def verify_tree(self, drafts: np.ndarray, parents: np.ndarray, target_logits: np.ndarray,
                    position: int) -> tuple[list[int], int]:
        """The longest path of a draft tree the target accepts, and its own token after it.

        ``drafts[j]`` hangs below ``parents[j]`` (-1: the root, the row's last token; parents come first);
        ``target_logits[0]`` is the root's, ``target_logits[j + 1]`` node j's. The walk starts at the root and
        at each node takes the target's own choice: greedy and coupled rows choose exactly as without drafts
        (argmax, or the Gumbel-max sample at that position) and descend to the child holding that token; a
        rejection-sampling row tries the children in order, accepting child c with probability
        p'(c) / sum(p'), where p' is p with the children already tried zeroed, and otherwise draws from p'
        (SpecInfer's recursive rejection with deterministic candidates: the emitted token is distributed
        exactly as p). Returns (accepted node indices from the root down, the next token).
        """
        # drafts [m], parents [m], target_logits [m + 1, V]; the root's child is at ``position``
        children: dict[int, list[int]] = {}
        for j, par in enumerate(parents.tolist()):
            children.setdefault(par, []).append(j)
        proc = self.processor
        if proc is not None:
            proc.rollback()  # the drafter pushed its own proposals
        path, node = [], -1
        while True:
            kids = children.get(node, ())
            if self.mode == "rejection":
                x = self._process(target_logits[node + 1])
                p = self.params.probs(x)
                residual, token, nxt = p.copy(), None, None
                for kid in kids:
                    t = int(drafts[kid])
                    mass = residual.sum()
                    if mass > 0 and self.rng.random() * mass < residual[t]:
                        token, nxt = t, kid
                        break
                    residual[t] = 0.0
                if token is None:  # (all of p on tried children has probability 0 of every one rejected)
                    token = sample(residual if residual.sum() > 0 else p, self.rng)
            else:
                token, x = self._choose(target_logits[node + 1], position + len(path))
                nxt = next((kid for kid in kids if drafts[kid] == token), None)
            self._record(x, token)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
            if proc is not None:
                proc.push(token)
        if proc is not None:
            proc.rollback()
        return path, token


class _ProcessedRows:
    """A verify call's processed logits, row j made on first use after pushing drafts[:j]; indexing gives the
    processed probabilities (``[j]`` a row, ``[j, x]`` one entry), as accept_sampling reads them."""

    def __init__(self, sampler: RowSampler, logits: np.ndarray, drafts: np.ndarray):
        self.sampler, self.raw, self.drafts = sampler, logits, drafts
        self._rows: list[np.ndarray] = []
        self._probs: dict[int, np.ndarray] = {}
        self._pushed = 0  # drafts pushed to the processor: its state is row _pushed's

    def _at(self, j: int) -> None:
        proc = self.sampler.processor
        while self._pushed < j:
            if proc is not None:
                proc.push(self.drafts[self._pushed])
            self._pushed += 1

    def logits(self, j: int) -> np.ndarray:
        while len(self._rows) <= j:
            i = len(self._rows)
            self._at(i)
            self._rows.append(self.sampler._process(self.raw[i]))
        return self._rows[j]

    def choose(self, j: int, position: int) -> int:
        """The row's own token at row j (greedy or coupled), lazily masked where the sampler may."""
        if not self.sampler._lazy:
            return self.sampler._pick(self.logits(j), position)
        self._at(j)
        return self.sampler._choose(self.raw[j], position)[0]

    def __getitem__(self, key):
        j, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if j not in self._probs:
            self._probs[j] = self.sampler.params.probs(self.logits(j))
        return self._probs[j][rest] if rest else self._probs[j]


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): mean tokens emitted per target call with k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """S = E / (k * c + v): costs relative to one target decode call (DESIGN.md §4)."""
    return expected_tokens_per_call(alpha, k) / (k * draft_cost + verify_cost)
