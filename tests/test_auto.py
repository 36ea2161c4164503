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


def test_a_build_that_fails_while_its_head_is_made_leaves_no_engine_and_no_process(tmp_path, model_dir, monkeypatch):
    """The head is made in a second process while the target compiles: a failure of the target's compile stops it
    and leaves nothing at the output path."""
    import torch

    import trtspec
    from trtspec.heads import carried

    started = []
    start = carried.HEAD_CARRIERS["eagle3"]

    def recording(*args, **kw):
        finish = start(*args, **kw)
        started.append(finish.process)
        return finish

    def failing(*args, **kw):
        raise RuntimeError("the target's compile failed")

    monkeypatch.setitem(carried.HEAD_CARRIERS, "eagle3", recording)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", failing)
    head_dir = released_head(tmp_path / "released", model_dir(ARCH))
    with pytest.raises(RuntimeError, match="the target's compile failed"):
        trtspec.build(model_dir(ARCH), tmp_path / "engine", backend="torch", head=head_dir, max_seq_len=S_MAX,
                      max_batch=MAX_BATCH)
    assert not (tmp_path / "engine").exists() and not list(tmp_path.glob(".engine*"))
    assert len(started) == 1 and started[0].poll() is not None  # started, then stopped


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


def test_an_engine_carrying_its_head_drafts_with_it_compiled(carrier):
    engine_dir, _ = carrier
    engine = load_engine(engine_dir)
    assert engine.manifest["head"]["kind"] == "eagle3" and engine.manifest["model"]["hidden_states"]["layers"]
    assert engine.manifest["head"]["form"] == "compiled"
    plain = Generator(engine, drafter="none")
    reference = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=16)]
    plain.close()
    assert Generator(engine).scheduler.drafter_name == "auto"  # the default for an engine with a head
    carried = Generator(engine, drafter="eagle3", num_draft_tokens=3, k_policy="fixed")  # no draft given
    assert carried.scheduler.drafter.engine.backend == "torch"
    seen = _recorded(carried)
    assert [r.token_ids for r in carried.generate(PROMPTS, max_new_tokens=16)] == reference
    carried.close()
    assert any(any(row) for row in seen)


def test_the_compiled_head_computes_the_head(carrier, model_dir):
    """The carried head's package (8-bit blocks, int8 activations) against the head's float step on the same calls:
    target features for 6 positions, then a drafted position reading the head's own output."""
    import numpy as np
    import torch

    from trtspec.heads.eagle3 import load_head
    from trtspec.heads.export import _step_module

    engine_dir, head_dir = carrier
    compiled = load_engine(engine_dir / "head")
    head, config = load_head(head_dir, target_dir=model_dir(ARCH))
    step = _step_module(head.float().eval(), S_MAX)
    rng = np.random.default_rng(0)
    t = 6
    ids = rng.integers(0, config.vocab_size, (1, t + 1))
    features = rng.standard_normal((1, t, 3 * config.target_hidden_size)).astype(np.float32)
    cache = [torch.zeros(1, config.num_key_value_heads, S_MAX, config.head_dim) for _ in range(2)]
    calls = [(ids[:, :t], np.arange(t)[None], {"features": features}), (ids[:, t:], np.array([[t]]), None)]
    hidden = None  # the float step's output hidden states, from the first call on
    for i, (call_ids, pos, inputs) in enumerate(calls):
        if inputs is None:  # the drafted position: the head's own output at the position before
            inputs = {"hidden_in": hidden[:, -1:]}
        got = compiled.forward(call_ids, pos, inputs=inputs).copy()
        got_hidden = compiled.features.copy()
        f = torch.from_numpy(inputs.get("features", np.zeros((1, pos.shape[1], 3 * config.target_hidden_size),
                                                                np.float32)))
        h_in = torch.from_numpy(inputs.get("hidden_in", np.zeros((1, pos.shape[1], config.hidden_size), np.float32)))
        with torch.no_grad():
            ref, hidden, *cache = step(torch.from_numpy(call_ids), torch.from_numpy(pos), f, h_in, *cache)
        ref, hidden = ref.numpy(), hidden.numpy()
        assert got.shape == ref.shape == (1, pos.shape[1], config.draft_vocab_size)
        # 8-bit weights and int8 activations: within a few percent of the logits' range, the same top token
        assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max(), (i, np.abs(got - ref).max(), np.abs(ref).max())
        assert np.abs(got_hidden - hidden).max() <= 0.03 * np.abs(hidden).max()
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    with pytest.raises(ValueError, match=r"features has shape \(1, 6, \d+\), the call needs \(1, 2, "):
        compiled.forward(ids[:, :2], np.arange(2)[None], inputs={"features": features})
    with pytest.raises(ValueError, match="takes no input features"):  # the target's engine has none
        load_engine(engine_dir).forward(ids[:, :1], np.zeros((1, 1), np.int64), inputs={"features": features[:, :1]})


