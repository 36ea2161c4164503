"""`trtspec serve --ray`: the OpenAI app on Ray Serve with 2 engine replicas of a tiny model, on a local Ray.

Checked with the official `openai` client through Ray's HTTP proxy: outputs equal Generator's,
a replica killed under load leaves the endpoint answering (failures are 5xx, nothing hangs or is
wrong) and comes back, and prefix-aware routing keeps a shared prefix on one replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

from conftest import ARCH, WrappedEngine, free_port
from trtspec import Generator, load_engine
from trtspec.server.routing import PrefixIndex, block_keys

ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'trtspec[ray]'")
serve = pytest.importorskip("ray.serve")

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os", "class Stack:"]
SHARED = "You are a careful assistant. Answer with code only, no prose. " * 2  # > 16 tokens


@pytest.fixture(scope="module")
def pair(chat_export, perturbed_export):
    return str(chat_export), str(perturbed_export(ARCH, 0.3, max_seq_len=128, max_batch=4))


@pytest.fixture(scope="module")
def alone(pair):
    gen = Generator(pair[0])
    return lambda prompt, **kw: gen.generate(prompt, **kw)


@pytest.fixture(scope="module")
def endpoint(pair):
    """2 engine replicas (1 thread each) behind the ingress, on a local 2-CPU Ray instance: its URL, and
    Ray's Prometheus endpoint."""
    from trtspec.server.ray_app import build_app

    port, metrics_port = free_port(), free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"target": pair[0], "draft": pair[1], "replicas": 2, "num_draft_tokens": 3,
                             "model_name": "tiny", "health_check_period_s": 1}), name="trtspec", route_prefix="/")
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", ray_metrics=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_replicas() -> dict:
    """replica id -> state, of the EngineReplica deployment."""
    status = serve.status().applications["trtspec"].deployments["EngineReplica"]
    return status.replica_states if hasattr(status, "replica_states") else {}


def replica_pids(n: int, timeout: float = 30) -> dict:
    """replica id -> pid of the running engine replicas (asked through the deployment handle)."""
    handle = serve.get_deployment_handle("EngineReplica", app_name="trtspec")
    pids, deadline = {}, time.time() + timeout
    while len(pids) < n and time.time() < deadline:
        try:
            s = handle.stats.remote().result(timeout_s=30)
        except ray.exceptions.RayActorError:  # sent to a replica that died before the router heard of it
            time.sleep(0.5)
            continue
        if s["replica"] in pids:
            time.sleep(0.2)  # (the CPU is the starting replica's)
        pids[s["replica"]] = s["pid"]
    return pids


def ray_state() -> str:
    """What Ray holds, for a failure's message: the resources free, the live actors, the deployment's state."""
    from ray.util.state import list_actors

    actors = [(a.class_name, a.state, a.pid) for a in list_actors(limit=100) if a.state != "DEAD"]
    return f"available {ray.available_resources()} of {ray.cluster_resources()}; actors {actors}; " \
        f"EngineReplica {engine_replicas()}"


def test_completions_and_chat_through_ray_equal_generator_output(endpoint, alone, pair):
    c = client(endpoint.url)
    for prompt in PROMPTS:
        want = alone(prompt, max_new_tokens=20)
        out = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert out.choices[0].text == want.text
        assert out.usage.completion_tokens == len(want.token_ids)
        assert out.model_extra["trtspec"]["replica"]  # which replica answered
        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    messages = [{"role": "user", "content": "hello there"}]
    gen = Generator(pair[0])
    ids = gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = gen.scheduler.submit(list(ids), max_new_tokens=16).result()
    out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == want.text and out.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text


