"""The arithmetic of every quantization mode, in numpy, independent of any graph.

Weights are [K, N] (the MatMul's right operand: K inputs, N outputs).
Everything is symmetric (zero point 0), as TensorRT's explicit quantization requires.
Scales are computed in float32 and rounded to the model's dtype *before* the
values are quantized with them, so the graph's DequantizeLinear reproduces
exactly what was computed here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

INT8_MAX = 127.0
INT4_MIN, INT4_MAX = -8.0, 7.0
FP8_MAX = 448.0  # largest finite float8 E4M3FN


def _scale(amax: np.ndarray, qmax: float, dtype) -> np.ndarray:
    """amax / qmax in ``dtype``; a channel that is all zeros gets scale 1 (any scale represents zeros)."""
    scale = (np.asarray(amax, np.float32) / np.float32(qmax)).astype(dtype)
    return np.where(scale > 0, scale, np.ones_like(scale)).astype(dtype)


def int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> q int8 [K, N], scale [N] (one per output channel)."""
    scale = _scale(np.abs(w).max(axis=0), INT8_MAX, w.dtype)
    q = np.clip(np.rint(w.astype(np.float32) / scale.astype(np.float32)), -INT8_MAX, INT8_MAX)
    return q.astype(np.int8), scale


def fp8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> q float8_e4m3fn [K, N], scale [N]; round to nearest even, saturating at 448."""
    scale = _scale(np.abs(w).max(axis=0), FP8_MAX, w.dtype)
    x = np.clip(w.astype(np.float32) / scale.astype(np.float32), -FP8_MAX, FP8_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn), scale


def padded_k(k: int, block_size: int) -> int:
    """K rounded up to a whole number of blocks: a block size need not divide K, the last block is zero-padded."""
    return -(-k // block_size) * block_size


def pad_to(a: np.ndarray, size: int, axes=(0,)) -> np.ndarray:
    """``a`` with zeros appended along ``axes`` up to ``size`` on each."""
    return np.pad(a, [(0, size - a.shape[i] if i in axes else 0) for i in range(a.ndim)])


def int4_blocked(w: np.ndarray, block_size: int, clip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> q int4 [K', N], scale [K' / block_size, N] (blocks of block_size along K).

    K' is K rounded up to a multiple of block_size: where the block size does not divide K the last block
    is padded with zero rows (q = 0 there), and the graph zero-pads the MatMul's input to K' to match
    (what TensorRT's blocked DequantizeLinear needs: whole blocks). ``clip`` [K' / block_size, N] in (0, 1]
    shrinks each block's range (AWQ's clipping): values beyond clip * max|block| saturate, the rest get a
    finer grid.
    """
    k, n = w.shape
    kp = padded_k(k, block_size)
    blocks = pad_to(w.astype(np.float32), kp).reshape(kp // block_size, block_size, n)
    amax = np.abs(blocks).max(axis=1)
    scale = _scale(amax if clip is None else amax * clip, INT4_MAX, w.dtype)
    q = np.clip(np.rint(blocks / scale.astype(np.float32)[:, None, :]), INT4_MIN, INT4_MAX)
    return q.reshape(kp, n).astype(ml_dtypes.int4), scale


def dequantize(q: np.ndarray, scale: np.ndarray, block_size: int = 0) -> np.ndarray:
    """The float32 weight a DequantizeLinear of (q, scale) produces: per channel ([N]) or blocked ([K'/B, N],
    with K' = q's rows, padding included)."""
    scale = scale.astype(np.float32)
    if block_size:
        scale = np.repeat(scale, block_size, axis=0)
    return q.astype(np.float32) * scale


def fake_quantize(w: np.ndarray, fmt: str, block_size: int = 0, clip: np.ndarray | None = None) -> np.ndarray:
    """Quantize then dequantize w [K, N] in ``fmt`` ("int8", "fp8", "int4"): what the graph computes with."""
    if fmt == "int8":
        return dequantize(*int8_per_channel(w))
    if fmt == "fp8":
        return dequantize(*fp8_per_channel(w))
    if fmt == "int4":
        return dequantize(*int4_blocked(w, block_size, clip), block_size)[: w.shape[0]]
    raise ValueError(f"unknown format {fmt!r}")


def activation_scale(amax: float, fmt: str, dtype) -> np.ndarray:
    """The per-tensor scale (a scalar of ``dtype``) of an activation whose calibrated |max| is amax."""
    return _scale(np.float32(amax), INT8_MAX if fmt == "int8" else FP8_MAX, dtype)


def smoothquant_factors(act_absmax: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """SmoothQuant's per-input-channel factors s [K]: s_j = max|X_j|^alpha / max|W_j,:|^(1 - alpha).

    The activation is divided by s and each weight's rows multiplied by s, which
    moves activation outliers into the weights (Xiao et al. 2023). ``weights``
    are every MatMul reading the activation, so they share one s.
    """
    w_absmax = np.max([np.abs(w.astype(np.float32)).max(axis=1) for w in weights], axis=0)
    a = np.asarray(act_absmax, np.float32)
    s = np.power(np.maximum(a, 1e-5), alpha) / np.power(np.maximum(w_absmax, 1e-5), 1.0 - alpha)
    return np.where((a > 0) & (w_absmax > 0), s, 1.0).astype(np.float32)


def awq_search(x: np.ndarray, mean_abs: np.ndarray, weights: list[np.ndarray], block_size: int,
               grid: int = 20) -> tuple[np.ndarray, float, float, float]:
    """AWQ's per-input-channel scale search (Lin et al. 2024) for int4 weights blocked along K.

    x [R, K] calibration activations; mean_abs [K] their mean |x| per channel; weights
    every [K, N] MatMul reading x (one shared s). For alpha on a grid in [0, 1):
    s = mean_abs^alpha (normalised), loss = sum ||x W - (x / s) Q(s W)||^2; the best s wins.
    alpha = 0 is plain round-to-nearest, so the result is never worse than RTN on x.
    Returns (s [K], best alpha, loss at best alpha, loss of RTN).
    """
    x = x.astype(np.float32)
    ref = [x @ w.astype(np.float32) for w in weights]
    base = np.maximum(np.asarray(mean_abs, np.float32), np.float32(1e-6) * max(float(np.max(mean_abs)), 1e-12))
    best = (np.ones_like(base), 0.0, np.inf)
    rtn_loss = np.inf
    for i in range(grid):
        alpha = i / grid
        s = np.power(base, alpha)
        s = s / np.sqrt(s.max() * s.min())
        xs = x / s
        loss = 0.0
        for w, r in zip(weights, ref):
            wq = fake_quantize((w.astype(np.float32) * s[:, None]).astype(w.dtype), "int4", block_size)
            loss += float(np.square(xs @ wq - r).sum())
        if i == 0:
            rtn_loss = loss
        if loss < best[2]:
            best = (s.astype(np.float32), alpha, loss)
    return best[0], best[1], best[2], rtn_loss



def awq_clip_search(x: np.ndarray, w: np.ndarray, block_size: int,
                    ratios=tuple(1.0 - 0.05 * i for i in range(10))) -> tuple[np.ndarray, float, float]:
    """AWQ's clipping search: per block of K and output channel, the range shrink that minimises the output error.

    x [R, K] calibration activations (already divided by the AWQ scale), w [K, N] (already scaled).
    The output error separates over blocks: x W - x Q(W) = sum_b x[:, b] (W_b - Q(W_b)), and each
    block's term over its output channels, so every (block, channel) picks its ratio on its own.
    Returns (clip [K'/B, N], loss with the clip, loss without) where loss is that sum of per-block errors.
    """
    kp = padded_k(w.shape[0], block_size)  # a ragged last block: zero inputs meet zero weights
    x, w = pad_to(x.astype(np.float32), kp, axes=(1,)), pad_to(w, kp)
    k, n = w.shape
    nb = k // block_size
    xb = x.reshape(len(x), nb, block_size)
    errors = []
    for r in ratios:
        delta = (w.astype(np.float32) - fake_quantize(w, "int4", block_size, np.full((nb, n), r, np.float32)))
        delta = delta.reshape(nb, block_size, n)
        errors.append(np.square(np.einsum("rbk,bkn->rbn", xb, delta)).sum(axis=0))  # [nb, N]
    errors = np.stack(errors)  # [ratios, nb, N]
    best = errors.argmin(axis=0)
    clip = np.asarray(ratios, np.float32)[best]
    return clip, float(errors.min(axis=0).sum()), float(errors[0].sum())


def gptq(w: np.ndarray, xtx: np.ndarray, block_size: int, *, damp: float = 0.01, act_order: bool = True,
         lazy_batch: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ (Frantar et al. 2023) for int4 weights blocked along K: w [K, N] -> q int4 [K', N], scale [K'/B, N]
    (K' as in int4_blocked: a ragged last block is padded with zero rows, which GPTQ sees as dead channels).

    ``xtx`` [K, K] is sum x^T x over the calibration inputs x [R, K] (the layer's Hessian up to a factor 2/R).
    Input channels are quantized one at a time, in order of decreasing Hessian diagonal with ``act_order``,
    and each one's rounding error is spread over the channels not yet quantized through the inverse Hessian
    (its upper Cholesky factor), so the output error ||x W - x Q|| is what gets minimised, not ||W - Q||.
    ``damp`` adds that fraction of the mean diagonal to it. The block scales are those of round-to-nearest on
    w (max |block| / 7; with act_order the blocks are visited out of order, so they are fixed up front); a
    block's scale does not move, its integers do. Channels the calibration never excited get zero weight.
    """
    k = padded_k(w.shape[0], block_size)
    n = w.shape[1]
    wt = pad_to(w.astype(np.float64), k).T.copy()  # [N, K']: GPTQ's rows-are-outputs layout
    h = pad_to(np.asarray(xtx, np.float64), k, axes=(0, 1))
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    wt[:, dead] = 0.0
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    scale = _scale(np.abs(wt.T.reshape(k // block_size, block_size, n)).max(axis=1), INT4_MAX, w.dtype)  # [K/B, N]
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    wt, h = wt[:, perm], h[np.ix_(perm, perm)]
    col_scale = scale.astype(np.float64)[perm // block_size].T  # [N, K] in visiting order
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # H^-1 = U^T U, U upper triangular
    q = np.zeros_like(wt)
    for start in range(0, k, lazy_batch):
        end = min(start + lazy_batch, k)
        block, err = wt[:, start:end].copy(), np.zeros((n, end - start))
        for j in range(end - start):
            col, s = block[:, j], col_scale[:, start + j]
            q[:, start + j] = np.clip(np.rint(col / s), INT4_MIN, INT4_MAX)
            e = (col - q[:, start + j] * s) / u[start + j, start + j]
            block[:, j:] -= np.outer(e, u[start + j, start + j:end])
            err[:, j] = e
        wt[:, end:] -= err @ u[start:end, end:]
    q_kn = np.empty((k, n))
    q_kn[perm] = q.T
    return q_kn.astype(ml_dtypes.int4), scale
