"""Attention with logit soft-capping (Gemma 2), as one custom op exported as ONNX ``Attention(softcap=...)``.

``F.scaled_dot_product_attention`` has no soft-capping, and writing the scores out (MatMul, Tanh, Softmax,
MatMul) would break the contract's one Attention node per layer. ONNX's Attention (opset 23+) has the
``softcap`` attribute: scores = softcap * tanh(q k^T * scale / softcap), then the mask, then softmax. The
eager implementation below is the reference the exported graph is checked against (and what the torch
backend runs). Models without soft-capping keep SDPA.
"""

from __future__ import annotations

import torch
from onnxscript.onnx_opset import opset24


@torch.library.custom_op("trtspec::softcapped_attention", mutates_args=())
def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    # q [B, H, T, D], k/v [B, Hkv, S, D], mask bool [B, 1, T, S] -> [B, H, T, D]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


@softcapped_attention.register_fake
def _(q, k, v, mask, scale, softcap):
    # contiguous, as the op's matmul returns it (empty_like would keep q's strides, a transposed view: compiled
    # graphs then read the result with the wrong strides)
    return q.new_empty(q.shape)


def _attention(q, k, v, mask, scale: float, softcap: float):
    y, _, _, _ = opset24.Attention(q, k, v, mask, scale=scale, softcap=softcap)  # the unused outputs are dropped
    return y


TRANSLATION_TABLE = {torch.ops.trtspec.softcapped_attention.default: _attention}
