"""Tree speculation (runtime/drafters/trees.py, the drafters' token trees): verified trees keep the target's greedy
output and sample, on every family and backend, through the scheduler and the server."""

from __future__ import annotations

import pytest

from conftest import WrappedEngine
from trtspec import Generator, load_engine

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os"]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("width,nodes", [(2, None), (4, 9)])
def test_greedy_tree_speculation_equals_target_greedy_and_compacts(batch, width, nodes, tree_engine, perturbed_export):
    target = tree_engine("llama-gqa-rope3")
    kept = []
    wrapped = WrappedEngine(target, lambda *a: None)
    wrapped.keep_path = lambda row, start, path: (kept.append(list(path)), target.keep_path(row, start, path))
    reference = [r.token_ids for r in Generator(target).generate(PROMPTS[:batch], max_new_tokens=40)]
    draft = load_engine(perturbed_export("llama-gqa-rope3", 0.3))
    gen = Generator(wrapped, draft, num_draft_tokens=4, k_policy="fixed", tree_width=width, tree_nodes=nodes)
    out = gen.generate(PROMPTS[:batch], max_new_tokens=40)
    assert [r.token_ids for r in out] == reference
    shapes = gen.scheduler.stats().tree_shapes
    assert sum(shapes.values()) > 0 and set(shapes) <= {f"{k}x{width}" for k in range(1, 5)}
    assert kept, "no sibling was ever accepted: the compaction path went untested"
    chain = Generator(target, draft, num_draft_tokens=4, k_policy="fixed").generate(PROMPTS[:batch], max_new_tokens=40)
    assert out.stats.mean_tokens_per_target_call >= chain.stats.mean_tokens_per_target_call


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2"])
def test_greedy_tree_speculation_is_exact_on_every_family(arch, exported, perturbed_export):
    target = load_engine(exported(arch, tree=True, ring_cache=False))
    reference = [r.token_ids for r in Generator(target).generate(PROMPTS, max_new_tokens=24)]
    draft = load_engine(perturbed_export(arch, 0.3))
    out = Generator(target, draft, num_draft_tokens=3, k_policy="fixed", tree_width=3).generate(PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in out] == reference


@pytest.mark.parametrize("form", ["torch", "torch-inductor"])
def test_tree_speculation_over_a_torch_target_is_its_own_greedy_output_and_sample(form, tree_engine, perturbed_export):
    target = tree_engine("llama-gqa-rope3", form)
    kept = []
    wrapped = WrappedEngine(target, lambda *a: None)
    wrapped.keep_path = lambda row, start, path: (kept.append(list(path)), target.keep_path(row, start, path))
    draft = load_engine(perturbed_export("llama-gqa-rope3", 0.3))
    for params in (dict(max_new_tokens=30), dict(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=11)):
        reference = [r.token_ids for r in Generator(target).generate(PROMPTS, **params)]
        gen = Generator(wrapped, draft, num_draft_tokens=3, k_policy="fixed", tree_width=3)
        out = gen.generate(PROMPTS, **params)
        assert [r.token_ids for r in out] == reference
        assert sum(gen.scheduler.stats().tree_shapes.values()) > 0
    assert kept, "no sibling was ever accepted: the torch engine's keep_path went untested"


def test_coupled_tree_sampling_is_the_target_only_sample(tree_engine, perturbed_export):
    target = tree_engine("llama-gqa-rope3")
    params = dict(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=11)
    reference = [r.token_ids for r in Generator(target).generate(PROMPTS, **params)]
    draft = load_engine(perturbed_export("llama-gqa-rope3", 0.3))
    out = Generator(target, draft, num_draft_tokens=3, k_policy="fixed", tree_width=3).generate(PROMPTS, **params)
    assert [r.token_ids for r in out] == reference
    assert 0 < out.stats.accepted < out.stats.proposed


def test_tree_options_are_checked(tree_engine, exported):
    plain = load_engine(exported("llama-gqa-rope3"))
    with pytest.raises(ValueError, match="--tree"):
        Generator(plain, plain, tree_width=3)
    tree = tree_engine("llama-gqa-rope3")
    with pytest.raises(ValueError, match="tree_width must be"):
        Generator(tree, tree, tree_width=0)
    with pytest.raises(ValueError, match="draft-model and head drafters"):
        Generator(tree, drafter="prompt_lookup", tree_width=2)


