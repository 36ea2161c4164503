"""A request's logits processing and the state it depends on: logit_bias, min_tokens, penalties, grammar.

The processed logits define the request's distribution, so they must be the same wherever a token is drawn or
checked: the target's choice of the prompt's first token, each verified position, and each position the draft
proposes for. The state moves with the tokens: ``push`` a drafted token and the next position sees it (its count,
the grammar after it); ``rollback`` drops the round's drafts; ``commit`` makes the emitted tokens permanent. So a
speculative round processes position j exactly as target-only decoding would after the same j tokens, and greedy
speculation equals greedy target-only decoding with the same penalties (and sampling stays exactly the processed
target distribution).

Order (vLLM's): logit_bias, min_tokens (EOS forbidden before it), repetition_penalty (prompt and output tokens),
frequency and presence penalties (output tokens), grammar mask; temperature, top-k and top-p come after
(sampling.SamplingParams.probs).
"""

from __future__ import annotations

import numpy as np

from .sampling import SamplingParams


class LogitsProcessor:
    def __init__(self, params: SamplingParams, prompt_ids, eos_ids, constraint=None):
        self.params = params
        self.constraint = constraint  # grammar.Constraint or None
        if params.logit_bias:
            self._bias_ids = np.array([t for t, _ in params.logit_bias], np.int64)
            self._bias = np.array([b for _, b in params.logit_bias], np.float32)
        else:
            self._bias_ids = None
        self._eos = np.array(sorted(eos_ids), np.int64)
        self._eos_set = frozenset(int(t) for t in eos_ids)
        self._counts: dict[int, int] = {}  # output tokens (committed and pushed) -> occurrences
        self._seen = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1 else None
        self._prompt_seen = frozenset(self._seen) if self._seen is not None else None
        self.generated = 0  # committed output tokens
        self.pending: list[int] = []  # this round's drafted tokens on top of them
        self._consumed = 0  # of them, those the grammar consumed (an EOS ends the output: the grammar never sees it)

    def apply(self, logits: np.ndarray, grammar: bool = True) -> np.ndarray:
        """The processed logits of the next position (after the committed and pushed tokens): a float32 copy.
        ``grammar=False`` leaves the grammar's mask out (see ``allows``)."""
        # logits [V] -> [V] float32
        p = self.params
        x = np.array(logits, dtype=np.float32)
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias
        if self.generated + len(self.pending) < p.min_tokens:
            x[self._eos] = -np.inf
        if self._seen:
            ids = np.fromiter(self._seen, np.int64, len(self._seen))
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self._counts and (p.frequency_penalty or p.presence_penalty):
            ids = np.fromiter(self._counts.keys(), np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            x[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if grammar and self.constraint is not None:
            self.mask(x)
        return x

    def mask(self, x: np.ndarray) -> None:
        """The grammar's mask on processed logits x [V] (in place), in the state after the round's tokens so far."""
        self.constraint.mask(x, tuple(self.pending))

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` at the next position (True without a grammar)."""
        return self.constraint is None or self.constraint.allows(int(token), tuple(self.pending))

    def push(self, token: int) -> None:
        """One more token in front of the next position (a draft, or a verified position's token)."""
        token = int(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        if self._seen is not None:
            self._seen.add(token)
        if self.constraint is not None and token not in self._eos_set:
            self.constraint.consume(token)
            self._consumed += 1
        self.pending.append(token)

    def rollback(self) -> None:
        """Drop the pushed tokens: the state is the committed output again."""
        if not self.pending:
            return
        for t in self.pending:
            c = self._counts[t] - 1
            if c:
                self._counts[t] = c
            else:
                del self._counts[t]
                if self._seen is not None and t not in self._prompt_seen:
                    self._seen.discard(t)
        if self.constraint is not None:
            self.constraint.rollback(self._consumed)
        self.pending = []
        self._consumed = 0

    def commit(self, tokens) -> None:
        """The request's output grew by ``tokens`` (what the one stop rule took)."""
        self.rollback()
        for t in tokens:
            self.push(t)
        self.generated += len(self.pending)
        self.pending = []
        self._consumed = 0
        if self.constraint is not None:
            self.constraint.forget()

    def allowed_prefix(self, drafts) -> int:
        """How many leading drafts the grammar allows (all of them without one)."""
        if self.constraint is None:
            return len(drafts)
        return self.constraint.allowed_prefix(drafts)

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (none without one, or after an EOS: the output ends there)."""
        if self.constraint is None or (self.pending and self.pending[-1] in self._eos_set):
            return []
        return self.constraint.forced()

    @property
    def finished(self) -> bool:
        """The grammar allows nothing but EOS now."""
        return self.constraint is not None and self.constraint.finished