def test_bad_requests_are_400s_from_the_ingress(endpoint):
    c = client(endpoint.url)
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be greater than or equal to 0"):
        c.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=-1)  # refused by the ingress
    with pytest.raises(openai.BadRequestError, match="logit_bias key '99999' is not a token id"):
        c.completions.create(model="tiny", prompt="x", max_tokens=4, logit_bias={"99999": 5})  # by the replica
    with pytest.raises(openai.BadRequestError, match="128-token context"):
        c.completions.create(model="tiny", prompt="x", max_tokens=500)
    with pytest.raises(openai.BadRequestError, match="not served here"):
        c.completions.create(model="other", prompt="x", max_tokens=4)


def test_prefix_aware_routing_keeps_a_shared_prefix_on_one_replica(endpoint):
    c = client(endpoint.url)
    replicas, reused = [], []
    for i in range(6):
        out = c.completions.create(model="tiny", prompt=f"{SHARED}Question {i}: sort a list", max_tokens=4,
                                   temperature=0)
        replicas.append(out.model_extra["trtspec"]["replica"])
        reused.append(out.model_extra["trtspec"]["prefix_tokens_reused"])
    assert len(set(replicas)) == 1, replicas
    assert all(r >= 16 for r in reused[1:]), reused  # the replica's prefix cache served the shared part


def test_ingress_metrics_count_requests(endpoint):
    client(endpoint.url).completions.create(model="tiny", prompt="import os", max_tokens=2, temperature=0)
    text = httpx.get(endpoint.url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith('trtspec_requests_total{endpoint="completions",status="200"}'))
    assert float(line.split()[-1]) >= 1


def test_each_replica_exports_its_scheduler_counters_next_to_rays_own_metrics(endpoint):
    c = client(endpoint.url)
    for prompt in PROMPTS:
        c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    deadline, finished = time.time() + 60, {}
    while time.time() < deadline:
        text = httpx.get(endpoint.ray_metrics, timeout=30).text
        finished = {}
        for line in text.splitlines():
            if line.startswith("ray_trtspec_replica_requests_finished_total{"):
                replica = line.split('replica="')[1].split('"')[0]
                finished[replica] = float(line.split()[-1])
        if len(finished) == 2 and sum(finished.values()) >= len(PROMPTS) and "ray_serve_" in text:
            break
        time.sleep(1)
    assert len(finished) == 2 and sum(finished.values()) >= len(PROMPTS), finished
    assert "ray_serve_" in text  # Ray Serve's own metrics on the same endpoint


