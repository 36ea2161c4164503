"""TensorRT 11's rules for explicit quantization, checked on an ONNX graph (CPU only, no TensorRT).

TensorRT 11 accepts only explicit quantization (Q/DQ nodes): symmetric (zero
point absent or 0), scales that are build-time constants, INT8/FP8 for
activations and weights, INT4 only as weight-only blocked DequantizeLinear of a
constant 2-D weight. Activations are quantized per tensor; a QuantizeLinear
must feed DequantizeLinear (a Q/DQ pair), since TensorRT places the quantized
kernels by those pairs. `trtspec check` runs the same rules.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..onnx_graph import GraphIndex, attr

INT4_TYPES = {TensorProto.INT4, TensorProto.UINT4}
INT8_FP8_TYPES = {TensorProto.INT8, TensorProto.FLOAT8E4M3FN}
ACCEPTED_TYPES = INT4_TYPES | INT8_FP8_TYPES


def qdq_violations(model_proto, base_dir=None) -> list[str]:
    """Every Q/DQ rule of TensorRT 11's explicit quantization that ``model_proto`` breaks, one line each.

    ``base_dir``: where the model's external data lies, for a model loaded without it."""
    g = GraphIndex(model_proto, base_dir)
    problems = []
    for node in model_proto.graph.node:
        problems += qdq_node_violations(node, g)
    return problems


def qdq_node_violations(node, g: GraphIndex):
    """The rule violations of one QuantizeLinear/DequantizeLinear node (nothing for other ops)."""
    if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return
    scale = g.constant(node.input[1])
    if scale is None:
        yield (f"{node.name}: {node.op_type} scale {node.input[1]!r} comes from {g.describe(node.input[1])}; "
               "TensorRT needs constant scales (an initializer)")
    else:
        values = g.array(scale).astype(np.float64)
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            yield f"{node.name}: {node.op_type} scale {node.input[1]!r} has zero, negative or non-finite values"
    if len(node.input) > 2 and node.input[2]:
        yield from _check_zero_point(node, g)
    quantized = _quantized_type(node, g)
    if quantized == TensorProto.UINT8:
        yield f"{node.name}: {node.op_type} uses UINT8; TensorRT quantizes to INT8 (UINT8 is only a network I/O type)"
    elif quantized is not None and quantized not in ACCEPTED_TYPES:
        name = TensorProto.DataType.Name(quantized)
        yield f"{node.name}: {node.op_type} uses {name}; trtspec emits INT8, FP8 E4M3 or INT4 (weights) only"
    if quantized in INT4_TYPES:
        yield from _check_int4(node, g)
        return
    if node.op_type == "QuantizeLinear":
        if scale is not None and len(scale.dims) != 0 and g.constant(node.input[0]) is None:
            yield (f"{node.name}: activation {node.input[0]!r} is quantized with a {list(scale.dims)} scale; "
                   "activations are quantized per tensor (a scalar scale)")
        others = [c for c in g.consumers.get(node.output[0], []) if c.op_type != "DequantizeLinear"]
        if others or node.output[0] in g.outputs:
            yield f"{node.name}: QuantizeLinear output {node.output[0]!r} does not feed only DequantizeLinear; TensorRT needs Q/DQ pairs"


def _check_zero_point(node, g):
    zp = g.constant(node.input[2])
    if zp is None:
        yield f"{node.name}: {node.op_type} zero point {node.input[2]!r} is computed at run time; TensorRT needs none or a constant 0"
    elif g.array(zp).astype("float64").any():
        yield f"{node.name}: {node.op_type} has a nonzero zero point (asymmetric quantization); TensorRT supports only symmetric Q/DQ (zero point 0)"


def _quantized_type(node, g) -> int | None:
    """The integer/float8 type on the quantized side of a Q or DQ node."""
    if len(node.input) > 2 and node.input[2]:
        zp = g.constant(node.input[2])
        if zp is not None:
            return zp.data_type
    if node.op_type == "QuantizeLinear":
        return attr(node, "output_dtype", 0) or TensorProto.UINT8  # ONNX's default without a zero point
    source = g.constant(node.input[0])
    if source is not None:
        return source.data_type
    tt = g.tensor_type(node.input[0])
    return tt.elem_type if tt is not None else None


def _check_int4(node, g):
    if node.op_type == "QuantizeLinear":
        yield f"{node.name}: INT4 QuantizeLinear; TensorRT takes INT4 only as weight-only DequantizeLinear of constant weights"
        return
    weight = g.constant(node.input[0])
    if weight is None:
        yield f"{node.name}: INT4 DequantizeLinear of {node.input[0]!r}, which is not a constant weight; INT4 is weight-only in TensorRT"
        return
    if len(weight.dims) != 2:
        yield f"{node.name}: INT4 weight {node.input[0]!r} is {len(weight.dims)}-D; TensorRT's INT4 DequantizeLinear takes 2-D weights"
    if not attr(node, "block_size", 0):
        yield f"{node.name}: INT4 DequantizeLinear without block_size; TensorRT's INT4 is blocked (block_size along K)"
    elif len(weight.dims) == 2 and attr(node, "axis", 1) not in (0, -2) and not _is_tied_table(node, g):
        yield f"{node.name}: INT4 weight {node.input[0]!r} is blocked along axis {attr(node, 'axis', 1)}; block along K (axis 0 of a [K, N] weight)"
    elif len(weight.dims) == 2 and weight.dims[attr(node, "axis", 1)] % attr(node, "block_size", 0):
        blocked = weight.dims[attr(node, "axis", 1)]
        yield (f"{node.name}: INT4 weight {node.input[0]!r} has {blocked} rows along its blocked axis, not a multiple "
               f"of block_size {attr(node, 'block_size', 0)}; TensorRT's blocked DequantizeLinear takes whole blocks "
               "(pad the weight with zero rows and its MatMul's input with zero columns)")
    n = int(np.prod(weight.dims))
    if weight.data_location != TensorProto.EXTERNAL and len(weight.raw_data) != (n + 1) // 2:
        yield f"{node.name}: INT4 weight {node.input[0]!r} is not stored packed (two values per byte in raw_data)"


def _is_tied_table(node, g) -> bool:
    """A tied embedding/lm_head table [V, H] blocked along H (axis 1): it feeds only the embedding Gather and
    Transpose([1, 0]) -> MatMul, so H is the lm_head's K. TensorRT blocks along the last or second-to-last axis."""
    if attr(node, "axis", 1) not in (1, -1):
        return False
    uses = g.consumers.get(node.output[0], [])
    for use in uses:
        if use.op_type == "Gather" and use.input[0] == node.output[0] and attr(use, "axis", 0) == 0:
            continue
        if use.op_type == "Transpose" and list(attr(use, "perm", [])) == [1, 0] and all(
                c.op_type == "MatMul" and c.input[1] == use.output[0] for c in g.consumers.get(use.output[0], [])):
            continue
        return False
    return bool(uses)
