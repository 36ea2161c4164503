"""Continuous batching (runtime/scheduler.py): requests join and leave a running batch, and each gets exactly its
output alone."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from conftest import WrappedEngine, make_prompt
from trtspec import Generator, Scheduler
from trtspec.engines.base import greedy_steps, lease


def _workload():
    """16 requests: mixed prompt lengths and max_new_tokens 8..200, greedy and seeded sampling, stop strings."""
    requests = []
    for i in range(16):
        params = {"max_new_tokens": [8, 40, 200, 17, 64, 120, 9, 33][i % 8]}
        if i % 3 == 1:
            params.update(temperature=0.9, top_p=0.9, seed=100 + i)
        if i % 5 == 2:
            params["stop"] = ["main", "::", "r="]
        requests.append((make_prompt(i, [2, 8, 20, 4][i % 4]), params))
    return requests


def test_16_concurrent_requests_through_4_rows_each_equal_the_request_alone(target, draft, alone):
    scheduler = Scheduler(target, draft, num_draft_tokens=4)  # load-aware k
    requests = _workload()
    barrier = threading.Barrier(len(requests))
    results = [None] * len(requests)

    def client(i):
        prompt, params = requests[i]
        barrier.wait()
        results[i] = scheduler.submit(prompt, **params).result(timeout=300)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (prompt, params), got in zip(requests, results):
        want = alone(prompt, **params)
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
    assert any(r.stats.proposed for r in results)  # the draft was used
    assert any(r.finish_reason == "stop" for (_, p), r in zip(requests, results) if "stop" in p)
    stats = scheduler.stats()
    assert stats.requests_finished == 16 and stats.running == 0 and stats.waiting == 0
    assert max(b for _, _, b in scheduler.round_log) == 4


def test_seeded_sampling_equals_target_only_sampling_whatever_the_drafter(target, draft, alone):
    # coupled sampling: the draft changes the speed, never the sample a seed gives
    params = {"max_new_tokens": 48, "temperature": 1.0, "top_k": 20, "seed": 5}
    prompt = make_prompt(3, 12)
    want = alone(prompt, **params).token_ids
    for gen in (Generator(target, draft, num_draft_tokens=3, k_policy="fixed"), Generator(target, drafter="prompt_lookup", k_policy="fixed"),
                Generator(target, drafter="suffix", k_policy="fixed"),
                Generator(target, draft, num_draft_tokens=6, k_policy="load-aware")):
        assert gen.generate(prompt, **params).token_ids == want
    other = Generator(target).generate(prompt, **{**params, "seed": 6}).token_ids
    assert other != want


def test_a_request_submitted_mid_generation_starts_before_the_others_finish(target, draft, alone):
    scheduler = Scheduler(target, draft, num_draft_tokens=3)
    long_handle = scheduler.submit(make_prompt(1, 5), max_new_tokens=200)
    stream = iter(long_handle)
    next(stream)  # the long request is running
    short = scheduler.submit(make_prompt(2, 7), max_new_tokens=10)
    result = short.result(timeout=60)
    assert not long_handle.done  # still running when the late request finished
    assert result.token_ids == alone(make_prompt(2, 7), max_new_tokens=10).token_ids
    rest = long_handle.result(timeout=120)
    assert rest.token_ids == alone(make_prompt(1, 5), max_new_tokens=200).token_ids


def test_a_lone_greedy_row_decodes_in_the_engines_loop_and_yields_to_arrivals_and_cancel(target, alone):
    # no drafter and one greedy row: the scheduler hands the engine a run of one-token calls (greedy_steps)
    scheduler = Scheduler(target)
    solo = scheduler.submit(make_prompt(6, 5), max_new_tokens=60).result(timeout=60)
    assert solo.stats.target_calls == len(solo.token_ids) == 60  # one prefill call, then one call per token
    assert scheduler.stats().k_histogram == {0: 59}
    _yields_to_an_arrival_and_a_cancel(scheduler, Scheduler(WrappedEngine(target, slow_call)), alone)


def test_a_lone_sampled_row_decodes_in_the_engines_loop_with_its_own_picks(target, monkeypatch):
    # one coupled row (temperature, top-p; no logits processing) and no drafter: the engine's loop picks each token
    # with the row's sampler, the same tokens and counters as a step a token (lone_row_loops off)
    from trtspec.runtime import worker

    loops_run = []
    monkeypatch.setattr(worker, "greedy_steps", lambda *a: loops_run.append(a[-1]) or greedy_steps(*a))
    prompt = make_prompt(5, 8)
    for params in ({"temperature": 0.9, "seed": 3}, {"temperature": 1.2, "top_p": 0.8, "seed": 4}):
        results, stats = [], []
        for loops in (True, False):
            gen = Generator(target)
            gen.scheduler.lone_row_loops = loops
            results.append(gen.generate(prompt, max_new_tokens=50, **params))
            stats.append(gen.scheduler.stats())
        assert results[0].token_ids == results[1].token_ids and results[0].finish_reason == results[1].finish_reason
        for name in ("rounds", "target_calls", "k_histogram"):
            assert getattr(stats[0], name) == getattr(stats[1], name), name
        assert results[0].token_ids != Generator(target).generate(prompt, max_new_tokens=50).token_ids  # (sampled)
    assert [pick is not None for pick in loops_run] == [True, False] * 2  # (each greedy run: the argmax)
    gen = Generator(target)
    gen.scheduler._host_logits = False  # (an engine's logits on a GPU: the batch path picks there, only ids cross)
    loops_run.clear()
    assert gen.generate(prompt, max_new_tokens=50, **params).token_ids == results[0].token_ids and not loops_run


def slow_call(ids, pos, row):
    time.sleep(0.002)  # a request so slowed cannot finish before a cancel


def _yields_to_an_arrival_and_a_cancel(scheduler, slow, alone):
    """A lone row's loop stops for a newcomer, which finishes beside it; on ``slow`` (a slowed target) a cancel
    ends the loop within a call. Every output is the request's own alone."""
    long_handle = scheduler.submit(make_prompt(1, 5), max_new_tokens=200)
    next(iter(long_handle))
    short = scheduler.submit(make_prompt(2, 7), max_new_tokens=10).result(timeout=60)
    assert not long_handle.done
    assert short.token_ids == alone(make_prompt(2, 7), max_new_tokens=10).token_ids
    assert long_handle.result(timeout=120).token_ids == alone(make_prompt(1, 5), max_new_tokens=200).token_ids
    assert max(b for _, _, b in scheduler.round_log) == 2
    handle = slow.submit(make_prompt(4, 10), max_new_tokens=200)
    next(iter(handle))
    handle.cancel()
    cancelled = handle.result(timeout=60)
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < 200
    assert cancelled.token_ids == alone(make_prompt(4, 10), max_new_tokens=200).token_ids[: len(cancelled.token_ids)]


