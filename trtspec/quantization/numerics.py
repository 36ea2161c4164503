"""The arithmetic of every quantization mode, independent of any graph: numpy, and torch for the searches.

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


def int4_blocked(w: np.ndarray, block_size: int, clip: np.ndarray | None = None,
                 columns: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> q int4 [K', N], scale [K' / block_size, N] (blocks of block_size along K).

    K' is K rounded up to a multiple of block_size: where the block size does not divide K the last block
    is padded with zero rows (q = 0 there), and the graph zero-pads the MatMul's input to K' to match
    (what TensorRT's blocked DequantizeLinear needs: whole blocks). ``clip`` [K' / block_size, N] in (0, 1]
    shrinks each block's range (AWQ's clipping): values beyond clip * max|block| saturate, the rest get a
    finer grid. Done ``columns`` output channels at a time (a 150k-token tied head stays a few copies of a slice).
    """
    k, n = w.shape
    kp = padded_k(k, block_size)
    q = np.empty((kp, n), ml_dtypes.int4)
    scale = np.empty((kp // block_size, n), w.dtype)
    for c in range(0, n, columns):
        part = slice(c, min(c + columns, n))
        blocks = pad_to(w[:, part].astype(np.float32), kp).reshape(kp // block_size, block_size, -1)
        amax = np.abs(blocks).max(axis=1)
        scale[:, part] = _scale(amax if clip is None else amax * clip[:, part], INT4_MAX, w.dtype)
        qc = np.clip(np.rint(blocks / scale[:, part].astype(np.float32)[:, None, :]), INT4_MIN, INT4_MAX)
        q[:, part] = qc.reshape(kp, -1).astype(ml_dtypes.int4)
    return q, scale


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


def _torch(a, dtype=None):
    import torch

    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    return t.to(dtype or torch.float32)


def _int4_fake_t(w, block_size: int, dtype, clip=None):
    """fake_quantize(w, "int4", block_size, clip) in torch on a float32 w [K', N] whose K' is whole blocks;
    the same arithmetic as int4_blocked (scales rounded to ``dtype``, the model's, before use)."""
    import torch

    kp, n = w.shape
    blocks = w.reshape(kp // block_size, block_size, n)
    amax = blocks.abs().amax(dim=1)
    if clip is not None:
        amax = amax * clip
    scale = (amax / np.float32(INT4_MAX)).to(dtype).to(torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None, :]
    return (torch.clamp(torch.round(blocks / scale), INT4_MIN, INT4_MAX) * scale).reshape(kp, n)


def _torch_dtype(np_dtype):
    import torch

    return torch.float16 if np.dtype(np_dtype) == np.float16 else torch.float32


def search_dtype():
    """The dtype of the AWQ search's error matmuls: bfloat16 where this CPU multiplies it at least 2x faster than
    float32 (matrix units: AMX, avx512_bf16), else float32. Measured once per process (~20 ms)."""
    global _SEARCH_DTYPE
    if _SEARCH_DTYPE is None:
        import time

        import torch

        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, y = a.to(dtype), b.to(dtype)
            x @ y
            t = time.perf_counter()
            for _ in range(4):
                x @ y
            times[dtype] = time.perf_counter() - t
        _SEARCH_DTYPE = torch.bfloat16 if times[torch.bfloat16] * 2 <= times[torch.float32] else torch.float32
    return _SEARCH_DTYPE


_SEARCH_DTYPE = None


def awq_search(x: np.ndarray, mean_abs: np.ndarray, weights: list[np.ndarray], block_size: int,
               grid: int = 20, matmul_dtype=None) -> tuple[np.ndarray, float, float, float]:
    """AWQ's per-input-channel scale search (Lin et al. 2024) for int4 weights blocked along K.

    x [R, K] calibration activations; mean_abs [K] their mean |x| per channel; weights
    every [K, N] MatMul reading x (one shared s). For alpha on a grid in [0, 1):
    s = mean_abs^alpha (normalised), loss = sum ||x W - (x / s) Q(s W)||^2; the best s wins.
    alpha = 0 is plain round-to-nearest, so the result is never worse than RTN on x.
    The loss is computed as ||x E||^2 with E = W - Q(s W) / s (float32); the product x E in ``matmul_dtype``
    (torch; default float32; ``search_dtype()`` is the fast choice for large layers).
    Returns (s [K], best alpha, loss at best alpha, loss of RTN).
    """
    import torch

    matmul_dtype = matmul_dtype or torch.float32
    k = weights[0].shape[0]
    kp = padded_k(k, block_size)
    xm = _torch(x, matmul_dtype)
    ws = [_torch(pad_to(w.astype(np.float32), kp)) for w in weights]
    dtypes = [_torch_dtype(w.dtype) for w in weights]
    mean_abs = np.asarray(mean_abs, np.float32)
    base = _torch(np.maximum(mean_abs, np.float32(1e-6) * max(float(np.max(mean_abs)), 1e-12)))
    best = (torch.ones_like(base), 0.0, np.inf)
    rtn_loss = np.inf
    for i in range(grid):
        alpha = i / grid
        s = torch.pow(base, alpha)
        s = s / torch.sqrt(s.max() * s.min())
        sp = torch.nn.functional.pad(s, (0, kp - k), value=1.0)[:, None]
        loss = 0.0
        for w, dtype in zip(ws, dtypes):
            scaled = (w * sp).to(dtype).to(torch.float32)
            err = (w - _int4_fake_t(scaled, block_size, dtype) / sp)[:k]
            loss += float(torch.square((xm @ err.to(matmul_dtype)).to(torch.float32)).sum())
        if i == 0:
            rtn_loss = loss
        if loss < best[2]:
            best = (s, alpha, loss)
    return best[0].numpy().astype(np.float32), best[1], best[2], rtn_loss


def block_gram(x: np.ndarray, block_size: int):
    """x [R, K] -> [K'/B, B, B]: each block of input channels' x_b^T x_b (K zero-padded to whole blocks), float32
    (torch). What AWQ's clipping search needs of the calibration inputs, summed over every token."""
    import torch

    xt = _torch(x)
    kp = padded_k(xt.shape[1], block_size)
    xb = torch.nn.functional.pad(xt, (0, kp - xt.shape[1])).reshape(len(xt), kp // block_size, block_size)
    return torch.einsum("rbi,rbj->bij", xb, xb)


def awq_clip_search(gram, w: np.ndarray, block_size: int, ratios=tuple(1.0 - 0.05 * i for i in range(10)),
                    s: np.ndarray | None = None, columns: int = 8192) -> tuple[np.ndarray, float, float]:
    """AWQ's clipping search: per block of K and output channel, the range shrink that minimises the output error.

    gram [K'/B, B, B]: ``block_gram`` of the calibration inputs x; w [K, N] (already scaled by the AWQ scale
    ``s`` [K], whose 1/s is applied to x here). The output error separates over blocks:
    x W - x Q(W) = sum_b x_b (W_b - Q(W_b)), and each block's term over output channels, so every (block,
    channel) picks its ratio on its own; block b's error for channel n is d^T G_b d with d = W_b[:, n] -
    Q(W_b)[:, n], over every calibration token at B^2 multiply-adds per weight (not one per token).
    Returns (clip [K'/B, N], loss with the clip, loss without) where loss is that sum of per-block errors.
    """
    import torch

    kp = padded_k(w.shape[0], block_size)  # a ragged last block: zero inputs meet zero weights
    nb, n = kp // block_size, w.shape[1]
    g = _torch(gram)
    if s is not None:
        inv = torch.nn.functional.pad(1.0 / _torch(s), (0, kp - len(s)), value=1.0).reshape(nb, block_size)
        g = g * inv[:, :, None] * inv[:, None, :]
    dtype = _torch_dtype(w.dtype)
    rates = torch.tensor(ratios, dtype=torch.float32)
    clip, best_total, plain_total = np.empty((nb, n), np.float32), 0.0, 0.0
    for c in range(0, n, columns):
        wc = _torch(pad_to(w[:, c:c + columns].astype(np.float32), kp))
        errors = []
        for r in rates:
            d = (wc - _int4_fake_t(wc, block_size, dtype, r)).reshape(nb, block_size, -1)
            errors.append((d * torch.bmm(g, d)).sum(dim=1))  # [nb, columns]
        errors = torch.stack(errors)  # [ratios, nb, columns]
        best = errors.min(dim=0)
        clip[:, c:c + columns] = rates[best.indices].numpy()
        best_total += float(best.values.double().sum())
        plain_total += float(errors[0].double().sum())
    return clip, best_total, plain_total


def gptq(w: np.ndarray, xtx, block_size: int, *, damp: float = 0.01, act_order: bool = True,
         lazy_batch: int = 128, columns: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ (Frantar et al. 2023) for int4 weights blocked along K: w [K, N] -> q int4 [K', N], scale [K'/B, N]
    (K' as in int4_blocked: a ragged last block is padded with zero rows, which GPTQ sees as dead channels).

    ``xtx`` [K, K] is sum x^T x over the calibration inputs x [R, K] (the layer's Hessian up to a factor 2/R).
    Input channels are quantized one at a time, in order of decreasing Hessian diagonal with ``act_order``,
    and each one's rounding error is spread over the channels not yet quantized through the inverse Hessian
    (its upper Cholesky factor), so the output error ||x W - x Q|| is what gets minimised, not ||W - Q||.
    ``damp`` adds that fraction of the mean diagonal to it. The block scales are those of round-to-nearest on
    w (max |block| / 7; with act_order the blocks are visited out of order, so they are fixed up front); a
    block's scale does not move, its integers do. Channels the calibration never excited get zero weight.
    Output channels are independent, so MatMuls reading one input are done as one w = [W1 W2 ...].
    Torch, float32 (the inverse Hessian in float64 if float32's Cholesky fails).
    """
    import torch

    k = padded_k(w.shape[0], block_size)
    n = w.shape[1]
    h = torch.nn.functional.pad(_torch(xtx), (0, k - xtx.shape[1], 0, k - xtx.shape[0]))
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * float(torch.diagonal(h).double().mean()))
    perm = (torch.argsort(-torch.diagonal(h), stable=True) if act_order else torch.arange(k))
    u = _inverse_cholesky(h[perm][:, perm])  # H^-1 = U^T U, U upper triangular
    q_kn = np.empty((k, n), ml_dtypes.int4)
    scale = np.empty((k // block_size, n), w.dtype)
    for c in range(0, n, columns):  # output channels are independent: a wide (tied) head goes in slices
        part = slice(c, min(c + columns, n))
        wt = _torch(pad_to(w[:, part].astype(np.float32), k)).T.contiguous()  # [n, K']: rows are outputs
        wt[:, dead] = 0.0
        scale[:, part] = _scale(np.abs(wt.T.numpy().reshape(k // block_size, block_size, -1)).max(axis=1),
                                INT4_MAX, w.dtype)
        col_scale = _torch(scale[:, part].astype(np.float32))[perm // block_size].T.contiguous()  # visiting order
        q = _gptq_columns(wt[:, perm], col_scale, u, lazy_batch)
        q_kn[perm.numpy(), part] = q.T.numpy().astype(ml_dtypes.int4)
    return q_kn, scale


def _gptq_columns(wt, col_scale, u, lazy_batch: int):
    """GPTQ's loop over input channels (in visiting order) for output channels wt [n, K]: their integers."""
    import torch

    n, k = wt.shape
    q = torch.zeros_like(wt)
    for start in range(0, k, lazy_batch):
        end = min(start + lazy_batch, k)
        block, err = wt[:, start:end].clone(), torch.zeros((n, end - start))
        for j in range(end - start):
            col, s = block[:, j], col_scale[:, start + j]
            qj = torch.clamp(torch.round(col / s), INT4_MIN, INT4_MAX)
            q[:, start + j] = qj
            e = (col - qj * s) / u[start + j, start + j]
            block[:, j:].sub_(torch.outer(e, u[start + j, start + j:end]))
            err[:, j] = e
        wt[:, end:].sub_(err @ u[start:end, end:])
    return q


def _inverse_cholesky(h):
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U): float32, or float64 where float32 is not positive
    definite enough."""
    import torch

    for dtype in (torch.float32, torch.float64):
        chol, info = torch.linalg.cholesky_ex(h.to(dtype))
        if int(info) == 0:
            u, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
            if int(info) == 0 and bool(torch.isfinite(u).all()):
                return u.to(torch.float32)
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even after damping; "
                     "calibrate on more text (--calib-samples)")
