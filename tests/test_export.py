"""The step graph: logits equal the HF model's, the graph keeps the contract, the manifest describes it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import ARCHITECTURES, S_MAX, hf_logits, random_ids
from trtspec import UnsupportedModelError, export, load_engine
from trtspec.exporter.contract import contract_violations

TOL = 1e-4


FORMS = ["export", "fused"]  # the portable graph as exported, and the default onnxruntime build (lowered, fused)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_decode_chunk_logits_match_hf(arch, form, step_engine, model_dir, hf_model):
    engine = step_engine(arch, form)
    ids = random_ids(12, seed=1)
    ref = hf_logits(hf_model(model_dir(arch)), ids)
    prefill = engine.forward(ids[None, :7], np.arange(7)[None]).copy()
    decode = engine.forward(ids[None, 7:8], np.array([[7]])).copy()
    chunk = engine.forward(ids[None, 8:12], np.arange(8, 12)[None]).copy()
    np.testing.assert_allclose(prefill[0], ref[:7], atol=TOL, rtol=0)
    np.testing.assert_allclose(decode[0], ref[7:8], atol=TOL, rtol=0)
    np.testing.assert_allclose(chunk[0], ref[8:12], atol=TOL, rtol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ragged_batch_with_rollback_logits_match_hf(arch, form, step_engine, model_dir, hf_model):
    engine = step_engine(arch, form)
    model = hf_model(model_dir(arch))
    a, b = random_ids(12, seed=2), random_ids(9, seed=3)
    ref_a, ref_b = hf_logits(model, a), hf_logits(model, b)
    # prefill: 7 and 4 tokens, right-padded; decode 1 each; then a 4-token chunk each, at each row's own positions
    ids = np.stack([a[:7], np.concatenate([b[:4], [0, 0, 0]])])
    out = engine.forward(ids, np.tile(np.arange(7), (2, 1))).copy()
    np.testing.assert_allclose(out[0], ref_a[:7], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1, :4], ref_b[:4], atol=TOL, rtol=0)
    out = engine.forward(np.array([[a[7]], [b[4]]]), np.array([[7], [4]])).copy()
    np.testing.assert_allclose(out[0, 0], ref_a[7], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1, 0], ref_b[4], atol=TOL, rtol=0)
    out = engine.forward(np.stack([a[8:12], b[5:9]]), np.stack([np.arange(8, 12), np.arange(5, 9)])).copy()
    np.testing.assert_allclose(out[0], ref_a[8:12], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], ref_b[5:9], atol=TOL, rtol=0)
    # rollback, as after rejected drafts: row a keeps 10 tokens, row b 6; both continue with other tokens
    # written over the stale slots
    a2, b2 = np.concatenate([a[:10], random_ids(3, seed=4)]), np.concatenate([b[:6], random_ids(3, seed=5)])
    out = engine.forward(np.stack([a2[10:13], b2[6:9]]), np.stack([np.arange(10, 13), np.arange(6, 9)])).copy()
    np.testing.assert_allclose(out[0], hf_logits(model, a2)[10:13], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], hf_logits(model, b2)[6:9], atol=TOL, rtol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma2", "gemma3"])  # every layer windowed; Gemma local/global
def test_sliding_window_beyond_the_window_matches_hf(arch, form, step_engine, model_dir, hf_model):
    # the tiny models have a 16-token window; 40 positions exercise it
    engine = step_engine(arch, form)
    ids = random_ids(40, seed=4)
    ref = hf_logits(hf_model(model_dir(arch)), ids)
    out = np.concatenate([engine.forward(ids[None, :30], np.arange(30)[None])[0].copy(),
                          engine.forward(ids[None, 30:], np.arange(30, 40)[None])[0].copy()])
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama-gqa-rope3", "gpt2"])
def test_graph_keeps_the_step_contract(arch, exported):
    path = exported(arch)
    manifest = json.loads((path / "manifest.json").read_text())
    model = onnx.load(str(path / manifest["graph"]))
    onnx.checker.check_model(model, full_check=True)
    assert contract_violations(model, manifest["model"]["num_layers"]) == []
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TensorScatter") == 2 * manifest["model"]["num_layers"]
    assert ops.count("Attention") == manifest["model"]["num_layers"]
    assert "Expand" not in ops  # GQA stays native: the cache is never expanded to the query heads
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {24}
    cache = model.graph.input[2].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in cache][1:] == [
        manifest["model"]["num_kv_heads"], S_MAX, manifest["model"]["head_dim"]]


def test_manifest_records_what_the_runtime_needs(exported):
    path = exported("llama-gqa-rope3")
    manifest = json.loads((path / "manifest.json").read_text())
    m = manifest["model"]
    assert (m["architecture"], m["max_seq_len"], m["max_batch"], m["dtype"], m["opset"]) == (
        "llama", S_MAX, 3, "float32", 24)
    assert m["special_tokens"] == {"bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": 0}
    assert m["kv_aliases"]["present_key_0"] == "past_key_0"
    assert manifest["config"]["rope_parameters"]["rope_type"] == "llama3"
    assert set(manifest["versions"]) >= {"torch", "transformers", "onnx", "trtspec"}
    assert "model.onnx" in manifest["files"] and "tokenizer/tokenizer.json" in manifest["files"]


def test_external_data_for_large_models(monkeypatch, model_dir, tmp_path, hf_model):
    import trtspec.exporter.step_graph as exporter

    monkeypatch.setattr(exporter, "EXTERNAL_DATA_BYTES", 0)  # treat the tiny model as large
    path = export(model_dir("qwen2"), tmp_path / "ext", max_seq_len=32, max_batch=2)
    manifest = json.loads((path / "manifest.json").read_text())
    assert "model.onnx.data" in manifest["files"]
    assert (path / "model.onnx").stat().st_size < (path / "model.onnx.data").stat().st_size
    ids = random_ids(6, seed=5)
    out = load_engine(path).forward(ids[None], np.arange(6)[None])
    np.testing.assert_allclose(out[0], hf_logits(hf_model(model_dir("qwen2")), ids), atol=TOL, rtol=0)


def test_published_checkpoint_bf16_sharded_with_an_eos_list_and_a_chat_template(model_dir, tmp_path):
    """Issue 30: checkpoints as published: bfloat16 safetensors in shards with an index file, several EOS ids in
    generation_config.json, a chat template. Exported in float32 it computes what HF computes in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, published = model_dir("qwen2"), tmp_path / "published"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(published, max_shard_size="60KB")
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer.save_pretrained(published)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 5], pad_token_id=0).save_pretrained(published)
    assert (published / "model.safetensors.index.json").is_file() and len(list(published.glob("*.safetensors"))) > 2
    path = export(published, tmp_path / "out", max_seq_len=32, max_batch=2)
    assert json.loads((path / "manifest.json").read_text())["model"]["special_tokens"]["eos_token_ids"] == [2, 5]
    ids = random_ids(9, seed=6)
    reference = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32).eval()
    out = load_engine(path).forward(ids[None], np.arange(9)[None])
    np.testing.assert_allclose(out[0], hf_logits(reference, ids), atol=TOL, rtol=0)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    exported_tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    assert (exported_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_float16_export_is_checked_and_typed(model_dir, tmp_path):
    path = export(model_dir("llama"), tmp_path / "fp16", max_seq_len=32, max_batch=2, dtype="float16")
    model = onnx.load(str(path / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.input[2].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert contract_violations(model, 2) == []


def test_longrope_past_its_original_length_is_refused(model_dir, tmp_path):
    # the tiny Phi-3's LongRoPE holds its short factors to 64 tokens; past that HF rescales by sequence length
    with pytest.raises(UnsupportedModelError, match="LongRoPE switches to its long factors for sequences over 64 "
                                                    "tokens.*use --max-seq-len 64 or less"):
        export(model_dir("phi3"), tmp_path / "out", max_seq_len=128)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    from transformers import PhiConfig

    PhiConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'phi'.*gemma2, gemma3_text, gpt2, llama, mistral, phi3, qwen2, qwen3"):
        export(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer_is_refused(model_dir, tmp_path):
    import shutil

    src = model_dir("llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("tokenizer") and f.name != "special_tokens_map.json":
            shutil.copy(f, bare / f.name)
    with pytest.raises(UnsupportedModelError, match="no usable tokenizer"):
        export(bare, tmp_path / "out")
    assert not (tmp_path / "out").exists()
