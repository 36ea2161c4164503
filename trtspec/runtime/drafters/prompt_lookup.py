"""Prompt lookup: the continuation of the latest earlier occurrence of the row's last n-gram (no model)."""

from __future__ import annotations

import numpy as np

from .base import Drafter, Proposal


class PromptLookupDrafter(Drafter):
    """Propose the continuation of the latest earlier occurrence of the sequence's last n-gram.

    Each row keeps a dict n-gram -> index of the token that followed it, updated
    with the new tokens only, so a round costs O(new tokens), not O(length).
    """

    name = "prompt_lookup"
    proposes_drafts = True
    drafts_after_forced = True  # the lookup reads the forced tokens like any others

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes):
        return cls(max_batch)

    def __init__(self, max_batch: int, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.rows: list[tuple[dict, list[int]]] = [({}, [0]) for _ in range(max_batch)]  # (index, [indexed upto])

    def admit(self, row, prefix, n):
        self.rows[row] = ({}, [0])

    def _index(self, row, seq, upto):
        # add the n-grams ending at positions [done, upto) (each has a known follower)
        index, done = self.rows[row]
        for end in range(done[0], upto):
            for g in range(1, self.max_ngram + 1):
                if end - g + 1 >= 0:
                    index[tuple(seq[end - g + 1 : end + 1].tolist())] = end + 1
        done[0] = max(done[0], upto)

    def propose(self, tokens, n, caps, samplers, capacity):
        b = n.size
        k = int(caps.max()) if b else 0
        drafts = np.zeros((b, k), np.int64)
        counts = np.zeros(b, np.int64)
        for row in np.flatnonzero(caps > 0):
            length = int(n[row])
            seq = tokens[row]
            self._index(row, seq, length - 1)
            index = self.rows[row][0]
            for g in range(min(self.max_ngram, length), 0, -1):
                start = index.get(tuple(seq[length - g : length].tolist()))
                if start is not None:
                    m = min(int(caps[row]), length - start)
                    drafts[row, :m] = seq[start : start + m]
                    counts[row] = m
                    break
        return Proposal(drafts, counts)

    def move_row(self, src, dst):
        self.rows[dst] = self.rows[src]
