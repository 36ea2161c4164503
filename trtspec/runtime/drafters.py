"""Drafters propose up to k next tokens per sequence: a draft engine, prompt lookup, or none.

A drafter sees the batch's token buffer ``tokens [B, cap]`` and each row's
token count ``n [B]`` (prompt + output so far; the last one is not yet in any
cache). ``propose`` returns drafts [B, k], how many of each row are real
proposals, and the draft's processed distributions when it sampled them.
"""

from __future__ import annotations

import numpy as np

from .sampling import SamplingParams, sample


class NoDrafter:
    name = "none"

    def prefill(self, input_ids, position_ids, lengths):
        pass

    def propose(self, tokens, n, k, params, rng):
        b = n.size
        return np.zeros((b, 0), np.int64), np.zeros(b, np.int64), None

    def accepted(self, rows_valid):
        pass

    def move_row(self, src, dst):
        pass


class DraftModelDrafter:
    """Chain drafting with a small model over its own engine and KV cache."""

    name = "draft"

    def __init__(self, engine, pad_id: int):
        self.engine = engine
        self.pad_id = pad_id
        self.cached = np.zeros(engine.max_batch, np.int64)  # tokens of each row in the draft's cache

    def prefill(self, input_ids, position_ids, lengths):
        # input_ids/position_ids [B, P] right-padded, lengths [B]
        self.engine.forward(input_ids, position_ids)
        self.cached[: lengths.size] = lengths

    def propose(self, tokens, n, k, params: SamplingParams, rng):
        # tokens [B, cap] int64, n [B] -> drafts [B, k], counts [B], probs [B, k, V] or None
        b = n.size
        cached = self.cached[:b]
        # Catch up: feed what the draft has not seen (the last token, plus the last draft when all k were
        # accepted), right-padded; pads land beyond each row's length, where the next write overwrites them.
        width = int((n - cached).max())
        offsets = np.arange(width)
        idx = np.minimum(cached[:, None] + offsets, n[:, None] - 1)
        ids = np.where(cached[:, None] + offsets < n[:, None], np.take_along_axis(tokens, idx, axis=1), self.pad_id)
        logits = self.engine.forward(ids, cached[:, None] + offsets)
        last = logits[np.arange(b), n - cached - 1]  # [B, V]
        drafts = np.empty((b, k), np.int64)
        probs = None if params.greedy else np.empty((b, k, last.shape[-1]))
        for j in range(k):
            if params.greedy:
                drafts[:, j] = last.argmax(axis=-1)
            else:
                probs[:, j] = params.probs(last)
                drafts[:, j] = [sample(row, rng) for row in probs[:, j]]
            if j + 1 < k:
                last = self.engine.forward(drafts[:, j : j + 1], (n - 1 + j + 1)[:, None])[:, 0]
        # fed: the catch-up tokens and drafts[:, :k-1]
        cached[:] = n + k - 1
        return drafts, np.full(b, k, np.int64), probs

    def accepted(self, rows_valid):
        # rows_valid [B]: tokens now known to be right in each row; later draft entries are stale
        b = rows_valid.size
        np.minimum(self.cached[:b], rows_valid, out=self.cached[:b])

    def move_row(self, src, dst):
        self.engine.move_row(src, dst)
        self.cached[dst] = self.cached[src]


class PromptLookupDrafter:
    """Propose the continuation of the latest earlier occurrence of the sequence's last n-gram.

    Each row keeps a dict n-gram -> index of the token that followed it, updated
    with the new tokens only, so a round costs O(new tokens), not O(length).
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.rows: list[tuple[dict, list[int]]] = []  # per row: (index, [positions indexed])

    def prefill(self, input_ids, position_ids, lengths):
        self.rows = [({}, [0]) for _ in range(lengths.size)]

    def _index(self, row, seq, upto):
        # add the n-grams ending at positions [done, upto) (each has a known follower)
        index, done = self.rows[row]
        for end in range(done[0], upto):
            for g in range(1, self.max_ngram + 1):
                if end - g + 1 >= 0:
                    index[tuple(seq[end - g + 1 : end + 1].tolist())] = end + 1
        done[0] = max(done[0], upto)

    def propose(self, tokens, n, k, params, rng):
        b = n.size
        drafts = np.zeros((b, k), np.int64)
        counts = np.zeros(b, np.int64)
        for row in range(b):
            length = int(n[row])
            seq = tokens[row]
            self._index(row, seq, length - 1)
            index = self.rows[row][0]
            for g in range(min(self.max_ngram, length), 0, -1):
                start = index.get(tuple(seq[length - g : length].tolist()))
                if start is not None:
                    m = min(k, length - start)
                    drafts[row, :m] = seq[start : start + m]
                    counts[row] = m
                    break
        return drafts, counts, None

    def accepted(self, rows_valid):
        pass

    def move_row(self, src, dst):
        self.rows[dst] = self.rows[src]