def test_where_the_kernels_cannot_be_built_the_head_is_carried_for_onnxruntime(carrier, model_dir, tmp_path,
                                                                                monkeypatch):
    import shutil

    from trtspec import kernels
    from trtspec.heads.carried import carry_head

    engine_dir, head_dir = carrier
    engine = load_engine(engine_dir)
    reference = [r.token_ids for r in Generator(engine, drafter="none").generate(PROMPTS, max_new_tokens=16)]
    writing = tmp_path / "engine"  # the engine as the build has it when it carries the head
    shutil.copytree(engine_dir, writing, ignore=shutil.ignore_patterns("head"))
    monkeypatch.setattr(kernels, "load", lambda *a, **k: "torch")
    monkeypatch.setattr(kernels, "status", lambda: {"backend": "torch", "reason": "no C++ compiler"})
    section = carry_head(head_dir, writing, engine.manifest, model_dir(ARCH))
    monkeypatch.undo()
    assert section["form"] == "onnxruntime"
    head = load_engine(writing / section["path"])
    assert head.backend == "onnxruntime" and head.manifest["model"]["weight_bits"] == 8
    gen = Generator(engine, head, drafter="eagle3", num_draft_tokens=3, k_policy="fixed")
    seen = _recorded(gen)
    assert [r.token_ids for r in gen.generate(PROMPTS, max_new_tokens=16)] == reference
    gen.close()
    assert any(any(row) for row in seen)


def _linear_costs(one=1.0, per_token=0.1):
    return lambda b, t, tree=False: one + per_token * (t - 1)


def test_chains_stop_where_another_draft_no_longer_pays():
    import numpy as np

    from trtspec.runtime.drafters.auto import ConfidenceStop

    stop = ConfidenceStop(_linear_costs())
    calls = [(2, 3, 0.05), (2, 1, 0.05), (2, 1, 0.05), (2, 1, 0.05)]
    chains = np.array([[0.9, 0.8, 0.7, 0.6], [0.05, 0.01, 0.005, 0.001]])
    # before any verdict the probabilities are taken as they are: a likely chain is kept whole (tokens 1 + 3.0 over
    # 1.3 + 0.2 s beat every shorter one), an unlikely one is cut to nothing (one token over 1.2 s is the best)
    assert stop.trim(chains, np.array([4, 4]), calls).tolist() == [4, 0]
    assert stop.call_s == pytest.approx(0.05) and list(stop.pending) == [0]
    # one more draft pays for the first row (0.6 * 0.6 / 0.7 more tokens for 0.15 s), not for the second
    assert stop.extend(chains[:, :4], calls[:1]).tolist() == [True, False]
    assert stop.trim(chains, np.array([2, 4]), calls).tolist() == [2, 0]  # never more than a row drafted
    # the target rejects such confident chains' first draft, again and again: the calibration learns it
    for _ in range(40):
        stop.trim(chains, np.array([4, 4]), calls)
        stop.record(0, 0)
    assert stop.calibrated(chains[:1])[0, 0] < 0.1
    assert stop.trim(chains, np.array([4, 4]), calls).tolist() == [0, 0]
    assert not stop.extend(chains[:, :1], calls[:1]).any()
    # costs not measured yet: chains are not cut
    assert ConfidenceStop(lambda b, t, tree=False: None).trim(chains, np.array([3, 4]), calls).tolist() == [3, 4]


def test_the_head_is_asked_only_while_asking_it_paid(eagle):
    from trtspec.runtime.drafters import AutoDrafter
    from trtspec.runtime.drafters.auto import _PROBE_EVERY

    target_path, head_path, _ = eagle
    gen = Generator(load_engine(target_path), head_path, drafter="auto")
    drafter = gen.scheduler.drafter
    assert isinstance(drafter, AutoDrafter)
    drafter._greedy, drafter.costs = True, _linear_costs()
    assert drafter._draft_k(1, 4) == 4  # nothing measured yet: asked
    drafter.asked = (0.1, 2.0, 0.5)  # 1.1 tokens over 1.1 + 0.5 s: slower than one token a second
    assert [drafter._draft_k(1, 4) for _ in range(_PROBE_EVERY + 1)] == [0] * _PROBE_EVERY + [4]  # then a probe
    drafter.asked = (1.5, 3.0, 0.3)  # 2.5 tokens over 1.2 + 0.3 s
    assert drafter._draft_k(1, 4) == 4
    drafter._greedy = False  # sampled rows: the head's measured acceptance and call costs (SuffixThenDraft)
    drafter.draft_accepted, drafter.draft_checked, drafter.draft_call_s = 0.0, 100.0, 0.5
    assert drafter._draft_k(1, 4) == 0
    gen.close()


def test_auto_with_measured_costs_cuts_chains_and_equals_the_target(eagle):
    """The default load-aware policy: the call costs are measured, the chains cut by the head's calibrated
    probabilities; the output is the target's, alone and batched."""
    target_path, head_path, _ = eagle
    target = load_engine(target_path)
    reference = [r.token_ids for r in Generator(target).generate(PROMPTS * 2, max_new_tokens=40)]
    gen = Generator(target, head_path, drafter="auto", num_draft_tokens=4)
    stop = gen.scheduler.drafter.stop
    assert [gen.generate(p, max_new_tokens=40).token_ids for p in PROMPTS * 2] == reference
    assert [r.token_ids for r in gen.generate(PROMPTS * 2, max_new_tokens=40)] == reference
    assert stop.costs is not None and stop.trials.sum() > 0  # the head's chains were proposed and judged
    gen.close()
