"""Logits processing, logprobs and n samples stay lossless under speculation (runtime/logits.py, RowSampler).

Penalties, logit_bias and min_tokens are checked against an independent reference: HF's own logits with the
documented formulas applied here, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import hf_logits
from test_verify import ALPHA, _chi_square_p_value
from trtspec import Generator, load_engine

ARCH = "llama-gqa-rope3"
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"]

PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.6},
    "logit_bias": {"logit_bias": {7: 6.0, 11: 8.0, 13: -100.0}},
    "min_tokens": {"min_tokens": 12},  # with EOS made likely (below): without min_tokens it ends at once
    "all": {"presence_penalty": -0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "logit_bias": {9: 4.0},
            "min_tokens": 5},
}


def _reference_processed(logits, prompt, out, kw, eos):
    """The documented processing, written out: logit_bias, min_tokens, repetition, frequency, presence."""
    x = logits.astype(np.float64).copy()
    for t, b in kw.get("logit_bias", {}).items():
        x[t] += b
    if len(out) < kw.get("min_tokens", 0):
        x[list(eos)] = -np.inf
    r = kw.get("repetition_penalty", 1.0)
    if r != 1.0:
        for t in set(prompt) | set(out):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= kw.get("frequency_penalty", 0.0) * out.count(t) + kw.get("presence_penalty", 0.0)
    return x


def _reference_greedy(model, prompt, kw, eos, n):
    out = []
    for _ in range(n):
        x = _reference_processed(hf_logits(model, prompt + out)[-1], prompt, out, kw, eos)
        t = int(x.argmax())
        if t in eos:
            break
        out.append(t)
    return out


@pytest.fixture(scope="module")
def target(exported):
    return load_engine(exported(ARCH))


@pytest.fixture(scope="module")
def noisy(perturbed_export):
    return load_engine(perturbed_export(ARCH, 0.3))


@pytest.fixture(scope="module")
def plain(target):
    gen = Generator(target)
    yield gen
    gen.close()


@pytest.mark.parametrize("name", list(PENALTIES))
def test_greedy_with_penalties_equals_the_reference_with_and_without_speculation(name, target, noisy, plain,
                                                                                  hf_model, model_dir):
    kw = dict(PENALTIES[name])
    model = hf_model(model_dir(ARCH))
    eos = set(target.manifest["model"]["special_tokens"]["eos_token_ids"])
    base = {}
    if name == "min_tokens":
        base = {"logit_bias": {t: 12.0 for t in eos}}
        kw.update(base)
    prompts_ids = [plain.scheduler.encode(p).tolist() for p in PROMPTS]
    reference = [_reference_greedy(model, ids, kw, eos, 24) for ids in prompts_ids]
    unpenalised = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=24, **base)]
    assert reference != unpenalised  # the penalty changes the output: the comparison below means something
    assert [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=24, **kw)] == reference
    for gen in (Generator(target, noisy, num_draft_tokens=4, k_policy="fixed"),
                Generator(target, drafter="prompt_lookup", num_draft_tokens=3, k_policy="fixed")):
        out = gen.generate(PROMPTS, max_new_tokens=24, **kw)
        assert [r.token_ids for r in out] == reference
        assert out.stats.proposed > 0  # drafts were verified under the penalty
        if gen.draft is not None:
            assert out.stats.accepted > 0  # and the draft's, processed alike, were kept
        alone = gen.generate(PROMPTS[0], max_new_tokens=24, **kw)  # the lone-row loop
        assert alone.token_ids == reference[0]
        gen.close()


def _exact_joint_processed(model, prompt_ids, params, kw, eos, depth):
    joint = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            joint[tuple(prefix)] = prob
            return
        x = _reference_processed(hf_logits(model, prompt_ids + prefix)[-1], prompt_ids, prefix, kw, eos)
        p = params.probs(x)
        for t in np.flatnonzero(p):
            walk(prefix + [int(t)], prob * p[t])

    walk([], 1.0)
    return joint


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_penalised_speculative_sampling_follows_the_penalised_target_distribution(sampling, exported, perturbed_export,
                                                                                   model_dir, hf_model):
    from trtspec.runtime import SamplingParams

    options = {"max_seq_len": 16, "max_batch": 64}
    target = load_engine(exported(ARCH, **options))
    draft = load_engine(perturbed_export(ARCH, 0.5, **options))
    gen = Generator(target, draft, num_draft_tokens=2, k_policy="fixed", sampling=sampling)
    kw = {"presence_penalty": 1.0, "frequency_penalty": 1.5, "repetition_penalty": 1.5, "logit_bias": {7: 1.0}}
    params = SamplingParams(temperature=1.5, top_k=4)
    prompt = "def"
    eos = set(target.manifest["model"]["special_tokens"]["eos_token_ids"])
    joint = _exact_joint_processed(hf_model(model_dir(ARCH)), gen.tokenizer(prompt)["input_ids"], params, kw, eos, 3)
    counts, accepted, proposed = {}, 0, 0
    for i in range(20_480 // 64):
        out = gen.generate([prompt] * 64, max_new_tokens=3, temperature=1.5, top_k=4, seed=64 * i, **kw)
        accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
        for r in out:
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    gen.close()
    assert 0.02 < accepted / proposed < 0.95  # acceptance and rejection both exercised
    assert _chi_square_p_value(counts, joint) > ALPHA


def _log_softmax(x):
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.parametrize("drafter", ["none", "draft", "prompt_lookup", "suffix"])
def test_greedy_logprobs_equal_hf_log_softmax_on_every_path(drafter, target, noisy, hf_model, model_dir):
    model = hf_model(model_dir(ARCH))
    gen = Generator(target, noisy if drafter == "draft" else None, drafter=drafter, num_draft_tokens=3)
    batched = gen.generate(PROMPTS, max_new_tokens=20, logprobs=3)
    lone = gen.generate(PROMPTS[1], max_new_tokens=20, logprobs=3)  # the lone-row loop
    for prompts, out in ((PROMPTS, batched), (PROMPTS[1:2], [lone])):
        for p, r in zip(prompts, out):
            ids = gen.scheduler.encode(p).tolist()
            lp = np.stack([_log_softmax(row) for row in hf_logits(model, ids + r.token_ids)[len(ids) - 1 : -1]])
            assert len(r.logprobs) == len(r.token_ids) > 0
            for j, (token, value, top) in enumerate(r.logprobs):
                assert token == r.token_ids[j]
                assert abs(value - lp[j, token]) <= 1e-4
                best = np.argsort(-lp[j], kind="stable")[:3]
                assert [t for t, _ in top] == best.tolist()
                assert np.allclose([v for _, v in top], lp[j, best], atol=1e-4)
    gen.close()


def test_sampled_logprobs_are_those_of_the_processed_distribution(target, noisy, hf_model, model_dir):
    from trtspec.runtime import SamplingParams

    model = hf_model(model_dir(ARCH))
    gen = Generator(target, noisy, num_draft_tokens=3)
    kw = {"temperature": 0.8, "top_k": 20, "presence_penalty": 0.5}
    r = gen.generate(PROMPTS[0], max_new_tokens=16, seed=3, logprobs=0, **kw)
    gen.close()
    ids = gen.scheduler.encode(PROMPTS[0]).tolist()
    params = SamplingParams(temperature=0.8, top_k=20)
    logits = hf_logits(model, ids + r.token_ids)
    eos = set(target.manifest["model"]["special_tokens"]["eos_token_ids"])
    for j, (token, value, top) in enumerate(r.logprobs):
        x = _reference_processed(logits[len(ids) - 1 + j], ids, r.token_ids[:j], {"presence_penalty": 0.5}, eos)
        assert top == [] and abs(value - np.log(params.probs(x)[token])) <= 1e-4


def test_prompt_logprobs_equal_hf(target, hf_model, model_dir):
    model = hf_model(model_dir(ARCH))
    gen = Generator(target, prefill_chunk=5)  # the prompt is read in several chunks
    gen.generate(PROMPTS[1], max_new_tokens=2)  # its slots are in the prefix cache now: they must not be reused
    r = gen.scheduler.submit(PROMPTS[1], max_new_tokens=2, prompt_logprobs=2).result()
    gen.close()
    ids = gen.scheduler.encode(PROMPTS[1]).tolist()
    lp = np.stack([_log_softmax(row) for row in hf_logits(model, ids)])
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ids)
    for i, (token, value, top) in enumerate(r.prompt_logprobs[1:], start=1):
        assert token == ids[i] and abs(value - lp[i - 1, token]) <= 1e-4
        assert [t for t, _ in top] == np.argsort(-lp[i - 1], kind="stable")[:2].tolist()


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_n_samples_share_the_prompt_and_reproduce_with_seed_plus_i(sampling, target, noisy):
    # rejection sampling reproduces only with the same draft lengths (verify.RowSampler): a fixed k
    gen = Generator(target, noisy, num_draft_tokens=3, sampling=sampling,
                    k_policy="fixed" if sampling == "rejection" else "load-aware")
    handles = gen.scheduler.submit_n(PROMPTS[1], 3, max_new_tokens=16, temperature=1.0, seed=40)
    first = [h.result() for h in handles]
    again = [h.result() for h in gen.scheduler.submit_n(PROMPTS[1], 3, max_new_tokens=16, temperature=1.0, seed=40)]
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in first}) == 3  # independent samples
    plen = gen.scheduler.encode(PROMPTS[1]).size
    assert [r.stats.prefix_tokens_reused for r in first[1:]] == [plen - 1, plen - 1]  # the first's slots, copied
    if sampling == "coupled":  # sample i is the target's own sample with seed + i
        plain = Generator(target)
        assert [r.token_ids for r in first] == [plain.generate(PROMPTS[1], max_new_tokens=16, temperature=1.0,
                                                               seed=40 + i).token_ids for i in range(3)]
        plain.close()
    gen.close()


def test_invalid_processing_parameters_are_refused(plain):
    for kw, message in [({"presence_penalty": 3}, "presence_penalty must be a number in \\[-2, 2\\]"),
                        ({"repetition_penalty": 0}, "repetition_penalty must be a number in \\(0, 10\\]"),
                        ({"logit_bias": {10**6: 1}}, "is not a token id of this model"),
                        ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in \\[-100, 100\\]"),
                        ({"min_tokens": 50, "max_new_tokens": 10}, "min_tokens \\(50\\) must not exceed"),
                        ({"logprobs": 21}, "logprobs must be an integer in \\[0, 20\\]"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
                         "Invalid type: bogus")]:
        with pytest.raises(ValueError, match=message):
            plain.generate(PROMPTS[0], **{"max_new_tokens": 10, **kw})


def _exact_joint_constrained(model, constraint_of, prompt_ids, params, eos):
    """P(output text) under the grammar-masked target distribution, every token path walked to the grammar's end."""
    joint = {}

    def walk(prefix, prob):
        c = constraint_of()
        for t in prefix:
            c.consume(t)
        if c.finished:
            text = tuple(prefix)
            joint[text] = joint.get(text, 0.0) + prob
            return
        x = hf_logits(model, prompt_ids + prefix)[-1].astype(np.float32)
        c.mask(x)
        p = params.probs(x)
        for t in np.flatnonzero(p):
            walk(prefix + [int(t)], prob * p[t])

    walk([], 1.0)
    return joint


