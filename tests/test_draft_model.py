"""The draft-model drafter (runtime/drafters/draft_model.py): a lone greedy row's draft chain runs in the draft
engine's own loop and proposes what the generic loop of forward calls does."""

from __future__ import annotations


from conftest import WrappedEngine, make_prompt
from trtspec import Generator


def test_a_lone_greedy_draft_chain_in_the_engines_loop_proposes_what_the_generic_loop_does(target, draft, alone):
    # one greedy row: the draft's k - 1 one-token calls run as greedy_steps; behind a wrapper they run as
    # forward calls, round by round. Same drafts, so the same acceptance, call counts and output.
    calls = []
    wrapped = WrappedEngine(draft, lambda ids, pos, row: calls.append(ids.shape))
    prompt = make_prompt(8, 6)
    fast = Generator(target, draft, num_draft_tokens=4, k_policy="fixed").generate([prompt], max_new_tokens=80)
    slow = Generator(target, wrapped, num_draft_tokens=4, k_policy="fixed").generate([prompt], max_new_tokens=80)
    assert fast[0].token_ids == slow[0].token_ids == alone(prompt, max_new_tokens=80).token_ids
    for name in ("proposed", "accepted", "rounds", "target_calls", "accepted_histogram", "draft_calls"):
        assert getattr(fast.stats, name) == getattr(slow.stats, name), name
    assert slow.stats.draft_calls == len(calls) and 0 < fast.stats.accepted < fast.stats.proposed