def test_a_lone_greedy_row_with_a_draft_runs_its_rounds_in_a_loop_of_its_own(target, draft, alone):
    # one greedy row, a draft, k fixed: the round repeats in the lone row's loop (_decode_round); the batch path
    # (lone_row_loops off) makes the same calls, so tokens, acceptance and every counter are equal, also where
    # the rounds shrink k near max_new_tokens and near the cache's capacity (a long prompt, finish "length")
    accepted = proposed = 0
    for prompt, params in ((make_prompt(8, 6), {"max_new_tokens": 80}), (make_prompt(3, 20), {"max_new_tokens": 45}),
                           (make_prompt(9, 45), {"max_new_tokens": 400})):
        results, stats = [], []
        for loops in (True, False):
            gen = Generator(target, draft, num_draft_tokens=4, k_policy="fixed")
            gen.scheduler.lone_row_loops = loops
            results.append(gen.generate([prompt], **params))
            stats.append(gen.scheduler.stats())
        fast, slow = results
        assert fast[0].token_ids == slow[0].token_ids == alone(prompt, **params).token_ids
        assert fast[0].finish_reason == slow[0].finish_reason
        for name in ("proposed", "accepted", "rounds", "target_calls", "draft_calls", "k_histogram"):
            assert getattr(stats[0], name) == getattr(stats[1], name), name
        assert fast[0].stats.accepted_histogram == slow[0].stats.accepted_histogram
        accepted, proposed = accepted + stats[0].accepted, proposed + stats[0].proposed
    assert 0 < accepted < proposed  # drafts both accepted and rejected
    assert fast[0].finish_reason == "length" and len(alone(prompt, **params).token_ids) < 400  # capacity reached
    # the loop stops for a newcomer (both then share rounds) and for a cancel
    _yields_to_an_arrival_and_a_cancel(Scheduler(target, draft, num_draft_tokens=3, k_policy="fixed"),
                                       Scheduler(WrappedEngine(target, slow_call), draft, k_policy="fixed"), alone)


