"""The KV cache write: one custom op, exported as ONNX ``TensorScatter``.

A plain ``index_copy``/slice assignment exports as ScatterND, which neither
TensorRT's importer nor onnxruntime treat as an in-place cache update. A custom
op with its own translation gives exactly the node the contract asks for
(DESIGN.md §2): the cache graph input feeds ``TensorScatter`` directly and its
result is the graph output.
"""

from __future__ import annotations

import torch
from onnxscript.onnx_opset import opset24

# KV_WRITE_AXIS is written literally: TensorRT's importer only takes axis -2.
KV_WRITE_AXIS = -2


@torch.library.custom_op("trtspec::kv_cache_write", mutates_args=())
def kv_cache_write(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    # cache [B, Hkv, S_max, D], update [B, Hkv, T, D], write_indices [B] int64 -> [B, Hkv, S_max, D]
    # Functional in torch (the ONNX op is functional too); in place only in the backends.
    out = cache.clone()
    t = update.shape[2]
    for b, start in enumerate(write_indices.tolist()):
        out[b, :, start : start + t] = update[b]
    return out


@kv_cache_write.register_fake
def _(cache, update, write_indices):
    return torch.empty_like(cache)


@torch.library.custom_op("trtspec::kv_cache_write_ring", mutates_args=())
def kv_cache_write_ring(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    # cache [B, Hkv, n, D] a ring (position p in slot p mod n), update [B, Hkv, T, D] with T <= n, write_indices [B]
    out = cache.clone()
    n, t = cache.shape[2], update.shape[2]
    for b, start in enumerate(write_indices.tolist()):
        out[b, :, [(start + j) % n for j in range(t)]] = update[b]
    return out


@kv_cache_write_ring.register_fake
def _(cache, update, write_indices):
    return torch.empty_like(cache)


def _tensor_scatter(cache, update, write_indices):
    return opset24.TensorScatter(cache, update, write_indices, axis=KV_WRITE_AXIS, mode="linear")


def _tensor_scatter_ring(cache, update, write_indices):
    return opset24.TensorScatter(cache, update, write_indices, axis=KV_WRITE_AXIS, mode="circular")


TRANSLATION_TABLE = {torch.ops.trtspec.kv_cache_write.default: _tensor_scatter,
                     torch.ops.trtspec.kv_cache_write_ring.default: _tensor_scatter_ring}
