"""The load-aware policy (runtime/load_aware.py): each round's k and tree width from the measured costs and the rows'
own acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.runtime.load_aware import LoadAwareK, ShapeTimes


def test_load_aware_k_drafts_when_it_pays_and_stops_when_the_batch_is_full():
    policy = LoadAwareK(8, list(range(1, 9)))
    for _ in range(50):
        policy.record_acceptance(4, 3)  # alpha = 0.75
    # engine calls cost 1 ms + 0.5 ms per token they carry: verify calls grow with B * (k + 1)
    for b in (1, 8):
        for t in (1, 2, 3, 5, 9):
            policy.target.record(b, t, 1e-3 + 0.5e-3 * b * t)
        policy.draft.record(b, 1, 0.1e-3 + 0.05e-3 * b)
    caps1, caps8 = np.full(1, 8), np.full(8, 8)
    # before any round is measured, the estimate decides
    k1 = policy.choose(1, caps1)
    assert k1 >= 2
    assert policy.tokens_per_second(1, k1, caps1) > policy.tokens_per_second(1, 0, caps1)
    assert policy.choose(8, caps8) == 0
    # measured rounds override the estimate: here a round with drafts at batch 1 turns out to take so long (host work
    # the calls do not show) that drafting is slower than plain decoding, even at this acceptance
    for _ in range(5):
        policy.record_round(1, 0, 1, 4e-3)
        for k in range(1, 9):
            policy.record_round(1, k, 2, 20e-3)
    assert policy.choose(1, caps1) == 0
    # a neighbour of the best k is tried again after 16 rounds, so a change is noticed; while the best stays the
    # gap doubles (32, 64, ...: a try costs a catch-up of the draft)
    chosen = [policy.choose(8, caps8) for _ in range(16 + 32 + 64)]
    tries = [i for i, k in enumerate(chosen) if k]
    assert len(tries) == 3 and tries[0] < 16 and np.diff(tries).tolist() == [32, 64] and set(chosen) == {0, 1}
    # a row that may draft only 2 caps the round's k for that row
    assert policy.choose(1, np.array([2])) <= 2


def test_load_aware_k_weighs_each_rows_own_acceptance():
    # rounds measured on rows that accept a fifth of their drafts: drafting loses to plain decoding for such rows,
    # and the same measurements, scaled to a row that accepts 90 %, say it pays for that row
    policy = LoadAwareK(4, [1, 2, 3, 4])
    caps, low, high = np.array([4]), [(20, 100)], [(90, 100)]
    for _ in range(5):
        for k in range(5):
            expected = policy.expected_tokens(k, caps, alphas=policy.row_alphas(low))
            policy.record_round(1, k, expected, 2.1e-3 + 0.6e-3 * k, expected=expected)
    assert policy.choose_shape(1, caps, low)[0] == 0
    assert policy.choose_shape(1, caps, high)[0] == 4
    assert policy.last_expected == pytest.approx(policy.expected_tokens(4, caps, alphas=policy.row_alphas(high)))
    # a row with nothing checked yet starts from the policy's alpha


def test_load_aware_k_measures_sampled_rounds_apart_and_gives_sampled_rows_their_own_prior():
    # the same acceptance, but sampled rounds cost more per drafted position (noise, the rejection rule): drafting
    # pays for greedy rows and not for sampled ones, which a table shared by both would not see
    policy = LoadAwareK(4, [1, 2, 3, 4])
    caps, rows = np.array([4]), [(30, 40)]
    for _ in range(5):
        for k in range(5):
            expected = policy.expected_tokens(k, caps, alphas=policy.row_alphas(rows))
            policy.record_round(1, k, expected, 2.0e-3 + 0.3e-3 * k, expected=expected)
            policy.record_round(1, k, expected, 2.0e-3 + 2.5e-3 * k, expected=expected, sampled=True)
    greedy_k = policy.choose_shape(1, caps, rows)[0]
    assert greedy_k >= 2
    assert policy.choose_shape(1, caps, rows, sampled=True)[0] == 0
    assert policy.choose(1, caps, rows, sampled=False) == greedy_k  # the sampled rounds left the greedy table alone
    # a sampled row that has checked nothing yet starts from sampled rows' acceptance, a greedy one from greedy rows'
    for _ in range(40):
        policy.record_acceptance(4, 4)  # greedy rows: every draft accepted
        policy.record_acceptance(4, 1, sampled=True)  # sampled rows: 1 of 2 checked
    greedy, sampled, either = policy.row_alphas([(0, 0, False), (0, 0, True), (0, 0)])
    assert sampled == pytest.approx(policy.alpha_of(1, sampled=True)) and sampled < 0.55
    assert greedy == pytest.approx(policy.alpha_of(1, sampled=False)) and greedy > 0.95
    assert either == pytest.approx(policy.alpha) and sampled < either < greedy
    assert policy.row_alphas([(0, 0)]) == [pytest.approx(policy.alpha)]


def test_the_load_aware_policy_picks_trees_only_where_the_wider_call_pays():
    def policy_with(slope_ms):
        policy = LoadAwareK(6, list(range(1, 30)), widths=(1, 3))
        for _ in range(40):
            policy.record_acceptance(4, 2)  # chains: alpha 0.6
            policy.record_acceptance(4, 3, width=3)  # trees of width 3: 0.75 per depth
        for t in range(1, 20):  # a call costs 2 ms + slope per token it carries
            policy.target.record(1, t, 2e-3 + slope_ms * 1e-3 * t)
        policy.draft.record(1, 1, 0.2e-3)
        return policy

    caps = np.array([6])
    k, width = policy_with(0.02).choose_shape(1, caps)  # verify nearly free (a GPU): the tree
    assert width == 3 and k >= 2
    k, width = policy_with(0.6).choose_shape(1, caps)  # each token costs a third of a decode (this CPU): chains
    assert width == 1
    # measured rounds decide once there are enough: trees that emit more but take longer lose
    policy = policy_with(0.02)
    for _ in range(5):
        for k in range(1, 7):
            policy.record_round(1, k, 3, 10e-3, width=3)
            policy.record_round(1, k, 2.5, 5e-3)
        policy.record_round(1, 0, 1, 3e-3)
    assert policy.choose_shape(1, caps)[1] == 1


def test_a_plain_stretch_lasts_until_the_policys_next_try_of_a_neighbour():
    policy = LoadAwareK(4, [1, 2, 3, 4])
    for k in (1, 2, 3, 4):  # drafts never pay: k = 0 is the best
        policy.target.record(1, k + 1, 0.010 * (1 + k))
        for _ in range(4):
            policy.record_round(1, k, 1, 0.010 * (1 + k) + 0.002 * k)
    policy.target.record(1, 1, 0.010)
    for _ in range(4):
        policy.record_round(1, 0, 1, 0.010)
    caps = np.array([4])
    assert policy.choose(1, caps) == 0
    stretch = policy.plain_stretch(1)
    assert stretch == 16 - 1  # the gap between tries, less the look that chose k = 0
    assert policy.choose(1, caps) == 1  # the look after the stretch tries a neighbour
    assert policy.choose(1, caps) == 0 and policy.plain_stretch(1) == 32 - 1  # the gap doubled: the best held


def test_a_neighbour_is_timed_against_the_best_in_the_same_seconds_so_a_drifting_machine_picks_the_best_k():
    # alpha 0.8; a round costs 6 ms + 1.05 ms a draft (+ 0.6 ms at k = 4): k = 3 is the best, 3.6 % above k = 4. The
    # machine runs 40 % slower in every other stretch of 50 rounds (as these shared machines drift). Judged on the
    # means of each k's own rounds, measured at different times, the policy ran 47 % of its rounds at k = 3; timed
    # against each other in consecutive rounds, it settles on k = 3.
    policy = LoadAwareK(4, [1, 2, 3, 4])
    for _ in range(50):
        policy.record_acceptance(5, 4)
    caps = np.array([4])
    chosen = []
    for t in range(1200):
        speed = 1.4 if (t // 50) % 2 else 1.0
        k = policy.choose(1, caps)
        chosen.append(k)
        seconds = 1e-3 * (6 + 1.05 * k + (0.6 if k == 4 else 0)) * speed
        policy.record_round(1, k, policy.last_expected, seconds)
    assert np.mean(np.array(chosen[200:]) == 3) > 0.9
    assert policy.choose(1, caps) == 3


def test_shape_times_come_from_consecutive_rounds_of_two_shapes_whatever_the_machines_speed():
    times = ShapeTimes()
    # k = 2 rounds take 8 ms and k = 4 rounds 10 ms on a fast machine; k = 0 rounds 5 ms. The machine runs at speed
    # 1, 2, then 1.5: each pair is measured within one speed, never across
    for speed, shapes in ((1.0, [(2, 1), (4, 1), (2, 1)]), (2.0, [(4, 1), (0, 1), (4, 1)]), (1.5, [(0, 1), (2, 1)])):
        times.last = None  # (a new speed: the test keeps pairs within one)
        for shape in shapes:
            times.record(shape, {0: 5e-3, 2: 8e-3, 4: 10e-3}[shape[0]] * speed)
        if speed == 1.0:
            assert times.now((2, 1)) is None  # timed against another shape twice: not trusted yet
    logs = times.logs()
    assert logs[(4, 1)] - logs[(2, 1)] == pytest.approx(np.log(10 / 8))
    assert logs[(0, 1)] - logs[(2, 1)] == pytest.approx(np.log(5 / 8))
    for _ in range(20):  # the machine at speed 1.5 now: a shape's time now is its time at that speed
        times.record((2, 1), 8e-3 * 1.5)
    assert times.now((2, 1)) == pytest.approx(8e-3 * 1.5, rel=1e-3)
    assert times.now((4, 1)) == pytest.approx(10e-3 * 1.5, rel=1e-3)
    assert times.now((6, 1)) is None  # never timed
