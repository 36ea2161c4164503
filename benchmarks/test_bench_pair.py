"""Per-configuration timings on held-out prompts (pytest-benchmark). The side-by-side table with
speedups, acceptance and theoretical speedups is `trtspec bench` (benchmarks/README.md)."""

from __future__ import annotations

import pytest

from trtspec import Generator
from trtspec.bench import _hf_runner

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
NEW = 64


def _run_all(run, prompts):
    return [run(p, NEW, 0.0, seed=0)[0] for p in prompts]


@pytest.mark.parametrize("mode", ["plain", "assisted", "prompt_lookup"])
def test_hf(benchmark, prompts, mode):
    run = _hf_runner(ROOT / "models" / "stdlib-target", ROOT / "models" / "stdlib-draft", 2, mode, 4)
    benchmark.pedantic(_run_all, args=(run, prompts), rounds=2, iterations=1)


@pytest.mark.parametrize("config", ["target_only", "k2", "k4", "k6", "adaptive", "prompt_lookup"])
def test_trtspec(benchmark, pair, prompts, config):
    target, draft = pair
    if config == "target_only":
        gen = Generator(target)
    elif config == "prompt_lookup":
        gen = Generator(target, drafter="prompt_lookup", num_draft_tokens=4, k_policy="fixed")
    elif config == "adaptive":
        gen = Generator(target, draft, num_draft_tokens=8, k_policy="load-aware")
    else:
        gen = Generator(target, draft, num_draft_tokens=int(config[1:]), k_policy="fixed")
    reference = [r.token_ids for r in Generator(target).generate(prompts, max_new_tokens=NEW)]

    def run():
        return [gen.generate(p, max_new_tokens=NEW).token_ids for p in prompts]

    assert benchmark.pedantic(run, rounds=3, iterations=1) == reference  # lossless, or the timing is meaningless
