"""The auto drafter (runtime/drafters/auto.py): suffix decoding where the text repeats, the EAGLE-3 head elsewhere,
output the target's (greedy and sampled); and an engine that carries its head (build --head: heads/carried.py),
whose head drafts exactly as the same head exported beside it."""

from __future__ import annotations

import pytest

from conftest import ARCH, MAX_BATCH, S_MAX, released_head
from trtspec import Generator, load_engine

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "import os", "the cat sat on the mat. the cat"]


def test_auto_equals_target_greedy_and_drafts_with_both(eagle):
    target_path, head_path, _ = eagle
    target = load_engine(target_path)
    reference = [r.token_ids for r in Generator(target).generate(PROMPTS, max_new_tokens=24)]
    gen = Generator(target, head_path, drafter="auto", num_draft_tokens=3, k_policy="fixed")
    assert [gen.generate(p, max_new_tokens=24).token_ids for p in PROMPTS] == reference  # alone
    assert [r.token_ids for r in gen.generate(PROMPTS, max_new_tokens=24)] == reference  # batched
    by = gen.scheduler.stats().by_drafter
    assert set(by) == {"suffix", "eagle3"} and all(proposed > 0 for proposed, _ in by.values())
    gen.close()


def test_auto_samples_the_target_distribution(exported, built, model_dir, tmp_path):
    """A head trained by distill on the tiny target's own answers (distill/eagle3_engine.py), so that its drafts are
    accepted and rejected; every other batch starts with the suffix drafter's cache of earlier outputs empty, so both
    drafters draft rows."""
    from test_verify import ALPHA, _chi_square_p_value, _exact_joint

    from trtspec.distill.eagle3_engine import distill_eagle3_engine
    from trtspec.heads.export import export_head
    from trtspec.runtime import SamplingParams
    from trtspec.runtime.drafters import SuffixCache

    writer = built(ARCH, hidden_states="low,mid,high")
    words = ["def", "The", "import", "class", "for", "x =", "a b a", "if"]
    tok = Generator(load_engine(writer)).tokenizer
    requests = [(w, tok(w)["input_ids"]) for w in words]
    distill_eagle3_engine(writer, tmp_path / "trained", requests=requests, heldout=requests[:2], max_new_tokens=40,
                          draft_vocab=256, steps=60, batch=8, seq=32, lr=5e-3, ttt_steps=2, eval_every=0,
                          eval_tokens=8, bf16=False)
    target = load_engine(exported(ARCH, max_seq_len=16, max_batch=64, hidden_states="low,mid,high"))
    head = export_head(tmp_path / "trained", tmp_path / "head", target=target.path)
    gen = Generator(target, head, drafter="auto", num_draft_tokens=2, k_policy="fixed")
    prompt = "def"
    params = SamplingParams(temperature=1.5, top_k=4)
    joint = _exact_joint(model_dir(ARCH), gen.tokenizer(prompt)["input_ids"], params, depth=3)
    counts = {}
    for i in range(20_480 // 64):
        if i % 2 == 0:  # every other batch starts without earlier outputs: the suffix drafter has nothing, the head drafts
            gen.scheduler.drafter.suffix.cache = SuffixCache()
        for r in gen.generate([prompt] * 64, max_new_tokens=3, temperature=1.5, top_k=4, seed=64 * i):
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert sum(counts.values()) == 20_480
    assert _chi_square_p_value(counts, joint) > ALPHA
    by = gen.scheduler.stats().by_drafter  # both drafters' rows verified, with both outcomes
    assert set(by) == {"suffix", "eagle3"}
    assert all(0.0 < accepted / proposed < 1.0 for proposed, accepted in by.values()), by
    gen.close()


@pytest.fixture(scope="module")
def carrier(tmp_path_factory, model_dir):
    """(an AOT torch engine built with --head, the head's directory)"""
    import trtspec

    root = tmp_path_factory.mktemp("carried")
    head_dir = released_head(root / "released", model_dir(ARCH))
    engine = trtspec.build(model_dir(ARCH), root / "engine", backend="torch", head=head_dir, max_seq_len=S_MAX,
                           max_batch=MAX_BATCH)
    return engine, head_dir


def _recorded(gen):
    """Every round's proposal (drafts and counts) of a Generator's drafter, as it makes them."""
    drafter, seen = gen.scheduler.drafter, []
    propose = drafter.propose

    def record(*args, **kw):
        p = propose(*args, **kw)
        seen.append([p.drafts[r, : p.counts[r]].tolist() for r in range(len(p.counts))])
        return p

    drafter.propose = record
    return seen


def test_an_engine_carrying_its_head_drafts_as_the_head_beside_it(carrier, tmp_path):
    from trtspec.heads.carried import WEIGHT_BITS
    from trtspec.heads.export import export_head_for

    engine_dir, head_dir = carrier
    engine = load_engine(engine_dir)
    assert engine.manifest["head"]["kind"] == "eagle3" and engine.manifest["model"]["hidden_states"]["layers"]
    plain = Generator(engine, drafter="none")
    reference = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=16)]
    plain.close()
    assert Generator(engine).scheduler.drafter_name == "auto"  # the default for an engine with a head
    carried = Generator(engine, drafter="eagle3", num_draft_tokens=3, k_policy="fixed")  # no draft given
    seen = _recorded(carried)
    assert [r.token_ids for r in carried.generate(PROMPTS, max_new_tokens=16)] == reference
    carried.close()
    # beside it: the same head exported for the engine as the build carries it (its matrices in 8-bit blocks)
    head = export_head_for(head_dir, tmp_path / "head", target=engine_dir, target_manifest=engine.manifest,
                           weight_bits=WEIGHT_BITS)
    beside = Generator(engine, head, drafter="eagle3", num_draft_tokens=3, k_policy="fixed")
    seen_beside = _recorded(beside)
    assert [r.token_ids for r in beside.generate(PROMPTS, max_new_tokens=16)] == reference
    beside.close()
    assert seen == seen_beside and any(any(row) for row in seen)
