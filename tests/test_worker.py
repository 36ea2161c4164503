"""The worker (runtime/worker.py), which makes every engine and drafter call of a step: what one request's own
processing raises in any of those calls fails that request alone."""

from __future__ import annotations

import pytest

from conftest import make_prompt
from trtspec import Scheduler
from trtspec.engines.base import lease


@pytest.mark.parametrize("call", [1, 4, 9])  # its first token, a draft position, later ones (drafted or verified)
def test_a_request_whose_own_processing_raises_fails_alone(target, draft, alone, call):
    from trtspec.runtime.request import RequestFailedError

    scheduler = Scheduler(target, draft, num_draft_tokens=3, k_policy="fixed")
    prompts = [make_prompt(80 + i, 6) for i in range(3)]
    with lease(target):  # nothing runs until the culprit is rigged
        victims = scheduler.submit_many(prompts, [{"max_new_tokens": 40}] * 3)
        culprit = scheduler.submit(make_prompt(90, 6), max_new_tokens=40, logit_bias={5: 1.0})
        processor = culprit._request.sampler.processor
        apply, calls = processor.apply, []

        def failing(*args, **kwargs):  # its logits processing raises at its call-th use
            calls.append(1)
            if len(calls) == call:
                raise FloatingPointError("simulated fault in one request")
            return apply(*args, **kwargs)

        processor.apply = failing
    with pytest.raises(RequestFailedError, match="simulated fault in one request"):
        culprit.result(timeout=60)
    assert [h.result(timeout=60).token_ids for h in victims] == [alone(p, max_new_tokens=40).token_ids for p in prompts]
    assert scheduler.stats().requests_failed == 1
