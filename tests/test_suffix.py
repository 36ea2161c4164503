"""Suffix decoding: proposals from the row's own text and earlier outputs, trees best-first, lossless output."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec import Generator, load_engine
from trtspec.runtime.suffix import MAX_OCCURRENCES, SuffixCache, SuffixDrafter

ARCH = "llama-gqa-rope3"
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox jumps over the lazy dog. The quick",
           "import os"]


def propose(drafter, rows, k):
    # rows: token lists, one per row -> the Proposal for caps k
    cap = max(map(len, rows)) + k + 1
    tokens = np.zeros((len(rows), cap), np.int64)
    for r, seq in enumerate(rows):
        tokens[r, : len(seq)] = seq
    return drafter.propose(tokens, np.array([len(s) for s in rows]), np.full(len(rows), k), None, cap)


def test_a_chain_is_what_followed_the_rows_last_tokens_before():
    drafter = SuffixDrafter(2)
    p = propose(drafter, [[1, 2, 3, 4, 5, 9, 1, 2, 3], [7, 8, 6, 5]], 3)
    assert p.parents is None
    assert p.counts.tolist() == [3, 0]  # row 1's suffix never occurred before: nothing, and no cost
    assert p.drafts[0, :3].tolist() == [4, 5, 9]


def test_the_longest_earlier_suffix_decides_and_the_tree_is_best_first():
    drafter = SuffixDrafter(1, tree=True, tree_nodes=4, min_score=0.0)
    # after (5, 1, 2): 3 twice, 4 once; after (1, 2) alone also 8 once: the longer match (5, 1, 2) decides
    history = [5, 1, 2, 3, 6, 0, 5, 1, 2, 4, 7, 0, 5, 1, 2, 3, 6, 0, 1, 2, 8, 0, 5, 1, 2]
    p = propose(drafter, [history], 2)
    m = int(p.counts[0])
    nodes = list(zip(p.drafts[0, :m].tolist(), p.parents[0, :m].tolist()))
    # scores: 3 (2/3), 3>6 (2/3), 4 (1/3), 4>7 (1/3): parents before children, the likeliest first
    assert nodes == [(3, -1), (4, -1), (6, 0), (7, 1)]


def test_min_score_cuts_rare_continuations():
    drafter = SuffixDrafter(1, tree=True, min_score=0.5)
    history = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]  # after (9, 1, 2): 3 (3/4), 4 (1/4)
    p = propose(drafter, [history], 1)
    assert p.drafts[0, : p.counts[0]].tolist() == [3]


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


def test_occurrences_are_the_latest_ones():
    drafter = SuffixDrafter(1, min_score=0.0)
    history = []
    for follower in range(MAX_OCCURRENCES + 4):
        history += [1, 2, 100 + follower]
    p = propose(drafter, [history + [1, 2]], 1)
    # every follower seen once: the latest occurrence wins the tie
    assert p.drafts[0, 0] == 100 + MAX_OCCURRENCES + 3


def test_rows_move_with_their_index_and_a_new_request_starts_empty():
    drafter = SuffixDrafter(2)
    propose(drafter, [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]], 1)
    drafter.move_row(1, 0)
    drafter.admit(1, None, 0)
    p = propose(drafter, [[4, 5, 6, 4, 5], [1, 2, 3, 1, 2]], 1)
    assert p.drafts[:, 0].tolist() == [6, 3]  # row 1 re-read its tokens from the buffer


@pytest.fixture(scope="module")
def plain(exported):
    return load_engine(exported(ARCH))


@pytest.fixture(scope="module")
def tree(exported):
    return load_engine(exported(ARCH, tree=True))


@pytest.fixture(scope="module")
def reference(plain):
    return [r.token_ids for r in Generator(plain).generate(PROMPTS, max_new_tokens=40)]


@pytest.mark.parametrize("form", ["chains", "trees"])
@pytest.mark.parametrize("k_policy", ["fixed", "load-aware"])
def test_greedy_suffix_decoding_equals_target_greedy_alone_listed_and_streamed(form, k_policy, plain, tree,
                                                                               reference):
    engine = plain if form == "chains" else tree
    gen = Generator(engine, drafter="suffix", num_draft_tokens=4, k_policy=k_policy)
    assert [gen.generate(p, max_new_tokens=40).token_ids for p in PROMPTS] == reference
    out = gen.generate(PROMPTS, max_new_tokens=40)  # the second time, earlier outputs are in the shared cache
    assert [r.token_ids for r in out] == reference
    if k_policy == "fixed":
        assert out.stats.accepted > 0 and out.stats.mean_tokens_per_target_call > 1.5
    if form == "trees" and k_policy == "fixed":
        assert sum(gen.scheduler.stats().tree_shapes.values()) > 0
    text = "".join(gen.stream(PROMPTS[0], max_new_tokens=40))
    assert text == gen.tokenizer.decode(reference[0], skip_special_tokens=True)
    gen.close()


def test_tree_nodes_apply_to_suffix_but_tree_width_does_not(tree):
    with pytest.raises(ValueError, match="tree_width applies"):
        Generator(tree, drafter="suffix", tree_width=2)
    gen = Generator(tree, drafter="suffix", tree_nodes=5)
    assert gen.scheduler.drafter.tree_nodes == 5 and gen.scheduler.drafter.tree
    gen.close()


def test_suffix_sampling_follows_the_target_distribution(exported, model_dir):
    from test_speculative import ALPHA, _chi_square_p_value, _exact_joint, _sample_sequences

    from trtspec.runtime import SamplingParams

    target = load_engine(exported(ARCH, tree=True, max_seq_len=16, max_batch=64))
    gen = Generator(target, drafter="suffix", num_draft_tokens=2, k_policy="fixed")
    params = SamplingParams(temperature=1.5, top_k=4)
    joint = _exact_joint(model_dir(ARCH), gen.tokenizer("def")["input_ids"], params, depth=3)
    counts, _ = _sample_sequences(gen, "def", params, 20_480, seed=0)
    assert sum(counts.values()) == 20_480
    assert _chi_square_p_value(counts, joint) > ALPHA
    stats = gen.scheduler.stats()  # earlier outputs were proposed, with both outcomes
    assert stats.proposed > 0 and 0.02 < stats.accepted / stats.proposed < 0.98
