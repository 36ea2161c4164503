"""The OpenAI surface beyond plain text — logprobs, echo, n, penalties, structured output — with the official
`openai` client against a real server, lossless under speculation."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import openai
import pytest

from conftest import ARCH, Server, hf_logits
from test_server import draft, server, target  # noqa: F401 - the same fixtures: chat model, draft, server
from trtspec import Generator, Scheduler, load_engine
from trtspec.server import create_app

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"]


@pytest.fixture(scope="module")
def hf(hf_model, model_dir):
    return hf_model(model_dir(ARCH))  # the same weights as chat_export's (seed 0)


def _log_softmax(x):
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


def _ids(target, text):
    from trtspec.runtime.tokenizer import load_tokenizer

    return load_tokenizer(target)(text)["input_ids"]


@pytest.mark.parametrize("num_draft_tokens", [0, 3])
def test_completion_logprobs_equal_hf_log_softmax(server, target, hf, num_draft_tokens):
    client = server.client()
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=2,
                                    extra_body={"num_draft_tokens": num_draft_tokens})
    prompt = _ids(target, PROMPTS[0])
    tokens = out.choices[0].logprobs.tokens
    usage_ids = prompt + [int(t) for t in _completion_ids(server, PROMPTS[0], 16, num_draft_tokens)]
    tok = server.app.state.scheduler.tokenizer
    texts = [tok.decode([t]) for t in usage_ids[len(prompt):]]  # each token's own text, or its bytes
    assert [t if "\ufffd" not in t else "bytes:" for t in texts] == [t if not t.startswith("bytes:") else "bytes:"
                                                                     for t in tokens]
    lp = np.stack([_log_softmax(r) for r in hf_logits(hf, usage_ids)[len(prompt) - 1 : -1]])
    generated = usage_ids[len(prompt):]
    got = out.choices[0].logprobs.token_logprobs
    assert np.allclose(got, lp[np.arange(len(generated)), generated], atol=1e-4)
    for j, top in enumerate(out.choices[0].logprobs.top_logprobs):
        assert len(top) == 2 and np.allclose(sorted(top.values(), reverse=True), np.sort(lp[j])[::-1][:2], atol=1e-4)
    offsets = out.choices[0].logprobs.text_offset
    assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


def _completion_ids(server, prompt, max_tokens, k):
    # the token ids behind a completion, from the server's own scheduler
    scheduler = server.app.state.scheduler
    return scheduler.submit(prompt, max_new_tokens=max_tokens, num_draft_tokens=k).result().token_ids


def test_chat_logprobs_streamed_equal_unstreamed_and_hf(server, target, hf):
    client = server.client()
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    # a token may hold part of a UTF-8 character: its bytes, joined, are the text
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == out.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert np.allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=1e-4)
    tok = server.app.state.scheduler.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    generated = server.app.state.scheduler.submit(prompt, max_new_tokens=12).result().token_ids
    lp = np.stack([_log_softmax(r) for r in hf_logits(hf, prompt + generated)[len(prompt) - 1 : -1]])
    assert np.allclose([c.logprob for c in content], lp[np.arange(len(generated)), generated], atol=1e-4)


def test_echo_with_logprobs_returns_the_prompt_and_its_logprobs(server, target, hf):
    client = server.client()
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                    logprobs=1)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert text.startswith(PROMPTS[1])
    prompt = _ids(target, PROMPTS[1])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(prompt) + out.usage.completion_tokens
    ref = np.stack([_log_softmax(r) for r in hf_logits(hf, prompt)])
    assert np.allclose(lp.token_logprobs[1 : len(prompt)], ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    streamed = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                              logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_n_choices_reproduce_with_a_seed_streamed_or_not(server):
    client = server.client()
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=5, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3
    texts = [""] * 3
    finished = set()
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [c.text for c in a.choices] and finished == {0, 1, 2}
    alone = [server.app.state.scheduler.submit(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=5 + i).result()
             for i in range(3)]
    assert [c.text for c in a.choices] == [r.text for r in alone]  # choice i samples with seed + i
    assert a.usage.completion_tokens == sum(len(r.token_ids) for r in alone)


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"logit_bias": {"7": 10, "8": -100}}, {"repetition_penalty": 1.5},
                                     {"min_tokens": 10}])
def test_penalties_through_the_server_equal_target_only(server, target, penalty):
    client = server.client()
    base = {}
    if "min_tokens" in penalty:  # EOS made likely: without min_tokens the output ends at once
        base = {"logit_bias": {str(t): 12 for t in target.manifest["model"]["special_tokens"]["eos_token_ids"]}}
        penalty = {**penalty, **base}
    extra = {k: v for k, v in penalty.items() if k in ("repetition_penalty", "min_tokens")}
    direct = {k: v for k, v in penalty.items() if k not in extra}
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0, **direct,
                                    extra_body=extra)
    gen = Generator(target)
    kw = {**penalty}
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    expected = gen.generate(PROMPTS[2], max_new_tokens=20, **kw)
    plain = gen.generate(PROMPTS[2], max_new_tokens=20, **{k: {int(t): b for t, b in v.items()} for k, v in base.items()})
    gen.close()
    assert out.choices[0].text == expected.text
    assert expected.token_ids != plain.token_ids  # the penalty mattered


# -- structured output ------------------------------------------------------------------------------------

WORDS = ["alpha", "beta", "gamma", "delta", "x", "y", "on", "off"]


def _random_schema(rng, depth=0) -> dict:
    """A random JSON schema whose every document is bounded (strings, arrays and numbers have limits): a
    random-weight model must be able to finish it."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null"] + (["array", "object"] if depth < 2 else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 8))}
    if kind == "integer":
        return {"type": "integer", "minimum": -int(rng.integers(0, 100)), "maximum": int(rng.integers(0, 1000))}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": int(rng.integers(1, 100)), "multipleOf": 0.25}
    if kind == "enum":
        return {"enum": list(rng.choice(WORDS, size=int(rng.integers(1, 4)), replace=False)) + ([3] if rng.random() < .3 else [])}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": int(rng.integers(1, 4))}
    if kind == "object":
        return _random_object(rng, depth + 1)
    return {"type": kind}


