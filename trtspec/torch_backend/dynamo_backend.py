"""The "trtspec" torch.compile backend: torch_tensorrt where it is importable, else inductor.

Importing this module registers it: ``torch.compile(model, backend="trtspec")``.

Torch-TensorRT lowers a slice/index_copy cache write to TensorRT's KV cache
update layer only for one token at batch 1 (DESIGN.md §3); the multi-token,
per-row write of ``trtspec::kv_cache_write_`` needs a converter of our own to
``IKVCacheUpdateLayer``. That converter is not written: the documented pieces
found (the layer's inputs cache/update/writeIndices and its aliased output;
``dynamo_tensorrt_converter``) leave open how torch_tensorrt hands a mutated
module buffer to a network input that must alias its output, and nothing here
can run TensorRT to settle it. So a graph that writes the cache is refused on
the TensorRT path instead of being compiled wrongly.
"""

from __future__ import annotations

import logging

import torch
from torch._dynamo import lookup_backend, register_backend

from ..errors import BackendUnavailableError

log = logging.getLogger("trtspec.torch")

CONVERTER_MISSING = (
    "torch_tensorrt cannot compile the KV cache write yet: the converter from trtspec::kv_cache_write_ to "
    "TensorRT's IKVCacheUpdateLayer is not written (see trtspec/torch_backend/dynamo_backend.py). "
    "Use backend='inductor', or build a TensorRT engine from the ONNX export with `trtspec build --backend tensorrt`"
)


def torch_tensorrt_importable() -> bool:
    try:
        import torch_tensorrt  # noqa: F401  (importing it registers its torch.compile backends)
    except Exception:  # not installed, or installed without the TensorRT libraries it loads
        return False
    return True


def refuse_kv_cache_write_on_tensorrt():
    """Raise the error that says why the torch engine cannot use torch_tensorrt here."""
    if not torch_tensorrt_importable():
        raise BackendUnavailableError(
            "backend 'torch_tensorrt' needs the torch_tensorrt package and TensorRT, which are not importable here; "
            "use backend='inductor'"
        )
    raise NotImplementedError(CONVERTER_MISSING)


def _writes_kv_cache(gm: torch.fx.GraphModule) -> bool:
    op = torch.ops.trtspec.kv_cache_write_
    return any(node.target in (op, op.default) for node in gm.graph.nodes)


@register_backend(name="trtspec")
def trtspec_backend(gm: torch.fx.GraphModule, example_inputs):
    if torch_tensorrt_importable():
        if _writes_kv_cache(gm):
            raise NotImplementedError(CONVERTER_MISSING)
        log.info("trtspec backend: compiling a graph of %d nodes with torch_tensorrt", len(gm.graph.nodes))
        return lookup_backend("torch_tensorrt")(gm, example_inputs)
    log.info("trtspec backend: torch_tensorrt is not importable; compiling a graph of %d nodes with inductor",
             len(gm.graph.nodes))
    return lookup_backend("inductor")(gm, example_inputs)
