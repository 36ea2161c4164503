"""The Medusa drafter (runtime/drafters/medusa.py): heads on the target's last hidden state draft product trees (or
chains) that keep the target's greedy output, and the Medusa authors' layout loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ARCH
from trtspec import Generator, load_engine


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
