"""Draft heads on the target's features: an EAGLE-3 head in its authors' released layout loads, exports to a step
graph equal to the torch head, and drafts for exact speculation (chains and trees, batched, sampled)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtspec import Generator, load_engine

ARCH = "llama-gqa-rope3"
TOL = 1e-4


def released_head(out, target_dir, *, draft_vocab=200, seed=0):
    """A random EAGLE-3 head written exactly as the EAGLE authors publish theirs: config.json (architecture
    LlamaForCausalLMEagle3, draft_vocab_size) and pytorch_model.bin with fc / midlayer.* / norm / lm_head / d2t /
    t2d, no embedding (it is the target's)."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target_dir)
    h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // nh
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * (shape[-1] ** -0.5)

    ids = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab]).values
    state = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(nh * d, 2 * h), "midlayer.self_attn.k_proj.weight": w(nkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * d, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, nh * d),
        "midlayer.mlp.gate_proj.weight": w(96, h), "midlayer.mlp.up_proj.weight": w(96, h),
        "midlayer.mlp.down_proj.weight": w(h, 96),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "norm.weight": torch.ones(h), "lm_head.weight": w(draft_vocab, h) * 8,
        "d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill(0, ids, True),
    }
    out.mkdir(parents=True)
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": 96,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab, "max_position_embeddings": 2048,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    return out


@pytest.fixture(scope="module")
def eagle(tmp_path_factory, exported, built, model_dir):
    from trtspec.heads.export import export_head

    target = built(ARCH, tree=True, hidden_states="low,mid,high,last")  # (more layers than the head reads)
    tmp = tmp_path_factory.mktemp("eagle3")
    head_dir = released_head(tmp / "released", model_dir(ARCH))
    head = export_head(head_dir, tmp / "head", target=target)
    return target, head, head_dir


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


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree_width", [1, 3])
def test_greedy_eagle3_speculation_equals_target_greedy(eagle, batch, tree_width):
    target_path, head_path, _ = eagle
    target = load_engine(target_path)
    prompts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"][:batch]
    reference = [r.token_ids for r in Generator(target).generate(prompts, max_new_tokens=16)]
    gen = Generator(target, head_path, drafter="eagle3", num_draft_tokens=3, k_policy="fixed", tree_width=tree_width)
    out = gen.generate(prompts, max_new_tokens=16)  # (within the 64-slot cache: trees are never cut for room)
    assert [r.token_ids for r in out] == reference
    assert out.stats.proposed > 0
    # the head drafted every round after the first: it got the target's features of every verified position
    # (the last rounds draft fewer: the output's room)
    assert all(r.stats.proposed >= 3 * (r.stats.rounds - 3) for r in out)


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


@pytest.mark.parametrize("tree_width", [1, 3])
def test_greedy_eagle3_speculation_over_a_torch_target_equals_its_greedy(eagle, model_dir, tree_width):
    import trtspec
    from conftest import MAX_BATCH, S_MAX

    # the torch backend with the same features (the head reads low/mid/high) and tree input as the built target
    target = trtspec.compile(model_dir(ARCH), max_seq_len=S_MAX, max_batch=MAX_BATCH, backend="eager", tree=True,
                             hidden_states="low,mid,high,last")
    prompts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"]
    reference = [r.token_ids for r in Generator(target).generate(prompts, max_new_tokens=16)]

    def run(target):  # -> (outputs, the target features the head was fed)
        head, fed = load_engine(eagle[1]), []
        forward = head.forward

        def recorded(ids, pos, first_row=0, **kw):
            features = (kw.get("inputs") or {}).get("features")
            if features is not None:
                fed.append(features.copy())
            return forward(ids, pos, first_row=first_row, **kw)

        head.forward = recorded
        gen = Generator(target, head, drafter="eagle3", num_draft_tokens=3, k_policy="fixed", tree_width=tree_width)
        return gen.generate(prompts, max_new_tokens=16), fed

    out, fed = run(target)
    assert [r.token_ids for r in out] == reference
    assert all(r.stats.proposed >= 3 * (r.stats.rounds - 3) for r in out)
    # the head read the same features from the torch target as from the onnxruntime one
    ort_out, ort_fed = run(load_engine(eagle[0]))
    assert [r.token_ids for r in ort_out] == reference and len(fed) == len(ort_fed) > 0
    for got, ref in zip(fed, ort_fed):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("tree_width", [1, 3])
