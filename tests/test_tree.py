"""Tree verification and target features in the step graph: hidden-state outputs equal HF's per layer; a
tree call's logits equal HF's for every node's path; keeping the accepted path compacts the cache in place, and
decoding goes on exactly (exporter/contract.py). Tree speculation through the drafters: test_trees.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TREE, hf_logits, random_ids
from trtspec import load_engine
from trtspec.engines.base import tree_positions

TOL = 1e-4


def _caches(engine) -> list[np.ndarray]:
    """An engine's KV cache buffers as arrays (onnxruntime: numpy buffers; torch: tensors)."""
    if hasattr(engine, "caches"):
        return [c.cpu().numpy() for c in engine.caches]
    return list(engine.cache.values())


def _hf_hidden(model, ids):
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids, np.int64))[None], output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states], out.logits[0].float().numpy()


@pytest.mark.parametrize("arch,form", [("llama-gqa-rope3", "fused"), ("qwen3", "export"), ("gemma2", "export"),
                                       ("phi3", "export"), ("gpt2", "export"), ("llama-gqa-rope3", "torch-inductor")])
def test_hidden_states_equal_hf_per_layer(arch, form, tree_engine, model_dir, hf_model):
    engine = tree_engine(arch, form)
    model = engine.manifest["model"]
    layers = model["hidden_states"]["layers"]
    n = model["num_layers"]
    assert n == 2 and layers == [1, 1, 1, 2]  # low/mid/high spread over a shallow model, then the last state
    hf = hf_model(model_dir(arch))
    ids = random_ids(20, seed=3)
    ref, ref_logits = _hf_hidden(hf, ids)
    got, logits = [], []
    for start, end in ((0, 13), (13, 14), (14, 20)):  # a prefill chunk, a decode call, a verify-sized call
        logits.append(engine.forward(ids[None, start:end], np.arange(start, end)[None])[0].copy())
        got.append(engine.features[0].copy())
    got = np.concatenate(got)
    h = hf.config.hidden_size
    assert got.shape == (20, len(layers) * h) and model["hidden_states"]["size"] == got.shape[1]
    for j, layer in enumerate(layers):
        np.testing.assert_allclose(got[:, j * h : (j + 1) * h], ref[layer], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.concatenate(logits), ref_logits, atol=TOL, rtol=0)


def _paths(tokens, parents):
    # each node's tokens from the root down
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(path[::-1])
    return out


# two trees of different sizes (the smaller padded with nodes that only see the root and themselves)
TREES = [
    ([7, 11, 13, 19, 21, 23, 29], [-1, 0, 0, 1, 2, 1, 3]),
    ([31, 37, 41, 43], [-1, 0, 1, 0]),
]


@pytest.mark.parametrize("arch,form", [("llama-gqa-rope3", "fused"), ("llama-gqa-rope3", "export"),
                                       ("qwen3", "plain"), ("gemma2", "export"), ("gpt2", "fused"),
                                       ("llama-gqa-rope3", "torch-inductor"), ("gemma2", "torch")])
