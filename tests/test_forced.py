"""Jump-forward (runtime/forced.py): a grammar's forced tokens go in front of a row's drafts, verified without
asking the drafter, and count apart from the drafter's proposals."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from trtspec.runtime.drafters import Proposal
from trtspec.runtime.forced import constrain, forced_counts, forced_tokens


class _Grammar:
    """A logits processor whose grammar forces ``forced`` next and then allows every token but 13."""

    def __init__(self, forced):
        self._forced, self.constraint = forced, object()

    def forced(self):
        return list(self._forced)

    def rollback(self):
        pass

    def allowed_prefix(self, tokens):
        return next((i for i, t in enumerate(tokens) if t == 13), len(tokens))


def _rows(*processors):
    return [SimpleNamespace(processor=p) for p in processors]


def test_forced_tokens_shrink_the_caps_of_rows_that_draft_after_them_and_zero_the_others():
    samplers = _rows(None, _Grammar([5, 6, 7]), _Grammar([]))
    room = np.array([8, 8, 8])
    caps = np.array([4, 4, 4])
    assert forced_tokens(samplers, caps, room, True, 16, 8) == {1: [5, 6, 7]}
    assert caps.tolist() == [4, 4, 4]  # 8 - 3 forced tokens leave room for 4 drafts
    caps = np.array([4, 4, 4])
    assert forced_tokens(samplers, caps, np.array([8, 5, 8]), False, 16, 8) == {1: [5, 6, 7]}
    assert caps.tolist() == [4, 0, 4]  # a tree drafter drafts nothing after forced tokens
    assert forced_tokens(_rows(None), np.array([4]), room, True, 16, 8) is None  # no row has a grammar


def test_constrain_lays_forced_tokens_before_the_drafts_and_cuts_at_the_first_forbidden_one():
    samplers = _rows(None, _Grammar([5, 6]))
    proposal = Proposal(np.array([[1, 2, 3], [9, 13, 4]]), np.array([3, 3]))
    constrain(samplers, proposal, {1: [5, 6]}, room=np.array([8, 8]), max_drafts=8)
    assert proposal.counts.tolist() == [3, 3]
    assert proposal.drafts[1, :3].tolist() == [5, 6, 9]  # the forced tokens, then the drafts up to 13
    assert proposal.forced[1, :3].tolist() == [True, True, False] and not proposal.forced[0].any()
    assert forced_counts(proposal, 1, 3, [0, 1]) == (2, 2)  # both forced tokens accepted, the draft not
    assert forced_counts(proposal, 0, 3, [0, 1, 2]) == (0, 0)
