"""runtime/tokenizer.py: prompts to checked token ids, and each token's own bytes."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.errors import CapacityError
from trtspec.runtime.tokenizer import encode_prompt, token_bytes
from trtspec.testing import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(vocab_size=300)


def test_a_string_or_ids_become_the_tokenizers_ids(tokenizer):
    text = "def add(a, b):\n    return a + b"
    ids = encode_prompt(tokenizer, text, vocab_size=316, bos_id=1, capacity=64)
    assert ids.dtype == np.int64 and ids.tolist() == tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids.tolist()) == text
    assert encode_prompt(tokenizer, [5, 7, np.int64(9)], vocab_size=316, bos_id=1, capacity=64).tolist() == [5, 7, 9]
    assert encode_prompt(tokenizer, "", vocab_size=316, bos_id=1, capacity=64).tolist() == [1]  # BOS starts it


def test_bad_prompts_are_refused_saying_why(tokenizer):
    with pytest.raises(ValueError, match="prompt token ids must lie in \\[0, 316\\)"):
        encode_prompt(tokenizer, [3, 316], vocab_size=316, bos_id=1, capacity=64)
    with pytest.raises(TypeError, match="a prompt must be a string or a list of token ids, got dict"):
        encode_prompt(tokenizer, {"text": "x"}, vocab_size=316, bos_id=1, capacity=64)
    with pytest.raises(TypeError, match="got list"):
        encode_prompt(tokenizer, [1, True], vocab_size=316, bos_id=1, capacity=64)
    with pytest.raises(ValueError, match="no BOS token"):
        encode_prompt(tokenizer, "", vocab_size=316, bos_id=None, capacity=64)
    with pytest.raises(CapacityError, match="prompt has 8 tokens but the engine holds 8 positions.*--max-seq-len 16"):
        encode_prompt(tokenizer, list(range(8)), vocab_size=316, bos_id=1, capacity=8)
    assert encode_prompt(tokenizer, list(range(7)), vocab_size=316, bos_id=1, capacity=8).size == 7


def test_token_bytes_join_to_the_texts_utf8_even_inside_a_character(tokenizer):
    of = token_bytes(tokenizer)
    for text in ("import os\nprint('héllo wörld')", "naïve café — 東京 🙂", "  tabs\tand\r\nlines"):
        ids = tokenizer(text)["input_ids"]
        assert b"".join(of(t) for t in ids) == text.encode("utf-8")
    # a character of several bytes spread over byte tokens: each token gives exactly its part
    parts = [of(t) for t in tokenizer("🙂")["input_ids"]]
    assert b"".join(parts) == "🙂".encode("utf-8") and all(parts)
    assert of(tokenizer.convert_tokens_to_ids("</s>")) == b"</s>"  # a special token: its text
