"""The prompt-lookup drafter (runtime/drafters/prompt_lookup.py): what it proposes, and greedy output equal to the
target's."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec import Generator, load_engine

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"]
ARCH = "llama-gqa-rope3"


@pytest.fixture(scope="module")
def target(exported):
    return load_engine(exported(ARCH))


@pytest.fixture(scope="module")
def reference(target):
    """Target-only greedy output, 40 tokens per prompt."""
    return [r.token_ids for r in Generator(target).generate(PROMPTS, max_new_tokens=40)]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_prompt_lookup_and_no_drafter_equal_target_greedy(target, reference, k):
    for drafter in ("prompt_lookup", "none"):
        out = Generator(target, drafter=drafter, num_draft_tokens=k, k_policy="fixed").generate(PROMPTS, max_new_tokens=40)
        assert [r.token_ids for r in out] == reference


def test_the_longest_earlier_n_gram_decides_and_its_latest_occurrence_is_copied():
    from trtspec.runtime.drafters.prompt_lookup import PromptLookupDrafter

    rows = [
        [7, 1, 2, 3, 9, 1, 2, 5, 7, 1, 2],  # (7, 1, 2) occurred once: its follower wins over (1, 2)'s later one
        [1, 2, 9, 1, 2, 4, 1, 2],  # (1, 2) twice before: the latest occurrence's continuation
        [5, 6, 5],  # only (5,) occurred: its continuation, cut where the row ends
        [4, 5, 6],  # nothing occurred before
        [3, 8, 3],  # cap 0: no drafts asked for
    ]
    caps = np.array([2, 2, 4, 3, 0])
    width = max(map(len, rows)) + int(caps.max()) + 1
    tokens = np.zeros((len(rows), width), np.int64)  # tokens [B, capacity] int64, each row's first n[r] its own
    for r, seq in enumerate(rows):
        tokens[r, : len(seq)] = seq
    p = PromptLookupDrafter(len(rows)).propose(tokens, np.array([len(s) for s in rows]), caps, None, width)
    assert p.counts.tolist() == [2, 2, 2, 0, 0]
    assert [p.drafts[r, :m].tolist() for r, m in enumerate(p.counts)] == [[3, 9], [4, 1], [6, 5], [], []]
