"""The worker: owns the engines, the drafter and the rows' token buffers, and executes the scheduler's plans.

vLLM v1's model runner (shared/STYLE.md): ``execute(plan) -> StepResult`` makes every engine and drafter call of
one step, in the plan's order (runtime/plan.py):
  1. the rows' buffers take what their outputs took of the last result; the caches then hold each row's verified
     tokens, and the drafter learns which of its rows' tokens were right (a head: their features);
  2. the cache moves: finished rows' slots saved for the prefix cache and their outputs to a drafter that learns
     from them, rows moved to close the gaps, newcomers' prompts and reused prefix slots loaded;
  3. prompts: one target call over the prompt-reading rows' chunks; each finished prompt's first token chosen (its
     request's sampler), then the drafter reads the same chunks;
  4. the decoding rows' round: the grammar's forced tokens, the drafter's Proposal (drafters/), ONE target call
     over [last token, forced..., drafts...] per row (a tree mask where a row drafted a tree), every row's
     verdict by the one acceptance walk (verify.verify_rows: the logits stay on the engine's device, where the
     target's picks are made, runtime/picks.py), the accepted tree path's K/V moved into place;
     or a lone plain row's one-token calls in the engine's own loop (engines.base.greedy_steps).
``tokens`` [B, cap] holds each row's known tokens (``n``: how many; ``tc``: how many the target's cache holds).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from ..engines import load_engine
from ..engines.base import greedy_steps, lease, tree_positions
from .drafters import Proposal
from .forced import ahead_of_forced, constrain, forced_counts
from .picks import host_rows, host_view, target_picks
from .plan import (DecodeResult, DraftShape, LearnOutput, Load, LoneDecode, LoneResult, Move, PromptChunks,
                   PromptResult, Save, StepPlan, StepResult, Verdict)
from .sampling import SamplingParams, log_probs, logprob_entry
from .verify import RowFault, verify_rows


def open_engine(engine_or_path, num_threads):
    """A loaded engine, or the engine (or export) directory's, loaded."""
    if isinstance(engine_or_path, (str, os.PathLike)):
        return load_engine(engine_or_path, num_threads=num_threads)
    return engine_or_path


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
        self._verified = None  # the last round's (rows, n before it, accepted nodes per row) until it is settled
        # the target's logits stay where the engine makes them (a torch engine's device); picks.py reads them there
        self._device_logits = {"as_tensor": True} if getattr(target, "tensor_logits", False) else {}

    def locks(self):
        """The engines' leases, in one order (another scheduler on the same engines waits for them)."""
        return [lock for _, lock in sorted({id(lease(e)): lease(e) for e in self.engines}.items())]

    def execute(self, plan: StepPlan) -> StepResult:
        """Every engine and drafter call of one step (the module docstring's order)."""
        self._settle(plan.appended)
        result = StepResult(saved=self._move_caches(plan.cache))
        if plan.prompts is not None:
            result.prompts = self._read_prompts(plan.prompts)
        if plan.decode is not None:
            result.decode = self._decode(plan.decode)
        elif plan.alone is not None:
            result.alone = self._decode_alone(plan.alone)
        return result

    # -- 1. what the outputs took -------------------------------------------------------------------------

    def _settle(self, appended: dict | None) -> None:
        """Each row's buffer takes the tokens its output took of the last result; after a round, each row's cache
        holds its verified tokens (not the last one), the drafter learns which of its rows' tokens are right, a
        head the features of the root and the accepted nodes. None: the last result is void (its rows failed)."""
        if appended is None:
            self._verified = None
            return
        for s, tokens in appended.items():
            n = int(self.n[s])
            self.tokens[s, n : n + len(tokens)] = tokens
            self.n[s] = n + len(tokens)
        verified, self._verified = self._verified, None
        if verified is None:
            return
        b, n_before, paths = verified
        valid = n_before.copy()
        for s, path in enumerate(paths):
            if path is not None:
                valid[s] = min(int(n_before[s]) + len(path), int(self.n[s]))
                self.tc[s] = valid[s]
        if self._observe is not None:
            features = self.target.features
            nodes = [[0, *[j + 1 for j in path]] if path is not None else [0] for path in paths]
            self._observe(0, n_before - 1, [features[s, nodes[s][: valid[s] - n_before[s] + 1]] for s in range(b)])
        self.drafter.accepted(valid)

    # -- 2. the cache moves ---------------------------------------------------------------------------------

    def _move_caches(self, ops) -> list:
        saved = []
        for op in ops:
            if isinstance(op, Move):
                self._move_row(op.src, op.dst)
            elif isinstance(op, Load):
                self._load(op)
            elif isinstance(op, Save):
                keep = min(int(self.tc[op.row]), int(self.n[op.row]))
                saved.append((self.tokens[op.row, :keep].copy(), *self._save(op.row, keep))
                             if keep >= op.least else None)
            elif isinstance(op, LearnOutput):
                self.drafter.finish(op.row, self.tokens[op.row, : int(self.n[op.row])], op.prompt_len)
        return saved

    def _load(self, op: Load) -> None:
        row, plen = op.row, op.prompt_ids.size
        self.tokens[row, :plen] = op.prompt_ids
        self.n[row] = plen
        self.tc[row] = op.reused
        t_block, d_block = op.blocks if op.reused else (None, None)
        if op.reused:
            self.target.load_prefix(t_block.head(op.reused), row)
        self.drafter.admit(row, d_block, op.reused)

    def _save(self, row: int, keep: int) -> tuple:
        """The target's and the drafter's first ``keep`` slots of ``row``, for reuse."""
        return self.target.save_prefix(row, keep), self.drafter.save_prefix(row, keep)

    def _move_row(self, src: int, dst: int) -> None:
        self.target.move_row(src, dst, int(self.tc[src]))
        self.drafter.move_row(src, dst)
        self.tokens[dst] = self.tokens[src]
        self.n[dst] = self.n[src]
        self.tc[dst] = self.tc[src]

    # -- 3. prompts -------------------------------------------------------------------------------------------

    def _read_prompts(self, plan: PromptChunks) -> PromptResult:
        """One target call over the rows' chunks (shorter chunks padded beyond their length: the pads' writes land in
        slots the mask hides and later writes overwrite); the first tokens; the drafter reads the same chunks."""
        t0 = time.perf_counter()
        first, p = plan.first, len(plan.chunks)
        chunk = np.array(plan.chunks, np.int64)
        offsets = np.arange(int(chunk.max()))
        read = self.tc[first : first + p].copy()  # each row's tokens read before this chunk
        pos = read[:, None] + offsets
        src = np.minimum(pos, self.tokens.shape[1] - 1)
        ids = np.where(offsets < chunk[:, None], np.take_along_axis(self.tokens[first : first + p], src, axis=1),
                       self.pad_id)
        logits = self.target.forward(ids, pos, first_row=first, **self._device_logits)
        self.tc[first : first + p] += chunk
        entries = [None if plan.logprobs[i] is None else
                   _prompt_entries(*plan.logprobs[i], host_rows(logits, i, chunk[i]), int(read[i])) for i in range(p)]
        tokens = self._first_tokens(plan.choosers, logits, chunk, self.n[first : first + p])
        draft_calls = (self.drafter.prefill(ids, pos, first, chunk) or 0) if plan.draft else 0
        if self._observe is not None:
            features = self.target.features
            self._observe(first, pos[:, 0], [features[i, : chunk[i]] for i in range(p)])
        shared = [(keep, *self._save(first + i, keep)) if keep else None for i, keep in enumerate(plan.share)]
        return PromptResult(tokens, entries, shared, draft_calls, time.perf_counter() - t0)

    @staticmethod
    def _first_tokens(choosers, logits, chunk, positions) -> list:
        """Each finished prompt's first token (None where a row's prompt goes on), or its sampler's exception: picked
        where the logits are (picks.target_picks) for rows that need nothing else of them."""
        rows = [i for i, c in enumerate(choosers) if c is not None]
        if not rows:
            return [None] * len(choosers)
        if isinstance(logits, torch.Tensor) and logits.device.type != "cpu":
            last = torch.stack([logits[i, int(chunk[i]) - 1] for i in range(len(choosers))])[:, None]  # [P, 1, V]
        else:
            last = host_view(logits)[np.arange(len(choosers)), np.asarray(chunk) - 1][:, None]
        skip = set(range(len(choosers))) - set(rows)
        chosen, picked = target_picks(choosers, last, np.ones(len(choosers), np.int64), positions[:, None], skip)
        tokens = [None] * len(choosers)
        for i in rows:
            try:
                tokens[i] = (int(chosen[i, 0]) if i in picked
                             else choosers[i].choose(host_rows(last, i, 1)[0], int(positions[i])))
            except Exception as exc:  # noqa: BLE001 - this request's own failure: it alone ends
                tokens[i] = exc
        return tokens

    # -- 4. a decoding round -----------------------------------------------------------------------------------

    def _decode(self, plan: DraftShape) -> DecodeResult:
        """The drafter's drafts (after each row's forced tokens), ONE target call over them, every row's verdict."""
        t0 = time.perf_counter()
        b, caps, forced = len(plan.samplers), plan.caps, plan.forced
        faults = []
        proposal = Proposal.empty(b)
        if plan.k:
            if plan.width != getattr(self.drafter, "tree_width", plan.width):
                self.drafter.tree_width = plan.width  # this round's shape (the policy weighs trees and chains)
            ahead = ahead_of_forced(plan.samplers, forced, caps, self.tokens, self.n[:b])
            try:
                proposal = self.drafter.propose(self.tokens[:b], ahead, caps, plan.samplers, self.capacity)
            except RowFault as fault:  # one row's processing failed mid-step: that row ends, the others verify
                row = next((s for s, r in enumerate(plan.samplers) if r is fault.owner), None)
                if row is None:
                    raise
                faults.append((row, fault))  # (without drafts this round: their output is the same)
        if forced is not None:
            constrain(plan.samplers, proposal, forced, plan.room, self.max_drafts)
        t1 = time.perf_counter()
        logits, width, depth = self._verify_call(proposal)
        t2 = time.perf_counter()
        verdicts = self._verdicts(plan.samplers, proposal, logits, depth, {s for s, _ in faults})
        tree = proposal.parents is not None
        chains_forced = proposal.forced is not None and bool(proposal.forced.any())
        return DecodeResult(verdicts, faults, proposal.calls, proposal.drafts.shape[1], width, tree, proposal.shape,
                            chains_forced, t0, t1 - t0, t2 - t1)

    def _verify_call(self, proposal: Proposal):
        """ONE target call over each row's [last token, drafts...] (rows with fewer drafts padded beyond their
        length; a tree's pads hang off the root, seen by nobody else) -> (logits [B, W, V], W, tree depths or None)."""
        b = proposal.counts.size
        n = self.n[:b]
        drafts, parents, counts = proposal.drafts, proposal.parents, proposal.counts
        if parents is not None:  # every row writes the call's width of slots from n - 1: cut to the room left
            counts = proposal.counts = np.minimum(counts, min(int((self.capacity - n).min()), self.max_drafts))
        width = int(counts.max()) + 1
        ids = np.full((b, width), self.pad_id, np.int64)
        ids[:, 0] = self.tokens[np.arange(b), n - 1]
        real = np.arange(width - 1) < counts[:, None]
        ids[:, 1:] = np.where(real, drafts[:, : width - 1], self.pad_id)
        if parents is None:
            return self.target.forward(ids, (n - 1)[:, None] + np.arange(width), **self._device_logits), width, None
        call_parents = np.zeros((b, width), np.int64)
        call_parents[:, 0] = -1
        call_parents[:, 1:] = np.where(real, parents[:, : width - 1] + 1, 0)
        mask, depth = tree_positions(call_parents)
        return self.target.forward(ids, (n - 1)[:, None] + depth, tree_mask=mask, **self._device_logits), width, depth

    def _verdicts(self, samplers, proposal: Proposal, logits, depth, skip) -> list:
        """Every row's Verdict (verify.verify_rows), the accepted tree path's K/V moved to the slots its positions
        give; the round is settled when the next step says what the outputs took."""
        b = len(samplers)
        n = self.n[:b]
        parents = proposal.parents
        walks = verify_rows(samplers, proposal.drafts, parents, proposal.counts, proposal.probs, logits, n, skip, depth)
        verdicts, paths = [], []
        for s, walk in enumerate(walks):
            if not isinstance(walk, tuple):  # None (failed earlier this round) or its own sampler's exception
                verdicts.append(walk)
                paths.append(None)
                continue
            path, token = walk
            m = int(proposal.counts[s])
            if parents is not None and path != list(range(len(path))):
                self.target.keep_path(s, int(n[s]) - 1, [0, *[j + 1 for j in path]])
            # a chain's drafts, or the deepest path of a tree: the most this row's drafts could have given
            proposed = m if parents is None else int(depth[s, : m + 1].max())
            forced_accepted, forced = forced_counts(proposal, s, m, path)
            source = proposal.sources[s] if proposal.sources is not None else self.drafter.name
            verdicts.append(Verdict([*proposal.drafts[s, path].tolist(), token], len(path), proposed, forced,
                                    forced_accepted, source))
            paths.append(path)
        self._verified = (b, n.copy(), paths)
        return verdicts

    def _decode_alone(self, plan: LoneDecode) -> LoneResult:
        """Row 0 alone, no drafts: one-token target calls in the engine's own loop, each token the argmax or the
        coupled sampler's pick for its position (the call's fed token's + 1)."""
        t0 = time.perf_counter()
        n0 = int(self.n[0])
        sampler = plan.sampler
        pick = None if sampler.mode == "greedy" else (lambda x, i: sampler.choose(x, n0 + i))

        def on_token(token):
            taken, go_on = plan.take(token)
            if taken:
                self.tokens[0, int(self.n[0])] = token
                self.n[0] += 1
            return go_on

        calls, seconds = greedy_steps(self.target, 0, int(self.tokens[0, n0 - 1]), n0 - 1, plan.steps, on_token, pick)
        self.tc[0] = min(n0 - 1 + calls, int(self.n[0]))  # the cache holds every token fed
        return LoneResult(calls, seconds, t0, pick is not None)

    def warm_up(self, rows: int, width: int) -> None:
        """Each engine once at ``rows`` x ``width`` tokens (slots no request holds)."""
        ids = np.zeros((rows, width), np.int64)
        pos = np.broadcast_to(np.arange(width), ids.shape)
        for engine in self.engines:
            engine.forward(ids, pos)


def _prompt_entries(prompt: np.ndarray, n: int, logits: np.ndarray, start: int) -> list:
    """The prompt logprob entries of positions start.. (logits [T, V]: position j's give the prompt's token j + 1)."""
    greedy = SamplingParams()
    return [logprob_entry(log_probs(greedy, logits[c]), int(prompt[start + c + 1]), n)
            for c in range(min(logits.shape[0], prompt.size - 1 - start))]
