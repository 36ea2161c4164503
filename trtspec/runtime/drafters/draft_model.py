"""Drafting with a small model over its own engine and KV cache: chains, or chains with siblings (trees)."""

from __future__ import annotations

import time

import numpy as np

from ...engines.base import greedy_steps
from .trees import branching_tree, pack_trees
from .base import ANY, Drafter, Proposal


class DraftModelDrafter(Drafter):
    """Chain drafting with a small model over its own engine and KV cache.

    ``tree_width`` > 1 makes each round's chain a tree (drafters/trees.branching_tree): beside the chain token at
    each depth, the draft's next tree_width - 1 likeliest tokens, up to ``tree_nodes`` nodes in all; the draft
    makes the same calls as for the chain, the target verifies the tree in one call (a --tree export)."""

    name = "draft"
    proposes_drafts = True
    needs_draft_model = True
    proposes_trees = True
    branches = True

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes):
        return cls(draft, pad_id, tree_width=tree_width, tree_nodes=tree_nodes)

    def __init__(self, engine, pad_id: int, *, tree_width: int = 1, tree_nodes: int | None = None):
        self.engine = engine
        self.pad_id = pad_id
        self.cached = np.zeros(engine.max_batch, np.int64)  # tokens of each row in the draft's cache
        self.max_call = engine.max_call_tokens
        self.tree_width = tree_width
        self.tree_nodes = tree_nodes
        self._chains = None  # a tree round's (tokens view, n, chains, chain lengths), for accepted()

    forced_beyond_k = 16  # a grammar row's forced tokens a chain may hold beyond its k proposals

    # a chain may start after a row's grammar-forced tokens (the catch-up call reads them); a tree may not (the
    # scheduler asks for chains only: a round of width 1)
    drafts_after_forced = True
    catches_up = True  # (propose's first call reads what the row's cache lacks)

    def admit(self, row, prefix, n):
        # what its block holds of the n reused slots (it may have skipped the prompt): the rest when it drafts
        held = min(n, prefix.tokens) if prefix is not None else 0
        if held:
            self.engine.load_prefix(prefix.head(held), row)
        self.cached[row] = held

    def reusable(self, prefix):
        return ANY  # it catches up on the slots its block lacks

    def save_prefix(self, row, n):
        keep = min(int(self.cached[row]), n)
        return self.engine.save_prefix(row, keep) if keep else None

    def prefill(self, input_ids, position_ids, first_row, fed):
        self.engine.forward(input_ids, position_ids, first_row=first_row)
        self.cached[first_row : first_row + fed.size] += fed
        return 1

    def propose(self, tokens, n, caps, samplers, capacity):
        # tokens [B, cap] int64, n [B], caps [B] -> Proposal(drafts [B, K], counts [B], probs [B, K, V] or None)
        # First one call catches every row up with the tokens its cache lacks (the last one or two, more after
        # rounds without drafting); then k - 1 one-token calls extend the drafts.
        b = n.size
        tree = self.tree_width > 1
        if b == 1 and samplers[0].processor is None and samplers[0].mode == "greedy" and not tree:  # (logprobs: verify)
            return self._greedy_chain(tokens[0], int(n[0]), int(caps[0]))
        cached = self.cached[:b]
        # pads sit beyond each row's cached tokens, where the mask hides them and later writes overwrite them
        width = int(max(1, (n - cached).max()))
        width = min(width, int((capacity - cached).min()))  # no row may write past the cache's capacity
        width = min(width, self.max_call)  # (rings: a longer catch-up takes several rounds)
        offsets = np.arange(width)
        fed = np.clip(n - cached, 0, width)
        pos = cached[:, None] + offsets
        ids = np.where(offsets < fed[:, None], np.take_along_axis(tokens, np.minimum(pos, tokens.shape[1] - 1), axis=1),
                       self.pad_id)
        t0 = time.perf_counter()
        logits = self.engine.forward(ids, pos)
        calls = [(b, width, time.perf_counter() - t0)]
        cached += fed
        # a row drafts only when it is fully caught up (its logits then predict token n)
        counts = np.where((cached == n) & (fed > 0), caps, 0).astype(np.int64)
        if not counts.any():
            return Proposal(np.zeros((b, 0), np.int64), counts, None, calls)
        # a chain holds up to counts[r] proposals, and a grammar row's forced tokens between them beyond that
        # (within the cache; the scheduler cuts the chain to the room its verify call has)
        grammar = not tree and any(s.processor is not None and s.processor.constraint is not None for s in samplers)
        limit = np.where(counts > 0, np.minimum(counts + (self.forced_beyond_k if grammar else 0), capacity - n), 0)
        k = int(limit.max())
        drafts = np.zeros((b, k), np.int64)
        probs = None
        if not tree and any(samplers[r].mode == "rejection" for r in range(b) if counts[r]):
            probs = np.zeros((b, k, logits.shape[-1]))
        forced = np.zeros((b, k), bool) if grammar else None
        branches = [([], [], []) for _ in range(b)] if tree else None  # per row: chain logprobs, siblings
        last = logits[np.arange(b), np.maximum(fed - 1, 0)]  # [B, V]
        # length[r]: row r's drafts so far; fed[r]: those its cache holds (draft j sits at position n + j). A grammar
        # row's chain takes the tokens its grammar forces after a proposal without asking the model (jump-forward:
        # they are what the masked draft would propose), and the next call reads them with the proposal.
        length = np.zeros(b, np.int64)
        proposed = np.zeros(b, np.int64)  # of them, the model's proposals
        fed_drafts = np.zeros(b, np.int64)
        going = (proposed < counts) & (length < limit)
        while True:
            for r in np.flatnonzero(going & (fed_drafts == length)):  # rows whose last call read all they hold
                proposed[r] += 1
                j = int(length[r])
                if tree:
                    drafts[r, j], lp, others = samplers[r].propose_branches(last[r], int(n[r]) + j, self.tree_width)
                    if drafts[r, j] < 0:  # nothing the request allows: the chain ends here
                        counts[r] = limit[r] = j
                        continue
                    branches[r][0].append(lp)
                    branches[r][1].append(others)
                    length[r] += 1
                    continue
                drafts[r, j], q = samplers[r].propose(last[r], int(n[r]) + j)
                if drafts[r, j] < 0:
                    counts[r] = limit[r] = j
                    continue
                if q is not None:
                    probs[r, j] = q
                length[r] += 1
                proc = samplers[r].processor
                if proc is not None and length[r] < limit[r]:
                    # (the next call reads them with the proposal: within the tokens a call may carry)
                    for t in proc.forced()[: int(min(limit[r] - length[r], self.max_call - 1))]:
                        drafts[r, length[r]] = t
                        forced[r, length[r]] = True
                        proc.push(t)
                        if probs is not None:
                            probs[r, length[r], t] = 1.0
                        length[r] += 1
            going = (proposed < counts) & (length < limit)
            if not going.any():
                break
            # rows still drafting read their new tokens; the others write pads at their first free slots (harmless:
            # beyond what they hold, overwritten later). Every row's slots stay consecutive and inside the cache: a
            # row near the end bounds the call's width, and a row with more to read reads the rest next call
            pending = length - fed_drafts
            start = np.where(counts > 0, n + fed_drafts, cached)  # (rows going draft: counts > 0)
            width = max(1, min(int(pending[going].max()), int((capacity - start).min())))
            offsets = np.arange(width)
            step_pos = np.minimum(start[:, None] + offsets, capacity - 1)
            real = going[:, None] & (offsets < pending[:, None])
            step_ids = np.where(real, np.take_along_axis(drafts, np.minimum(fed_drafts[:, None] + offsets, k - 1), 1),
                                self.pad_id)
            t0 = time.perf_counter()
            out = self.engine.forward(step_ids, step_pos)
            calls.append((b, width, time.perf_counter() - t0))
            read = np.where(going, np.minimum(pending, width), 0)
            last = out[np.arange(b), np.clip(read - 1, 0, width - 1)]  # (rows that read all they hold: their last)
            fed_drafts = fed_drafts + read
        drafting = counts > 0
        cached[drafting] = n[drafting] + fed_drafts[drafting]  # the catch-up tokens and the drafts read
        if tree:
            return self._tree(tokens, n, drafts, length, branches, calls)
        k = int(length.max())
        return Proposal(drafts[:, :k], length, None if probs is None else probs[:, :k], calls,
                        forced=None if forced is None else forced[:, :k])

    def _tree(self, tokens, n, chains, lengths, branches, calls):
        # chains [B, k] drafted with siblings -> a tree Proposal of at most tree_nodes nodes per row
        budget = self.tree_nodes or chains.shape[1] * self.tree_width
        trees = [branching_tree(chains[r, : lengths[r]].tolist(), branches[r][0], branches[r][1], budget)
                 if lengths[r] else ([], []) for r in range(n.size)]
        drafts, parents, counts = pack_trees(trees, budget)
        self._chains = (tokens, n.copy(), chains, lengths.copy())
        return Proposal(drafts, counts, None, calls, parents, f"{chains.shape[1]}x{self.tree_width}")

    def _greedy_chain(self, row_tokens, n, k):
        # one greedy row: the same calls as the batch path (catch-up, then k - 1 one-token calls), without its
        # array work, the chain's one-token calls in the engine's own loop (engines.base.greedy_steps)
        c = int(self.cached[0])
        calls = []
        for start in range(c, n, self.max_call):  # one call, unless rings bound the tokens a call may carry
            end = min(n, start + self.max_call)
            t0 = time.perf_counter()
            logits = self.engine.forward(row_tokens[None, start:end], np.arange(start, end)[None])
            calls.append((1, end - start, time.perf_counter() - t0))
        chain = [int(logits[0, -1].argmax())]
        if k > 1:
            steps, seconds = greedy_steps(self.engine, 0, chain[0], n, k - 1, lambda t: chain.append(t) or True)
            calls.extend([(1, 1, seconds / steps)] * steps)
        self.cached[0] = n + k - 1
        return Proposal(np.array([chain], np.int64), np.array([k], np.int64), None, calls)

    def accepted(self, valid):
        # valid [B]: tokens now known to be right in each row; later draft entries are stale
        b = valid.size
        np.minimum(self.cached[:b], valid, out=self.cached[:b])
        if self._chains is not None:  # a tree round: the cache holds the chain, which a sibling may have beaten
            tokens, n, chains, lengths = self._chains
            self._chains = None
            for r in range(b):
                k = int(lengths[r])
                if k:
                    agree = chains[r, :k] == tokens[r, n[r] : n[r] + k]
                    kept = k if agree.all() else int(np.argmin(agree))
                    self.cached[r] = min(self.cached[r], n[r] + kept)

    def move_row(self, src, dst):
        self.engine.move_row(src, dst, int(self.cached[src]))
        self.cached[dst] = self.cached[src]
