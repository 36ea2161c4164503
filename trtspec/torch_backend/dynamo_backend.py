"""The "trtspec" torch.compile backend: torch_tensorrt where it is importable, else inductor.

Importing this module registers it: ``torch.compile(model, backend="trtspec")``.

On the TensorRT side the cache write must be the functional
``trtspec::kv_cache_write`` (cache in, cache out), which our converter maps to
TensorRT's in-place KV cache update layer (tensorrt_converter.py). A graph that
stores into a tensor it was given (the inductor path's cache write: an indexed
store into a module buffer) is refused there: a TensorRT network cannot mutate a
torch buffer. ``trtspec.compile(..., backend="torch_tensorrt")`` builds the functional form.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._dynamo import lookup_backend, register_backend

from ..errors import BackendUnavailableError

log = logging.getLogger("trtspec.torch")

MUTATING_WRITE_ON_TENSORRT = (
    "this graph writes a torch buffer in place (an indexed store), which a TensorRT network cannot do; "
    "pass the cache in and out with the functional trtspec::kv_cache_write, as "
    "trtspec.compile(..., backend='torch_tensorrt') does, or compile with backend='inductor'"
)


def torch_tensorrt_importable() -> bool:
    try:
        import torch_tensorrt  # noqa: F401  (importing it registers its torch.compile backends)
    except Exception:  # not installed, or installed without the TensorRT libraries it loads
        return False
    return True


def require_torch_tensorrt() -> None:
    """Register our converter with torch_tensorrt, or say why the backend cannot be used here."""
    if not torch_tensorrt_importable():
        raise BackendUnavailableError(
            "backend 'torch_tensorrt' needs the torch_tensorrt package and TensorRT, which are not importable here; "
            "use backend='inductor'"
        )
    from . import tensorrt_converter

    tensorrt_converter.register()


def writes_in_place(gm: torch.fx.GraphModule) -> bool:
    """The graph stores into a tensor it was given: ``x[idx] = v`` or an in-place method (``x.copy_(v)``)."""
    return any((node.op == "call_function" and node.target is operator.setitem)
               or (node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__"))
               for node in gm.graph.nodes)


@register_backend(name="trtspec")
def trtspec_backend(gm: torch.fx.GraphModule, example_inputs):
    if torch_tensorrt_importable():
        if writes_in_place(gm):
            raise NotImplementedError(MUTATING_WRITE_ON_TENSORRT)
        require_torch_tensorrt()
        log.info("trtspec backend: compiling a graph of %d nodes with torch_tensorrt", len(gm.graph.nodes))
        return lookup_backend("torch_tensorrt")(gm, example_inputs)
    log.info("trtspec backend: torch_tensorrt is not importable; compiling a graph of %d nodes with inductor",
             len(gm.graph.nodes))
    return lookup_backend("inductor")(gm, example_inputs)