@pytest.fixture(scope="module", params=["coupled", "rejection"])
def tree_sampling(request, exported, perturbed_export, model_dir):
    from test_verify import _exact_joint

    from trtspec.runtime import SamplingParams

    options = {"max_seq_len": 16, "max_batch": 64}
    target = load_engine(exported("llama-gqa-rope3", tree=True, **options))
    draft = load_engine(perturbed_export("llama-gqa-rope3", 0.5, **options))
    gen = Generator(target, draft, num_draft_tokens=2, k_policy="fixed", sampling=request.param, tree_width=3)
    params = SamplingParams(temperature=1.5, top_k=4)
    joint = _exact_joint(model_dir("llama-gqa-rope3"), gen.tokenizer("def")["input_ids"], params, depth=3)
    return gen, params, joint


def test_tree_sampling_follows_the_target_distribution(tree_sampling, monkeypatch):
    from test_verify import ALPHA, _chi_square_p_value, _sample_sequences

    gen, params, joint = tree_sampling
    counts, _ = _sample_sequences(gen, "def", params, 20_480, seed=0)
    assert sum(counts.values()) == 20_480
    assert _chi_square_p_value(counts, joint) > ALPHA
    stats = gen.scheduler.stats()  # trees were verified, with both outcomes
    assert sum(stats.tree_shapes.values()) > 0 and 0.02 < stats.accepted / stats.proposed < 0.98
    if gen.scheduler.sampling == "rejection":
        # the same test catches a wrong rule: after a rejected child, keep drawing from p (not p without it)
        from trtspec.runtime import verify

        from trtspec.runtime.sampling import sample

        real = verify.accept_rejection

        def wrong(p, candidates, q, rng):
            i, token = real(p, candidates, q, rng)
            if i >= 0 or not candidates:
                return i, token
            return -1, sample(p, rng)  # every child rejected: drawn from p, which may give a rejected child again

        monkeypatch.setattr(verify, "accept_rejection", wrong)
        counts, _ = _sample_sequences(gen, "def", params, 20_480, seed=0)
        assert _chi_square_p_value(counts, joint) < ALPHA


def test_a_load_aware_tree_round_stays_exact(tree_engine, perturbed_export):
    target = tree_engine("llama-gqa-rope3")
    reference = [r.token_ids for r in Generator(target).generate(PROMPTS, max_new_tokens=40)]
    draft = load_engine(perturbed_export("llama-gqa-rope3", 0.3))
    gen = Generator(target, draft, num_draft_tokens=4, tree_width=3)  # load-aware: chains and trees as they pay
    policy = gen.scheduler.policy
    assert policy.widths == (1, 3)
    for t in range(1, 16):  # told that wide calls are nearly free and trees accept well, it starts with trees
        policy.target.record(3, t, 1e-3)
    for _ in range(20):
        policy.record_acceptance(4, 4, width=3)
    out = gen.generate(PROMPTS, max_new_tokens=40)
    assert [r.token_ids for r in out] == reference
    assert sum(gen.scheduler.stats().tree_shapes.values()) > 0  # trees were tried (and judged)


def test_served_streams_with_trees_are_the_target_only_text(tree_engine, perturbed_export):
    """The OpenAI server over a tree-drafting scheduler: concurrent streamed completions, each equal to target-only
    decoding (the official client, a real server on 127.0.0.1)."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import Server
    from trtspec import Scheduler
    from trtspec.server import create_app

    target = tree_engine("llama-gqa-rope3")
    draft = load_engine(perturbed_export("llama-gqa-rope3", 0.3))
    reference = [r.text for r in Generator(target).generate(PROMPTS, max_new_tokens=24)]
    scheduler = Scheduler(target, draft, num_draft_tokens=3, k_policy="fixed", tree_width=3)
    with Server(create_app(scheduler, model_name="tiny")) as s:
        client = s.client()

        def stream(prompt):
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(stream, PROMPTS))
        import httpx

        metrics = httpx.get(s.url + "/metrics").text
    assert texts == reference
    shapes = scheduler.stats().tree_shapes
    assert sum(shapes.values()) > 0  # and the chosen shapes are exported to Prometheus
    assert all(f'trtspec_rounds_by_tree_shape{{shape="{k}"}} {float(v)}' in metrics for k, v in shapes.items())
