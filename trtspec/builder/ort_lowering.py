"""Rewrites of the step graph for onnxruntime's CPU kernels, applied at `build` (the export keeps the portable form).

Each rule matches one pattern and replaces it by what onnxruntime runs best, with every weight stored once:

- ``tied_head_transposed``: a tied lm_head reads the embedding through ``Transpose(W) -> MatMul``. onnxruntime
  would constant-fold the Transpose into a second float copy of the embedding; ``FusedMatMul(x, W, transB=1)``
  reads the one copy (and measured no slower than the folded MatMul: 0.53 vs 0.51 ms at T=1, 0.57 vs 0.80 ms at
  T=5 for an 8192x512 head, 2 threads).
- ``tied_int4``: the tied weight quantized to INT4 (one ``DequantizeLinear`` blocked along the hidden axis,
  feeding both the embedding ``Gather`` and the lm_head's ``Transpose -> MatMul``). The head becomes
  ``MatMulNBits``; the embedding lookup gathers the rows of the *same* packed initializer and scales and unpacks
  them (a few element-wise ops over B*T rows). onnxruntime's ``GatherBlockQuantized`` would need a second packed
  copy: it wants the data [V, H/2] or int4 [V, H], ``MatMulNBits`` wants [V, H/B, B/2], and both check shapes.

``lower(model, fuse_qdq=...)`` applies the rules and returns how often each fired (the manifest records it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..engines.onnxruntime import MATMUL_NBITS_ACCURACY_LEVEL

MS = "com.microsoft"


def _perm(node: ir.Node):
    attr = node.attributes.get("perm")
    return None if attr is None else list(attr.as_ints())


def _head_transposes(w: ir.Value):
    """The Transpose([1, 0]) -> MatMul uses of ``w`` (where MatMul's weight operand is the transpose), and whether
    every other use is an axis-0 Gather (the embedding lookup)."""
    heads, others_ok = [], True
    for use in w.uses():
        node = use.node
        if node.op_type == "Transpose" and _perm(node) == [1, 0]:
            t = node.outputs[0]
            if t.uses() and all(u.node.op_type == "MatMul" and u.idx == 1 for u in t.uses()):
                heads.append(node)
                continue
        if not (node.op_type == "Gather" and use.idx == 0 and node.attributes.get_int("axis", 0) == 0):
            others_ok = False
    return heads, others_ok


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old`` everywhere (graph outputs included), under its name, type and shape."""
    new.type, new.shape = old.type, old.shape
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    name, old.name = old.name, None
    new.name = name


def _replace_matmuls(graph: ir.Graph, transpose: ir.Node, make) -> int:
    count = 0
    for use in list(transpose.outputs[0].uses()):
        matmul = use.node
        new = make(matmul)
        graph.insert_before(matmul, new)
        _take_over(matmul.outputs[0], new.outputs[0])
        graph.remove(matmul, safe=True)
        count += 1
    if not transpose.outputs[0].uses():
        graph.remove(transpose, safe=True)
    return count


def tied_head_transposed(graph: ir.Graph) -> int:
    fired = 0
    for w in list(graph.initializers.values()):
        if w.const_value is None or len(w.shape or ()) != 2:
            continue
        heads, _ = _head_transposes(w)
        for transpose in heads:
            fired += _replace_matmuls(graph, transpose, lambda mm: ir.node(
                "FusedMatMul", [mm.inputs[0], w], attributes={"transB": 1, "transA": 0, "alpha": 1.0}, domain=MS,
                name=f"{mm.name}/transB"))
    return fired


def pack_uint4(q: np.ndarray, block_size: int) -> np.ndarray:
    """Signed int4 q [N, K] -> MatMulNBits' B [N, K/B, B/2]: q + 8 (its default zero point), low nibble first."""
    n, k = q.shape
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // block_size, block_size // 2)


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    base, i = name, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
    value.shape, value.type = ir.Shape(array.shape), ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    return value


def _op(graph: ir.Graph, anchor: ir.Node, op: str, inputs, name: str, **attributes) -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes, name=name)
    graph.insert_before(anchor, node)
    return node.outputs[0]


