"""The self-draft (runtime/drafters/self_draft.py): the target's own INT4 build, made once and reused, drafts
losslessly on every family."""

from __future__ import annotations

import json

import pytest

from trtspec import ArtifactError, Generator, build


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3"])
def test_new_families_speculate_losslessly_with_their_int4_self_draft(exported, tmp_path, arch):
    target = build(exported(arch), tmp_path / "target")
    prompts = ["def add(a, b):", "The quick brown fox"]
    expected = [r.token_ids for r in Generator(target).generate(prompts, max_new_tokens=24)]
    out = Generator(target, draft="self", num_draft_tokens=3, k_policy="fixed").generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in out] == expected and out.stats.accepted > 0


def test_self_draft_is_built_once_and_greedy_equals_the_target(exported, tmp_path):
    from trtspec import self_draft
    from trtspec.runtime.drafters.self_draft import block_for

    target = build(exported("llama"), tmp_path / "target")
    prompts = ["def add(a, b):", "The quick brown fox"]
    expected = [r.token_ids for r in Generator(target).generate(prompts, max_new_tokens=24)]
    spec = Generator(target, draft="self", num_draft_tokens=3, k_policy="fixed")
    out = spec.generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in out] == expected
    assert out.stats.accepted > 0
    made = spec.draft.path
    assert made == tmp_path / "target-self-int4-gptq"
    manifest = json.loads((made / "manifest.json").read_text())
    assert manifest["quantization"]["mode"] == "int4-gptq" and manifest["build"]["rewrites"]["tied_int4"] == 1
    # the largest block dividing the hidden size (the tied table takes whole blocks; the tiny model's is 64)
    assert manifest["quantization"]["block_size"] == block_for(exported("llama")) == 64
    stamp = (made / "model.onnx").stat().st_mtime_ns
    assert self_draft(target) == made and (made / "model.onnx").stat().st_mtime_ns == stamp  # reused
    with pytest.raises(ArtifactError, match="already quantized"):
        self_draft(made)


def test_the_float_build_of_a_gguf_drafts_with_the_files_own_blocks_and_a_blocks_build_is_refused(tmp_path):
    """--draft self on an export of a GGUF file: the float build drafts with the file's own blocks (its onnxruntime
    build with int8 activations), losslessly; a build that already runs those blocks is refused, saying why."""
    from trtspec import export
    from trtspec.testing import make_tiny_gguf

    exp = export(make_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "export", max_seq_len=64, max_batch=2)
    target = build(exp, tmp_path / "float", weights="float")
    prompt = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n"
    expected = Generator(target).generate(prompt, max_new_tokens=24).token_ids
    spec = Generator(target, draft="self", num_draft_tokens=3, k_policy="fixed")
    out = spec.generate(prompt, max_new_tokens=24)
    assert out.token_ids == expected and out.stats.accepted > 0
    manifest = json.loads((spec.draft.path / "manifest.json").read_text())
    assert manifest["build"]["weights"] == "gguf" and manifest["self_draft"]["mode"] == "gguf-blocks"
    with pytest.raises(ArtifactError, match="runs its GGUF file's own blocks"):
        Generator(build(exp, tmp_path / "blocks", backend="onnxruntime"), draft="self")
