"""The worker: owns the engines, the drafter and the rows' token buffers, and runs what the scheduler planned.

vLLM v1's shape (shared/STYLE.md): the scheduler (runtime/scheduler.py) decides each step — which rows read which
prompt chunk, each decoding row's draft budget, the round's k and tree width — and never calls a model. The worker
executes those decisions over the engines and hands back what came of them:
  read_prompts   one target call over the prompt-reading rows' chunks -> their logits (the first tokens are the
                 scheduler's to choose and emit), then ``draft_reads`` lets the drafter read the same chunks;
  propose        the drafter's Proposal for the decoding rows (chains or token trees; drafters/);
  verify         ONE target call over [last token, drafts...] per row (a tree mask where a row drafted a tree),
                 every row's verdict by the one acceptance rule (verify.verify_rows), and the accepted path's
                 K/V moved into place (Engine.keep_path) -> Verdicts;
  settle         after the scheduler emitted the accepted tokens: how much of each row the caches now hold (the
                 drafter and a head's features learn it);
  decode_alone   a lone greedy row with no drafts in the engine's own loop (engines.base.greedy_steps);
and the cache moves: a row's prefix slots loaded at admission, saved at retirement, rows moved to close a gap.
``tokens`` [B, cap] holds each row's known tokens (``n``: how many; ``tc``: how many the target's cache holds).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from ..engines import load_engine
from ..engines.base import greedy_steps, lease, tree_positions
from .drafters import Proposal
from .verify import verify_rows


def open_engine(engine_or_path, num_threads):
    """A loaded engine, or the engine (or export) directory's, loaded."""
    if isinstance(engine_or_path, (str, os.PathLike)):
        return load_engine(engine_or_path, num_threads=num_threads)
    return engine_or_path


@dataclass
class Verdicts:
    """What one verify call gave: per row (accepted nodes, next token), the exception its own sampler raised, or
    None (a row that failed earlier this round); the call's width, the rows' tree depths ([B, W], None for
    chains) and the seconds the call took."""

    rows: list
    width: int
    depth: np.ndarray | None
    seconds: float


