"""Engines shared between threads: every caller gets its output alone; an engine never mixes two callers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trtspec import EngineBusyError, Generator, load_engine

ARCH = "llama-gqa-rope3"
OPTIONS = {"max_seq_len": 128, "max_batch": 4}
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick", "import os", "class Stack:",
           "x = [1, 2, 3]\nfor i in x:", "while True:", "# a comment\n", "return"]


@pytest.fixture(scope="module")
def target(exported):
    return load_engine(exported(ARCH, **OPTIONS))


@pytest.fixture(scope="module")
def draft(perturbed_export):
    return load_engine(perturbed_export(ARCH, 0.3, **OPTIONS))


def _in_threads(fn, n):
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("drafter", ["draft", "prompt_lookup", "suffix"])  # suffix: its cache shared by the threads
def test_8_threads_sharing_one_generator_each_get_their_output_alone(target, draft, drafter):
    lengths = [48, 10, 30, 64, 5, 48, 20, 40]
    alone = [Generator(target).generate(p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, lengths)]
    gen = Generator(target, draft, num_draft_tokens=3, k_policy="fixed") if drafter == "draft" else Generator(target, drafter=drafter, k_policy="fixed")
    got = _in_threads(lambda i: gen.generate(PROMPTS[i], max_new_tokens=lengths[i]).token_ids, 8)
    assert got == alone


def test_8_threads_seeded_sampling_each_get_their_output_alone(target, draft):
    params = [{"max_new_tokens": 32, "temperature": 0.7 + 0.1 * i, "top_p": 0.95, "seed": i} for i in range(8)]
    alone = [Generator(target).generate(p, **kw).token_ids for p, kw in zip(PROMPTS, params)]
    gen = Generator(target, draft, num_draft_tokens=4, k_policy="load-aware")
    got = _in_threads(lambda i: gen.generate(PROMPTS[i], **params[i]).token_ids, 8)
    assert got == alone


def test_8_threads_streaming_from_one_generator(target, draft):
    alone = [Generator(target).generate(p, max_new_tokens=24).text for p in PROMPTS]
    gen = Generator(target, draft, num_draft_tokens=2, k_policy="fixed")
    got = _in_threads(lambda i: "".join(gen.stream(PROMPTS[i], max_new_tokens=24)), 8)
    assert got == alone


def test_two_generators_on_the_same_engines_take_turns(target, draft):
    alone = [Generator(target).generate(p, max_new_tokens=40).token_ids for p in PROMPTS[:4]]
    gens = [Generator(target, draft, num_draft_tokens=3, k_policy="fixed"), Generator(target, drafter="prompt_lookup", k_policy="fixed")]
    got = _in_threads(lambda i: [r.token_ids for r in gens[i % 2].generate(PROMPTS[:4], max_new_tokens=40)], 4)
    assert all(g == alone for g in got)


def test_a_simultaneous_forward_on_one_engine_is_refused_not_mixed(exported):
    engine = load_engine(exported(ARCH, **OPTIONS))
    ids = np.array([[5, 6, 7]])
    pos = np.arange(3)[None]
    reference = engine.forward(ids, pos).copy()
    inside, release = threading.Event(), threading.Event()
    run = engine.session.run_with_iobinding

    def slow_run(binding):
        inside.set()
        release.wait(10)
        return run(binding)

    engine.session.run_with_iobinding = slow_run
    results = []
    worker = threading.Thread(target=lambda: results.append(engine.forward(ids, pos).copy()))
    worker.start()
    assert inside.wait(10)
    with pytest.raises(EngineBusyError, match="not thread-safe. Share one trtspec.Generator"):
        engine.forward(np.array([[9]]), np.array([[3]]))
    with pytest.raises(EngineBusyError):
        engine.move_row(0, 1)
    release.set()
    worker.join()
    engine.session.run_with_iobinding = run
    np.testing.assert_array_equal(results[0], reference)  # the refused call wrote nothing
    np.testing.assert_array_equal(engine.forward(ids, pos), reference)
