"""Speculative decoding is lossless: greedy output equals the target's, sampling follows the target's law."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import S_MAX, WrappedEngine
from trtspec import Generator, load_engine
from trtspec.runtime import verify as verify_module

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"]
ARCH = "llama-gqa-rope3"


@pytest.fixture(scope="module")
def target(exported):
    return load_engine(exported(ARCH))


@pytest.fixture(scope="module")
def reference(target):
    """Target-only greedy output, 40 tokens per prompt."""
    return [r.token_ids for r in Generator(target).generate(PROMPTS, max_new_tokens=40)]


@pytest.fixture(scope="module", params=["self", "noisy", "unrelated"])
def draft(request, exported, perturbed_export):
    # agrees always / often / almost never
    if request.param == "self":
        return load_engine(exported(ARCH))
    if request.param == "noisy":
        return load_engine(perturbed_export(ARCH, 0.3))
    return load_engine(exported(ARCH, seed=7))


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_equals_target_greedy(target, draft, reference, k, batch):
    gen = Generator(target, draft, num_draft_tokens=k, k_policy="fixed")
    prompts = PROMPTS[:batch]
    out = gen.generate(prompts, max_new_tokens=40)
    assert [r.token_ids for r in out] == reference[:batch]
    s = out.stats
    assert s.proposed > 0 and 0 <= s.accepted <= s.proposed
    assert sum(i * n for i, n in enumerate(s.accepted_histogram)) == s.accepted
    assert sum(s.accepted_histogram) == sum(sum(r.stats.accepted_histogram) for r in out)
    assert s.new_tokens == sum(len(r.token_ids) for r in out)


def test_draft_agreement_levels_show_in_the_acceptance_rate(target, exported, perturbed_export):
    rates = []
    for d in (exported(ARCH), perturbed_export(ARCH, 0.3), exported(ARCH, seed=7)):
        rates.append(Generator(target, d, num_draft_tokens=4, k_policy="fixed").generate(PROMPTS, max_new_tokens=40).stats.acceptance_rate)
    assert rates[0] == 1.0
    assert rates[0] > rates[1] > rates[2]


def test_load_aware_k_is_lossless_and_stays_within_bounds(target, exported, reference):
    gen = Generator(target, exported(ARCH), num_draft_tokens=6, k_policy="load-aware")
    out = gen.generate(PROMPTS, max_new_tokens=40)
    assert [r.token_ids for r in out] == reference
    assert set(out.stats.k_chosen) <= set(range(0, 7))


def test_finished_rows_leave_the_batch(target, exported):
    calls = []

    long_prompt = "x " * 45  # fills most of the 64-slot cache: this row ends early with "length"
    prompts = [PROMPTS[0], long_prompt, PROMPTS[2]]
    gen = Generator(WrappedEngine(target, lambda ids, pos, first: calls.append(ids.shape[0])), exported(ARCH),
                    num_draft_tokens=3, k_policy="fixed")
    assert S_MAX - 30 < len(gen.tokenizer(long_prompt)["input_ids"]) < S_MAX
    out = gen.generate(prompts, max_new_tokens=30)
    assert out[1].finish_reason == "length" and len(out[1].token_ids) < 30
    assert calls[0] == 3 and calls[-1] == 2
    alone = [Generator(target).generate(p, max_new_tokens=30).token_ids for p in prompts]
    assert [r.token_ids for r in out] == alone


def test_capacity_ends_with_length_never_an_exception(target, exported):
    gen = Generator(target, exported(ARCH), num_draft_tokens=6, k_policy="fixed")
    prompt = "y " * 20
    result = gen.generate(prompt, max_new_tokens=500)
    plain = Generator(target).generate(prompt, max_new_tokens=500)
    assert result.token_ids == plain.token_ids
    if result.finish_reason == "length":
        assert len(gen.tokenizer(prompt)["input_ids"]) + len(result.token_ids) == S_MAX


@pytest.mark.parametrize("boundary", [7, 5])  # inside one accepted block of 5 tokens, and across two
def test_stop_string_straddling_tokens_stops_at_the_right_place(target, exported, boundary):
    plain = Generator(target)
    full = plain.generate(PROMPTS[0], max_new_tokens=20)
    tok = plain.tokenizer
    ids = full.token_ids
    # a stop string made of the end of token `boundary` and the start of the next one
    head = tok.decode(ids[: boundary + 1])
    stop = head[-2:] + tok.decode(ids[: boundary + 2])[len(head) : len(head) + 2]
    first = full.text.find(stop)
    assert first >= 0
    spec = Generator(target, exported(ARCH), num_draft_tokens=4, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=20, stop=stop)
    expected = plain.generate(PROMPTS[0], max_new_tokens=20, stop=stop)
    assert spec.finish_reason == expected.finish_reason == "stop"
    assert spec.text == expected.text == full.text[:first]  # the stop string is not returned (OpenAI's rule)
    assert spec.token_ids == expected.token_ids
    assert stop in tok.decode(spec.token_ids) and stop not in tok.decode(spec.token_ids[:-1])


def test_stream_yields_the_text_in_accepted_blocks(target, exported):
    gen = Generator(target, exported(ARCH), num_draft_tokens=4, k_policy="fixed")
    stream = gen.stream(PROMPTS[0], max_new_tokens=30)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == gen.generate(PROMPTS[0], max_new_tokens=30).text
    assert 1 < len(deltas) < 30


def test_seeded_sampling_reproduces(target, exported):
    gen = Generator(target, exported(ARCH, seed=7), num_draft_tokens=3)
    a = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11)
    b = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11)
    c = gen.generate(PROMPTS, max_new_tokens=24, temperature=0.9, top_p=0.9, seed=12)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_invalid_drafting_options_are_refused(target, exported):
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        Generator(target, exported(ARCH), num_draft_tokens=0)
    with pytest.raises(ValueError, match="num_draft_tokens=64 is not supported"):
        Generator(target, exported(ARCH), num_draft_tokens=S_MAX)
    with pytest.raises(ValueError, match="unknown drafter"):
        Generator(target, drafter="lookahead")
    with pytest.raises(ValueError, match="needs a draft model"):
        Generator(target, drafter="draft")


# -- exactness of speculative sampling ---------------------------------------------------------

def _exact_joint(model_path, prompt_ids, params, depth):
    """P(t1..t_depth) under the target's processed distributions, from the HF model's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    joint = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            joint[tuple(prefix)] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + prefix])).logits[0, -1].numpy()
        p = params.probs(logits)
        for t in np.flatnonzero(p):
            walk(prefix + [int(t)], prob * p[t])

    walk([], 1.0)
    return joint


