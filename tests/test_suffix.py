"""Suffix decoding (runtime/drafters/suffix.py): proposals from the row's own text and earlier outputs, trees
best-first, lossless output. The text and the shared cache it drafts from: test_suffix_text.py."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec import Generator, Scheduler, load_engine
from trtspec.runtime.drafters.suffix import _PROBE_EVERY, SuffixDrafter

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


def test_the_round_shape_pays_for_its_verify_call():
    # three earlier occurrences of (8, 1, 2, 3), all followed by 4 5 6 7: score 3/4 at every depth
    history = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [1, 2, 3]
    cheap = SuffixDrafter(1, costs=lambda b, t, tree: 1.0 + 0.5 * (t - 1))
    # (1 + 0.75 m) / (1 + m / 2) grows with m
    assert propose(cheap, [history], 4).drafts[0].tolist() == [4, 5, 6, 7]
    # the verdicts say depth 1 is accepted, deeper never: depth 2 is proposed until its calibrated gain g no longer
    # pays for its slot ((1.75 + g) / 2 < 1.75 / 1.5), then only the first node
    for _ in range(40):
        propose(cheap, [history], 4)
        cheap.accepted(np.array([len(history) + 1]))
    assert cheap.calibration(1, 8) > 1.0 and 0.75 * cheap.calibration(2, 8) <= 1.75 * 2 / 1.5 - 1.75 + 1e-9
    assert propose(cheap, [history], 4).drafts[0].tolist() == [4]
    # a verify slot costing as much as a decode call: a node scoring below 1 never pays, so nothing is proposed,
    # but one node goes out every _PROBE_EVERY rounds, so the calibration keeps learning
    dear = SuffixDrafter(1, costs=lambda b, t, tree: 1.0 * t)
    counts = [int(propose(dear, [history], 4).counts[0]) for _ in range(2 * _PROBE_EVERY)]
    assert sum(counts) == 2 and max(counts) == 1
    # no costs known yet: every node scoring at least min_score
    assert propose(SuffixDrafter(1, costs=lambda b, t, tree: None), [history], 4).counts.tolist() == [4]


def test_short_and_full_matches_are_calibrated_apart():
    """A 2-token match whose continuation is always rejected lowers the calibration of short matches only: a full
    8-token match's nodes still pay for their slots (a regenerated answer repeats whole, prose matches rarely)."""
    drafter = SuffixDrafter(1, costs=lambda b, t, tree: 1.0 + 0.01 * (t - 1))  # slots nearly free: all proposed
    short = [9, 1, 2, 50, 51, 52, 53, 7, 1, 2]  # (1, 2) matched after 9 once before: a 2-token match
    for _ in range(40):
        assert propose(drafter, [short], 4).counts.tolist() == [4]
        drafter.accepted(np.array([len(short)]))  # nothing accepted
    assert drafter.calibration(1, 2) < 0.25 and drafter.calibration(1, 8) == 1.0
    drafter.costs = lambda b, t, tree: 1.0 + 0.4 * (t - 1)  # noqa: E731  (a slot now costs 0.4 of a call)
    # three earlier occurrences of the last 8 tokens, all followed by 4 5 6 7: score 3/4, calibration 1: pays
    full = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [1, 2, 3]
    drafter.admit(0, None, 0)  # a new request in the row
    p = propose(drafter, [full], 4)
    assert p.drafts[0, : p.counts[0]].tolist()[:1] == [4]
    # the short match's own nodes, calibrated down, no longer pay
    drafter.admit(0, None, 0)
    assert propose(drafter, [short], 4).counts.tolist() == [0]


