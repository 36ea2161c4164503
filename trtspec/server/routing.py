"""Which replica holds a prompt's prefix: the bookkeeping behind prefix-aware routing (no Ray needed here).

Each engine replica keeps the KV of sequences it has served (runtime/scheduler.py's PrefixCache), so a
prompt that starts like an earlier one is cheaper on the replica that served the earlier one. The index
remembers, per block of ``block_tokens`` prompt tokens (a chained hash: a block's key covers everything
before it), which replicas were sent a prompt containing it, and answers: for each candidate replica,
how many leading tokens of this prompt did it see. It learns from routing decisions only (the replicas
are not asked), so it is an estimate: a replica may have evicted a prefix since.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_keys(ids, block_tokens: int) -> list[bytes]:
    """Chained keys of the full ``block_tokens``-token blocks of ``ids`` (key i covers tokens [0, (i+1)*B))."""
    ids = np.asarray(ids, dtype=np.int64)
    keys, h = [], hashlib.blake2b(digest_size=16)
    for start in range(0, ids.size - block_tokens + 1, block_tokens):
        h.update(ids[start:start + block_tokens].tobytes())
        keys.append(h.copy().digest())
    return keys


class PrefixIndex:
    """Block key -> replicas that were sent it, least recently used keys dropped past ``max_keys``."""

    def __init__(self, block_tokens: int = 16, max_keys: int = 1 << 18):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_keys = max_keys
        self._owners: OrderedDict[bytes, set] = OrderedDict()
        self._held: dict = {}  # replica -> blocks it holds

    def __len__(self):
        return len(self._owners)

    def held_blocks(self, replica) -> int:
        """How many distinct prefix blocks ``replica`` holds: its share of the prefixes seen."""
        return self._held.get(replica, 0)

    def matched_tokens(self, ids, replicas) -> dict:
        """For each of ``replicas``: how many leading tokens of ``ids`` it was sent before."""
        matched = {r: 0 for r in replicas}
        alive = set(replicas)
        for i, key in enumerate(block_keys(ids, self.block_tokens)):
            owners = self._owners.get(key)
            alive &= owners if owners else set()
            if not alive:
                break
            for r in alive:
                matched[r] = (i + 1) * self.block_tokens
        return matched

    def record(self, ids, replica):
        """``replica`` was sent ``ids``: it will hold their prefix blocks."""
        for key in block_keys(ids, self.block_tokens):
            owners = self._owners.get(key)
            if owners is None:
                owners = self._owners[key] = set()
            else:
                self._owners.move_to_end(key)
            if replica not in owners:
                owners.add(replica)
                self._held[replica] = self._held.get(replica, 0) + 1
        while len(self._owners) > self.max_keys:
            for r in self._owners.popitem(last=False)[1]:
                self._held[r] -= 1

    def forget(self, replica):
        """``replica`` is gone (died, scaled down): nothing of it is reusable any more."""
        for key in list(self._owners):
            owners = self._owners[key]
            owners.discard(replica)
            if not owners:
                del self._owners[key]
        self._held.pop(replica, None)
