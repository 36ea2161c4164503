"""Greedy generation through the engine equals HF generate(); the CLI and the Generator's errors."""

from __future__ import annotations

import json

import pytest

from conftest import ARCHITECTURES, S_MAX
from trtspec import CapacityError, Generator
from trtspec.cli import main

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import"]


def hf_greedy(model_path, hf_model, prompt, max_new_tokens):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = hf_model(model_path).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generation_equals_hf_generate(arch, exported, model_dir, hf_model):
    gen = Generator(exported(arch))
    result = gen.generate(PROMPTS[0], max_new_tokens=32)
    assert result.token_ids == hf_greedy(model_dir(arch), hf_model, PROMPTS[0], 32)
    assert result.finish_reason == ("stop" if 2 in result.token_ids else "length")
    assert result.text == gen.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_batch_of_prompts_of_different_lengths_equals_each_alone(exported, model_dir, hf_model):
    gen = Generator(exported("qwen3"))
    out = gen.generate(PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in out] == [hf_greedy(model_dir("qwen3"), hf_model, p, 20) for p in PROMPTS]
    assert out.stats.requests == 3 and out.stats.new_tokens == sum(len(r.token_ids) for r in out)
    assert all(r.stats.tokens_per_s > 0 and r.stats.time_to_first_token_s > 0 for r in out)


def test_more_prompts_than_max_batch_run_in_chunks(exported):
    gen = Generator(exported("gpt2"))
    prompts = PROMPTS * 2  # 6 prompts, engine max batch 3
    out = gen.generate(prompts, max_new_tokens=8)
    alone = [gen.generate(p, max_new_tokens=8).token_ids for p in prompts]
    assert [r.token_ids for r in out] == alone


def test_one_prompt_as_token_ids_is_one_request(exported):
    """generate(ids) with a prompt's token ids (a list of ints, as chat_ids() returns) is that one prompt, as the
    text is: ints cannot be prompts of a batch, so the two never overlap."""
    import numpy as np

    gen = Generator(exported("llama"))
    ids = gen.tokenizer(PROMPTS[1])["input_ids"]
    text = gen.generate(PROMPTS[1], max_new_tokens=10)
    for prompt in (ids, tuple(ids), np.array(ids)):
        result = gen.generate(prompt, max_new_tokens=10)
        assert result.token_ids == text.token_ids and result.text == text.text
    batch = gen.generate([ids, PROMPTS[0]], max_new_tokens=10)  # a list of prompts: ids and text
    assert [r.token_ids for r in batch] == [text.token_ids, gen.generate(PROMPTS[0], max_new_tokens=10).token_ids]
    assert "".join(gen.stream(ids, max_new_tokens=10)) == text.text
    with pytest.raises(TypeError, match="a prompt must be a string or a list of token ids, got float"):
        gen.generate([1.5, 2.5], max_new_tokens=4)


def test_prompt_longer_than_capacity_is_refused_before_any_work(exported):
    gen = Generator(exported("llama"))
    with pytest.raises(CapacityError, match=f"prompt has .* tokens but the engine holds {S_MAX} positions"):
        gen.generate(["short", "word " * (S_MAX + 5)], max_new_tokens=4)
    # the engine still generates correctly afterwards
    assert gen.generate(PROMPTS[0], max_new_tokens=8).token_ids == Generator(exported("llama")).generate(
        PROMPTS[0], max_new_tokens=8).token_ids


def test_reaching_capacity_ends_with_length(exported):
    gen = Generator(exported("llama"))
    result = gen.generate(PROMPTS[1], max_new_tokens=500)
    prompt_len = len(gen.tokenizer(PROMPTS[1])["input_ids"])
    if result.finish_reason == "length":
        assert prompt_len + len(result.token_ids) == S_MAX
    else:
        assert result.token_ids[-1] == 2


def test_cli_generate_json(exported, capsys):
    rc = main(["generate", "--target", str(exported("llama")), "--prompt", PROMPTS[0], "--prompt", PROMPTS[2],
               "--max-new-tokens", "6", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    gen = Generator(exported("llama"))
    assert [r["token_ids"] for r in data["results"]] == [
        gen.generate(p, max_new_tokens=6).token_ids for p in (PROMPTS[0], PROMPTS[2])]
    assert data["stats"]["new_tokens"] == sum(len(r["token_ids"]) for r in data["results"])


def test_cli_export_build_generate_streams_text(model_dir, tmp_path, capsys):
    src = model_dir("llama")
    assert main(["export", str(src), "-o", str(tmp_path / "export"), "--max-seq-len", "48", "--max-batch", "2"]) == 0
    assert main(["build", str(tmp_path / "export"), "-o", str(tmp_path / "engine")]) == 0
    capsys.readouterr()
    assert main(["generate", "--target", str(tmp_path / "engine"), "--prompt", PROMPTS[0], "--max-new-tokens", "10"]) == 0
    captured = capsys.readouterr()
    expected = Generator(tmp_path / "engine").generate(PROMPTS[0], max_new_tokens=10).text
    assert captured.out == PROMPTS[0] + expected + "\n"
    assert "10 tokens" in captured.err and "tok/s" in captured.err


def test_cli_generate_no_stream_prints_the_text_once_complete(exported, capsys):
    assert main(["generate", "--target", str(exported("llama")), "--prompt", PROMPTS[0], "--max-new-tokens", "6",
                 "--no-stream"]) == 0
    expected = Generator(exported("llama")).generate(PROMPTS[0], max_new_tokens=6).text
    assert capsys.readouterr().out == PROMPTS[0] + expected + "\n---\n"


def test_cli_reports_bad_input_as_an_error_message(tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a trtspec artifact" in capsys.readouterr().err