def test_a_one_token_match_proposes_only_under_call_costs_and_is_calibrated_apart():
    """No 2-token suffix occurred before, but the last token did: what followed its latest occurrence, where the
    call costs are known (the round's shape weighs it), calibrated apart from longer matches; not with costs
    unknown, nor under a draft model (which drafts such rows)."""
    history = [7, 40, 41, 42, 9, 7, 50, 51, 8, 7]  # (9, 7) and (8, 7) never before; 7 last followed by 50
    nearly_free = lambda b, t, tree: 1.0 + 0.01 * (t - 1)  # noqa: E731
    drafter = SuffixDrafter(1, costs=lambda b, t, tree: 1.0 + 0.2 * (t - 1))  # a lone occurrence's 1/2 pays
    p = propose(drafter, [history], 3)
    assert p.drafts[0, : p.counts[0]].tolist() == [50, 51, 8]
    assert propose(SuffixDrafter(1), [history], 3).counts.tolist() == [0]
    assert propose(SuffixDrafter(1, costs=nearly_free, one_token_matches=False), [history], 3).counts.tolist() == [0]
    assert propose(SuffixDrafter(1, costs=nearly_free), [[1, 2, 3]], 3).counts.tolist() == [0]  # 3 never before
    for _ in range(40):  # never accepted: 1-token matches stop paying for their slots, 2-token matches untouched
        propose(drafter, [history], 3)
        drafter.accepted(np.array([len(history)]))
    assert drafter.calibration(1, 1) <= 0.4 and drafter.calibration(1, 2) == 1.0  # (0.4: slots stop paying)
    drafter.admit(0, None, 0)
    assert propose(drafter, [history], 3).counts.tolist() == [0]
    drafter.admit(0, None, 0)
    assert propose(drafter, [[5, 1, 2, 60, 61, 5, 1, 2]], 2).drafts[0].tolist() == [60, 61]


def test_a_round_deeper_than_any_before_is_proposed_and_calibrated():
    """k is the engine's to allow (up to a call's width): the per-depth calibration grows to any depth."""
    history = list(range(1, 41)) * 3 + [1, 2, 3]
    drafter = SuffixDrafter(1, costs=lambda b, t, tree: 1.0 + 0.01 * (t - 1))
    p = propose(drafter, [history], 30)
    assert p.drafts[0, : p.counts[0]].tolist() == list(range(4, 34))
    drafter.accepted(np.array([len(history) + 30]))
    assert drafter.calibration(30, 8) > 1.0 and drafter.calibration(31, 8) == 1.0


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
    from test_verify import ALPHA, _chi_square_p_value, _exact_joint, _sample_sequences

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


@pytest.fixture(scope="module")
def draft(perturbed_export):
    return load_engine(perturbed_export(ARCH, 0.3))


@pytest.mark.parametrize("form", ["chains", "trees"])
def test_suffix_over_a_draft_model_equals_target_greedy_and_both_propose(form, plain, tree, draft, reference):
    engine = plain if form == "chains" else tree
    gen = Generator(engine, draft, drafter="suffix", num_draft_tokens=4, k_policy="fixed")
    assert [gen.generate(p, max_new_tokens=40).token_ids for p in PROMPTS] == reference  # alone
    assert [r.token_ids for r in gen.generate(PROMPTS, max_new_tokens=40)] == reference  # listed
    text = "".join(gen.stream(PROMPTS[1], max_new_tokens=40))
    assert text == gen.tokenizer.decode(reference[1], skip_special_tokens=True)
    by = gen.scheduler.stats().by_drafter
    # rows without a match drafted with the model, the others from their matches; each accepted some
    assert set(by) == {"suffix", "draft"} and all(accepted > 0 for _, accepted in by.values())
    gen.close()
    gen = Generator(engine, draft, drafter="suffix", num_draft_tokens=4)  # load-aware: shapes from measured costs
    assert [r.token_ids for r in gen.generate(PROMPTS, max_new_tokens=40)] == reference
    gen.close()


def test_suffix_takes_a_draft_model_not_a_head(plain, exported):
    with pytest.raises(ValueError, match="drop one of them"):
        Generator(plain, exported(ARCH), drafter="prompt_lookup")


