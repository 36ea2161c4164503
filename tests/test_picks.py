"""The target's picks made where its logits are (runtime/picks.py): coupled sampling's noise is standard Gumbel noise
from (seed, position) alone, the same bits as a plain-numpy SplitMix64; the picks made from a tensor equal each row's
own pick on the host, top-k and top-p included; and a round verified from a tensor gives every row the verdict it
gets from numpy logits, for chains and trees, in every sampling mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtspec.engines.base import tree_positions
from trtspec.runtime.picks import (coupled_pick, dropped, gumbel_noise, gumbel_noise_at, gumbel_noise_host,
                                   noise_start, target_picks)
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.verify import RowSampler, verify_rows


def _splitmix_reference(key: int, position: int, size: int) -> np.ndarray:
    """SplitMix64's outputs 1..size from noise_start, in numpy's uint64 arithmetic (defined to wrap)."""
    with np.errstate(over="ignore"):
        counters = np.arange(1, size + 1, dtype=np.uint64)
        z = np.uint64(noise_start(key, position)) + counters * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def test_noise_is_splitmix64_bit_for_bit_and_standard_gumbel():
    """The int64 ops in torch (which wrap, and whose >> is arithmetic) give numpy's uint64 bits; the draws are
    standard Gumbel (Kolmogorov-Smirnov over 2**18), all finite, and streams of other positions or seeds are
    uncorrelated with it."""
    from scipy import stats

    size = 1 << 18
    z = _splitmix_reference(123456789, 42, size)
    u = ((z >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52
    want = -np.log(-np.log(u))
    got = gumbel_noise_host(123456789, 42, size)
    np.testing.assert_array_equal(got, want)
    # torch's ops (the device's noise): the same bits before the logarithms, within an ulp of them after
    np.testing.assert_allclose(gumbel_noise(123456789, 42, size).numpy(), want, rtol=4e-16, atol=4e-15)
    assert np.isfinite(got).all() and got.max() > 9 and got.min() < -2
    assert stats.kstest(got, stats.gumbel_r.cdf).pvalue > 1e-3
    for other in (gumbel_noise(123456789, 43, size), gumbel_noise(123456790, 42, size)):
        assert abs(np.corrcoef(got, other.numpy())[0, 1]) < 0.02
    # a seed beyond int64 and position 0 work alike
    assert np.isfinite(gumbel_noise((1 << 64) - 1, 0, 8).numpy()).all()


def _full_pick(x: np.ndarray, temperature: float, key: int, position: int) -> int:
    """The Gumbel-max pick over every token: numpy's first maximum of x / T + G."""
    return int((x.astype(np.float64) / temperature + gumbel_noise_host(key, position, x.size)).argmax())


@pytest.mark.parametrize("native", [True, False], ids=["candidates", "numpy"])
def test_coupled_pick_is_the_full_gumbel_max_pick(native, monkeypatch):
    """coupled_pick, with the compiled kernels' candidates and without, picks the first maximum of x / T + G over
    all tokens: vocabularies of 1 to 49,152 (not all multiples of the kernel's 64-id blocks), logits spread from 1e-3
    to 300 with ties, -inf (masked), a NaN or +inf (the full pick's own result), temperatures 1e-3 to 50; the noise of
    chosen ids alone is the whole noise's, bit for bit. The candidates are few (the pruning works) and always hold
    the pick."""
    from trtspec import kernels
    from trtspec.runtime import picks

    if native and kernels.load() != "native":
        pytest.skip("the compiled kernels could not be built here")
    monkeypatch.setattr(picks, "_native_candidates", lambda: native)
    rng = np.random.default_rng(17)
    sizes = []
    for trial in range(400):
        v = int(rng.choice([1, 3, 64, 100, 1000, 49152]))
        x = (rng.standard_normal(v) * rng.choice([1e-3, 1.0, 4.0, 30.0, 300.0])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)
        if trial % 5 == 1:
            x[rng.random(v) < 0.5] = -np.inf
        if trial % 37 == 2:
            x[rng.integers(v)] = rng.choice([np.nan, np.inf])
        if trial % 41 == 3:
            x[:] = -np.inf
        t = float(rng.choice([1e-3, 0.3, 0.8, 1.0, 2.0, 50.0]))
        key, position = int(rng.integers(0, 1 << 62)) * 4 + 3, int(rng.integers(0, 8192))
        want = _full_pick(x, t, key, position)
        assert coupled_pick(x, t, key, position) == want, (trial, v, t)
        if native:
            ids = torch.ops.trtspec.gumbel_candidates(torch.from_numpy(x), t, picks._i64(noise_start(key, position)))
            finite = np.isfinite(x).any() and not (np.isnan(x).any() or np.isposinf(x).any())
            assert (want in ids.tolist()) == finite and (ids == ids.sort().values).all()
            sizes.append(ids.numel())
    if native:
        assert max(sizes) <= 4 and np.mean(sizes) < 1.5, sizes
    ids = rng.choice(49152, 500, replace=False)
    np.testing.assert_array_equal(gumbel_noise_at(5, 9, ids), gumbel_noise_host(5, 9, 49152)[ids])


