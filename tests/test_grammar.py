"""runtime/grammar.py: structured output, the grammar masking every token the target and the draft draw; forced
tokens verified before drafts, rejection sampling exact under the mask, lazy masking equal to the full mask."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import hf_logits
from test_verify import ALPHA, _chi_square_p_value
from test_logits import ARCH, PROMPTS, noisy, target  # noqa: F401 (the same engines, module fixtures)
from trtspec import Generator, load_engine


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
