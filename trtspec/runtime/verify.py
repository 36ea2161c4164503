"""Where a draft token is accepted: the verification rules of speculative decoding (DESIGN.md §4), and each
request's RowSampler, which applies them with the request's own parameters and randomness."""

from __future__ import annotations

import functools

import numpy as np
import torch

from .picks import coupled_pick, gumbel_noise, gumbel_noise_host, host_rows, target_picks
from .sampling import SamplingParams, log_probs, logprob_entry, sample


def accept_chosen(candidates, token: int) -> tuple[int, int]:
    """One node of a greedy or coupled walk: the target chose ``token`` (its argmax, or its Gumbel-max sample, as
    without drafts); the walk descends to the candidate holding it. Returns (index of that candidate, or -1: none
    holds it and the walk ends, the token emitted)."""
    for i, t in enumerate(candidates):
        if t == token:
            return i, token
    return -1, token


def accept_rejection(p: np.ndarray, candidates, q, rng: np.random.Generator) -> tuple[int, int]:
    """One node of recursive rejection sampling (SpecInfer): the emitted token is distributed exactly as ``p``.

    The node's candidates (its children's tokens, in order) are tried one after another: candidate x, drawn from q,
    is accepted with probability min(1, p'(x) / q(x)), where p' is what is left of p, normalised; at a rejection p'
    becomes norm(max(0, p' - q)). When none is accepted, the token is drawn from p'. ``q`` [len(candidates), V]
    (a draft model's distributions), or None: deterministic candidates (q one-hot at x, so a rejection zeroes x).
    A chain's node has one candidate: min(1, p(x)/q(x)) and the residual norm(max(0, p - q)) of DESIGN.md §4.
    Returns (index of the accepted candidate, or -1, the token)."""
    residual = p
    for i, x in enumerate(candidates):
        mass = residual.sum()
        q_x = 1.0 if q is None else q[i][x]
        if mass > 0 and rng.random() * q_x * mass < residual[x]:
            return i, int(x)
        if q is None:
            residual = residual.copy() if residual is p else residual
            residual[x] = 0.0
        else:
            residual = np.maximum(residual / mass - q[i], 0.0)
    if residual.sum() <= 0:  # p <= q everywhere only when p == q, where rejection has probability 0
        residual = p
    return -1, sample(residual, rng)


SPECULATIVE_SAMPLING = ("coupled", "rejection")


