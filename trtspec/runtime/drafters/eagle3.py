"""Drafting with an EAGLE-3 head over the target's own features (trained by distill/heads.py, exported by heads/export.py).

The head's cache holds one entry per target position p that the target has verified: the pair (target features
of p, token p + 1). The scheduler hands over the features of every position the target verifies (``observe``:
prompt chunks, the root and accepted drafts of each round); a round first feeds the pending pairs in one head
call, whose last output predicts the first draft, then one one-token call per further draft, each reading the
head's own previous output instead of target features. Those drafted entries are overwritten next round (the
head's cache only ever counts the verified pairs). Drafts are chains, or with ``tree_width`` > 1 chains with
siblings (drafters/trees.branching_tree), exactly as the draft-model drafter makes them.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ...errors import ArtifactError
from ...manifest import DRAFT_TO_TARGET
from .trees import branching_tree, pack_trees
from .base import Drafter, Proposal


def feature_columns(model: dict, layers, hidden_size: int, what: str) -> np.ndarray:
    """The columns of a target's hidden_states output (manifest ``model`` section) that hold ``layers`` (HF
    hidden_states indices, in that order); refused, saying how to re-export, when the target lacks one."""
    have = (model.get("hidden_states") or {}).get("layers") or []
    missing = [i for i in layers if i not in have]
    if missing:
        spec = ",".join(str(i) for i in sorted(set(have) | set(layers)))
        raise ArtifactError(f"{what} reads the target's hidden states {list(layers)} but the target outputs "
                            f"{have or 'none'}; re-export the target with --hidden-states {spec}")
    return np.concatenate([np.arange(hidden_size) + have.index(i) * hidden_size for i in layers])


def draft_to_target(engine) -> np.ndarray:
    """A head engine's draft id -> target id map [V_draft]."""
    path = Path(engine.path) / DRAFT_TO_TARGET
    if not path.is_file():
        raise ArtifactError(f"{engine.path} has no {DRAFT_TO_TARGET}: not an exported draft head")
    return np.load(path)


