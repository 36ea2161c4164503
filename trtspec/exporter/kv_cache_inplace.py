"""The KV cache write as a mutating custom op, for the torch backend.

The ONNX path uses the functional ``trtspec::kv_cache_write`` (kv_cache_op.py):
the ONNX op is functional and the backends alias past/present. In torch the
cache is a persistent buffer, so the write mutates it: ``mutates_args`` tells
torch.compile, which functionalizes the call and lets inductor re-inplace it
on the buffer, so prefill, decode and verify writes never copy the cache.
Being one opaque op (not a scatter traced into the graph) also leaves a single
node for a TensorRT converter to map to its KV cache update layer.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("trtspec::kv_cache_write_", mutates_args=("cache",))
def kv_cache_write_(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> None:
    # cache [B, Hkv, S_max, D] written in place, update [B, Hkv, T, D], write_indices [B] int64
    # cache[b, :, start_b : start_b + T] = update[b] (slots mod the cache length: a sliding-window layer's ring;
    # a full cache never wraps); one scatter, no host sync (CUDA-graph safe).
    b, h, t, d = update.shape
    slots = (write_indices[:, None] + torch.arange(t, device=update.device)) % cache.shape[2]  # [B, T]
    cache.scatter_(2, slots[:, None, :, None].expand(b, h, t, d), update)


@kv_cache_write_.register_fake
def _(cache, update, write_indices):
    return None