def _random_object(rng, depth=0) -> dict:
    names = list(rng.choice(WORDS, size=int(rng.integers(1, 4)), replace=False))
    props = {n: _random_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest.fixture(scope="module")
def long_server(exported, perturbed_export):
    """512 positions: room for the documents of a model that knows nothing (a byte-level tokenizer of 300 tokens)."""
    target = load_engine(exported(ARCH, max_seq_len=512, max_batch=4))
    draft = load_engine(perturbed_export(ARCH, 0.3, max_seq_len=512, max_batch=4))
    with Server(create_app(Scheduler(target, draft, num_draft_tokens=3), model_name="tiny")) as s:
        yield s


def test_100_random_json_schemas_always_give_valid_documents_with_and_without_the_draft(long_server):
    """Greedy and sampled, with the draft (and jump-forward) and without: every output parses and validates, and
    speculation changes nothing (coupled sampling with a seed is the target's own sample)."""
    schemas = [_random_object(np.random.default_rng(i)) for i in range(100)]

    async def one(client, schema, temperature, k):
        out = await client.completions.create(
            model="tiny", prompt="data = ", max_tokens=480, temperature=temperature, seed=1,
            extra_body={"num_draft_tokens": k,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        return out.choices[0].text, out.choices[0].finish_reason, out.model_extra["trtspec"]

    async def main():
        client = openai.AsyncOpenAI(base_url=long_server.url + "/v1", api_key="unused", max_retries=0)
        sem = asyncio.Semaphore(4)

        async def limited(*a):
            async with sem:
                return await one(client, *a)

        jobs = [(s, t, k) for s in schemas for t in (0.0, 1.0) for k in (3, 0)]
        try:
            return jobs, await asyncio.gather(*(limited(*j) for j in jobs))
        finally:
            await client.close()

    jobs, results = asyncio.run(main())
    forced = 0
    for (schema, temperature, k), (text, finish, stats) in zip(jobs, results):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
        forced += stats["forced_tokens"]
    for i in range(0, len(results), 2):  # with the draft == without it
        assert results[i][0] == results[i + 1][0], jobs[i]
    assert forced > 0  # the grammar's forced tokens were taken without the draft


def test_json_object_and_regex_formats(long_server):
    client = long_server.client()
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=400, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=1.0, seed=3,
                                    extra_body={"guided_regex": "(yes|no) [0-9]{3}"})
    import re

    assert re.fullmatch("(yes|no) [0-9]{3}", out.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="Invalid type: nothing"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nothing"}}}})
