"""The text suffix decoding drafts from (runtime/drafters/suffix_text.py): the shared cache of earlier outputs, its
bounds and separators, and the occurrences a lookup reads."""

from __future__ import annotations

from test_suffix import propose
from trtspec.runtime.drafters.suffix import SuffixDrafter
from trtspec.runtime.drafters.suffix_text import MAX_OCCURRENCES, SuffixCache


def test_the_shared_cache_proposes_an_earlier_output_and_forgets_the_oldest():
    cache = SuffixCache(max_tokens=12)
    cache.add([10, 11, 12, 13, 14, 15])
    drafter = SuffixDrafter(1, cache=cache)
    assert propose(drafter, [[99, 11, 12]], 3).drafts[0].tolist() == [13, 14, 15]
    cache.add([20, 21, 22, 23, 24, 25, 26])  # 13 tokens > 12: the first output goes
    assert cache.tokens == 7
    drafter = SuffixDrafter(1, cache=cache)
    assert propose(drafter, [[99, 11, 12]], 3).counts.tolist() == [0]
    assert propose(drafter, [[99, 11, 12, 21, 22]], 2).drafts[0].tolist() == [23, 24]


def test_a_cached_continuation_ends_where_its_output_ended():
    cache = SuffixCache()
    cache.add([10, 11, 12])
    cache.add([20, 21, 22, 23])
    drafter = SuffixDrafter(1, cache=cache)
    p = propose(drafter, [[5, 11, 12]], 4)  # (10, 11, 12) was a whole output: nothing followed it
    assert p.counts.tolist() == [0]
    p = propose(SuffixDrafter(1, cache=cache), [[5, 10, 11]], 4)
    assert p.drafts[0, : p.counts[0]].tolist() == [12]  # not 12 and then the next output's 20, 21


def test_occurrences_are_the_latest_ones():
    drafter = SuffixDrafter(1, min_score=0.0)
    history = []
    for follower in range(MAX_OCCURRENCES + 4):
        history += [1, 2, 100 + follower]
    p = propose(drafter, [history + [1, 2]], 1)
    # every follower seen once: the latest occurrence wins the tie
    assert p.drafts[0, 0] == 100 + MAX_OCCURRENCES + 3
