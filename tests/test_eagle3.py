"""The EAGLE-3 drafter (runtime/drafters/eagle3.py): a head on the target's features drafts chains and trees, over
onnxruntime and torch targets and under a grammar, and the output stays the target's."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCH
from trtspec import Generator, load_engine

TOL = 1e-4


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