class Eagle3Drafter(Drafter):
    name = "eagle3"
    proposes_drafts = True
    needs_draft_model = True  # its head runs on an engine of its own
    reads_features = True
    proposes_trees = True
    branches = True

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes):
        return cls(draft, target, pad_id, tree_width=tree_width, tree_nodes=tree_nodes)

    def __init__(self, head, target, pad_id: int, *, tree_width: int = 1, tree_nodes: int | None = None):
        model = head.manifest["model"]
        if model.get("head") != "eagle3":
            raise ArtifactError(f"{head.path} is not an exported EAGLE-3 head (trtspec export-head)")
        size = model["extra_inputs"]["features"] // len(model["target_layers"])
        # the columns of the target's hidden_states output the head reads (it may output more layers)
        self.columns = feature_columns(target.manifest["model"], model["target_layers"], size, "the EAGLE-3 head")
        self.engine = head
        self.pad_id = pad_id
        self.to_target = draft_to_target(head)
        self.vocab = target.vocab_size
        self.tree_width, self.tree_nodes = tree_width, tree_nodes
        self.max_call = head.max_call_tokens
        rows = head.max_batch
        # None, or what ends each greedy row's chain where another draft no longer pays (auto.ConfidenceStop)
        self.stop = None
        self.fed = np.zeros(rows, np.int64)  # verified pairs in the head's cache: positions [0, fed)
        self.known = np.zeros(rows, np.int64)  # positions whose target features are known: [0, known)
        self.history: list[np.ndarray | None] = [None] * rows  # per row: features [>= known, F], grown by doubling

    def _features(self, row: int, start: int, stop: int) -> np.ndarray:
        return self.history[row][start:stop]

    def _append(self, row: int, start: int, f: np.ndarray) -> None:
        h = self.history[row]
        end = start + len(f)
        if h is None or h.shape[0] < end:
            grown = np.empty((max(end, 2 * (0 if h is None else h.shape[0]), 64), f.shape[-1]), np.float32)
            if h is not None:
                grown[: self.known[row]] = h[: self.known[row]]
            self.history[row] = h = grown
        h[start:end] = f
        self.known[row] = end

    # -- the scheduler's hooks ----------------------------------------------------------------------------------
    def admit(self, row, prefix, n):
        # pairs [0, n - 1) hold (their features, a token of the shared prefix); position n - 1's pair needs the
        # token after the prefix, which may differ: it waits, with its features, for the next round
        self.fed[row] = self.known[row] = 0
        if n:
            pairs = min(prefix.pairs, n - 1)
            if pairs:
                self.engine.load_prefix(prefix.block.head(pairs), row)
            self.fed[row] = pairs
            self._append(row, 0, prefix.features[:n])

    def reusable(self, prefix):
        return prefix.tokens if prefix is not None else 0

    def save_prefix(self, row, n):
        # the verified pairs and the features of every saved position (the head's KV alone cannot restart a row)
        keep = min(int(self.known[row]), n)
        if keep < 1:
            return None
        pairs = min(int(self.fed[row]), keep - 1)
        block = self.engine.save_prefix(row, pairs) if pairs else None
        return _HeadPrefix(block, self._features(row, 0, keep).copy(), pairs)

    def prefill(self, input_ids, position_ids, first_row, fed):
        return 0  # the head reads the target's features of those tokens (observe)

    def observe(self, first_row, starts, features):
        """The target verified positions starts[i], starts[i] + 1, ... of row first_row + i: their features [m_i, F]."""
        for i, (start, f) in enumerate(zip(starts, features)):
            r, start = first_row + i, int(start)
            if start > self.known[r] or not len(f):
                continue  # (a gap: this row drafts no more; nothing is lost but speed)
            self.fed[r] = min(self.fed[r], start)  # a position seen again: its pair is fed again
            self._append(r, start, f[:, self.columns])

    def accepted(self, valid):
        pass

    def move_row(self, src, dst):
        self.engine.move_row(src, dst, int(self.fed[src]))
        self.fed[dst], self.known[dst] = self.fed[src], self.known[src]
        self.history[dst], self.history[src] = self.history[src], self.history[dst]

    # -- drafting ---------------------------------------------------------------------------------------------------
    def _target_logits(self, logits):
        # head logits [B, V_draft] -> [B, V] over target ids (-inf off the draft vocabulary)
        full = np.full((logits.shape[0], self.vocab), -np.inf, np.float32)
        full[:, self.to_target] = logits
        return full

    def propose(self, tokens, n, caps, samplers, capacity):
        b = n.size
        calls = []
        # rows whose every verified position up to n - 2 has its features draft this round
        ready = (self.known[:b] == n - 1) & (caps > 0) & (self.known[:b] > self.fed[:b])
        counts = np.where(ready, caps, 0).astype(np.int64)
        k = int(counts.max()) if b else 0
        if k == 0:
            return Proposal(np.zeros((b, 0), np.int64), np.zeros(b, np.int64))
        fed = self.fed[:b]
        size = self.engine.extra_inputs["features"]
        # one call (or a few: max_call) feeds every ready row's pending pairs (f_p, token p + 1), p = fed ..
        todo = np.where(ready, n - 1 - fed, 0)
        last = np.zeros((b, self.engine.logits_size), np.float32)
        hidden = np.zeros((b, self.engine.features_size), np.float32)
        feats = [self._features(r, int(fed[r]), int(n[r]) - 1) if ready[r] else None for r in range(b)]
        done = np.zeros(b, np.int64)
        while (done < todo).any():
            start = fed + done  # rows with nothing (left) to feed write pads there: past their verified pairs
            width = int(min(self.max_call, (todo - done).max(), (self.engine.max_seq_len - start).min()))
            offsets = np.arange(width)
            real = offsets < (todo - done)[:, None]
            pos = start[:, None] + offsets
            ids = np.where(real, np.take_along_axis(tokens, np.minimum(pos + 1, tokens.shape[1] - 1), axis=1), self.pad_id)
            f = np.zeros((b, width, size), np.float32)
            for r in np.flatnonzero(ready):
                m = int(min(width, todo[r] - done[r]))
                if m > 0:
                    f[r, :m] = feats[r][done[r] : done[r] + m]
            t0 = time.perf_counter()
            logits = self.engine.forward(ids, pos, inputs={"features": f})
            calls.append((b, width, time.perf_counter() - t0))
            step = np.minimum(width, todo - done)
            ends = np.flatnonzero(ready & (done + step == todo) & (step > 0))
            last[ends] = logits[ends, step[ends] - 1]
            hidden[ends] = self.engine.features[ends, step[ends] - 1]
            done += step
        self.fed[:b] = np.where(ready, n - 1, fed)
        tree = self.tree_width > 1
        drafts = np.zeros((b, k), np.int64)
        branches = [([], []) for _ in range(b)]
        plain = [not tree and samplers[r].plain and samplers[r].mode == "greedy" for r in range(b)]
        stop = self.stop if self.stop is not None and all(plain) else None
        confidence = np.ones((b, k), np.float64)  # the head's probability of each row's chain so far
        for j in range(k):
            if stop is not None:  # the chain's probability: its tokens' probabilities under the head, multiplied
                top = last.max(-1, keepdims=True)
                p = 1.0 / np.exp(last - top).sum(-1)
                confidence[:, j] = p * (confidence[:, j - 1] if j else 1.0)
            full = None if all(plain) else self._target_logits(last)
            for r in np.flatnonzero(counts > j):
                if plain[r]:  # the argmax over the head's vocabulary, as a target id
                    drafts[r, j] = self.to_target[int(last[r].argmax())]
                elif tree:
                    drafts[r, j], lp, others = samplers[r].propose_branches(full[r], int(n[r]) + j, self.tree_width)
                    branches[r][0].append(lp)
                    branches[r][1].append(others)
                else:
                    drafts[r, j], _ = samplers[r].propose(full[r], int(n[r]) + j)
                if drafts[r, j] < 0:  # nothing on the head's vocabulary the request allows: the chain ends here
                    counts[r] = j
                    if tree:
                        del branches[r][0][-1], branches[r][1][-1]
            if stop is not None and j + 1 < k:  # rows whose next draft is not worth its call end here
                counts = np.where((counts > j + 1) & ~stop.extend(confidence[:, : j + 1], calls), j + 1, counts)
            if j + 1 < k:
                active = counts > j + 1
                if not active.any():
                    break
                # position n - 1 + j reads (own output at n - 2 + j, draft j); inactive rows write a pad past fed
                pos = np.where(active, n - 1 + j, self.fed[:b])[:, None]
                ids = np.where(active, drafts[:, j], self.pad_id)[:, None]
                t0 = time.perf_counter()
                out = self.engine.forward(ids, pos, inputs={"hidden_in": hidden[:, None]})
                calls.append((b, 1, time.perf_counter() - t0))
                last = out[:, 0].copy()
                hidden = self.engine.features[:, 0].copy()
        if stop is not None:  # each row's drafts cut to the count with the most tokens expected per second
            counts = stop.trim(confidence, counts, calls)
        if not tree:
            return Proposal(drafts, counts, None, calls)
        budget = self.tree_nodes or k * self.tree_width
        trees = [branching_tree(drafts[r, : counts[r]].tolist(), branches[r][0], branches[r][1], budget)
                 if counts[r] else ([], []) for r in range(b)]
        tdrafts, parents, tcounts = pack_trees(trees, budget)
        return Proposal(tdrafts, tcounts, None, calls, parents, f"{k}x{self.tree_width}")


class _HeadPrefix:
    """What an EAGLE-3 head keeps of a row for prefix reuse: its verified pairs' KV and the positions' features."""

    def __init__(self, block, features: np.ndarray, pairs: int):
        self.block, self.features, self.pairs = block, features, pairs
        self.tokens = features.shape[0]
        self.min_head = 0
        self.nbytes = int(features.nbytes) + (block.nbytes if block is not None else 0)
