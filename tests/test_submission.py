"""The caller's side of a Scheduler (runtime/submission.py): requests checked before they are queued, the async
API, and warm-up."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

import pytest

from conftest import WrappedEngine, make_prompt
from trtspec import Scheduler


def test_async_api_many_coroutines_and_a_consumer_that_leaves(target, draft, alone):
    scheduler = Scheduler(target, draft, num_draft_tokens=3)
    requests = [(make_prompt(40 + i, 2 + 3 * i), 10 + 9 * i) for i in range(6)]

    async def collect(prompt, n):
        return "".join([d async for d in scheduler.astream(prompt, max_new_tokens=n)])

    async def leave_early():
        async for _ in scheduler.astream(make_prompt(50, 5), max_new_tokens=200):
            break  # the consumer goes away: the request is cancelled

    async def main():
        texts = await asyncio.gather(*(collect(p, n) for p, n in requests), leave_early())
        result = await scheduler.agenerate(requests[0][0], max_new_tokens=requests[0][1])
        return texts[:-1], result

    texts, result = asyncio.run(main())
    assert texts == [alone(p, max_new_tokens=n).text for p, n in requests]
    assert result.token_ids == alone(requests[0][0], max_new_tokens=requests[0][1]).token_ids
    deadline = time.time() + 10
    while (scheduler.stats().requests_cancelled < 1 or scheduler.stats().running) and time.time() < deadline:
        time.sleep(0.01)
    assert scheduler.stats().requests_cancelled == 1 and scheduler.stats().running == 0


@pytest.mark.parametrize(
    "params, error, message",
    [
        ({"temperature": -1.0}, ValueError, "temperature must be a finite number >= 0"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an integer >= 1"),
        ({"num_draft_tokens": 300}, ValueError, "num_draft_tokens=300 is not supported"),
        ({"priority": "high"}, ValueError, "priority must be an integer"),
        ({"seed": 1.5, "temperature": 1.0}, ValueError, "seed must be an integer"),
        ({"prompt": "word " * 300}, Exception, "prompt has .* tokens but the engine holds 256 positions"),
    ],
)
def test_bad_requests_are_refused_before_queuing_and_disturb_no_other(target, draft, alone, params, error, message):
    scheduler = Scheduler(target, draft, num_draft_tokens=2)
    running = scheduler.submit(make_prompt(60, 6), max_new_tokens=60)
    params = dict(params)
    prompt = params.pop("prompt", "x")
    with pytest.raises(error, match=message):
        scheduler.submit(prompt, **params)
    assert running.result(timeout=60).token_ids == alone(make_prompt(60, 6), max_new_tokens=60).token_ids
    assert scheduler.stats().requests_finished == 1


def test_warm_up_calls_every_engine_at_its_widest_and_leaves_outputs_exact(target, draft, alone):
    """warm_up (the server's, before requests come) calls each engine once with every row and its widest call,
    writing slots no request holds: batched speculative outputs afterwards equal each request's target-only
    output. While a request runs it does nothing."""
    calls = []

    def record(ids, pos, first_row):
        calls.append(ids.shape)
        time.sleep(0.002)  # (a request lasts long enough to ask warm_up while it runs)

    scheduler = Scheduler(WrappedEngine(target, record), WrappedEngine(draft, record), num_draft_tokens=3)
    assert scheduler.warm_up()
    assert calls == [(4, 32), (4, 32)]
    prompts = [make_prompt(90 + i, 6 + 3 * i) for i in range(4)]
    outs = [h.result() for h in scheduler.submit_many(prompts, [{"max_new_tokens": 20}] * 4)]
    assert [o.token_ids for o in outs] == [alone(p, max_new_tokens=20).token_ids for p in prompts]
    handle = scheduler.submit(make_prompt(99, 40), max_new_tokens=150)
    while scheduler.stats().running == 0:
        time.sleep(0.001)
    calls.clear()
    assert scheduler.warm_up() is False and handle.result().finish_reason == "length"
    assert (4, 32) not in calls
    assert handle.result().token_ids == alone(make_prompt(99, 40), max_new_tokens=150).token_ids
    scheduler.close()


def test_exit_joins_a_loop_thread_that_is_still_ending(target, alone, monkeypatch):
    """A program may end right after a generate(), its Generator never closed. The loop thread (a daemon) may then
    still be freeing its step's tensors while the interpreter finalizes, and was stopped inside torch's C++ code,
    which aborted the process (2 of 24 runs of a four-generate script: benchmarks/exit_check.py). The exit hook
    closes every scheduler that ran and joins its last loop thread, even one that has already given up its work."""
    from trtspec.runtime import submission

    scheduler = Scheduler(target)
    ending, release = threading.Event(), threading.Event()
    loop = scheduler._loop

    def held_loop():  # the loop, then its thread's last moments held: its work given up, its frame not yet freed
        loop()
        ending.set()
        release.wait(30)

    scheduler._loop = held_loop
    prompt = make_prompt(70, 4)
    assert scheduler.submit(prompt, max_new_tokens=6).result(timeout=60).token_ids == \
        alone(prompt, max_new_tokens=6).token_ids
    assert ending.wait(30) and scheduler._thread is None  # no work left: the scheduler holds no running thread
    monkeypatch.setattr(submission, "_STARTED", weakref.WeakSet([scheduler]))  # (this module's other schedulers run on)
    exiting = threading.Thread(target=submission._close_at_exit)
    exiting.start()
    exiting.join(0.5)
    assert exiting.is_alive()  # the exit waits for the ending thread
    release.set()
    exiting.join(30)
    assert not exiting.is_alive() and not scheduler._last_thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(prompt, max_new_tokens=2)


def test_a_generator_as_a_context_manager_closes_at_the_end(target, alone):
    from trtspec import Generator

    prompt = make_prompt(71, 5)
    with Generator(target) as gen:
        assert gen.generate(prompt, max_new_tokens=6).token_ids == alone(prompt, max_new_tokens=6).token_ids
    assert not gen.scheduler._last_thread.is_alive()
    with pytest.raises(RuntimeError, match="this scheduler is closed"):
        gen.generate(prompt, max_new_tokens=2)


def test_exit_cancels_every_scheduler_before_it_joins_a_thread(target, monkeypatch):
    """Schedulers on the same engines take turns, so a loop thread may be waiting for the engines that another
    scheduler's loop holds. Closed one after another at exit, the waiting one was joined first, and that meant
    running the other's requests to their end (or the exit's whole 30 s). Every scheduler's requests are now
    cancelled before any thread is joined."""
    from trtspec.runtime import submission

    slow = WrappedEngine(target, lambda *_: time.sleep(0.02))  # 20 ms a call: 200 tokens take seconds
    holder, waiter = Scheduler(slow), Scheduler(slow)
    running = holder.submit(make_prompt(72, 4), max_new_tokens=200)
    deadline = time.time() + 30
    while holder.stats().running < 1 and time.time() < deadline:  # admitted: its loop holds the engines
        time.sleep(0.005)
    queued = waiter.submit(make_prompt(73, 4), max_new_tokens=4)  # its loop waits for the engines
    monkeypatch.setattr(submission, "_STARTED", [waiter, holder])  # the waiting one first
    monkeypatch.setattr(submission, "EXIT_JOIN_S", 600.0)
    submission._close_at_exit()
    assert running.result(timeout=60).finish_reason == "cancelled"
    assert len(running.result().token_ids) < 200 and queued.result(timeout=60).finish_reason == "cancelled"
    assert not holder._last_thread.is_alive() and not waiter._last_thread.is_alive()