def test_grammar_rounds_verify_forced_tokens_then_drafts_and_rejection_sampling_stays_exact(
        exported, perturbed_export, model_dir, hf_model, monkeypatch):
    """Under a grammar, a round verifies the tokens it forces and then drafts proposed after them, and the chain
    takes forced tokens without asking the draft: greedy output equals target-only output, and rejection sampling
    follows the grammar-masked target distribution exactly (chi-square over whole outputs)."""
    from trtspec.runtime import SamplingParams

    options = {"max_seq_len": 24, "max_batch": 64}
    target = load_engine(exported(ARCH, **options))
    draft = load_engine(perturbed_export(ARCH, 0.5, **options))
    fmt = {"type": "regex", "regex": "(ab|cd|ef) = (xa|yb|zc)"}
    gen = Generator(target, draft, num_draft_tokens=3, k_policy="fixed", sampling="rejection")
    mixed, chains = [], []  # per forced row: (forced tokens, tokens verified); per row: which drafts were forced
    import trtspec.runtime.worker as worker_module

    constrain = worker_module.constrain  # (the worker lays a round's forced tokens in front of its drafts)

    def recording(samplers, proposal, forced, room, max_drafts):
        constrain(samplers, proposal, forced, room, max_drafts)
        mixed.extend((len(t), int(proposal.counts[s])) for s, t in (forced or {}).items())
        if proposal.forced is not None:
            chains.extend(proposal.forced[s, : proposal.counts[s]].tolist() for s in range(len(samplers)))

    monkeypatch.setattr(worker_module, "constrain", recording)
    plain = Generator(target)
    prompt = "def"
    greedy = [r.text for r in plain.generate([prompt, "x"], max_new_tokens=16, response_format=fmt)]
    spec = gen.generate([prompt, "x"], max_new_tokens=16, response_format=fmt)
    assert [r.text for r in spec] == greedy
    # forced tokens inside a chain, after a proposal of the draft's, were taken without it; they count as forced
    assert any(marks[j] and not marks[j - 1] for marks in chains for j in range(1, len(marks)))
    assert all(r.stats.forced_tokens > 0 and r.stats.accepted <= r.stats.proposed for r in spec)
    params = SamplingParams(temperature=1.5, top_k=4)
    eos = set(target.manifest["model"]["special_tokens"]["eos_token_ids"])
    compiler = gen.scheduler.requests.grammar_compiler()
    joint_ids = _exact_joint_constrained(hf_model(model_dir(ARCH)), lambda: compiler.constraint(fmt),
                                         gen.tokenizer(prompt)["input_ids"], params, eos)
    joint = {}
    for ids, p in joint_ids.items():  # the same text by another tokenization is the same outcome
        text = gen.tokenizer.decode(list(ids))
        joint[text] = joint.get(text, 0.0) + p
    counts, accepted, proposed = {}, 0, 0
    for i in range(10_240 // 64):
        out = gen.generate([prompt] * 64, max_new_tokens=16, temperature=1.5, top_k=4, seed=64 * i, response_format=fmt)
        accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
        for r in out:
            counts[r.text] = counts.get(r.text, 0) + 1
    gen.close()
    plain.close()
    assert any(verified > f for f, verified in mixed)  # forced tokens and drafts after them, in one call
    assert 0.02 < accepted / proposed < 0.95
    assert set(counts) <= set(joint) and len(joint) > 3
    assert _chi_square_p_value(counts, joint) > ALPHA


GRAMMARS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]},
                                         "c": {"type": "array", "items": {"type": "string", "maxLength": 4}},
                                         "gamma": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["a", "b", "c", "gamma"], "additionalProperties": False}}},
    "regex": {"type": "regex", "regex": "(ab|c)+d?"},  # accepting and not finished after each "ab"/"c"
    "lark": {"type": "grammar", "grammar": 'start: "x" ("+" NUM)*\nNUM: /[0-9]{1,3}/'},
    "loose": {"type": "regex", "regex": '[^"]{0,40}'},  # most picks allowed: lazy masking's usual case
}


