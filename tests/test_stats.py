"""Statistics learnt after each step from its plan and result (runtime/stats.py): the scheduler's counters, each
request's, and what the load-aware policy records."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from trtspec.runtime.load_aware import LoadAwareK
from trtspec.runtime.plan import DecodeResult, DraftShape, LoneResult, Verdict
from trtspec.runtime.request import RequestStats
from trtspec.runtime.stats import Statistics


def _round(k, verdicts=(), forced_in_chains=False, calls=((1, 1, 1e-3),), tree=False):
    """One round's plan and result: a chain of 5 drafts (or a tree), the given verdicts."""
    plan = DraftShape([None] * max(1, len(verdicts)), np.array([k]), np.array([k]), k, 3 if tree else 1)
    result = DecodeResult(list(verdicts), [], list(calls), 5, 6, tree, "4x3" if tree else None, forced_in_chains,
                          0.0, 2e-3, 3e-3)
    return plan, result


def test_load_aware_k_records_no_round_whose_chain_held_forced_tokens():
    """Forced tokens a chain takes after a proposal come whatever k is: the load-aware policy does not record a
    round whose chains held any (counted as output, a k = 1 chain that reached a forced run looked better than any
    longer one and drafting stayed at k = 1); a round of free text is recorded as it was."""
    policy = LoadAwareK(4, [1, 2, 3, 4])
    statistics = Statistics(policy)
    statistics._learn_round(1, *_round(2, forced_in_chains=True), 6, 6e-3)
    assert policy.rounds == {}
    statistics._learn_round(1, *_round(4), 5, 6e-3)
    assert list(policy.rounds) == [(1, 4, 1, False)] and policy.rounds[(1, 4, 1, False)][:3] == [5, 6e-3, 1]


def test_a_rounds_verdicts_count_forced_tokens_apart_from_the_drafters():
    """Of 5 drafts (2 forced by a grammar, both accepted) 4 were accepted: the drafter proposed 3 and got 2 accepted;
    the request counts 2 forced tokens; the round, its calls and its time go to the counters and the policy."""
    policy = LoadAwareK(4, [1, 2, 3, 4])
    statistics = Statistics(policy)
    row = SimpleNamespace(stats=RequestStats(), sampler=SimpleNamespace(mode="greedy"))
    verdict = Verdict([1, 2, 3, 4, 5], accepted=4, proposed=5, forced=2, forced_accepted=2, source="draft")
    plan, result = _round(4, [verdict])
    plan.forced = {0: [7, 8]}  # a round that verifies forced tokens first: the policy learns nothing of it
    statistics.round([row], plan, result, emitted=5)
    counters = statistics.counters
    assert (counters.rounds, counters.target_calls, counters.draft_calls) == (1, 1, 1)
    assert (counters.proposed, counters.accepted, counters.by_drafter) == (3, 2, {"draft": [3, 2]})
    assert counters.k_histogram == {4: 1} and list(statistics.round_log) == [(0, 4, 1)]
    assert (row.stats.rounds, row.stats.target_calls, row.stats.forced_tokens) == (1, 1, 2)
    assert (row.stats.proposed, row.stats.accepted) == (3, 2)
    assert policy.rounds == {} and policy.target.means == {}  # (forced rounds are the grammar's)
    plan.forced = None
    statistics.round([row], plan, result, emitted=5)
    assert policy.target.means[(1, 6)][0] == 3e-3 and policy.draft.means[(1, 1)][0] == 1e-3
    assert list(policy.rounds) == [(1, 4, 1, False)]
    assert policy.checked[1] == 6 and policy.accepted[1] == 4  # acceptance: 2 of 3 drafts, twice


def test_a_lone_rows_calls_count_as_rounds_of_k_0():
    policy = LoadAwareK(4, [1, 2, 3, 4])
    statistics = Statistics(policy)
    row = SimpleNamespace(stats=RequestStats())
    statistics.alone(row, LoneResult(calls=10, seconds=0.02, started=0.0))
    counters = statistics.counters
    assert (counters.rounds, counters.target_calls, counters.k_histogram) == (10, 10, {0: 10})
    assert (row.stats.rounds, row.stats.target_calls) == (10, 10)
    assert policy.target.means[(1, 1)][0] == 0.002 and (1, 0, 1, False) in policy.rounds
    statistics.alone(row, LoneResult(calls=2, seconds=0.004, started=0.0, sampled=True))  # (a coupled row's)
    assert counters.k_histogram == {0: 12} and (1, 0, 1, True) in policy.rounds