def test_the_lone_row_loop_feeds_the_load_aware_policy_what_the_batch_path_does(target, draft, alone):
    # k chosen by a scripted policy (0 included: plain rounds, after which the draft catches up wider); the loop
    # and the batch path make the same choices from the same inputs and report the same rounds and call shapes
    prompt, logs = make_prompt(5, 9), []
    for loops in (True, False):
        gen = Generator(target, draft, num_draft_tokens=4, k_policy="load-aware")
        gen.scheduler.lone_row_loops = loops
        policy, log, script = gen.scheduler.policy, [], itertools.cycle([0, 3, 1, 4, 0, 0, 2])
        policy.choose_shape = lambda b, caps, seen=None, sampled=False: (min(next(script), int(caps.max())), 1)
        policy.plain_stretch = lambda b, sampled=False: 1  # each k = 0 one plain round (stretches: the test below)
        for name in ("record_round", "record_acceptance"):
            method = getattr(policy, name)
            setattr(policy, name, lambda *a, _m=method, _n=name: log.append((_n, *a[:3])) or _m(*a))
        for costs in ("target", "draft"):
            method = getattr(policy, costs).record
            setattr(getattr(policy, costs), "record", lambda b, t, s, _m=method, _c=costs: log.append((_c, b, t)) or _m(b, t, s))
        result = gen.generate([prompt], max_new_tokens=70)
        assert result[0].token_ids == alone(prompt, max_new_tokens=70).token_ids
        logs.append(log)
    assert logs[0] == logs[1]
    assert {entry[2] for entry in logs[0] if entry[0] == "record_round"} == {0, 1, 2, 3, 4}
    assert ("draft", 1, 3) in logs[0]  # a catch-up of three tokens after a plain round


