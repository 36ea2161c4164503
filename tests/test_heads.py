"""Draft heads on the target's features (heads/): an EAGLE-3 head in its authors' released layout loads and exports
to a step graph equal to the torch head; trained heads draft. Their drafters: test_eagle3.py, test_medusa.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import released_head
from trtspec import Generator, load_engine

ARCH = "llama-gqa-rope3"
TOL = 1e-4


def test_released_layout_loads_and_the_exported_head_equals_it(eagle, model_dir):
    import torch

    from trtspec.heads.eagle3 import load_head

    target_path, head_path, head_dir = eagle
    head, config = load_head(head_dir, target_dir=model_dir(ARCH))
    assert config.draft_vocab_size == 200 and config.target_hidden_size == 64
    engine = load_engine(head_path)
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(1, 9, 192)).astype(np.float32)
    tokens = rng.integers(3, 300, size=(1, 9))
    with torch.no_grad():
        ref = head.forward_steps(torch.from_numpy(feats), torch.from_numpy(tokens), 1)[0][0].numpy()
    # the verified pairs in two calls (5 + 4 positions), as a round's catch-up feeds them
    got = np.concatenate([engine.forward(tokens[:, s:e], np.arange(s, e)[None], inputs={"features": feats[:, s:e]})[0].copy()
                          for s, e in ((0, 5), (5, 9))])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    # a drafted position reads the head's own output: equal to the torch head fed that hidden state
    hidden = engine.features[0, -1].copy()
    out = engine.forward(np.array([[7]]), np.array([[9]]), inputs={"hidden_in": hidden[None, None]})[0, 0]
    with torch.no_grad():
        emb = head.embed_tokens(torch.tensor([[7]]))
        q, k, v = head.qkv(emb, torch.from_numpy(hidden)[None, None], torch.tensor([[9]]))
        # attention over the 9 verified pairs' keys and its own
        f = torch.from_numpy(feats)
        kk, vv = head.qkv(head.embed_tokens(torch.from_numpy(tokens)), head.fc(f), torch.arange(9)[None])[1:]
        keys, values = torch.cat([kk, k], 2), torch.cat([vv, v], 2)
        rep = config.num_attention_heads // config.num_key_value_heads
        att = torch.softmax(q @ keys.repeat_interleave(rep, 1).transpose(-1, -2) * config.head_dim**-0.5, -1)
        y = att @ values.repeat_interleave(rep, 1)
        ref_out = head.logits(head.finish(torch.from_numpy(hidden)[None, None], y))[0, 0].numpy()
    np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=0)
    manifest = engine.manifest["model"]
    assert manifest["logits_size"] == 200 and manifest["target_layers"] == [1, 1, 1]


def test_a_built_head_keeps_its_vocabulary_map_and_drafts_as_its_export(eagle, tmp_path):
    """`trtspec build` of an exported head: the engine carries draft_to_target.npy (before 2026-11-27 it did not,
    and the head engine was refused as "not an exported draft head"), and drafts the same tokens as the export."""
    from trtspec.builder import build
    from trtspec.manifest import read_manifest

    target_path, head_path, _ = eagle
    engine = build(head_path, tmp_path / "head-engine")
    assert read_manifest(engine)["format"] == "trtspec-engine"
    np.testing.assert_array_equal(np.load(engine / "draft_to_target.npy"), np.load(head_path / "draft_to_target.npy"))
    target = load_engine(target_path)
    prompts = ["def add(a, b):", "import os"]
    reference = [r.token_ids for r in Generator(target).generate(prompts, max_new_tokens=16)]
    runs = [Generator(target, head, drafter="eagle3", num_draft_tokens=3, k_policy="fixed").generate(prompts,
                                                                                                  max_new_tokens=16)
            for head in (head_path, engine)]
    assert [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[0]] == reference
    assert runs[1].stats.proposed == runs[0].stats.proposed > 0
    assert runs[1].stats.accepted == runs[0].stats.accepted


def test_eagle3_with_a_self_consistent_head_accepts(tmp_path, exported, built, model_dir):
    """A head trained for a few steps on the tiny target's own samples agrees with it often: drafts get accepted,
    through the scheduler (chains and a tree), and the output stays the target's. (Through the public API, as the
    README shows it: trtspec.distill(method="eagle3"), trtspec.export_head.)"""
    from trtspec import distill, export_head

    text = tmp_path / "text"
    text.mkdir()
    target = built(ARCH, tree=True, hidden_states="low,mid,high")
    gen = Generator(load_engine(target))
    samples = gen.generate(["def", "The", "import", "class", "for", "x ="] * 2, max_new_tokens=60)
    for i, r in enumerate(samples):
        (text / f"s{i}.py").write_text(r.text)
    distill(model_dir(ARCH), tmp_path / "head", [text], method="eagle3", heldout=[text / "s0.py"], draft_vocab=320,
            steps=60, batch=8, seq=32, lr=5e-3, eval_prompts=0, ttt_steps=2)
    head = export_head(tmp_path / "head", tmp_path / "head-export", target=target)
    prompts = ["def", "The quick"]
    reference = [r.token_ids for r in gen.generate(prompts, max_new_tokens=30)]
    for width in (1, 3):
        out = Generator(load_engine(target), head, drafter="eagle3", num_draft_tokens=3, k_policy="fixed",
                        tree_width=width).generate(prompts, max_new_tokens=30)
        assert [r.token_ids for r in out] == reference
        assert out.stats.accepted > 0
    # the distill report's acceptance check: the head exported for a fresh target export, through the engines
    from trtspec.distill import measure_acceptance

    measured = measure_acceptance(model_dir(ARCH), tmp_path / "head", prompts, method="eagle3", k=3, max_new_tokens=16)
    assert measured["alpha"] > 0 and measured["tokens_per_target_call"] > 1


def test_head_and_target_must_match(eagle, exported, tmp_path, model_dir):
    from trtspec.errors import ArtifactError
    from trtspec.heads.export import export_head

    _, _, head_dir = eagle
    plain = exported(ARCH)
    with pytest.raises(ArtifactError, match="--hidden-states"):
        export_head(head_dir, tmp_path / "x", target=plain)
    with pytest.raises(ValueError, match="needs its head"):
        Generator(load_engine(plain), drafter="eagle3")


def test_a_head_finds_the_targets_embedding_after_the_export_moved(eagle, exported, tmp_path, model_dir):
    """The released head has no embedding of its own: export_head takes the target's from the HF directory the
    engine's manifest names, which the engine keeps even when its export directory has moved; where that directory
    is unknown, the error says which option gives it."""
    import shutil

    from trtspec import build, export_head
    from trtspec.errors import ArtifactError

    _, _, head_dir = eagle
    x = shutil.copytree(exported(ARCH, hidden_states="low,mid,high"), tmp_path / "export")
    engine = build(x, tmp_path / "engine")
    x.rename(tmp_path / "export-moved")
    head = export_head(head_dir, tmp_path / "head", target=engine)
    assert head.is_dir()
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["source"].pop("model_dir")  # as an engine built before engines named their HF directory
    unknown = shutil.copytree(engine, tmp_path / "engine-old")
    (unknown / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="--target-model DIR"):
        export_head(head_dir, tmp_path / "head2", target=unknown)
    assert export_head(head_dir, tmp_path / "head3", target=unknown, target_model=model_dir(ARCH)).is_dir()


def test_the_cli_exports_a_tree_target_and_a_head_and_generates_the_targets_text(tmp_path, model_dir, capsys):
    from trtspec.cli import main

    src = model_dir(ARCH)
    target = tmp_path / "target"
    assert main(["export", str(src), "-o", str(target), "--max-seq-len", "64", "--max-batch", "2", "--tree",
                 "--hidden-states", "low,mid,high"]) == 0
    model = json.loads((target / "manifest.json").read_text())["model"]
    assert model["tree_verify"] and model["hidden_states"]["layers"] == [1, 1, 1]
    head = released_head(tmp_path / "released", src)
    assert main(["export-head", str(head), "--target", str(target), "-o", str(tmp_path / "head")]) == 0
    capsys.readouterr()

    def tokens(*extra, target=target):
        assert main(["generate", "--target", str(target), "--prompt", "def add(a, b):", "--max-new-tokens", "20",
                     "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["results"][0]["token_ids"]

    reference = tokens()
    head_args = ("--draft", str(tmp_path / "head"), "--drafter", "eagle3", "--tree-width", "2", "-k", "3")
    assert tokens(*head_args) == reference
    # --backend torch from the HF directory: the target compiled with the features the head reads and a tree input
    assert tokens(*head_args, "--backend", "torch", target=src) == reference