@pytest.fixture(scope="module")
def json_tokenizer():
    """A BPE tokenizer that learnt JSON: multi-byte tokens such as '": ' and ', "' make forced bytes that several
    token sequences spell (where llguidance's mask keeps only the canonical one)."""
    from trtspec.testing import make_tokenizer

    docs = ['{"a": 12, "b": "x", "c": ["ab", "yz"]}', '{"alpha": "beta", "gamma": [1, 2], "delta": null}',
            'x+12+7+300', "abcabcd cd ab"]
    return make_tokenizer(vocab_size=400, corpus=docs * 8)


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_grammar_allows_agrees_with_the_mask_on_every_token_of_every_state(name, json_tokenizer):
    """Constraint.allows (one token, without the mask where it can: what lazy masking asks) says exactly what the
    mask says, for every token of the vocabulary, in every state of random walks through the grammar: EOS, kept
    masks, and states whose forced bytes other tokens than the canonical ones spell (llguidance's validate_tokens
    takes those; the JSON walks must meet such states)."""
    from trtspec.runtime.grammar import GrammarCompiler

    tok = json_tokenizer
    eos = [tok.eos_token_id]
    compiler = GrammarCompiler(tok, len(tok), eos)
    rng = np.random.default_rng(0)
    states = raw_disagreements = 0
    for walk in range(6):
        c = compiler.constraint(GRAMMARS[name])
        for _ in range(40):
            x = np.zeros(c.vocab_size, np.float32)
            c.mask(x)
            allowed = np.isfinite(x)
            told = np.array([c.allows(t) for t in range(c.vocab_size)])
            assert (told == allowed).all(), (name, np.flatnonzero(told != allowed)[:10])
            raw = np.array([c.matcher.validate_tokens([t]) == 1 for t in range(c.vocab_size)])
            raw[eos] = allowed[eos]
            raw_disagreements += int((raw != allowed).any())
            c.mask(np.zeros(c.vocab_size, np.float32), key=("kept",))
            assert all(c.allows(t, key=("kept",)) == allowed[t] for t in rng.choice(c.vocab_size, 64))
            c.forget()
            states += 1
            choices = [t for t in np.flatnonzero(allowed) if t not in eos]
            if not choices or c.finished:
                assert allowed[eos].all()
                break
            c.consume(int(rng.choice(choices)))
    assert states >= 10
    if name == "json_schema":
        assert raw_disagreements > 0  # the walks met forced bytes spelt by non-canonical tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lazy_masking_picks_exactly_what_the_full_mask_picks(temperature, target, noisy, monkeypatch):
    """Greedy and coupled rows under a grammar pick from unmasked logits and mask only where the grammar refuses
    the pick: outputs (target-only and speculative) equal those of masking every position, with fewer masks."""
    from trtspec.runtime import grammar as grammar_module
    from trtspec.runtime import verify

    masks, lazy = [], [True]
    original_mask, original_init = grammar_module.Constraint.mask, verify.RowSampler.__init__

    def counting(self, x, key=None):
        masks.append(1)
        return original_mask(self, x, key)

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._lazy = self._lazy and lazy[0]

    monkeypatch.setattr(grammar_module.Constraint, "mask", counting)
    monkeypatch.setattr(verify.RowSampler, "__init__", init)
    kw = {"max_new_tokens": 24, "temperature": temperature, "seed": 3}

    def run(lazily):
        lazy[0] = lazily
        texts = []
        masks.clear()
        for gen in (Generator(target), Generator(target, noisy, num_draft_tokens=3, k_policy="fixed")):
            for fmt in GRAMMARS.values():
                texts.append([r.text for r in gen.generate(PROMPTS, response_format=fmt, **kw)])
            gen.close()
        return texts, len(masks)

    lazy_texts, lazy_masks = run(True)
    eager_texts, eager_masks = run(False)
    assert lazy_texts == eager_texts
    assert lazy_texts[: len(GRAMMARS)] == lazy_texts[len(GRAMMARS):]  # (coupled and greedy: the draft changes nothing)
    assert lazy_masks < eager_masks


def test_grammar_chains_near_the_cache_end_keep_every_rows_slots_inside_it(exported, perturbed_export):
    """A batch of grammar rows, one close to the cache's end while another's chain reads a long forced run: the
    draft's calls stay consecutive and inside the cache for every row (a long read is split), and the outputs
    equal target-only outputs. (Pads of the row near the end were clipped to the last slot: the engine refused the
    call and the request failed.)"""
    target = load_engine(exported(ARCH))  # 64 positions: the second prompt's row (37 tokens + 24) reaches the end
    draft = load_engine(perturbed_export(ARCH, 0.3))
    plain = Generator(target)
    spec = Generator(target, draft, num_draft_tokens=3, k_policy="fixed")
    for temperature in (0.0, 1.0):
        kw = {"max_new_tokens": 24, "temperature": temperature, "seed": 3, "response_format": GRAMMARS["json_schema"]}
        want = [r.text for r in plain.generate(PROMPTS, **kw)]
        got = spec.generate(PROMPTS, **kw)
        assert [r.text for r in got] == want
        assert sum(r.stats.forced_tokens for r in got) >= 8
    plain.close()
    spec.close()
