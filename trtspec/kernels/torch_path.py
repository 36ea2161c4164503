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
          "bool int8_activations) -> Tensor")
_library = None


def quantize_rows(x: torch.Tensor, group: int):
    """x [m, k] float32 -> (codes [m, k] float32 integers, scales [m, k/32], group sums [m, k/group])."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1) / torch.tensor(127.0, dtype=torch.float32)
    inv = torch.where(d != 0, torch.tensor(1.0, dtype=torch.float32) / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(blocks * inv[..., None])  # torch.round: half to even, as rint
    return q.reshape(m, k), d, q.reshape(m, k // group, group).sum(-1)


def gguf_linear(x, packed, n, k, bits, group, zero, has_min, int8_activations):
    # x [..., k] float32, packed [bytes] uint8 -> [..., n] float32
    b = layout.unpack(layout.Packed(packed.numpy(), n, k, bits, group, zero, has_min, ""))
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


def register() -> None:
    """Define torch.ops.trtspec.gguf_linear (and the path ops) in Python."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("trtspec", "FRAGMENT")
    _library.define(SCHEMA)
    _library.impl("gguf_linear", gguf_linear, "CPU")
    _library.define("gguf_kernel_path(str name='') -> str")
    _library.impl("gguf_kernel_path", _path, "CompositeImplicitAutograd")
    _library.define("gguf_kernel_paths() -> str[]")
    _library.impl("gguf_kernel_paths", lambda: ["torch"], "CompositeImplicitAutograd")


def _path(name: str = "") -> str:
    if name not in ("", "torch"):
        raise RuntimeError(f"gguf_kernel_path: only the pure-torch path is here (the C++ kernels were not built), "
                           f"not {name!r}")
    return "torch"
