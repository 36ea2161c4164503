"""The prefix cache (runtime/prefix_cache.py): KV slots of computed sequences, reused by prompts that start the
same way; bounded in bytes, least recently used out first, registered prefixes pinned."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from trtspec.runtime.prefix_cache import PrefixCache, reusable_slots


def _block(tokens, nbytes=100, min_head=0):
    return SimpleNamespace(tokens=tokens, nbytes=nbytes, min_head=min_head)


def test_a_prompt_reuses_its_longest_common_prefix_but_computes_its_last_token():
    cache = PrefixCache(10_000, min_tokens=4)
    seq = np.arange(20)
    assert cache.add(seq, _block(20), None)
    common, target, draft = cache.lookup(np.arange(12))
    assert common == 11 and target.tokens == 20 and draft is None  # at least one prompt token is left to compute
    assert cache.lookup(np.array([*range(6), 99, 98]))[0] == 6
    assert cache.lookup(np.array([*range(3), 99, 98])) is None  # fewer than min_tokens in common


def test_the_cache_is_bounded_evicts_least_recently_used_and_keeps_pinned_entries():
    cache = PrefixCache(300, min_tokens=2)
    a, b, c, d = (np.array([i, *range(10, 19)]) for i in range(4))
    cache.add(a, _block(10), None, pinned=True)
    cache.add(b, _block(10), None)
    cache.add(c, _block(10), None)
    assert cache.lookup(np.array([2, 10, 11, 12]))[0] == 3  # c used: b is now the least recently used
    cache.add(d, _block(10), None)
    kept = [int(tokens[0]) for tokens, *_ in cache.entries.values()]
    assert sorted(kept) == [0, 2, 3] and cache.nbytes <= cache.max_bytes


def test_only_slots_both_caches_hold_are_reused():
    hit = (30, _block(25), _block(12))
    assert reusable_slots(hit, lambda d: d.tokens) == (12, (hit[1], hit[2]))  # a draft model's cache holds 12
    assert reusable_slots(hit, lambda d: 1 << 62)[0] == 25  # a drafter without a cache: the target's 25
    ring = (30, _block(25, min_head=28), None)  # a sliding-window ring no longer holds the window before 25
    assert reusable_slots(ring, lambda d: 1 << 62) == (0, None)
    assert reusable_slots(None, lambda d: 0) == (0, None)
