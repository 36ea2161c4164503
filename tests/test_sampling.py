"""runtime/sampling.py: temperature, top-k and top-p as HF applies them, refused parameters, the inverse-CDF draw,
and the log-probabilities a request reports."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from test_verify import ALPHA, _chi_square_p_value
from trtspec.runtime.sampling import SamplingParams, log_probs, logprob_entry, sample


def _hf_probs(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = torch.from_numpy(logits.astype(np.float64))
    x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p is not None:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, dim=-1).numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, None, None), (1.3, 5, None),
                                                       (0.9, None, 0.8), (1.5, 12, 0.6), (0.5, 1, None)])
def test_probs_equal_hf_generates_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(3).standard_normal((6, 64)).astype(np.float32) * 3
    ours = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).probs(logits)
    np.testing.assert_allclose(ours, _hf_probs(logits, temperature, top_k, top_p), rtol=1e-9, atol=1e-12)
    assert np.allclose(ours.sum(-1), 1.0)
    if top_k is not None:
        assert ((ours > 0).sum(-1) <= top_k).all()


def _nucleus_by_full_sort(p: np.ndarray, top_p: float) -> np.ndarray:
    """top-p's definition over the whole vocabulary: sort it (descending, ties by id), drop a token where the mass
    before it, cumsum - p, reaches top_p."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    drop = np.zeros_like(sorted_p, dtype=bool)
    np.put_along_axis(drop, order, (np.cumsum(sorted_p, axis=-1) - sorted_p) >= top_p, axis=-1)
    p = np.where(drop, 0.0, p)
    return p / p.sum(axis=-1, keepdims=True)


def test_top_p_sorts_only_the_head_of_the_distribution_and_keeps_every_bit():
    """probs' top-p (which sorts only the tokens above a threshold holding the mass) gives the full sort's
    distribution to the bit: vocabularies to 49,152, one row or several, flat and peaked rows, ties, top_p near 0
    and near 1, with top-k before it."""
    rng = np.random.default_rng(8)
    for trial in range(300):
        v = int(rng.choice([2, 64, 1000, 49152]))
        shape = (v,) if trial % 4 else (3, v)
        logits = (rng.standard_normal(shape) * rng.choice([0.01, 0.5, 3.0, 10.0, 40.0])).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits)
        top_p = float(rng.choice([1e-3, 0.3, 0.8, 0.9, 0.95, 0.999, 0.99999]))
        top_k = int(rng.integers(1, 100)) if trial % 5 == 0 else None
        params = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.7])), top_k=top_k, top_p=top_p)
        plain = SamplingParams(temperature=params.temperature, top_k=top_k).probs(logits)
        np.testing.assert_array_equal(params.probs(logits), _nucleus_by_full_sort(plain, top_p))


def test_support_is_where_probs_are_nonzero():
    """support (the ids a coupled pick scores) equals np.flatnonzero(probs) on one row: top-k (its k-th largest from
    the tokens above a threshold), top-p, both, and neither; ties, -inf, NaN and +inf, float32 and float64 rows,
    underflow at tiny temperatures, k of 1 to all but one of the vocabulary."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        v = int(rng.choice([1, 2, 7, 64, 1000, 49152]))
        logits = (rng.standard_normal(v) * rng.choice([1e-3, 0.5, 3.0, 40.0, 300.0]) + rng.choice([0, 1e4]))
        logits = logits.astype(np.float32 if trial % 4 else np.float64)
        if trial % 3 == 0:
            logits = np.round(logits)
        if trial % 7 == 0:
            logits[rng.integers(0, v, size=max(1, v // 10))] = -np.inf
        if trial % 37 == 0:
            logits[rng.integers(0, v)] = rng.choice([np.nan, np.inf])
        top_k = int(rng.integers(1, v + 1)) if v > 1 and trial % 2 == 0 else None
        top_p = float(rng.choice([1e-3, 0.5, 0.9, 0.99999, 1.0])) if trial % 3 else None
        params = SamplingParams(temperature=float(rng.choice([1e-3, 0.3, 0.8, 1.7, 50.0])), top_k=top_k, top_p=top_p)
        with np.errstate(invalid="ignore"):
            want = np.flatnonzero(params.probs(logits))
            got = params.support(logits)
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}: {params}")


@pytest.mark.parametrize("options, message", [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": 1.0, "top_k": 0}, "top_k must be an integer >= 1"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p must be in \\(0, 1\\]"),
    ({"top_k": 5}, "only apply when sampling"),
    ({"presence_penalty": 3.0}, "presence_penalty must be a number in \\[-2, 2\\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a number in \\(0, 10\\]"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias keys must be token ids"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias values must be numbers in \\[-100, 100\\]"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"logprobs": 21}, "logprobs must be an integer in \\[0, 20\\]"),
])
def test_invalid_parameters_are_refused_saying_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_sample_draws_from_the_distribution():
    probs = np.array([0.05, 0.0, 0.4, 0.15, 0.3, 0.1])
    rng = np.random.default_rng(11)
    counts = Counter(sample(probs, rng) for _ in range(20000))
    assert counts[1] == 0  # a token of probability 0 is never drawn
    assert _chi_square_p_value(counts, {t: p for t, p in enumerate(probs) if p > 0}) > ALPHA


def test_reported_log_probs_are_those_of_the_distribution_drawn_from():
    logits = np.random.default_rng(5).standard_normal(40).astype(np.float32)
    greedy = log_probs(SamplingParams(), logits)
    np.testing.assert_allclose(greedy, torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy(), atol=1e-12)
    params = SamplingParams(temperature=0.8, top_k=7)
    sampled = log_probs(params, logits)
    assert np.isinf(sampled).sum() == 40 - 7  # filtered tokens cannot be drawn
    np.testing.assert_allclose(np.exp(sampled), params.probs(logits), atol=1e-15)
    token, value, top = logprob_entry(greedy, 3, 4)
    assert (token, value) == (3, float(greedy[3]))
    assert [t for t, _ in top] == list(np.argsort(-greedy)[:4]) and [v for _, v in top] == sorted(greedy)[::-1][:4]
