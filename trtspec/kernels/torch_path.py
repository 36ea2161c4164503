"""The GGUF linear layer in plain torch, for a machine where the C++ kernels cannot be built (no compiler).

Same schema as the compiled op (torch.ops.trtspec.gguf_linear) and, with int8 activations, the same result bit
for bit: the rounding of x, exact integer dot products per group (float64 holds them exactly), then the float32
steps of csrc/gguf_linear.h in their order. Float activations: the dequantized weights (exactly the kernels')
times x, accumulated by torch's matmul rather than one fma per k, so equal to float rounding, not to the bit.
Several times slower than the kernels: it unpacks the layout on every call.
"""

from __future__ import annotations

import numpy as np
import torch

from . import layout

SCHEMA = ("gguf_linear(Tensor x, Tensor packed, int n, int k, int bits, int group, int zero, bool has_min, "
          "bool half_scales, bool int8_activations) -> Tensor")
ATTENTION_SCHEMA = "attention_rows(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap) -> Tensor"
STEP_SCHEMAS = {"attention_rows_tokens": "attention_rows_tokens(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, "
                                         "float softcap) -> Tensor",
                "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
                "rope_qkv": "rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> "
                            "(Tensor, Tensor, Tensor)",
                "silu_mul": "silu_mul(Tensor x) -> Tensor"}
_library = None


def quantize_rows(x: torch.Tensor, group: int):
    """x [m, k] float32 -> (codes [m, k] float32 integers, scales [m, k/32], group sums [m, k/group])."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1) / torch.tensor(127.0, dtype=torch.float32)
    inv = torch.where(d != 0, torch.tensor(1.0, dtype=torch.float32) / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(blocks * inv[..., None])  # torch.round: half to even, as rint
    return q.reshape(m, k), d, q.reshape(m, k // group, group).sum(-1)


def gguf_linear(x, packed, n, k, bits, group, zero, has_min, half_scales, int8_activations):
    # x [..., k] float32, packed [bytes] uint8 -> [..., n] float32
    b = layout.unpack(layout.Packed(packed.numpy(), n, k, bits, group, zero, has_min, "", half_scales))
    codes = torch.from_numpy(b.codes.astype(np.float64))                      # [n, k]
    scales = torch.from_numpy(b.scales)                                       # [n, groups]
    minimums = torch.from_numpy(b.minimums) if has_min else None
    x2 = x.reshape(-1, k).float()
    groups = k // group
    if not int8_activations:
        w = (codes.float() - zero).reshape(n, groups, group) * scales[..., None]
        if has_min:
            w = w + minimums[..., None]
        y = x2 @ w.reshape(n, k).T
        return y.reshape(*x.shape[:-1], n)
    q, d, sums = quantize_rows(x2, group)
    m = x2.shape[0]
    dots = torch.einsum("mgi,ngi->mng", q.double().reshape(m, groups, group), codes.reshape(n, groups, group))
    idot = (dots - zero * sums.double()[:, None, :]).float()                  # [m, n, groups], exact
    t = idot * scales[None]
    if has_min:
        t = t + minimums[None] * sums[:, None, :]
    s = d[:, None, (torch.arange(groups) * group) // 32]                      # [m, 1, groups]
    acc = torch.zeros(m, n, dtype=torch.float32)
    for g in range(groups):                                                   # in group order, as the kernels
        acc = acc + t[:, :, g] * s[:, :, g]
    return acc.reshape(*x.shape[:-1], n)


def attention_rows(q, k, v, mask, scale, softcap):
    # the compiled op's (csrc/attention_rows.h) in plain torch: products and sums, so a row's result does not
    # depend on the call's rows either (not the same bits as the compiled op's)
    hkv, s = k.shape[1], mask.shape[-1]
    k, v = k[:, :, :s], v[:, :, :s]  # the slots the mask covers (a cache's live ones)
    q5 = q.unflatten(1, (hkv, q.shape[1] // hkv))  # [B, Hkv, G, T, D]: a group of query heads per key head
    scores = (q5[..., None, :] * k[:, :, None, None]).sum(-1) * scale  # [B, Hkv, G, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    return (probs[..., None] * v[:, :, None, None]).sum(-2).flatten(1, 2)


def attention_rows_tokens(q, k, v, mask, scale, softcap):
    return attention_rows(q, k, v, mask, scale, softcap).transpose(1, 2).flatten(2)


def rms_norm(x, weight, eps):
    # csrc/step_ops.cpp's in plain torch (HF's LlamaRMSNorm; torch's own order of the mean's sum)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_qkv(qkv, cos, sin, heads, kv_heads):
    d = cos.shape[-1]
    q, k, v = qkv.unflatten(-1, (heads + 2 * kv_heads, d)).split([heads, kv_heads, kv_heads], dim=2)
    cos, sin = cos[:, :, None], sin[:, :, None]

    def rotate(x):
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1) * sin

    return rotate(q).transpose(1, 2).contiguous(), rotate(k).contiguous(), v.contiguous()


def silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def register() -> None:
    """Define torch.ops.trtspec.gguf_linear, attention_rows (and its tokens-major form), rms_norm, rope_qkv, silu_mul
    (and the path ops) in Python."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("trtspec", "FRAGMENT")
    _library.define(SCHEMA)
    _library.impl("gguf_linear", gguf_linear, "CPU")
    _library.define(ATTENTION_SCHEMA)
    _library.impl("attention_rows", attention_rows, "CPU")
    for name, schema in STEP_SCHEMAS.items():
        _library.define(schema)
        _library.impl(name, globals()[name], "CPU")
    _library.define("gguf_kernel_path(str name='') -> str")
    _library.impl("gguf_kernel_path", _path, "CompositeImplicitAutograd")
    _library.define("gguf_kernel_paths() -> str[]")
    _library.impl("gguf_kernel_paths", lambda: ["torch"], "CompositeImplicitAutograd")


def _path(name: str = "") -> str:
    if name not in ("", "torch"):
        raise RuntimeError(f"gguf_kernel_path: only the pure-torch path is here (the C++ kernels were not built), "
                           f"not {name!r}")
    return "torch"