def test_killing_a_replica_under_load_fails_some_requests_cleanly_and_ray_replaces_it(endpoint, alone):
    pids = replica_pids(2)
    assert len(pids) == 2
    requests = [(PROMPTS[i % 4] + " " * (i // 4), 24) for i in range(16)]
    want = {p: alone(p, max_new_tokens=n).text for p, n in requests}
    victim = sorted(pids)[0]

    async def one(http, prompt, n, stream):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
        if not stream:
            r = await http.post(endpoint.url + "/v1/completions", json=body)
            return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
        text, error = "", None
        async with http.stream("POST", endpoint.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                    else:
                        text += event["choices"][0]["text"]
        return (500, error) if error else (200, text)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.create_task(one(http, p, n, i % 2 == 0)) for i, (p, n) in enumerate(requests)]
            await asyncio.sleep(0.3)
            os.kill(pids[victim], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(main(), 120))  # nothing hangs
    ok = 0
    for (prompt, _), (status, body) in zip(requests, results):
        assert status == 200 or 500 <= status < 600, (status, body)
        if status == 200:
            assert body == want[prompt]  # never wrong text
            ok += 1
    assert ok >= len(requests) // 2, results  # the other replica kept serving
    c = client(endpoint.url)
    for prompt in PROMPTS:  # new requests go to healthy replicas
        assert c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text == \
            alone(prompt, max_new_tokens=8).text
    # Ray starts a replacement: two replicas answer again, neither of them the victim. (The deployment's status is
    # no witness: read before the controller has seen the crash, it still says 2 RUNNING.)
    new = replica_pids(2, timeout=180)  # (a replica starts in seconds alone, but CI machines are shared)
    assert len(new) == 2 and victim not in new, (new, ray_state())
    assert engine_replicas() == {"RUNNING": 2}, ray_state()


# -- without Ray actors: health, routing index ------------------------------------------------------------------


def test_an_engine_failure_fails_the_request_and_marks_the_replica_unhealthy(pair):
    from trtspec.server.ray_app import EngineReplica

    engine = load_engine(pair[0])
    failing = {"on": False}

    def before(ids, pos, first_row):
        if failing["on"]:
            raise RuntimeError("device lost")

    replica = EngineReplica(WrappedEngine(engine, before))  # the plain class, outside Serve
    replica.check_health()  # healthy
    failing["on"] = True

    async def events():
        return [e async for e in replica.generate([1, 2, 3], {"max_new_tokens": 4})]

    got = asyncio.run(events())
    assert got[-1][0] == "error" and "device lost" in got[-1][1]
    with pytest.raises(RuntimeError, match="engine failed .*device lost"):
        replica.check_health()
    invalid = asyncio.run(_collect(replica.generate([1, 2], {"max_new_tokens": 0})))
    assert invalid == [("invalid", "max_new_tokens must be an integer >= 1, got 0")]


async def _collect(agen):
    return [e async for e in agen]


def test_prefix_index_matches_leading_blocks_per_replica():
    index = PrefixIndex(block_tokens=4)
    a = np.arange(20)
    index.record(a[:12], "r1")  # blocks 0..2
    index.record(np.r_[a[:4], 99, 98, 97, 96], "r2")  # block 0 only in common
    assert index.matched_tokens(a, ["r1", "r2", "r3"]) == {"r1": 12, "r2": 4, "r3": 0}
    assert (index.held_blocks("r1"), index.held_blocks("r2"), index.held_blocks("r3")) == (3, 2, 0)
    assert index.matched_tokens(a[:3], ["r1"]) == {"r1": 0}  # no full block
    index.forget("r1")
    assert index.matched_tokens(a, ["r1", "r2"]) == {"r1": 0, "r2": 4}
    assert (index.held_blocks("r1"), index.held_blocks("r2")) == (0, 2)
    assert block_keys(a[:8], 4)[0] == block_keys(np.r_[a[:4], 7, 7, 7, 7], 4)[0]
    assert block_keys(a[:8], 4)[1] != block_keys(np.r_[a[:4], 7, 7, 7, 7], 4)[1]
    small = PrefixIndex(block_tokens=1, max_keys=5)
    small.record(np.arange(8), "r")
    assert len(small) == 5 and small.held_blocks("r") == 5  # evicted keys are no longer held


def test_serve_ray_without_ray_says_how_to_install_it(chat_export):
    code = ("import sys; sys.modules['ray'] = None; from trtspec.cli import main; "
            f"main(['serve', '--target', {str(chat_export)!r}, '--ray'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "pip install 'trtspec[ray]'" in r.stderr


def test_the_serve_config_file_is_valid_and_builds_the_application(pair):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from trtspec.server.ray_app import build_app

    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "ray-serve.yaml")
    with open(path) as f:
        config = yaml.safe_load(f)
    ServeDeploySchema.model_validate(config)  # Ray's own schema of config files
    (app,) = config["applications"]
    assert app["import_path"] == "trtspec.server.ray_app:build_app"
    args = {**app["args"], "target": pair[0], "draft": pair[1]}  # the file names the bundled engines
    ingress = build_app(args)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (ingress.name, engine.name) == ("OpenAIIngress", "EngineReplica")
    assert engine.ray_actor_options["num_cpus"] == 1
    assert engine._deployment_config.autoscaling_config.max_replicas == 2
    with pytest.raises(ValueError, match="unknown trtspec Ray Serve argument"):
        build_app({**args, "replica": 2})
    with pytest.raises(ValueError, match="does not exist"):
        build_app({**args, "target": "/nonexistent/engine"})
