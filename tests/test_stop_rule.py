"""One stop rule on every path (runtime/stop_rule.py).

Target-only and speculative generation, alone, in a list wider than the engines' rows, streamed, and served
to the official `openai` client (stream and not) all return the text, token ids and finish reason of a
reference computed apart from the runtime: the target's greedy token ids straight from ``engine.forward``,
cut at the first EOS, decoded, and cut at the first token after which a stop string is in the generated text.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MAX_BATCH, Server
from trtspec import Generator, Scheduler, export, load_engine
from trtspec.runtime.stop_rule import RequestOutput
from trtspec.runtime.tokenizer import load_tokenizer
from trtspec.server import create_app

ARCH = "gpt2-untied"
N = 24  # max_new_tokens of every case
S_MAX = 80
CODE = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
        "for i in range(10):\n    print(i)", "x = [1, 2, 3]\n", "if __name__ == '__main__':"]


def _random_text(seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz      ,.:()=\n"), size=int(rng.integers(8, 32))))


PROMPTS = CODE + [_random_text(seed) for seed in range(6)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir):
    """Target and draft exports of a tiny model that writes printable text, with three EOS ids (as Llama 3 has).

    Printable: the output-projection rows of every other token are zero, so their logit (0) is never the
    largest. EOS ids: 2, the target's first greedy token after PROMPTS[0] (EOS as the very first token) and a
    token new in the second half of its output after PROMPTS[1] (EOS mid-output). The draft is the target plus
    noise: it is often right, so stop strings land inside blocks of accepted drafts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_dir(ARCH)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    texts = [tok.decode([i]) for i in range(len(tok))]
    silent = [i for i in range(model.config.vocab_size)
              if i < 3 or i >= len(texts) or not texts[i].isascii() or not (texts[i].isprintable() or "\n" in texts[i])]
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[silent] = 0
        first = int(model(torch.tensor([tok(PROMPTS[0])["input_ids"]])).logits[0, -1].argmax())
        ids = torch.tensor([tok(PROMPTS[1])["input_ids"]])
        for _ in range(N):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    out = ids[0, -N:].tolist()
    middle = next(t for i, t in enumerate(out) if i >= N // 2 and t not in out[:i] and t != first)
    eos = [2] + sorted({first, middle})
    model.generation_config.eos_token_id = eos
    exports = {}
    gen = torch.Generator().manual_seed(5)
    for name, noise in (("target", 0.0), ("draft", 0.1)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
            head[silent] = 0
        out = tmp_path_factory.mktemp(f"hf-stop-{name}")
        model.save_pretrained(out)
        tok.save_pretrained(out)
        exports[name] = export(out, tmp_path_factory.mktemp(f"export-stop-{name}") / "a", max_seq_len=S_MAX,
                               max_batch=MAX_BATCH)
    target = load_engine(exports["target"])
    assert target.manifest["model"]["special_tokens"]["eos_token_ids"] == eos
    return target, load_engine(exports["draft"]), load_engine(exports["target"])  # the last for the reference


def greedy_ids(engine, prompt_ids: list[int], n: int) -> list[int]:
    """The target's greedy continuation, n tokens, one engine.forward call each (EOS is just a token here)."""
    logits = engine.forward(np.array([prompt_ids]), np.arange(len(prompt_ids))[None], first_row=0)
    ids = [int(logits[0, -1].argmax())]
    for i in range(n - 1):
        logits = engine.forward(np.array([[ids[-1]]]), np.array([[len(prompt_ids) + i]]), first_row=0)
        ids.append(int(logits[0, 0].argmax()))
    return ids


def expected(tok, ids, eos_ids, stops, include) -> tuple[str, list[int], str]:
    """(text, token_ids, finish_reason) by the rule, from the raw greedy ids alone."""
    end = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    ids = ids if end is None else ids[:end]
    for t in range(1, len(ids) + 1):  # the first token after which a stop string is in the generated text
        text = tok.decode(ids[:t], skip_special_tokens=True)
        hits = [(text.find(s), len(s)) for s in stops if s in text]
        if hits:
            start, length = min(hits)  # the earliest-starting one, the shortest of those
            return text[: start + length if include else start], ids[:t], "stop"
    return tok.decode(ids, skip_special_tokens=True), ids, "length" if end is None else "stop"


def stop_sets(tok, prompt: str, ids: list[int]) -> dict[str, list[str]]:
    """Stop sets for one prompt, made from its own greedy text (EOS-free) so that most of them fire."""
    text = tok.decode(ids, skip_special_tokens=True)
    m = len(tok.decode(ids[: N // 2], skip_special_tokens=True))  # a token boundary mid-text
    s = text[max(m - 2, 0) : m + 4]
    sets = {
        "none": [],
        "newline": ["\n"],
        "one character": [text[len(text) // 2]] if text else ["e"],
        "multi-token": [text[max(m - 3, 0) : m + 3]],
        "overlapping": [s[2:], s[:4]],  # s[:4] starts first; s[2:] starts inside it
        "same start": [s[:5], s[:2]],  # both start at one place: the shorter one completes first
        "inside the first token": [tok.decode(ids[:1])[-2:]] if ids else ["\n"],
        "partly in the prompt": [prompt[-2:] + text[:2]],  # only the generated text counts
    }
    return {name: [x for x in stops if x and "\ufffd" not in x] or ["\n"] if stops else []
            for name, stops in sets.items()}


@pytest.fixture(scope="module")
def cases(pair):
    """[(prompt, stops, include_stop_str_in_output, expected (text, token_ids, finish_reason), set name)]."""
    target, _, reference_engine = pair
    tok = load_tokenizer(target)
    eos = set(target.manifest["model"]["special_tokens"]["eos_token_ids"])
    out = []
    for prompt in PROMPTS:
        raw = greedy_ids(reference_engine, tok(prompt)["input_ids"], N)
        clean = raw[: next((i for i, t in enumerate(raw) if t in eos), N)]
        for name, stops in stop_sets(tok, prompt, clean).items():
            for include in (False, True):
                out.append((prompt, stops, include, expected(tok, raw, eos, stops, include), name))
    return out


def test_the_cases_cover_what_the_rule_must_handle(pair, cases):
    by_prompt = {p: [c for c in cases if c[0] == p] for p in PROMPTS}
    assert all(c[3] == ("", [], "stop") for c in by_prompt[PROMPTS[0]])  # EOS as the first token
    assert all(N // 2 <= len(c[3][1]) < N and c[3][2] == "stop" for c in by_prompt[PROMPTS[1]] if c[4] == "none")
    fired = [c for c in cases if c[1] and c[3][2] == "stop" and c[0] not in PROMPTS[:2]]
    assert len(fired) > len(cases) // 2
    first = [c for c in fired if c[4] == "inside the first token"]
    assert len(first) >= 8 and all(len(c[3][1]) == 1 for c in first)
    assert any(c[3][2] == "length" for c in cases)
    # stop strings that end inside the token completing them: the token is returned, its text only up to the cut
    tok = load_tokenizer(pair[0])
    assert any(len(tok.decode(c[3][1])) > len(c[3][0]) + max(map(len, c[1])) for c in fired)


def _check(results, cases, path):
    wrong = []
    for (text, token_ids, reason), (prompt, stops, include, want, name) in zip(results, cases):
        if (text, reason) != (want[0], want[2]) or (token_ids is not None and list(token_ids) != want[1]):
            wrong.append(f"{name} stop={stops!r} include={include} prompt={prompt!r}:\n"
                         f"    got  {text!r} {reason} {token_ids}\n    want {want[0]!r} {want[2]} {want[1]}")
    assert not wrong, f"{path}: {len(wrong)} of {len(cases)} outputs differ from the reference\n" + "\n".join(wrong[:8])


@pytest.fixture(scope="module")
def generators(pair):
    target, draft, _ = pair
    gens = {"target-only": Generator(target), "speculative": Generator(target, draft, num_draft_tokens=3,
                                                                       k_policy="fixed")}
    yield gens
    for g in gens.values():
        g.close()


def _params(case):
    prompt, stops, include, _, _ = case
    return dict(max_new_tokens=N, stop=stops, include_stop_str_in_output=include)


@pytest.mark.parametrize("drafting", ["target-only", "speculative"])
def test_alone(generators, cases, drafting):
    gen = generators[drafting]
    results = [gen.generate(c[0], **_params(c)) for c in cases]
    _check([(r.text, r.token_ids, r.finish_reason) for r in results], cases, f"{drafting} alone")
    assert all(r.stats.new_tokens == len(r.token_ids) for r in results)
    if drafting == "speculative":  # many rounds accepted blocks of several tokens: stops fell inside them too
        rounds = np.sum([np.pad(r.stats.accepted_histogram, (0, 8))[:8] for r in results], axis=0)
        assert rounds[2:].sum() > rounds.sum() / 4, rounds


@pytest.mark.parametrize("drafting", ["target-only", "speculative"])
def test_in_a_list_wider_than_the_rows(generators, cases, drafting):
    scheduler = generators[drafting].scheduler
    assert len(cases) > 10 * scheduler.max_batch
    handles = scheduler.submit_many([c[0] for c in cases], [_params(c) for c in cases], stream=False)
    results = [h.result() for h in handles]
    _check([(r.text, r.token_ids, r.finish_reason) for r in results], cases, f"{drafting} in a list")
    # Generator.generate(list) with one stop set for every prompt
    sample = [c for c in cases if c[4] == "newline" and not c[2]]
    out = generators[drafting].generate([c[0] for c in sample], max_new_tokens=N, stop=["\n"])
    _check([(r.text, r.token_ids, r.finish_reason) for r in out], sample, f"{drafting} generate(list)")


@pytest.mark.parametrize("drafting", ["target-only", "speculative"])
def test_streamed_text_is_never_taken_back(generators, cases, drafting):
    results = []
    for c in cases:
        stream = generators[drafting].stream(c[0], **_params(c))
        text = "".join(stream)  # append-only deltas: equal to the end text means nothing was taken back
        r = stream.result
        results.append((text, r.token_ids, r.finish_reason))
        assert r.text == text
    _check(results, cases, f"{drafting} streamed")


@pytest.fixture(scope="module")
def server(pair):
    target, draft, _ = pair
    scheduler = Scheduler(target, draft, num_draft_tokens=3, k_policy="fixed")
    with Server(create_app(scheduler, model_name="tiny")) as s:
        yield s
    scheduler.close()


@pytest.mark.parametrize("stream", [False, True])
def test_served_to_the_openai_client(server, cases, stream):
    client = server.client()
    results, usage = [], []
    for prompt, stops, include, want, _ in cases:
        kw = dict(model="tiny", prompt=prompt, max_tokens=N, temperature=0, stop=stops or None,
                  extra_body={"include_stop_str_in_output": include})
        if stream:
            chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert len(reason) == 1
            results.append((text, None, reason[0]))
            usage.append(chunks[-1].usage.completion_tokens)
        else:
            out = client.completions.create(**kw)
            results.append((out.choices[0].text, None, out.choices[0].finish_reason))
            usage.append(out.usage.completion_tokens)
    _check(results, cases, f"server (stream={stream})")
    assert usage == [len(c[3][1]) for c in cases]  # completion_tokens counts the returned tokens


# -- the pieces --------------------------------------------------------------------------------------------


def test_a_partial_stop_string_is_held_back_until_it_cannot_match(pair):
    tok = load_tokenizer(pair[0])
    ids = tok("print(a + b)\nprint(x)")["input_ids"]
    out = RequestOutput(tok, eos_ids={2}, limit=100, stop=("\nprint(y",))
    emitted = []
    for t in ids:
        assert out.extend([t]) == 1
        emitted.append(out.delta())
        shown = "".join(emitted)
        # what is shown never ends with a beginning of the stop string, so nothing shown can be taken back
        assert not any(shown.endswith("\nprint(y"[:n]) for n in range(1, 8)), shown
    out.finish("length")
    emitted.append(out.delta())
    assert "".join(emitted) == out.text == "print(a + b)\nprint(x)"


def test_several_stop_strings_in_one_block_cut_at_the_earliest_start(pair):
    tok = load_tokenizer(pair[0])
    ids = tok("for i in range(10):\n    print(i)")["input_ids"]
    for include, text in ((False, "for i in "), (True, "for i in range")):
        out = RequestOutput(tok, eos_ids={2}, limit=100, stop=("(10)", "range", "print"), include_stop=include)
        taken = out.extend(ids)  # one block of all tokens: the rule finds the token that completes "range"
        assert out.finish_reason == "stop" and out.text == text
        assert "range" in tok.decode(ids[:taken]) and "range" not in tok.decode(ids[: taken - 1])