class RowFault(Exception):
    """Raised out of a batched step (a drafter's proposals) by one request's own processing — its grammar, logits
    processing or sampling (verify.RowSampler tags what its methods raise): the scheduler fails that request
    alone and the round goes on for the others. ``owner``: the RowSampler it came from."""

    def __init__(self, owner, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.owner = owner
        self.cause = cause


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
        # G_position (picks.gumbel_noise): drawn once, when the draft proposes there, and read again when the target
        # verifies it
        noise = self._gumbel.get(position)
        if noise is None or noise.size != size:
            noise = gumbel_noise_host(self.key, position, size)
            if len(self._gumbel) >= 64:  # positions far behind are never asked for again
                self._gumbel = {p: g for p, g in self._gumbel.items() if p > position - 32}
            self._gumbel[position] = noise
        return noise

    def noise(self, position: int, size: int, device):
        """G_position as a float64 tensor on ``device`` (picks.target_picks): the host's own array on the CPU;
        elsewhere made there each time (microseconds on a GPU, where keeping it would hold V float64 a position)."""
        if torch.device(device).type == "cpu":
            return torch.from_numpy(self._noise(position, size))
        return gumbel_noise(self.key, position, size, device)

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
        support = None
        if prm.top_k is not None or (prm.top_p is not None and prm.top_p < 1):
            support = prm.support(x)
        return coupled_pick(x, prm.temperature, self.key, position, support, lambda: self._noise(position, x.size))

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
    def accept(self, drafts: np.ndarray, parents: np.ndarray | None, draft_probs, target_logits: np.ndarray,
               position: int, chosen: np.ndarray | None = None) -> tuple[list[int], int]:
        """The drafts the target accepts, and its own token after them (DESIGN.md §4): THE acceptance walk of every
        round, for chains and token trees alike (verify_rows walks every row's).

        ``drafts[j]`` hangs below ``parents[j]`` (-1: the root, the row's last token; parents come first);
        ``parents`` None is a chain (parents j - 1). ``target_logits[0]`` is the root's, ``target_logits[j + 1]``
        node j's; ``drafts[0]`` is at sequence ``position``. The walk starts at the root and at each node takes the
        target's own choice: greedy and coupled rows choose exactly as without drafts (the argmax, or the
        Gumbel-max sample at that position; ``chosen``: the target's pick at every node, made where the logits are,
        for many rows at once: picks.py) and descend to the child holding that token (``accept_chosen``); a
        rejection-sampling row runs recursive rejection over the node's children (``accept_rejection``; ``draft_probs`` [m, V], a chain's draft
        distributions, or None: deterministic candidates). Returns (the accepted nodes from the root down, the
        next token)."""
        # drafts [m], parents [m] or None, draft_probs [m, V] or None, target_logits [m + 1, V]
        m = drafts.size
        if parents is None:
            def children(node):
                return (node + 1,) if node + 1 < m else ()
        else:
            kids: dict[int, list[int]] = {}
            for j, par in enumerate(parents.tolist()):
                kids.setdefault(par, []).append(j)

            def children(node):
                return kids.get(node, ())
        proc = self.processor
        if proc is not None:
            proc.rollback()  # the drafter pushed its own proposals
        record = self.params.logprobs is not None
        path, node = [], -1
        while True:
            nodes = children(node)
            candidates = [int(drafts[j]) for j in nodes]
            if chosen is not None:  # a plain greedy or coupled row (picks.target_picks)
                i, token = accept_chosen(candidates, int(chosen[node + 1]))
            elif self.mode == "rejection":
                x = self._process(target_logits[node + 1])
                q = None if draft_probs is None else [draft_probs[j] for j in nodes]
                i, token = accept_rejection(self.params.probs(x), candidates, q, self.rng)
            else:
                token, x = self._choose(target_logits[node + 1], position + len(path))
                i, token = accept_chosen(candidates, token)
            if record:
                self._record(x, token)
            if i < 0:
                break
            node = nodes[i]
            path.append(node)
            if proc is not None:
                proc.push(token)
        if proc is not None:
            proc.rollback()  # the scheduler commits what the output takes
        return path, token


def verify_rows(samplers, drafts: np.ndarray, parents: np.ndarray | None, counts: np.ndarray, probs, logits,
                positions: np.ndarray, skip=(), depth: np.ndarray | None = None) -> list:
    """Every row's verdict of one verify call: (accepted nodes, next token), or the exception its own sampler
    raised (that request's failure alone). Rows in ``skip`` (failed earlier this round) get None. ``logits`` are
    where the engine left them (a torch tensor on its device, or numpy): plain greedy and coupled rows get the
    target's picks made there, all at once, and only their ids come back (picks.target_picks); a row that needs its
    logits gets its own rows on the host. ``depth`` [B, W]: a tree call's node depths (None: chains)."""
    # drafts [B, K], parents [B, K] or None (chains), counts [B], probs [B, K, V] or None, logits [B, W, V]
    counts = np.asarray(counts)
    width = logits.shape[1]
    steps = np.arange(width) if depth is None else depth
    chosen, picked = target_picks(samplers, logits, counts + 1, np.asarray(positions)[:, None] + steps, skip)
    verdicts = []
    for s, sampler in enumerate(samplers):
        if s in skip:
            verdicts.append(None)
            continue
        m = int(counts[s])
        try:
            verdicts.append(sampler.accept(drafts[s, :m], None if parents is None else parents[s, :m],
                                           None if probs is None else probs[s, :m],
                                           None if s in picked else host_rows(logits, s, m + 1),
                                           int(positions[s]), chosen[s, : m + 1] if s in picked else None))
        except Exception as exc:  # noqa: BLE001 - this request's own failure (a RowFault): it alone ends
            verdicts.append(exc)
    return verdicts


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): mean tokens emitted per target call with k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """S = E / (k * c + v): costs relative to one target decode call (DESIGN.md §4)."""
    return expected_tokens_per_call(alpha, k) / (k * draft_cost + verify_cost)