def test_eagle3_under_a_grammar_ends_its_chain_where_its_vocabulary_allows_nothing(eagle, tree_width):
    # the grammar allows only letters whose tokens are off the head's reduced vocabulary: the head can propose
    # nothing there, so its chain ends (it used to propose a token the grammar refuses, failing the request)
    from trtspec.heads.export import draft_to_target

    target_path, head_path, _ = eagle
    target = load_engine(target_path)
    head = load_engine(head_path)
    on_head = set(draft_to_target(head).tolist())
    tok = Generator(target).tokenizer
    off = [c for c in "abcdefghijklmnopqrstuvwxyz" if tok.encode(c, add_special_tokens=False)[0] not in on_head
           and len(tok.encode(c, add_special_tokens=False)) == 1]
    assert len(off) >= 3
    fmt = {"type": "regex", "regex": "(" + "|".join(off[:3]) + "){8}"}
    prompts = ["def add(a, b):", "import os"]
    gen = Generator(target, head, drafter="eagle3", num_draft_tokens=3, k_policy="fixed", tree_width=tree_width)
    plain = Generator(target)
    for temperature in (0.0, 1.0):
        want = plain.generate(prompts, max_new_tokens=12, temperature=temperature, seed=5, response_format=fmt)
        got = gen.generate(prompts, max_new_tokens=12, temperature=temperature, seed=5, response_format=fmt)
        assert [r.text for r in got] == [r.text for r in want]
        assert all(len(r.text) == 8 and set(r.text) <= set(off[:3]) for r in got)


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


# -- Medusa -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def medusa(tmp_path_factory, built, model_dir):
    """Medusa heads trained briefly on the tiny target's own greedy text (so they agree with it often)."""
    from trtspec import distill

    tmp = tmp_path_factory.mktemp("medusa")
    target = built(ARCH, tree=True, hidden_states="last")
    text = tmp / "text"
    text.mkdir()
    for i, r in enumerate(Generator(load_engine(target)).generate(["def", "The", "import", "class", "for", "x ="] * 2,
                                                                  max_new_tokens=60)):
        (text / f"s{i}.py").write_text(r.text)
    distill(model_dir(ARCH), tmp / "heads", [text], method="medusa", heldout=[text / "s0.py"], medusa_heads=3,
            draft_vocab=320, steps=60, batch=8, seq=32, lr=5e-3, eval_prompts=0)
    return target, tmp / "heads"


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_medusa_tree_speculation_equals_target_greedy(medusa, exported, batch):
    target, heads = medusa
    prompts = ["def", "The quick", "import os"][:batch]
    engine = load_engine(target)
    reference = [r.token_ids for r in Generator(engine).generate(prompts, max_new_tokens=30)]
    gen = Generator(engine, heads, drafter="medusa", num_draft_tokens=3, k_policy="fixed", tree_nodes=8)
    out = gen.generate(prompts, max_new_tokens=30)
    assert [r.token_ids for r in out] == reference
    shapes = gen.scheduler.stats().tree_shapes
    assert out.stats.accepted > 0 and set(shapes) == {"medusa8"} and shapes["medusa8"] > 0
    # a target without --tree: each head's first choice, verified as a chain
    chain_target = load_engine(exported(ARCH, hidden_states="last"))
    out = Generator(chain_target, heads, drafter="medusa", num_draft_tokens=3, k_policy="fixed").generate(prompts, max_new_tokens=30)
    assert [r.token_ids for r in out] == reference


def test_medusa_heads_in_the_authors_layout_load(tmp_path, medusa):
    """medusa_lm_head.pt with full-vocabulary heads and no d2t (the Medusa authors' release) drafts as well."""
    import torch

    from trtspec.heads.medusa import HeadRunner

    target, heads = medusa
    ours = HeadRunner(heads)
    full = {}
    v = ours.vocab
    for i in range(ours.num_heads):
        w, b = ours.blocks[i]
        full[f"medusa_head.{i}.0.linear.weight"] = torch.from_numpy(w.T.copy())
        full[f"medusa_head.{i}.0.linear.bias"] = torch.from_numpy(b.copy())
        lm = torch.full((v, ours.hidden), 0.0)
        lm[torch.from_numpy(ours.to_target)] = torch.from_numpy(ours.heads[i].T.copy())
        full[f"medusa_head.{i}.1.weight"] = lm
    out = tmp_path / "authors"
    out.mkdir()
    torch.save(full, out / "medusa_lm_head.pt")
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": ours.num_heads, "medusa_num_layers": 1,
                                                 "hidden_size": ours.hidden, "vocab_size": v}))
    theirs = HeadRunner(out)
    hidden = np.random.default_rng(0).normal(size=(2, ours.hidden)).astype(np.float32)
    for (a_ids, _), (b_ids, _) in zip(ours.top(hidden, 1), theirs.top(hidden, 1)):
        np.testing.assert_array_equal(a_ids, b_ids)  # the same first choice over the full vocabulary


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