def test_suffix_over_a_draft_model_samples_the_target_distribution(exported, perturbed_export, model_dir):
    """Rejection sampling with two kinds of rows in one verify: the model's drafts with their q, the suffix's
    certain drafts (q one-hot)."""
    from test_verify import ALPHA, _chi_square_p_value, _exact_joint, _sample_sequences

    from trtspec.runtime import SamplingParams

    options = {"max_seq_len": 16, "max_batch": 64}
    target = load_engine(exported(ARCH, **options))
    draft = load_engine(perturbed_export(ARCH, 0.5, **options))
    gen = Generator(target, draft, drafter="suffix", num_draft_tokens=2, k_policy="fixed", sampling="rejection")
    params = SamplingParams(temperature=1.5, top_k=4)
    joint = _exact_joint(model_dir(ARCH), gen.tokenizer("def")["input_ids"], params, depth=3)
    counts, _ = _sample_sequences(gen, "def", params, 20_480, seed=0)
    assert sum(counts.values()) == 20_480
    assert _chi_square_p_value(counts, joint) > ALPHA
    by = gen.scheduler.stats().by_drafter  # both kinds of rows verified, with both outcomes
    assert set(by) == {"suffix", "draft"}
    assert all(0.02 < accepted / proposed < 0.98 for proposed, accepted in by.values())
    gen.close()


class _Grammar:
    """A row's logits processor whose grammar forbids one token (the Drafter protocol reads samplers[r].processor)."""

    constraint = True

    def __init__(self, forbidden):
        self.forbidden = forbidden

    def allowed_prefix(self, tokens):
        return next((i for i, t in enumerate(tokens) if t == self.forbidden), len(tokens))


class _Sampler:
    def __init__(self, processor):
        self.processor = processor


@pytest.mark.parametrize("tree", [False, True])
def test_under_a_grammar_only_allowed_tokens_are_proposed(tree):
    """Each continuation is cut at the first token the row's grammar forbids, before the trie is built: the
    allowed prefix of a forbidden continuation still counts, nothing after it is proposed. (Greedy output under a
    grammar equals the target's own with every drafter: test_logits.)"""
    # after (7, 1, 2): 3 4 9 twice and 3 5 6 once; a grammar forbidding 4 leaves 3 (three times) and 3 5 6 (once)
    history = [6, 7, 1, 2, 3, 4, 9, 5, 7, 1, 2, 3, 5, 6, 4, 7, 1, 2, 3, 4, 9, 8, 7, 1, 2]
    free = propose(SuffixDrafter(1, tree=tree, min_score=0.0), [history], 3)
    assert 4 in free.drafts[0, : free.counts[0]].tolist()
    drafter = SuffixDrafter(1, tree=tree, min_score=0.0)
    cap = len(history) + 4
    tokens = np.zeros((1, cap), np.int64)
    tokens[0, : len(history)] = history
    p = drafter.propose(tokens, np.array([len(history)]), np.array([3]), [_Sampler(_Grammar(4))], cap)
    m = int(p.counts[0])
    assert 4 not in p.drafts[0, :m].tolist()
    assert p.drafts[0, :m].tolist() == [3, 5, 6]  # a chain and a tree alike: 3 (1), then 5 (1/3), 6 (1/3)
    if tree:
        assert p.parents[0, :m].tolist() == [-1, 0, 1]


def test_serve_keeps_the_suffix_cache_and_shows_acceptance_per_drafter(plain, draft):
    import httpx
    from conftest import Server

    from trtspec.server import create_app

    scheduler = Scheduler(plain, draft, drafter="suffix", k_policy="fixed")
    with Server(create_app(scheduler, model_name="tiny")) as s:
        client = s.client()
        first = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40, temperature=0)
        cached = scheduler.drafter.cache.tokens
        second = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40, temperature=0)
        assert first.choices[0].text == second.choices[0].text
        assert cached > 0 and scheduler.drafter.cache.tokens > cached  # kept across requests
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
    by = scheduler.stats().by_drafter
    for name, (proposed, accepted) in by.items():
        assert f'trtspec_draft_tokens_proposed_by_drafter_total{{drafter="{name}"}} {float(proposed)}' in metrics
        assert f'trtspec_draft_tokens_accepted_by_drafter_total{{drafter="{name}"}} {float(accepted)}' in metrics
    assert by["suffix"][1] > 0  # the second request's answer came from the first's, drafted by the suffix cache