def _chi_square_p_value(samples, joint):
    from scipy.stats import chisquare

    keys = sorted(joint)
    observed = np.array([samples.get(k, 0) for k in keys], dtype=float)
    if sum(samples.values()) != observed.sum():
        return 0.0  # a sequence the target can never produce
    expected = np.array([joint[k] for k in keys]) * observed.sum()
    # pool the rare outcomes so every cell expects at least 5
    rare = expected < 5
    if rare.any():
        observed = np.append(observed[~rare], observed[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module", params=["coupled", "rejection"])
def sampling_setup(request, exported, perturbed_export, model_dir):
    from trtspec.runtime import SamplingParams

    options = {"max_seq_len": 16, "max_batch": 64}
    target = load_engine(exported(ARCH, **options))
    draft = load_engine(perturbed_export(ARCH, 0.5, **options))
    gen = Generator(target, draft, num_draft_tokens=2, k_policy="fixed", sampling=request.param)
    prompt = "def"
    params = SamplingParams(temperature=1.5, top_k=4)
    joint = _exact_joint(model_dir(ARCH), gen.tokenizer(prompt)["input_ids"], params, depth=3)
    return gen, prompt, params, joint


def _sample_sequences(gen, prompt, params, n, seed):
    counts = {}
    for i in range(n // 64):
        out = gen.generate([prompt] * 64, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                           seed=seed + 64 * i)  # prompt j of a call samples with seed + j
        for r in out:
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    return counts, out.stats


ALPHA = 1e-3  # significance: a correct sampler fails this test once in a thousand seeds


def test_speculative_sampling_follows_the_target_distribution(sampling_setup):
    gen, prompt, params, joint = sampling_setup
    counts, _ = _sample_sequences(gen, prompt, params, 20_480, seed=0)
    assert sum(counts.values()) == 20_480
    assert _chi_square_p_value(counts, joint) > ALPHA
    # the draft was really used, with both outcomes, so acceptance and rejection paths were exercised
    stats = gen.generate([prompt] * 64, max_new_tokens=3, temperature=1.5, top_k=4, seed=99).stats
    assert 0.02 < stats.acceptance_rate < 0.95


def test_a_wrong_acceptance_rule_fails_the_same_test(sampling_setup, monkeypatch):
    from trtspec.runtime.sampling import sample

    gen, prompt, params, joint = sampling_setup
    if gen.scheduler.sampling == "rejection":
        def wrong(p, candidates, q, rng):
            # a classic bug: after a rejection, draw from p instead of norm(max(0, p - q))
            for i, x in enumerate(candidates):
                q_x = 1.0 if q is None else q[i][x]
                if rng.random() * q_x < p[x]:
                    return i, int(x)
            return -1, sample(p, rng)

        monkeypatch.setattr(verify_module, "accept_rejection", wrong)
    else:
        def wrong(candidates, token):
            # keeping the draft's token at the first disagreement instead of the target's choice
            if token in candidates:
                return candidates.index(token), token
            return -1, candidates[0] if candidates else token

        monkeypatch.setattr(verify_module, "accept_chosen", wrong)
    counts, _ = _sample_sequences(gen, prompt, params, 20_480, seed=0)
    assert _chi_square_p_value(counts, joint) < ALPHA


TWELVE = ["def add(a, b):", "The quick brown fox", "import os", "class Stack:", "for i in range(10):", "x = 1",
          "if __name__ == '__main__':", "Speculative decoding", "return a + b", "print(i * i)", "self.x = x", "y"]


def _divergence(engine, prompt_ids, a, b) -> str:
    """Where two greedy continuations part and the target's two candidate logits there (one full forward)."""
    i = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
    ids = list(prompt_ids) + a[:i]
    logits = engine.forward(np.array([ids]), np.arange(len(ids))[None])[0, -1]
    got = {t: float(logits[t]) for t in (a + [None])[i : i + 1] + (b + [None])[i : i + 1] if t is not None}
    return f"token {i}: {got} (argmax {int(logits.argmax())})"


@pytest.mark.parametrize("k_policy", ["fixed", "load-aware"])
def test_greedy_speculative_list_of_12_through_4_rows_equals_target_only_alone(chat_export, perturbed_export, k_policy):
    """float32 engines: a batched verify call and a lone decode call may round differently, but never enough to
    flip an argmax here; a failure shows the two logits where the outputs part."""
    target = load_engine(chat_export)
    plain = Generator(target)
    alone = [plain.generate(p, max_new_tokens=40).token_ids for p in TWELVE]
    plain.close()
    draft = load_engine(perturbed_export(ARCH, 0.3, max_seq_len=128, max_batch=4))
    gen = Generator(target, draft, num_draft_tokens=4, k_policy=k_policy)
    assert gen.max_batch == 4
    out = gen.generate(TWELVE, max_new_tokens=40)
    gen.close()
    assert out.stats.accepted > 0
    differ = [i for i, r in enumerate(out) if r.token_ids != alone[i]]
    reference = load_engine(chat_export)
    assert not differ, "\n".join(
        f"{TWELVE[i]!r}: " + _divergence(reference, gen.tokenizer(TWELVE[i])["input_ids"], out[i].token_ids, alone[i])
        for i in differ)


@pytest.mark.parametrize("mode", ["greedy", "coupled", "rejection"])
def test_a_chain_verifies_as_the_tree_whose_parents_are_j_minus_1(mode):
    """One acceptance for chains and trees (verify.RowSampler.verify): a chain given as parents None and the same
    chain given as a tree with parents j - 1 get the same verdict from the same randomness, for every drafting
    outcome; with a draft distribution q (rejection) too; and verify_rows' one argmax for plain greedy rows gives
    what each row's own walk gives."""
    from trtspec.runtime.sampling import SamplingParams

    rng = np.random.default_rng(5)
    vocab, m = 12, 4
    params = SamplingParams() if mode == "greedy" else SamplingParams(temperature=1.3, seed=11)
    seen = set()
    for trial in range(200):
        logits = rng.normal(size=(m + 1, vocab)).astype(np.float32) * 2
        target_choice = logits.argmax(axis=-1)
        drafts = np.where(rng.random(m) < 0.6, target_choice[:m], rng.integers(0, vocab, m)).astype(np.int64)
        q = None
        if mode == "rejection" and trial % 2:
            q = rng.dirichlet(np.ones(vocab), size=m)
            q[np.arange(m), drafts] += 0.5
            q /= q.sum(axis=1, keepdims=True)
        verdicts = []
        for parents in (None, np.arange(m) - 1):
            sampler = verify_module.RowSampler(params, "rejection" if mode == "rejection" else "coupled")
            sampler.rng = np.random.default_rng(trial)
            verdicts.append(sampler.accept(drafts, parents, q, logits, 40))
        assert verdicts[0] == verdicts[1]
        path, token = verdicts[0]
        assert path == list(range(len(path))) and 0 <= token < vocab
        seen.add(len(path))
        if mode == "greedy":  # the longest prefix the argmax agrees with, then the argmax
            a = next((j for j in range(m) if drafts[j] != target_choice[j]), m)
            assert (len(path), token) == (a, int(target_choice[a]))
            batched = verify_module.verify_rows([verify_module.RowSampler(params)], drafts[None], None,
                                                np.array([m]), None, logits[None], np.array([40]))
            assert batched == [verdicts[0]]
    assert len(seen) >= 3  # rejections early, late and none were all exercised
