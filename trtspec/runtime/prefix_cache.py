"""KV slots of sequences already computed, kept for prompts that start the same way (DESIGN.md §7)."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np


class PrefixCache:
    """KV slots of already-processed token sequences, bounded in bytes, least recently used out first.

    Entries hold copies of a row's first n cache slots (target and draft). A new prompt
    reuses the longest common token prefix with any entry. Registered prefixes are pinned.
    """

    def __init__(self, max_bytes: int, min_tokens: int):
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.entries: OrderedDict[int, tuple] = OrderedDict()  # id -> (tokens, target block, draft block, pinned)
        self.nbytes = 0
        self._ids = itertools.count()

    @staticmethod
    def _size(target, draft):
        return target.nbytes + (draft.nbytes if draft is not None else 0)

    def lookup(self, prompt: np.ndarray):
        """(tokens reusable, target block, draft block) of the best entry for ``prompt``, or None."""
        best, best_len = None, 0
        for key, (tokens, target, draft, _) in self.entries.items():
            m = min(tokens.size, prompt.size - 1)  # at least one prompt token is left to compute
            common = int(np.argmin(tokens[:m] == prompt[:m])) if m and not np.array_equal(tokens[:m], prompt[:m]) else m
            if common < max(target.min_head, draft.min_head if draft is not None else 0):
                continue  # a sliding-window ring of the entry no longer holds the window before ``common``
            if common > best_len:
                best, best_len = key, common
        if best is None or best_len < self.min_tokens:
            return None
        self.entries.move_to_end(best)
        _, target, draft, _ = self.entries[best]
        return best_len, target, draft

    def add(self, tokens: np.ndarray, target, draft, pinned: bool = False) -> bool:
        size = self._size(target, draft)
        if tokens.size < self.min_tokens or size > self.max_bytes:
            return False
        for key, (old, t_old, d_old, old_pinned) in list(self.entries.items()):
            if old.size >= tokens.size and np.array_equal(old[: tokens.size], tokens):
                if pinned and not old_pinned:
                    self.entries[key] = (old, t_old, d_old, True)
                self.entries.move_to_end(key)
                return True  # already covered
            if old.size < tokens.size and np.array_equal(tokens[: old.size], old) and not old_pinned:
                del self.entries[key]  # the new entry covers it
                self.nbytes -= self._size(t_old, d_old)
        for key in list(self.entries):
            if self.nbytes + size <= self.max_bytes:
                break
            if not self.entries[key][3]:
                _, t_old, d_old, _ = self.entries.pop(key)
                self.nbytes -= self._size(t_old, d_old)
        if self.nbytes + size > self.max_bytes:
            return False  # what is left is pinned
        self.entries[next(self._ids)] = (tokens.copy(), target, draft, pinned)
        self.nbytes += size
        return True


def reusable_slots(hit, reusable) -> tuple[int, tuple | None]:
    """Of a prefix ``hit`` (common tokens, target block, drafter block), the slots both caches can take back:
    (how many, (target block, drafter block)); (0, None) when none. ``reusable(drafter block)``: how many leading
    tokens of its block the drafter can take back (drafters.Drafter.reusable; a draft model's: any, since it reads
    what its cache lacks when it drafts). The draft then reads the rest of the prompt alongside the target."""
    if hit is None:
        return 0, None
    common, t_block, d_block = hit
    reused = min(common, t_block.tokens, reusable(d_block))
    if reused < max(t_block.min_head, d_block.min_head if d_block is not None else 0):
        return 0, None  # a sliding-window ring no longer holds the window before that point
    return reused, (t_block, d_block)