class Worker:
    def __init__(self, target, draft, drafter, *, max_batch: int, capacity: int, max_drafts: int, pad_id: int,
                 k_room: int):
        self.target, self.draft, self.drafter = target, draft, drafter
        self.engines = [target] if draft is None else [target, draft]
        self.capacity, self.max_drafts, self.pad_id = capacity, max_drafts, pad_id
        self.tokens = np.full((max_batch, capacity + k_room + 1), pad_id, dtype=np.int64)
        self.n = np.zeros(max_batch, np.int64)  # known tokens per row (prompt + output)
        self.tc = np.zeros(max_batch, np.int64)  # tokens in the target's cache per row
        self._observe = getattr(drafter, "observe", None)  # drafters that read the target's features
        self._learn_output = getattr(drafter, "finish", None)  # drafters that learn from finished outputs

    def locks(self):
        """The engines' leases, in one order (another scheduler on the same engines waits for them)."""
        return [lock for _, lock in sorted({id(lease(e)): lease(e) for e in self.engines}.items())]

    # -- the cache moves --------------------------------------------------------------------

    def admit(self, row: int, prompt_ids: np.ndarray, hit) -> int:
        """A request takes ``row``: its prompt into the buffer; of a prefix-cache ``hit`` (common tokens, the target's
        and the drafter's saved blocks), the slots both caches can take back are loaded. Returns how many."""
        plen = prompt_ids.size
        self.tokens[row, :plen] = prompt_ids
        self.n[row] = plen
        reused, d_block = 0, None
        if hit is not None:
            common, t_block, d_block = hit
            # both caches must hold the reused slots: the draft then reads the rest of the prompt alongside
            reused = min(common, t_block.tokens, self.drafter.reusable(d_block))
            if reused < max(t_block.min_head, d_block.min_head if d_block is not None else 0):
                reused = 0  # a sliding-window ring no longer holds the window before that point
        if reused > 0:
            self.target.load_prefix(t_block.head(reused), row)
        self.tc[row] = reused
        self.drafter.admit(row, d_block, reused)
        return reused

    def save(self, row: int, keep: int) -> tuple:
        """The target's and the drafter's first ``keep`` slots of ``row``, for reuse."""
        return self.target.save_prefix(row, keep), self.drafter.save_prefix(row, keep)

    def learn_output(self, row: int, start: int) -> None:
        """A finished row's tokens from ``start`` on, to a drafter that learns from outputs (suffix decoding)."""
        if self._learn_output is not None:
            self._learn_output(row, self.tokens[row, start : int(self.n[row])])

    def move_row(self, src: int, dst: int) -> None:
        self.target.move_row(src, dst, int(self.tc[src]))
        self.drafter.move_row(src, dst)
        self.tokens[dst] = self.tokens[src]
        self.n[dst] = self.n[src]
        self.tc[dst] = self.tc[src]

    # -- prompts ------------------------------------------------------------------------------

    def read_prompts(self, first: int, chunks: list[int]):
        """Rows first, first + 1, ... read their next ``chunks[i]`` prompt tokens in one target call (shorter chunks
        padded beyond their length: the pads' writes land in slots the mask hides and later writes overwrite).
        Returns (ids, positions, chunk lengths, logits)."""
        p = len(chunks)
        chunk = np.array(chunks, np.int64)
        width = int(chunk.max())
        offsets = np.arange(width)
        pos = self.tc[first : first + p, None] + offsets
        src = np.minimum(pos, self.tokens.shape[1] - 1)
        ids = np.where(offsets < chunk[:, None], np.take_along_axis(self.tokens[first : first + p], src, axis=1),
                       self.pad_id)
        logits = self.target.forward(ids, pos, first_row=first)
        self.tc[first : first + p] += chunk
        return ids, pos, chunk, logits

    def draft_reads(self, ids, pos, first: int, chunk: np.ndarray) -> None:
        """The drafter reads the chunks the target just read (after the first tokens went out: they need only the
        target); a head drafter gets the target's features of them."""
        self.drafter.prefill(ids, pos, first, chunk)
        if self._observe is not None:
            features = self.target.features
            self._observe(first, pos[:, 0], [features[i, : chunk[i]] for i in range(len(chunk))])

    # -- a decoding round -----------------------------------------------------------------------

    def propose(self, ahead: np.ndarray, caps: np.ndarray, samplers) -> Proposal:
        """The drafter's drafts for rows [0, B): up to caps[s] each (``ahead``: each row's length as it drafts)."""
        return self.drafter.propose(self.tokens[: caps.size], ahead, caps, samplers, self.capacity)

    def verify(self, samplers, proposal: Proposal, skip=()) -> Verdicts:
        """ONE target call over each row's [last token, drafts...] (rows with fewer drafts padded beyond their
        length; a tree's pads hang off the root, seen by nobody else), then every row's verdict
        (verify.verify_rows) and its accepted path's K/V moved to the slots their positions give."""
        b = len(samplers)
        n = self.n[:b]
        drafts, parents, counts = proposal.drafts, proposal.parents, proposal.counts
        if parents is not None:  # every row writes the call's width of slots from n - 1: cut to the room left
            counts = proposal.counts = np.minimum(counts, min(int((self.capacity - n).min()), self.max_drafts))
        width = int(counts.max()) + 1
        ids = np.full((b, width), self.pad_id, np.int64)
        ids[:, 0] = self.tokens[np.arange(b), n - 1]
        real = np.arange(width - 1) < counts[:, None]
        ids[:, 1:] = np.where(real, drafts[:, : width - 1], self.pad_id)
        t0 = time.perf_counter()
        if parents is None:
            depth = None
            logits = self.target.forward(ids, (n - 1)[:, None] + np.arange(width))
        else:
            call_parents = np.zeros((b, width), np.int64)
            call_parents[:, 0] = -1
            call_parents[:, 1:] = np.where(real, parents[:, : width - 1] + 1, 0)
            mask, depth = tree_positions(call_parents)
            logits = self.target.forward(ids, (n - 1)[:, None] + depth, tree_mask=mask)
        seconds = time.perf_counter() - t0
        verdicts = verify_rows(samplers, drafts, parents, counts, proposal.probs, logits, n, skip)
        for s, verdict in enumerate(verdicts):
            if isinstance(verdict, tuple) and parents is not None:
                path = verdict[0]
                if path != list(range(len(path))):  # the accepted nodes' K/V to the slots their positions give
                    self.target.keep_path(s, int(n[s]) - 1, [0, *[j + 1 for j in path]])
        return Verdicts(verdicts, width, depth, seconds)

    def settle(self, n_before: np.ndarray, verdicts: Verdicts) -> None:
        """After the round's tokens were emitted (``n`` grown): each row's cache holds its verified tokens, not the
        last one; the drafter learns which of its rows' tokens are right, a head the features of the root and the
        accepted nodes."""
        b = n_before.size
        valid = self.n[:b].copy()
        accepted = [len(v[0]) if isinstance(v, tuple) else None for v in verdicts.rows]
        for s, a in enumerate(accepted):
            if a is not None:
                valid[s] = min(int(n_before[s]) + a, int(self.n[s]))
                self.tc[s] = valid[s]
            else:
                valid[s] = n_before[s]
        if self._observe is not None:
            features = self.target.features
            nodes = [[0, *[j + 1 for j in v[0]]] if isinstance(v, tuple) else [0] for v in verdicts.rows]
            self._observe(0, n_before - 1, [features[s, nodes[s][: valid[s] - n_before[s] + 1]] for s in range(b)])
        self.drafter.accepted(valid)

    def decode_alone(self, steps: int, on_token) -> tuple[int, float]:
        """Row 0 alone, greedy, no drafts: one-token target calls in the engine's own loop, ``on_token(token)``
        taking each (False: stop). Returns (calls, seconds in the engine)."""
        n0 = int(self.n[0])
        calls, seconds = greedy_steps(self.target, 0, int(self.tokens[0, n0 - 1]), n0 - 1, steps, on_token)
        self.tc[0] = min(n0 - 1 + calls, int(self.n[0]))  # the cache holds every token fed
        return calls, seconds

    def warm_up(self, rows: int, width: int) -> None:
        """Each engine once at ``rows`` x ``width`` tokens (slots no request holds)."""
        ids = np.zeros((rows, width), np.int64)
        pos = np.broadcast_to(np.arange(width), ids.shape)
        for engine in self.engines:
            engine.forward(ids, pos)