def _embedding_from_packed(graph: ir.Graph, gather: ir.Node, b: ir.Value, scales: ir.Value, hidden: int,
                           block_size: int) -> None:
    """Replace ``Gather(W_deq, ids)`` by the lookup of rows of the packed B [V, K/B, B/2] and scales [V, K/B]."""
    ids, out, prefix = gather.inputs[1], gather.outputs[0], f"{gather.name}/int4"
    dtype = scales.const_value.dtype.numpy()
    rows = _op(graph, gather, "Gather", [b, ids], f"{prefix}/rows", axis=0)  # [..., K/B, B/2] uint8
    lo = _op(graph, gather, "BitwiseAnd", [rows, _const(graph, f"{prefix}.mask", np.array(15, np.uint8))], f"{prefix}/lo")
    hi = _op(graph, gather, "BitShift", [rows, _const(graph, f"{prefix}.shift", np.array(4, np.uint8))], f"{prefix}/hi",
             direction="RIGHT")
    last = _const(graph, f"{prefix}.last", np.array([-1], np.int64))
    pair = _op(graph, gather, "Concat", [_op(graph, gather, "Unsqueeze", [lo, last], f"{prefix}/lo1"),
                                         _op(graph, gather, "Unsqueeze", [hi, last], f"{prefix}/hi1")],
               f"{prefix}/pair", axis=-1)  # [..., K/B, B/2, 2]: element 2j is the low nibble of byte j
    u = _op(graph, gather, "Cast", [pair], f"{prefix}/float", to=ir.DataType.from_numpy(dtype))
    scale = _op(graph, gather, "Unsqueeze", [_op(graph, gather, "Gather", [scales, ids], f"{prefix}/scales", axis=0),
                                             _const(graph, f"{prefix}.axes", np.array([-1, -2], np.int64))],
                f"{prefix}/scales2")  # [..., K/B, 1, 1]
    centered = _op(graph, gather, "Sub", [u, _const(graph, f"{prefix}.zero_point", np.array(8, dtype))], f"{prefix}/center")
    deq = _op(graph, gather, "Mul", [centered, scale], f"{prefix}/dequantize")
    shape = _op(graph, gather, "Concat", [_op(graph, gather, "Shape", [ids], f"{prefix}/ids_shape"),
                                          _const(graph, f"{prefix}.hidden", np.array([hidden], np.int64))],
                f"{prefix}/out_shape", axis=0)
    _take_over(out, _op(graph, gather, "Reshape", [deq, shape], f"{prefix}/rows_out"))
    graph.remove(gather, safe=True)


def tied_int4(graph: ir.Graph) -> int:
    fired = 0
    for dq in [n for n in graph if n.op_type == "DequantizeLinear"]:
        q, scale = dq.inputs[0], dq.inputs[1]
        block = dq.attributes.get_int("block_size", 0)
        if (q.const_value is None or scale.const_value is None or q.const_value.dtype != ir.DataType.INT4
                or len(q.shape) != 2 or block == 0 or dq.attributes.get_int("axis", 1) not in (1, -1)
                or len(dq.inputs) > 2 and dq.inputs[2] is not None):
            continue
        heads, others_ok = _head_transposes(dq.outputs[0])
        if not heads or not others_ok:
            continue
        n, k = q.shape
        b = _const(graph, f"{q.name}.packed", pack_uint4(q.const_value.numpy(), block))
        attrs = {"K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": MATMUL_NBITS_ACCURACY_LEVEL}
        for transpose in heads:
            fired += _replace_matmuls(graph, transpose, lambda mm: ir.node(
                "MatMulNBits", [mm.inputs[0], b, scale], attributes=attrs, domain=MS, name=f"{mm.name}/nbits"))
        for use in list(dq.outputs[0].uses()):
            _embedding_from_packed(graph, use.node, b, scale, k, block)
        graph.remove(dq, safe=True)
        graph.initializers.pop(q.name)
    return fired


RULES = {"tied_int4": tied_int4, "tied_head_transposed": tied_head_transposed}


def lower(model: ir.Model, *, fuse_qdq: bool) -> dict[str, int]:
    """Apply the rules to ``model`` in place; returns {rule: times fired} for the rules that fired."""
    applied = {}
    for name, rule in RULES.items():
        if name == "tied_int4" and not fuse_qdq:
            continue  # without Q/DQ fusion the engine computes exactly what the Q/DQ nodes say
        fired = rule(model.graph)
        if fired:
            applied[name] = fired
    if applied:
        model.opset_imports.setdefault(MS, 1)
        model.graph.sort()
    return applied
