"""Torch-TensorRT converter: the functional cache write ``trtspec::kv_cache_write`` -> IKVCacheUpdateLayer.

TensorRT's KV cache update layer (``INetworkDefinition.add_kv_cache_update``,
TensorRT >= 10.15) takes the cache [B, Hkv, S_max, D] — a network input —,
the update [B, Hkv, T, D] and write_indices [B], writes rows b at
write_indices[b] .. + T in place, and returns the cache, aliased to its input.
That is exactly the step contract's write, for any T (prefill, decode, k+1
verify) and per-row positions; the ONNX path reaches the same layer through
``TensorScatter``. Torch-TensorRT itself lowers only a one-token, batch-1
slice write to this layer (DESIGN.md §3), hence this converter.

Written against the documented APIs (TensorRT 11 Python API;
``torch_tensorrt.dynamo.conversion.dynamo_tensorrt_converter``) and **never
executed**: neither TensorRT nor Torch-TensorRT can be installed where trtspec
is developed. Tests drive ``add_kv_cache_update`` with a recording stand-in.
"""

from __future__ import annotations

_registered = False


def add_kv_cache_update(network, trt, cache, update, write_indices, name: str):
    """Add the in-place cache update to ``network``; returns its output (aliased to ``cache``)."""
    layer = network.add_kv_cache_update(cache, update, write_indices, trt.KVCacheMode.LINEAR)
    if layer is None:
        raise RuntimeError(
            f"TensorRT refused the KV cache update {name!r}: it needs TensorRT >= 10.15, a strongly typed network, "
            "a cache that is a network input with a static S_max, and float16/bfloat16/float32 data"
        )
    layer.name = name
    return layer.get_output(0)


def register() -> None:
    """Register the converter with Torch-TensorRT (idempotent). Needs torch_tensorrt importable."""
    global _registered
    if _registered:
        return
    import tensorrt as trt
    import torch
    from torch_tensorrt.dynamo.conversion import dynamo_tensorrt_converter
    from torch_tensorrt.dynamo.conversion.converter_utils import get_trt_tensor

    from ..exporter import kv_cache_op  # noqa: F401  (defines torch.ops.trtspec.kv_cache_write)

    @dynamo_tensorrt_converter(torch.ops.trtspec.kv_cache_write.default, supports_dynamic_shapes=True)
    def convert_kv_cache_write(ctx, target, args, kwargs, name):
        cache, update, write_indices = (get_trt_tensor(ctx, a, f"{name}_{i}") for i, a in enumerate(args))
        return add_kv_cache_update(ctx.net, trt, cache, update, write_indices, name)

    _registered = True
