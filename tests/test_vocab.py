"""runtime/vocab.py: a draft must tokenize as the target does, or it is refused saying what differs."""

from __future__ import annotations

import pytest

from trtspec import Generator, VocabularyMismatchError, export, load_engine
from trtspec.runtime.vocab import check_same_vocabulary


def _export(tmp_path, name, tokenizer, extra_logits=16):
    """A tiny random Llama with ``tokenizer``, its logits ``extra_logits`` wider than the vocabulary."""
    from transformers import AutoModelForCausalLM

    from trtspec.testing import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer) + extra_logits))
    model.save_pretrained(tmp_path / name)
    tokenizer.save_pretrained(tmp_path / name)
    return export(tmp_path / name, tmp_path / f"{name}-export", max_seq_len=32, max_batch=1)


def test_the_same_tokenizer_passes_and_another_logits_width_is_refused(tmp_path):
    from trtspec.testing import make_tokenizer

    tokenizer = make_tokenizer(vocab_size=300)
    target = _export(tmp_path, "target", tokenizer)
    check_same_vocabulary(load_engine(target), load_engine(_export(tmp_path, "same", tokenizer)))
    wider = _export(tmp_path, "wider", tokenizer, extra_logits=36)
    with pytest.raises(VocabularyMismatchError, match="vocab_size\\) 316 vs 336.*Use a draft trained with the target"):
        Generator(target, wider)


def test_a_tokenizer_with_other_merges_but_the_same_size_is_a_vocabulary_mismatch(tmp_path):
    from trtspec.testing import make_tokenizer

    ours = make_tokenizer()
    theirs = make_tokenizer(corpus=["lorem ipsum dolor sit amet, consectetur adipiscing elit " * 3,
                                    "SELECT name FROM users WHERE id = 42;"])
    assert len(ours) == len(theirs) and ours.special_tokens_map == theirs.special_tokens_map
    assert ours.get_vocab() != theirs.get_vocab()
    with pytest.raises(VocabularyMismatchError, match="tokens map to different ids"):
        Generator(_export(tmp_path, "a", ours), _export(tmp_path, "b", theirs))
