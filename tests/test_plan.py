"""The step plan (runtime/plan.py): what Scheduler.schedule() asks of the worker, step by step, for requests whose
prompts are read in chunks and then decode together."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCH
from trtspec import Generator, Scheduler, load_engine
from trtspec.runtime.plan import Load


@pytest.fixture(scope="module")
def target(exported):
    return load_engine(exported(ARCH))  # 64 slots, 3 rows


def _step(scheduler):
    """One step taken by hand (the loop thread's plan -> execute -> update): its plan."""
    plan = scheduler.schedule()
    scheduler.update(plan, scheduler.worker.execute(plan))
    return plan


def test_prompts_are_read_in_chunks_first_come_first_served_then_the_rows_decode_in_one_round(target):
    scheduler = Scheduler(target, drafter="prompt_lookup", num_draft_tokens=3, k_policy="fixed", prefill_chunk=16,
                          prefix_cache_mb=0)
    prompts = ["alpha beta gamma delta", "import os", "mu"]
    # queued without the loop thread: the test takes the steps itself
    requests = [scheduler.make_request(p, max_new_tokens=10, sink=lambda event: None) for p in prompts]
    scheduler._waiting.extend(requests)
    n = [int(r.prompt_ids.size) for r in requests]
    assert n[0] > 16 and (n[0] - 16) + n[1] + n[2] <= 16  # (the situation the plans below are for)

    # step 1: the three take rows 0, 1, 2, nothing reused; the first reads 16 tokens of its prompt, which leaves no
    # room for the others (after a part, only whole prompts)
    plan = _step(scheduler)
    assert [(type(op), op.row, op.reused) for op in plan.cache] == [(Load, 0, 0), (Load, 1, 0), (Load, 2, 0)]
    assert [op.prompt_ids.tolist() for op in plan.cache] == [r.prompt_ids.tolist() for r in requests]
    assert (plan.prompts.first, plan.prompts.chunks, plan.prompts.choosers) == (0, [16], [None])
    assert plan.appended == {} and plan.decode is None and plan.alone is None

    # step 2: the rest of the first prompt and the two others whole, in one call; each row's sampler then chooses
    # its first token
    plan = _step(scheduler)
    assert plan.cache == [] and plan.prompts.first == 0 and plan.prompts.chunks == [n[0] - 16, n[1], n[2]]
    assert plan.prompts.choosers == [r.sampler for r in requests]
    assert plan.decode is None

    # step 3: the rows hold their first tokens (the target's greedy ones) and decode in one round: k 3 each (fixed),
    # chains, room for 8 more tokens of their 10, no grammar
    plan = scheduler.schedule()
    first = [r.token_ids[:1] for r in Generator(target).generate(prompts, max_new_tokens=1)]
    assert plan.appended == {0: first[0], 1: first[1], 2: first[2]}
    assert plan.prompts is None and plan.alone is None
    shape = plan.decode
    assert shape.samplers == [r.sampler for r in requests]
    np.testing.assert_array_equal(shape.caps, [3, 3, 3])
    np.testing.assert_array_equal(shape.room, [8, 8, 8])
    assert (shape.k, shape.width, shape.forced, shape.sampled) == (3, 1, None, False)