PARAMS = [SamplingParams(temperature=1.3), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=2.0, top_k=9, top_p=0.8)]


@pytest.mark.parametrize("params", PARAMS, ids=["t", "top_k", "top_p", "both"])
def test_dropped_is_where_the_hosts_probs_are_zero(params):
    """Random logits, some with ties (rounded to quarters) and some far apart (underflow in float64's exp)."""
    rng = np.random.default_rng(3)
    for trial in range(60):
        x = rng.normal(size=(4, 50)).astype(np.float32) * (3 if trial % 3 else 400)
        if trial % 2:
            x = np.round(x * 4) / 4
        np.testing.assert_array_equal(dropped(params, torch.from_numpy(x)).numpy(), params.probs(x) == 0)


def _samplers(seed: int):
    """One request per kind: greedy, coupled (with and without top-k/top-p), rejection, and rows that need their
    logits on the host (logprobs)."""
    kinds = [SamplingParams(), *[SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed + i)
                                 for i, p in enumerate(PARAMS)],
             SamplingParams(temperature=1.1, seed=seed + 9), SamplingParams(logprobs=2),
             SamplingParams(temperature=0.9, seed=seed + 11, logprobs=0)]
    modes = ["coupled"] * 5 + ["rejection"] + ["coupled"] * 2
    return [RowSampler(p, mode) for p, mode in zip(kinds, modes)]


@pytest.mark.parametrize("device_ops", [True, False], ids=["torch ops", "numpy"])
def test_picks_from_a_tensor_are_each_rows_own_pick(device_ops):
    """target_picks on a tensor, with the device's torch ops (run here on the CPU) and with the CPU's numpy picks:
    greedy and coupled rows (top-k/top-p too) get, at every node, the token their own sampler picks from those
    logits at that node's position; the others are left to the host."""
    rng = np.random.default_rng(7)
    samplers = _samplers(seed=20)
    b, w, v = len(samplers), 5, 40
    for trial in range(20):
        logits = rng.normal(size=(b, w, v)).astype(np.float32) * 3
        counts = rng.integers(1, w + 1, size=b)
        positions = rng.integers(0, 100, size=(b, 1)) + np.arange(w)
        chosen, picked = target_picks(samplers, torch.from_numpy(logits), counts, positions, skip={1},
                                      on_device_ops=device_ops)
        assert picked == {0, 2, 3, 4}
        for s in picked:
            for j in range(counts[s]):
                assert chosen[s, j] == samplers[s]._choose(logits[s, j], int(positions[s, j]))[0], (trial, s, j)


@pytest.mark.parametrize("tree", [False, True])
def test_a_round_verified_from_a_tensor_equals_each_rows_walk_on_the_host(tree, monkeypatch):
    """verify_rows from a torch tensor with the device's torch ops, from the numpy array of the same logits, and
    with every row's walk on the host (no picks made ahead): the same verdict for every row, fresh samplers with
    the same seeds each time, and drafts that agree with the target often enough to be accepted."""
    import functools

    from trtspec.runtime import picks
    from trtspec.runtime import verify as verify_module

    rng = np.random.default_rng(11)
    b, k, v = 8, 4, 30
    accepted = 0
    for trial in range(40):
        logits = rng.normal(size=(b, k + 1, v)).astype(np.float32) * 4
        drafts = np.where(rng.random((b, k)) < 0.7, logits[:, :k].argmax(-1), rng.integers(0, v, (b, k)))
        counts = rng.integers(0, k + 1, size=b)
        parents = depth = None
        if tree:  # draft 0 under the root, drafts 1 and 2 under it (other tokens), draft 3 under draft 1
            parents = np.array([[-1, 0, 0, 1]] * b)
            _, depth = tree_positions(np.concatenate([np.full((b, 1), -1), parents + 1], axis=1))
            drafts[:, 2] = (drafts[:, 1] + 1 + rng.integers(0, v - 1, b)) % v
            drafts[:, 3] = logits[:, 2].argmax(-1)
        positions = rng.integers(1, 200, size=b)
        got = [verify_rows(_samplers(seed=trial), drafts, parents, counts, None, logits, positions, depth=depth)]
        with monkeypatch.context() as m:
            m.setattr(verify_module, "target_picks", functools.partial(target_picks, on_device_ops=True))
            tensor = torch.from_numpy(logits.copy())
            got.append(verify_rows(_samplers(seed=trial), drafts, parents, counts, None, tensor, positions, depth=depth))
        with monkeypatch.context() as m:
            m.setattr(picks, "on_device", lambda sampler: False)
            host = verify_rows(_samplers(seed=trial), drafts, parents, counts, None, logits, positions, depth=depth)
        assert got[0] == host and got[1] == host, trial
        accepted += sum(len(path) for path, _ in host)
    assert accepted > 50
