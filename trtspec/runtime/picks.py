"""The target's own picks made where its logits are: the device-resident half of a round (DESIGN.md §4).

A verify call returns logits [B, W, V] where the engine made them (a torch engine's tensor on its device; an
onnxruntime engine's numpy array). A greedy or coupled row with no logits processing and no logprobs (a ``plain``
RowSampler) needs nothing of them but the target's pick at each node: the argmax, or the Gumbel-max sample at that
node's sequence position. The acceptance walk reads only those (verify.RowSampler.accept with ``chosen``). So
``target_picks`` makes every such row's picks where the logits are, and only the ids, [B, W] int64, reach the host. A
row that needs its logits (penalties, bias, a grammar, logprobs, rejection sampling) has its own rows copied to the
host (``host_rows``), as before.

Off the CPU the picks are torch ops on the device, every row at once. On the CPU they are the host's numpy picks
(RowSampler._pick) on the same memory: torch's CPU argmax over a 49,152-token row took 45 us against numpy's 4
(measured here), and the two give the same ids (the first maximum; float64 division and addition round alike).

Coupled sampling's noise is a function of (seed, position, token id) alone: SplitMix64's outputs from a start that
(seed, position) give, the same integer bits in numpy (``gumbel_noise_host``) and in torch on any device
(``gumbel_noise``), so a draft proposed on the host and the target's pick on the device read the same G_i to within
an ulp of the logarithm, and a seed gives the same sample on every engine.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _i64(c: int) -> int:
    """The int64 whose bits are the uint64 ``c``."""
    c &= _MASK
    return c - (1 << 64) if c >> 63 else c


def _mix(z: int) -> int:
    # SplitMix64's finaliser on a Python int (the stream's start)
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    # a logical right shift of int64 bit patterns (torch's >> is arithmetic)
    return (z >> s) & ((1 << (64 - s)) - 1)


def noise_start(key: int, position: int) -> int:
    """Where the noise stream of (seed, position) starts: a uint64 (Python ints: a numpy int64 would overflow)."""
    return _mix(_mix(int(key)) + int(position) * _GOLDEN)


_COUNTERS: dict[int, np.ndarray] = {}  # size -> 1..size as uint64 (the host's noise reads them every position)


def gumbel_noise_host(key: int, position: int, size: int) -> np.ndarray:
    """``gumbel_noise`` in numpy (whose uint64 arithmetic wraps by definition): [size] float64, the same bits before
    the logarithms; 224 us for 49,152 tokens here (torch's CPU ops took 584)."""
    counters = _COUNTERS.get(size)
    if counters is None:
        counters = _COUNTERS[size] = np.arange(1, size + 1, dtype=np.uint64)
    return _gumbel(counters, key, position)


def gumbel_noise_at(key: int, position: int, ids: np.ndarray) -> np.ndarray:
    """``gumbel_noise_host(key, position, V)[ids]`` without the other tokens' noise: the same bits."""
    return _gumbel(np.asarray(ids, dtype=np.uint64) + np.uint64(1), key, position)


def _gumbel(counters: np.ndarray, key: int, position: int) -> np.ndarray:
    # SplitMix64's outputs number ``counters`` from noise_start(key, position) -> standard Gumbel draws, float64
    with np.errstate(over="ignore"):
        z = counters * np.uint64(_GOLDEN)
        z += np.uint64(noise_start(key, position))
        z ^= z >> np.uint64(30)
        z *= np.uint64(_M1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_M2)
        z ^= z >> np.uint64(31)
    z >>= np.uint64(12)
    u = z.astype(np.float64)
    u += 0.5
    u *= 2.0**-52
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    return np.negative(u, out=u)


def coupled_pick(x: np.ndarray, temperature: float, key: int, position: int, support: np.ndarray | None = None,
                 noise=None) -> int:
    """Coupled sampling's Gumbel-max pick, the first maximum of x / T + G (G: ``gumbel_noise_host(key, position,
    V)``), over ``support`` (ids, ascending) if given: x [V] float32 processed logits. ``noise``: a function giving G
    over all of V (a cache), else it is made here.

    Only a few ids can hold the maximum. With the compiled kernels loaded (an engine on them loaded them),
    torch.ops.trtspec.gumbel_candidates finds them, most ids without a logarithm, and they are scored here with the
    full pick's own numpy steps (one candidate, the usual case, is the pick): the same pick, 80 us against 271 for
    49,152 tokens (benchmarks/bench_picks.py). A support (top-k, top-p) is scored alone."""
    if support is None and x.dtype == np.float32 and x.flags.writeable and _native_candidates():
        ids = torch.ops.trtspec.gumbel_candidates(torch.from_numpy(x), float(temperature),
                                                  _i64(noise_start(key, position))).numpy()
        if ids.size == 1:  # (the usual case: the pick itself)
            return int(ids[0])
        if ids.size:  # (none: x holds a NaN or +inf)
            support = ids
    if support is not None:
        score = x[support].astype(np.float64) / temperature + gumbel_noise_at(key, position, support)
        return int(support[score.argmax()])
    g = noise() if noise is not None else gumbel_noise_host(key, position, x.size)
    return int((x.astype(np.float64) / temperature + g).argmax())


def _native_candidates() -> bool:
    """Whether the compiled kernels are loaded (an engine on them loaded them; nothing here compiles them)."""
    from ..kernels import loaded

    return loaded() == "native"


def gumbel_noise(key: int, position: int, size: int, device="cpu") -> torch.Tensor:
    """Standard Gumbel noise [size] float64 for sequence ``position`` of the request seeded ``key``, on ``device``:
    token i's -log(-log(u)), u = (h + 0.5) / 2^52 with h the top 52 bits of SplitMix64's output i + 1 from
    ``noise_start``. u lies in [2^-53, 1 - 2^-53], so every draw is finite."""
    z = torch.arange(1, size + 1, dtype=torch.int64, device=device) * _i64(_GOLDEN) + _i64(noise_start(key, position))
    z = (z ^ _shr(z, 30)) * _i64(_M1)
    z = (z ^ _shr(z, 27)) * _i64(_M2)
    z = z ^ _shr(z, 31)
    u = (_shr(z, 12).double() + 0.5) * 2.0**-52
    return u.log_().neg_().log_().neg_()


def dropped(params, x: torch.Tensor) -> torch.Tensor:
    """Where ``params.probs(x)`` is 0 (top-k, top-p, underflow), the same float64 steps in torch: x [m, V] -> bool."""
    z = x.double() / params.temperature
    v = z.shape[-1]
    if params.top_k is not None and params.top_k < v:
        kth = z.topk(params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    p = (z - z.amax(-1, keepdim=True)).exp()
    p /= p.sum(-1, keepdim=True)
    drop = p == 0
    if params.top_p is not None and params.top_p < 1:
        sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop |= torch.zeros_like(drop).scatter_(-1, order, drop_sorted)
    return drop


def as_tensor(logits) -> torch.Tensor:
    """Logits as a torch tensor where they are (numpy: a view, no copy)."""
    return logits if isinstance(logits, torch.Tensor) else torch.from_numpy(np.asarray(logits))


def host_view(logits) -> np.ndarray:
    """Logits on the CPU as a float32 numpy array (a view of a float32 CPU tensor, no copy)."""
    if isinstance(logits, np.ndarray):
        return logits
    return logits.float().cpu().numpy()


def host_rows(logits, s: int, n: int) -> np.ndarray:
    """Row s's first n positions' logits on the host, float32 [n, V] (a view where they are there already)."""
    if isinstance(logits, np.ndarray):
        return logits[s, :n]
    return logits[s, :n].float().cpu().numpy()


def host_logits(engine) -> bool:
    """Whether an engine's logits are on the host (an onnxruntime engine's numpy arrays, a torch engine on the CPU):
    a lone coupled row then picks there in the engine's own loop; elsewhere the batch path picks on the device."""
    return not getattr(engine, "tensor_logits", False) or getattr(getattr(engine, "device", None), "type", "") == "cpu"


def on_device(sampler) -> bool:
    """Whether a request's picks need nothing of the logits but themselves (target_picks makes them)."""
    return sampler.plain and sampler.mode in ("greedy", "coupled")


def target_picks(samplers, logits, counts, positions, skip=(), on_device_ops: bool | None = None
                 ) -> tuple[np.ndarray | None, set]:
    """The target's pick at every node of every ``on_device`` row, made where the logits are: (ids [B, W] int64 on
    the host, or None where no row is; the rows picked).

    ``logits`` [B, W, V]; row s's nodes are its first ``counts[s]`` positions, node j picking for sequence position
    ``positions[s, j]`` (a tree's: the root's plus the node's depth), which selects a coupled row's noise.
    ``on_device_ops``: torch ops (the default off the CPU) or the host's numpy picks (the default on it)."""
    rows = {s for s, r in enumerate(samplers) if s not in skip and on_device(r)}
    if not rows:
        return None, rows
    if on_device_ops is None:
        on_device_ops = isinstance(logits, torch.Tensor) and logits.device.type != "cpu"
    greedy = any(samplers[s].mode == "greedy" for s in rows)
    coupled = sorted(s for s in rows if samplers[s].mode == "coupled")
    if not on_device_ops:
        x = host_view(logits)
        # every row's argmax at once where any row is greedy (selecting rows first would copy their logits)
        picks = x.argmax(-1) if greedy else np.zeros(x.shape[:2], np.int64)
        for s in coupled:
            for j in range(int(counts[s])):
                picks[s, j] = samplers[s]._pick(x[s, j], int(positions[s, j]))
        return picks, rows
    x = as_tensor(logits)
    b, w, v = x.shape
    picks = x.argmax(-1) if greedy else torch.zeros((b, w), dtype=torch.int64, device=x.device)
    for s in coupled:
        sampler, m = samplers[s], int(counts[s])
        noise = torch.stack([sampler.noise(int(p), v, x.device) for p in positions[s, :m]])
        score = x[s, :m].double() / sampler.params.temperature + noise
        prm = sampler.params
        if prm.top_k is not None or (prm.top_p is not None and prm.top_p < 1):
            score = score.masked_fill(dropped(prm, x[s, :m]), -torch.inf)
        picks[s, :m] = score.argmax(-1)
    return picks.cpu().numpy(), rows  # (the round's one transfer)
