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
