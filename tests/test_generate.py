"""runtime/generate.py: `trtspec generate` as one function call."""

from __future__ import annotations

import pytest

import trtspec
from trtspec import Generator

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import"]


def test_trtspec_generate_is_the_generators_output_in_one_call(exported):
    target = exported("llama")
    want = Generator(target).generate(PROMPTS[0], max_new_tokens=6)
    assert trtspec.generate(target, PROMPTS[0], max_new_tokens=6).token_ids == want.token_ids
    batch = trtspec.generate(target, [PROMPTS[0], PROMPTS[2]], max_new_tokens=6)
    assert batch[0].token_ids == want.token_ids and batch.stats.new_tokens == sum(len(r.token_ids) for r in batch)
    stream = trtspec.generate(target, PROMPTS[0], max_new_tokens=6, stream=True)
    assert "".join(stream) == want.text and stream.result.token_ids == want.token_ids
    with pytest.raises(ValueError, match="system goes with chat"):
        trtspec.generate(target, "x", system="be brief")
    with pytest.raises(ValueError, match="stream takes one prompt"):
        trtspec.generate(target, ["a", "b"], stream=True)