def test_a_plain_stretch_runs_in_the_engines_loop_and_feeds_the_policy_as_one_round_a_step(target, draft, alone):
    # the policy stops drafting: the lone row's plain rounds until its next look run in one loop of the engine, and
    # the policy learns from them what the batch path (a step a round) tells it; the output is the target's own
    prompt, logs, looks = make_prompt(4, 9), [], []
    for loops in (True, False):
        gen = Generator(target, draft, num_draft_tokens=4, k_policy="load-aware")
        gen.scheduler.lone_row_loops = loops
        policy, log, script = gen.scheduler.policy, [], itertools.cycle([0, 2])
        chosen = []
        policy.choose_shape = lambda b, caps, seen=None, sampled=False: chosen.append(1) or (
            min(next(script), int(caps.max())), 1)
        policy.plain_stretch = lambda b, sampled=False: 5  # (the real one: rounds to the next look, test_load_aware)
        method = policy.record_round
        policy.record_round = lambda *a, _m=method: log.append(a[:3]) or _m(*a)
        result = gen.generate([prompt], max_new_tokens=60)
        assert result[0].token_ids == alone(prompt, max_new_tokens=60).token_ids
        logs.append(log)
        looks.append(len(chosen))
    assert logs[0] == logs[1]
    plain = sum(1 for b, k, tokens in logs[0] if k == 0)
    # half the looks say k = 0, each then 5 plain rounds (the last one cut by the output's limit, perhaps)
    assert looks[0] == looks[1] and 5 * (looks[0] // 2 - 1) < plain <= 5 * (looks[0] + 1) // 2 + 1


def test_a_draft_model_skips_the_prompts_while_the_policy_does_not_draft_and_catches_up_when_it_does(target, draft,
                                                                                                      alone):
    """While the load-aware policy's last choice at the batch size was plain decoding, the draft model does not read
    the prompts (useless drafts cost no prefill); when the policy drafts, its first call reads what its cache lacks.
    Every output is the target's own: two rows (the batch path's catch-up), then one (the greedy chain's), the
    second from the prefix cache."""
    prompts = [make_prompt(40 + i, 24) for i in range(2)]
    want = [alone(p, max_new_tokens=30).token_ids for p in prompts]
    for lazy in (True, False):
        calls = []
        gen = Generator(target, WrappedEngine(draft, lambda ids, pos, row: calls.append((ids.shape[1], int(pos.min())))),
                        num_draft_tokens=4, k_policy="load-aware")
        policy, drafter, script = gen.scheduler.policy, gen.scheduler.drafter, itertools.cycle([0, 3])
        policy.plain_at = lambda b: lazy
        policy.choose_shape = lambda b, caps, seen=None, sampled=False: (min(next(script), int(caps.max())), 1)
        prefills = []
        drafter.prefill = lambda *a, _m=drafter.prefill: prefills.append(a[3].tolist()) or _m(*a)
        assert [r.token_ids for r in gen.generate(prompts, max_new_tokens=30)] == want
        again = gen.generate(prompts[1], max_new_tokens=30)
        assert again.token_ids == want[1] and again.stats.prefix_tokens_reused >= 16
        if lazy:  # no prompt read; the first draft calls read whole prompts from slot 0
            assert prefills == [] and any(start == 0 and width >= 24 for width, start in calls), calls
        else:
            assert prefills and sum(map(sum, prefills)) >= 2 * 24


def test_cancelling_a_request_frees_its_row_for_the_next(target, draft, alone):
    scheduler = Scheduler(target, draft, max_batch=1)
    first = scheduler.submit(make_prompt(4, 10), max_new_tokens=200)
    next(iter(first))
    second = scheduler.submit(make_prompt(5, 10), max_new_tokens=20)
    first.cancel()
    cancelled = first.result(timeout=60)
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < 200
    full = alone(make_prompt(4, 10), max_new_tokens=200).token_ids
    assert cancelled.token_ids == full[: len(cancelled.token_ids)]
    assert second.result(timeout=60).token_ids == alone(make_prompt(5, 10), max_new_tokens=20).token_ids
    assert scheduler.stats().requests_cancelled == 1


def test_requests_queued_behind_a_lone_greedy_row_are_served_in_turn(target, draft, alone):
    """max_batch 1: a lone greedy row keeps its own loop while others wait (no free row for them) and the
    queue is served after it, with and without a draft; each output equals the request alone."""
    prompts = [make_prompt(30 + i, 6) for i in range(3)]
    for d in (None, draft):
        scheduler = Scheduler(target, d, max_batch=1)
        handles = [scheduler.submit(p, max_new_tokens=24) for p in prompts]
        for p, handle in zip(prompts, handles):
            assert handle.result(timeout=60).token_ids == alone(p, max_new_tokens=24).token_ids
        assert scheduler.stats().requests_finished == 3


def _completion_order(scheduler, submissions):
    """Submit while the scheduler's loop is held back, then let it run one row at a time."""
    lock = lease(scheduler.target)
    order = []
    with lock:
        handles = []
        for name, priority, pause in submissions:
            handles.append((name, scheduler.submit(make_prompt(len(handles), 4), max_new_tokens=4, priority=priority)))
            time.sleep(pause)
    for name, handle in handles:
        handle.result(timeout=60)
        order.append((handle._request.admitted, name))
    return [name for _, name in sorted(order)]


def test_higher_priority_is_admitted_first_fifo_within_a_level(target):
    scheduler = Scheduler(target, max_batch=1, aging_s=1e6)
    subs = [("low-a", 0, 0.0), ("high", 5, 0.0), ("mid", 2, 0.0), ("low-b", 0, 0.0), ("high-2", 5, 0.0)]
    assert _completion_order(scheduler, subs) == ["high", "high-2", "mid", "low-a", "low-b"]


def test_aging_lets_a_long_waiting_low_priority_request_through(target):
    # waiting 0.01 s counts as one level: after 0.3 s the low-priority request outranks a +5 newcomer
    scheduler = Scheduler(target, max_batch=1, aging_s=0.01)
    subs = [("old-low", 0, 0.3), ("new-high", 5, 0.0)]
    assert _completion_order(scheduler, subs) == ["old-low", "new-high"]


def test_prefix_reuse_gives_identical_output_and_counts_the_hit(target, draft, alone):
    scheduler = Scheduler(target, draft, num_draft_tokens=3, min_prefix_tokens=8)
    system = make_prompt(9, 25)
    n = scheduler.register_prefix(system)
    assert n > 60
    question = system + " " + make_prompt(10, 6)
    got = scheduler.submit(question, max_new_tokens=30).result(timeout=60)
    assert got.token_ids == alone(question, max_new_tokens=30).token_ids
    assert got.stats.prefix_tokens_reused == n
    stats = scheduler.stats()
    assert stats.prefix_hits == 1 and stats.prefix_tokens_reused == n
    # a finished request's tokens are kept too: a follow-up turn reuses prompt and answer
    follow_up = question + got.text + " kappa"
    again = scheduler.submit(follow_up, max_new_tokens=12).result(timeout=60)
    assert again.token_ids == alone(follow_up, max_new_tokens=12).token_ids
    assert again.stats.prefix_tokens_reused > n
    assert scheduler.stats().prefix_hits == 2


def test_the_prefix_cache_is_bounded_and_evicts_least_recently_used(target):
    per_token = sum(buf[0, :, 0].nbytes for buf in target.cache.values())
    prompts = [make_prompt(20 + i, 20) for i in range(4)]
    entry = per_token * (len(Generator(target).tokenizer(prompts[0])["input_ids"]) + 3)
    scheduler = Scheduler(target, prefix_cache_mb=2.5 * entry / 2**20, min_prefix_tokens=8)
    for p in prompts:
        scheduler.submit(p, max_new_tokens=4).result(timeout=60)
    cache = scheduler.prefix_cache
    assert cache.nbytes <= cache.max_bytes and 1 <= len(cache.entries) < 4
    assert scheduler.submit(prompts[-1] + " mu", max_new_tokens=2).result(timeout=60).stats.prefix_tokens_reused > 0
    assert scheduler.submit(prompts[0] + " mu", max_new_tokens=2).result(timeout=60).stats.prefix_tokens_reused == 0


def test_a_long_prompt_is_read_in_chunks_while_other_rows_keep_emitting(target, draft, alone):
    calls = []

    long_prompt = make_prompt(31, 30)
    expected = [alone(long_prompt, max_new_tokens=5).token_ids, alone(make_prompt(30, 4), max_new_tokens=150).token_ids]
    # (the wrapper hides the engine from the lease that serialises schedulers: no other may run meanwhile)
    recording = WrappedEngine(target, lambda ids, pos, first: calls.append((first, ids.shape, pos[:, 0].copy())))
    scheduler = Scheduler(recording, draft, num_draft_tokens=2, k_policy="fixed", prefill_chunk=8)
    running = scheduler.submit(make_prompt(30, 4), max_new_tokens=150)
    next(iter(running))
    n_long = len(scheduler.tokenizer(long_prompt)["input_ids"])
    calls.clear()
    result = scheduler.submit(long_prompt, max_new_tokens=5).result(timeout=60)
    assert [result.token_ids, running.result().token_ids] == expected
    # the new prompt was read 8 tokens a call in row 1, while row 0 kept verifying at advancing positions
    reading = [i for i, (first, shape, _) in enumerate(calls) if first == 1]
    assert len(reading) == -(-n_long // 8)
    assert [int(calls[i][2][0]) for i in reading[:3]] == [0, 8, 16]
    between = [int(start[0]) for first, shape, start in calls[reading[0] : reading[-1]] if first == 0]
    assert len(between) >= len(reading) - 1
    assert all(b > a for a, b in zip(between, between[1:]))


def test_an_engine_failure_fails_the_requests_in_flight_and_the_scheduler_keeps_serving(target, alone):
    calls = []

    def fail_the_fifth_call(*_):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("simulated engine failure")

    scheduler = Scheduler(WrappedEngine(target, fail_the_fifth_call))
    # queued together (one submit_many): both are in flight at the fifth call however busy the machine is
    doomed = scheduler.submit_many([make_prompt(70 + i, 5) for i in range(2)], [{"max_new_tokens": 30}] * 2)
    for h in doomed:
        with pytest.raises(RuntimeError, match="simulated engine failure"):
            h.result(timeout=60)
    ok = scheduler.submit(make_prompt(72, 5), max_new_tokens=20).result(timeout=60)
    assert ok.token_ids == alone(make_prompt(72, 5), max_new_tokens=20).token_ids
    assert scheduler.stats().requests_failed == 2


def test_a_request_whose_sink_raises_is_cancelled_alone(target, draft, alone):
    scheduler = Scheduler(target, draft, num_draft_tokens=3)
    prompts = [make_prompt(85 + i, 6) for i in range(3)]
    with lease(target):
        victims = scheduler.submit_many(prompts, [{"max_new_tokens": 40}] * 3)
        culprit = scheduler.submit(make_prompt(91, 6), max_new_tokens=40)

        def closed_loop(event):  # what call_soon_threadsafe raises once its caller's event loop is closed
            raise RuntimeError("Event loop is closed")

        culprit._request.sink = closed_loop
    assert [h.result(timeout=60).token_ids for h in victims] == [alone(p, max_new_tokens=40).token_ids for p in prompts]
    deadline = time.time() + 10
    while scheduler.stats().requests_cancelled < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert scheduler.stats().requests_cancelled == 1 and scheduler.stats().running == 0


def test_a_stream_left_early_is_cancelled(target, alone):
    gen = Generator(target)
    stream = gen.stream(make_prompt(80, 4), max_new_tokens=150)
    for _ in stream:
        break  # the loop's iterator is dropped here, which cancels the request
    deadline = time.time() + 10
    scheduler = gen.scheduler
    while (scheduler.stats().requests_cancelled < 1 or scheduler.stats().running) and time.time() < deadline:
        time.sleep(0.01)
    assert scheduler.stats().requests_cancelled == 1 and scheduler.stats().running == 0
    # the generator still serves the next request correctly
    want = alone(make_prompt(81, 4), max_new_tokens=12).token_ids
    assert gen.generate(make_prompt(81, 4), max_new_tokens=12).token_ids == want


def test_the_scheduler_plans_and_the_worker_makes_every_engine_call():
    """scheduler.py decides (rows, chunks, k, width) and calls no engine and no drafter: it imports nothing from
    engines/, calls none of an engine's or a drafter's methods, and reaches the worker only through execute (and
    its leases); runtime/worker.py makes every call."""
    import ast
    from pathlib import Path

    import trtspec.runtime.scheduler as scheduler_module

    tree = ast.parse(Path(scheduler_module.__file__).read_text())
    imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imports if m and "engines" in m.split(".")]
    engine_methods = {"forward", "keep_path", "save_prefix", "load_prefix", "move_row", "reset", "greedy_steps",
                      "propose", "prefill", "accepted", "observe"}
    calls, worker_calls = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner == "self.worker":
                worker_calls.add(node.func.attr)
            elif node.func.attr in engine_methods:
                calls.append(ast.unparse(node))
    assert not calls, calls
    assert worker_calls == {"execute", "locks"}


def test_the_scheduler_knows_no_drafter_by_name_or_type():
    """What a drafter needs is declared on its class (drafters.REGISTRY); scheduler.py names no drafter."""
    from pathlib import Path

    import trtspec.runtime.scheduler as scheduler_module
    from trtspec.runtime.drafters import REGISTRY

    source = Path(scheduler_module.__file__).read_text()
    for name, cls in REGISTRY.items():
        assert f'"{name}"' not in source and f"'{name}'" not in source, name
        assert cls.__name__ not in source, cls.__name__
    assert "SuffixThenDraft" not in source and "isinstance(self.drafter" not in source