def test_tree_call_logits_equal_hf_for_every_path_then_decoding_goes_on(arch, form, tree_engine, model_dir, hf_model):
    engine = tree_engine(arch, form)
    if form == "fused":  # decode calls keep the decode graph; tree calls run the built graph
        assert engine.manifest["build"]["decode_graph"]["graph"] == "decode.onnx"
    hf = hf_model(model_dir(arch))
    prompts = [random_ids(9, seed=1), random_ids(5, seed=2)]  # ragged: the rows' roots sit at different positions
    t = max(len(tokens) for tokens, _ in TREES)
    for r, p in enumerate(prompts):
        engine.forward(p[None], np.arange(p.size)[None], first_row=r)
    ids = np.zeros((2, t), np.int64)
    parents = np.zeros((2, t), np.int64)
    for r, (tokens, par) in enumerate(TREES):
        ids[r, : len(tokens)] = tokens
        parents[r] = [*par, *[0] * (t - len(par))]  # pads hang off the root
    mask, depth = tree_positions(parents)
    base = np.array([p.size for p in prompts])
    logits = engine.forward(ids, base[:, None] + depth, tree_mask=mask).copy()
    features = engine.features.copy()
    for r, (tokens, par) in enumerate(TREES):
        for i, path in enumerate(_paths(tokens, par)):
            seq = [*prompts[r], *path]
            np.testing.assert_allclose(logits[r, i], hf_logits(hf, seq)[-1], atol=TOL, rtol=0)
            hidden, _ = _hf_hidden(hf, seq)
            n = engine.manifest["model"]["num_layers"]
            h = hf.config.hidden_size
            np.testing.assert_allclose(features[r, i, -h:], hidden[n][-1], atol=TOL, rtol=0)
    # keep a path per row (row 0: nodes 0, 2, 4 -> tokens 7, 13, 21; row 1: the root alone), then decode on
    kept = [[0, 2, 4], [0]]
    for r, nodes in enumerate(kept):
        engine.keep_path(r, int(base[r]), nodes)
    seqs = [[*prompts[r], *[TREES[r][0][i] for i in nodes]] for r, nodes in enumerate(kept)]
    for step in range(4):
        nxt = [int(random_ids(1, seed=10 + step + r)[0]) for r in range(2)]
        pos = np.array([[len(s)] for s in seqs])
        out = engine.forward(np.array([[x] for x in nxt]), pos)
        for r in range(2):
            seqs[r].append(nxt[r])
            np.testing.assert_allclose(out[r, 0], hf_logits(hf, seqs[r])[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("form", ["export", "torch"])
def test_a_tree_with_nothing_accepted_leaves_the_cache_as_a_one_token_decode_would(form, tree_engine):
    tree, plain = tree_engine("llama-gqa-rope3", form), tree_engine("llama-gqa-rope3", "fused")
    prompt = random_ids(12, seed=5)
    for e in (tree, plain):
        e.reset()
        e.forward(prompt[None], np.arange(12)[None])
    tokens, parents = TREES[0]
    mask, depth = tree_positions(np.array([parents]))
    tree.forward(np.array([tokens]), 12 + depth, tree_mask=mask)
    tree.keep_path(0, 12, [0])
    plain.forward(np.array([[tokens[0]]]), np.array([[12]]))
    for got, ref in zip(_caches(tree), _caches(plain), strict=True):
        np.testing.assert_allclose(got[0, :, :13], ref[0, :, :13], atol=1e-5, rtol=0)
    a = tree.forward(np.array([[5]]), np.array([[13]]))[0, 0].copy()
    b = plain.forward(np.array([[5]]), np.array([[13]]))[0, 0]
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_tree_calls_are_checked(tree_engine, exported):
    engine = tree_engine("llama-gqa-rope3", "export")
    mask, depth = tree_positions(np.array([[-1, 0, 0]]))
    with pytest.raises(ValueError, match="root's position"):
        engine.forward(np.array([[4, 5, 6]]), np.array([[3, 4, 5]]), tree_mask=mask)  # chain positions, tree mask
    bad = mask.copy()
    bad[0, 0, 2] = True
    with pytest.raises(ValueError, match="only nodes before it"):
        engine.forward(np.array([[4, 5, 6]]), 3 + depth, tree_mask=bad)
    plain = load_engine(exported("llama-gqa-rope3"))
    with pytest.raises(ValueError, match="--tree"):
        plain.forward(np.array([[4, 5, 6]]), 3 + depth, tree_mask=mask)
    manifest = json.loads((exported("llama-gqa-rope3", **TREE) / "manifest.json").read_text())["model"]
    assert manifest["inputs"][:3] == ["input_ids", "position_ids", "tree_mask"]
    assert manifest["outputs"][:2] == ["logits", "hidden_states"]


def test_tensorrt_profiles_and_bindings_carry_the_tree_mask():
    # (pure Python: TensorRT is not installed here) every profile of a tree export gives tree_mask [B, T, T]
    from trtspec.builder.tensorrt_plan import profile_plan
    from trtspec.engines.tensorrt import call_bindings

    model = {"max_seq_len": 64, "max_batch": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "vocab_size": 100,
             "num_layers": 1, "kv_aliases": {"present_key_0": "past_key_0", "present_value_0": "past_value_0"},
             "tree_verify": True, "hidden_states": {"layers": [1], "size": 16}}
    plan = profile_plan(model, max_prefill=32, verify_tokens=[5, 17])
    shapes = {p["name"]: p["shapes"]["tree_mask"] for p in plan["profiles"]}
    assert shapes["verify_17"] == {"min": [1, 17, 17], "opt": [2, 17, 17], "max": [2, 17, 17]}
    assert shapes["prefill"]["max"] == [2, 32, 32] and shapes["decode"]["max"] == [2, 1, 1]
    pointers = {"input_ids": 1, "position_ids": 2, "logits": 3, "tree_mask": 4, "hidden_states": 5,
                "past_key_0": 1000, "past_value_0": 2000}
    shapes, addresses = call_bindings(model, model["kv_aliases"], 2, 17, pointers, first_row=0, row_bytes=10)
    assert shapes["tree_mask"] == [2, 17, 17] and addresses["tree_mask"] == 4 and addresses["hidden_states"] == 5
