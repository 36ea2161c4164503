"""`trtspec serve`: OpenAI's wire protocol, checked with the official `openai` client against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from conftest import ARCH, Server, WrappedEngine, free_port
from trtspec import Generator, Scheduler, load_engine
from trtspec.engines.base import lease
from trtspec.server import create_app

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os", "class Stack:"]


@pytest.fixture(scope="module")
def target(chat_export):
    return load_engine(chat_export)


@pytest.fixture(scope="module")
def draft(perturbed_export):
    return load_engine(perturbed_export(ARCH, 0.3, max_seq_len=128, max_batch=4))


@pytest.fixture(scope="module")
def server(target, draft):
    scheduler = Scheduler(target, draft, num_draft_tokens=3)
    with Server(create_app(scheduler, model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def alone(target):
    gen = Generator(target)
    return lambda prompt, **kw: gen.generate(prompt, **kw)


def test_completion_equals_generator_output_with_usage(server, alone, target):
    client = server.client()
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    want = alone(PROMPTS[0], max_new_tokens=20)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.prompt_tokens == len(Generator(target).tokenizer(PROMPTS[0])["input_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "tiny"
    extra = out.model_extra["trtspec"]
    assert extra["proposed"] >= extra["accepted"] >= 0 and extra["target_calls"] >= 1


def test_streamed_completion_is_the_same_text_in_blocks_and_ends_with_usage(server, alone):
    client = server.client()
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    want = alone(PROMPTS[1], max_new_tokens=30)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    # blocks: at most one a token; how many depends on timing (deltas that arrive together leave as one chunk,
    # and the tiny model can finish 30 tokens before the event loop runs twice)
    assert 1 <= len([c for c in chunks if c.choices and c.choices[0].text]) <= 30
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length" if want.finish_reason == "length" else "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_stop_strings_and_seeds(server, alone):
    client = server.client()
    full = alone(PROMPTS[0], max_new_tokens=20).text
    stop = full[5:8]
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].text == alone(PROMPTS[0], max_new_tokens=20, stop=stop).text == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    kept = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.find(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"
    kw = dict(model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    c = client.completions.create(**{**kw, "seed": 8})
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    assert a.choices[0].text == alone(PROMPTS[3], max_new_tokens=24, temperature=0.9, top_p=0.9, seed=7).text


def test_chat_renders_the_chat_template(server, target):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    gen = Generator(target)
    ids = gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = gen.scheduler.submit(list(ids), max_new_tokens=16).result()
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text
    assert out.object == "chat.completion" and out.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].object == "chat.completion.chunk" and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_without_a_template_is_a_400_that_says_so(exported):
    scheduler = Scheduler(exported(ARCH))  # the plain tiny tokenizer has no chat template
    with Server(create_app(scheduler, model_name="plain", warmup=False)) as s:
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            s.client().chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])


def test_16_concurrent_streams_through_4_rows_each_equal_the_request_alone(server, alone):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    requests = [(PROMPTS[i % 4] + " " * (i // 4), 8 + 5 * i) for i in range(16)]

    async def one(prompt, n):
        text = ""
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def main():
        try:
            return await asyncio.gather(*(one(p, n) for p, n in requests))
        finally:
            await client.close()

    texts = asyncio.run(main())
    assert texts == [alone(p, max_new_tokens=n).text for p, n in requests]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"n": 0}, "n: Input should be greater than or equal to 1"),
        ({"logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
        ({"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0"),
        ({"logit_bias": {"99999": 5}}, "logit_bias key '99999' is not a token id of this model"),
        ({"logit_bias": {"5": 150}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"min_tokens": 9}, "min_tokens=9 exceeds max_tokens=4"),
        ({"response_format": {"type": "xml"}}, "unknown response_format type 'xml'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         "Invalid type: bogus"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
         "/nope"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "send one"),
        ({"best_of": 3}, "best_of is not supported"),
        ({"model": "gpt-4"}, "model 'gpt-4' is not served here; this server serves 'tiny'"),
        ({"prompt": "word " * 200}, "but the engine holds 128 positions"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"temperature": -1}, "temperature: Input should be greater than or equal to 0"),
        ({"prompt": ["a", "b"]}, "2 prompts in one request"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop sequences"),
    ],
)
def test_invalid_requests_get_400_in_openai_error_schema(server, body, message):
    payload = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/completions", json=payload, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_and_wrong_types_never_crash_the_server(server, alone):
    for content in (b"{not json", b"[1, 2]", b'{"model": "tiny", "prompt": {"x": 1}}', b""):
        r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400 and "error" in r.json()
    out = server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert out.choices[0].text == alone(PROMPTS[0], max_new_tokens=5).text


def test_api_key_is_required_when_set(target):
    with Server(create_app(Scheduler(target), model_name="tiny", api_key="s3cret", warmup=False)) as s:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        r = httpx.get(s.url + "/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = s.client(api_key="s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens >= 1


def test_a_full_queue_answers_429_with_retry_after(target):
    scheduler = Scheduler(target, max_batch=1)
    with Server(create_app(scheduler, model_name="tiny", max_queue=1)) as s:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        with lease(target):  # the scheduler cannot start a round: the requests stay queued
            # the first would take the free row at the next round, the second waits beyond it: the queue is full
            queued = [threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", json=body, timeout=60))
                      for _ in range(2)]
            for i, t in enumerate(queued):
                t.start()
                while scheduler.waiting < i + 1:
                    time.sleep(0.01)
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        for t in queued:
            t.join(60)


def test_an_engine_failure_is_a_500_for_the_requests_in_flight_only(target, alone):
    armed = []

    def fail_once_armed(*_):
        if armed:
            armed.clear()
            raise RuntimeError("device lost")

    with Server(create_app(Scheduler(WrappedEngine(target, fail_once_armed)), model_name="tiny")) as s:
        armed.append(True)  # after the warm-up
        with pytest.raises(openai.InternalServerError, match="device lost"):
            s.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
        out = s.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
        assert out.choices[0].text == alone(PROMPTS[0], max_new_tokens=5).text
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert 'trtspec_requests_total{endpoint="completions",status="500"} 1.0' in metrics


def test_a_client_that_disconnects_mid_stream_cancels_its_request(target):
    scheduler = Scheduler(WrappedEngine(target, lambda *_: time.sleep(0.02)))  # a request long enough to interrupt
    with Server(create_app(scheduler, model_name="tiny")) as s:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.time() + 10
        while (scheduler.stats().requests_cancelled < 1 or scheduler.stats().running) and time.time() < deadline:
            time.sleep(0.02)
        stats = scheduler.stats()
        assert stats.requests_cancelled == 1 and stats.running == 0
        metrics = httpx.get(s.url + "/metrics", timeout=10).text  # the freed row shows in /metrics
        assert "trtspec_running_requests 0.0" in metrics
        assert 'trtspec_requests_total{endpoint="completions",status="499"} 1.0' in metrics


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['trtspec_requests_total{endpoint="completions",status="200"}'] >= 1
    assert samples["trtspec_generation_tokens_total"] >= 6
    assert samples["trtspec_time_to_first_token_seconds_count"] >= 1
    assert samples["trtspec_inter_token_latency_seconds_count"] >= 1
    assert samples["trtspec_queue_depth"] == 0 and samples["trtspec_running_requests"] == 0
    assert 0 <= samples["trtspec_draft_acceptance_rate"] <= 1
    assert "trtspec_prefix_cache_hits_total" in samples


def test_sigterm_drains_in_flight_requests_and_exits_0(chat_export):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtspec", "serve", "--target", str(chat_export), "--port", str(port),
         "--served-model-name", "tiny", "--drain-timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"  # the request in flight finished
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert "draining" in output


def _hostile_requests():
    """200 malformed or hostile requests: (method, path, kwargs for httpx)."""
    good = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    bodies = [
        b"", b"{", b"null", b"[]", b"42", b'"prompt"', b"{\"model\": \"tiny\", \"prompt\": \"hi\"",
        b"\xff\xfe\x00garbage", b'{"model": "tiny", "prompt": "hi", "max_tokens": 4,}', b"{'model': 'tiny'}",
    ]
    reqs = [("POST", "/v1/completions", {"content": b, "headers": {"content-type": "application/json"}}) for b in bodies]
    variants = [
        {"max_tokens": "4"}, {"max_tokens": 10**12}, {"max_tokens": -5}, {"max_tokens": 0}, {"max_tokens": 4.5},
        {"temperature": "hot"}, {"temperature": -0.1}, {"top_p": -1}, {"top_p": 0}, {"top_p": 2},
        {"top_k": -3}, {"seed": "x"}, {"seed": 1.5}, {"stop": 5}, {"stop": [""]}, {"stop": [1, 2]}, {"n": 100},
        {"n": 0}, {"logprobs": -1}, {"echo": "yes"}, {"best_of": 2}, {"prompt": None}, {"prompt": 5},
        {"prompt": {"text": "hi"}}, {"prompt": [1.5, 2]}, {"prompt": [-1, 5]}, {"prompt": [10**9]}, {"prompt": []},
        {"prompt": ["a", "b", "c"]}, {"prompt": "x" * (1 << 20)}, {"model": None}, {"model": ""}, {"model": "other"},
        {"stream": "yes"}, {"stream_options": 5}, {"priority": "urgent"}, {"num_draft_tokens": -1},
        {"num_draft_tokens": 10**6}, {"unknown_field": 1}, {"presence_penalty": 9.0}, {"logit_bias": {"x": 100}},
        {"logit_bias": [5]}, {"frequency_penalty": "-2"}, {"min_tokens": -1}, {"response_format": "json"},
        {"response_format": {"type": "json_schema"}}, {"response_format": {"type": "regex", "regex": "("}},
        {"guided_json": "{not json"},
    ]
    for v in variants:
        body = {**good, **v}
        if v == {"model": None}:
            body.pop("model")
        reqs.append(("POST", "/v1/completions", {"json": body}))
        if "prompt" in v:
            continue
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                **{k: val for k, val in v.items() if k != "prompt"}}
        reqs.append(("POST", "/v1/chat/completions", {"json": chat}))
    chat_bad = [{"messages": []}, {"messages": "hi"}, {"messages": [{"role": "wizard", "content": "x"}]},
                {"messages": [{"content": "no role"}]}, {"messages": [{"role": "user", "content": 5}]}, {"messages": None}]
    for v in chat_bad:
        reqs.append(("POST", "/v1/chat/completions", {"json": {"model": "tiny", "max_tokens": 4, **v}}))
    reqs += [("POST", "/v1/completions", {"content": json.dumps(good).encode(), "headers": {"content-type": "text/plain"}}),
             ("POST", "/v1/completions", {"data": {"model": "tiny", "prompt": "hi"}}),
             ("GET", "/v1/completions", {}), ("PUT", "/v1/chat/completions", {"json": good}),
             ("POST", "/v1/nothing", {"json": good}), ("DELETE", "/v1/models", {})]
    i = 0
    while len(reqs) < 200:  # random bytes and random JSON structures
        i += 1
        rnd = np.random.default_rng(i)
        if i % 2:
            reqs.append(("POST", "/v1/completions", {"content": rnd.bytes(int(rnd.integers(1, 300))),
                                                     "headers": {"content-type": "application/json"}}))
        else:
            junk = {str(k): [None, -1, "x" * 10, [1, {}], {"a": []}][int(rnd.integers(5))] for k in rnd.integers(0, 9, 4)}
            reqs.append(("POST", "/v1/chat/completions", {"json": {**junk, "model": "tiny"}}))
    return reqs[:200]


def test_200_hostile_requests_each_get_a_4xx_and_the_server_still_answers(server, alone):
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path, kw in _hostile_requests():
            r = http.request(method, path, **kw)
            assert 400 <= r.status_code < 500, (method, path, str(kw)[:200], r.status_code, r.text[:300])
            assert r.json()["error"]["message"]  # OpenAI's error schema, whatever went wrong
        out = server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert out.choices[0].text == alone(PROMPTS[0], max_new_tokens=8).text
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert "trtspec_requests" in families and "trtspec_time_to_first_token_seconds" in families


def test_a_taken_port_is_refused_before_the_engines_load(tmp_path):
    """`trtspec serve` on a port another process listens on: a one-line error naming the port and what to do, at
    once (the target here does not exist: the port is checked first), and no traceback."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "trtspec", "serve", "--target", str(tmp_path / "no-engine"),
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot serve on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "trtspec", "serve", "--target", str(tmp_path / "no-engine"),
                           "--host", "no-such-host.invalid", "--port", str(port)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "cannot serve on no-such-host.invalid" in done.stderr and "--host" in done.stderr
