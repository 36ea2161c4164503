"""Quantization passes over an onnx_ir step graph. Each does one job and records it in the report.

- ``find_linears``: the MatMuls (and GPT-2's Gemms) over a constant [K, N] weight, and which are left alone.
- ``scale_inputs``: divide a MatMul input by per-channel factors s and multiply the weight rows by s
  (SmoothQuant migration, AWQ scaling). The graph computes the same function afterwards.
- ``quantize_weights``: weight -> DequantizeLinear(constant q, constant scale) -> MatMul. An INT4 block size
  that does not divide K pads the weight's last block with zero rows and the MatMul's input with as many
  zero columns (TensorRT's blocked DequantizeLinear takes whole blocks; onnxruntime's build folds the Pad).
- ``quantize_activations``: activation -> QuantizeLinear -> DequantizeLinear -> MatMul, per-tensor scale.

We write these ourselves rather than call onnxruntime.quantization or ModelOpt:
ORT's static quantizer rewrites the whole graph through its own calibration
(it would also quantize the KV-cache path and Attention inputs unless every
node is excluded by name) and emits UINT8/asymmetric by default; its 4-bit
quantizer's QDQ output blocks along K but stores scales transposed for its own
kernels; ModelOpt's ONNX PTQ needs a GPU for INT4 AWQ. Our passes touch only
the MatMul weights and their inputs, so the KV cache I/O and the contract stay
untouched, and their numerics are the numpy functions in ``numerics``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from . import numerics
from .report import Entry, QuantizationReport

FORMATS = {
    # format: (numpy dtype of q, ONNX type, per-channel or blocked)
    "int8": (np.int8, ir.DataType.INT8),
    "fp8": (ml_dtypes.float8_e4m3fn, ir.DataType.FLOAT8E4M3FN),
    "int4": (ml_dtypes.int4, ir.DataType.INT4),
}


@dataclass
class Linear:
    """A MatMul/Gemm whose right operand is a constant weight [K, N]."""

    node: ir.Node
    name: str

    @property
    def weight(self) -> ir.Value:
        return self.node.inputs[1]

    @property
    def activation(self) -> ir.Value:
        return self.node.inputs[0]

    def weight_array(self) -> np.ndarray:
        return self.weight.const_value.numpy()


def _lm_head_nodes(graph: ir.Graph) -> set[int]:
    """The MatMuls that produce the logits (first MatMul/Gemm met walking back from the logits output)."""
    found, stack, seen = set(), [graph.outputs[0]], set()
    while stack:
        value = stack.pop()
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in ("MatMul", "Gemm"):
            found.add(id(node))
            continue
        stack.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return found


def find_linears(model: ir.Model, report: QuantizationReport, *, include_lm_head: bool) -> list[Linear]:
    """The MatMuls a pass may quantize; every other MatMul over a constant goes into the report as skipped."""
    graph = model.graph
    lm_head = _lm_head_nodes(graph)
    linears = []
    for node in graph:
        if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        weight = node.inputs[1].const_value
        if weight is None:
            continue  # tied lm_head (see find_tied_head) or activation x activation (Attention does QK and PV)
        name = node.name or node.inputs[1].name
        shape = tuple(weight.shape)
        nbytes = weight.nbytes
        reason = None
        if len(shape) != 2:
            reason = f"weight is {len(shape)}-D; only 2-D [K, N] weights are quantized"
        elif not weight.dtype.is_floating_point():
            reason = f"weight is {weight.dtype.name}, not floating point"
        elif node.op_type == "Gemm" and any(node.attributes.get_int(a, d) != d for a, d in (("transA", 0), ("transB", 0))):
            reason = "Gemm with a transposed operand; only A @ B + C is handled"
        elif node.op_type == "Gemm" and any(node.attributes.get_float(a, 1.0) != 1.0 for a in ("alpha", "beta")):
            reason = "Gemm with alpha or beta != 1"
        elif len(node.inputs[1].uses()) != 1:
            reason = "weight is shared with another node"
        elif id(node) in lm_head and not include_lm_head:
            reason = "lm_head stays in high precision (pass --quantize-lm-head to include it)"
        report.entries.append(Entry(name, shape, "skipped" if reason else "pending", reason or "", nbytes, nbytes))
        if reason is None:
            linears.append(Linear(node, name))
    return linears


@dataclass
class TiedHead:
    """An lm_head that reads the embedding table: Gather(W [V, H], ids) and MatMul(x, Transpose(W))."""

    matmul: ir.Node
    embedding: ir.Value  # the initializer W [V, H]
    name: str = "lm_head"

    @property
    def activation(self) -> ir.Value:
        return self.matmul.inputs[0]

    def weight_array(self) -> np.ndarray:
        """The head's weight as a [K, N] = [H, V] MatMul weight."""
        return self.embedding.const_value.numpy().T


def find_tied_head(model: ir.Model) -> TiedHead | None:
    """The lm_head tied to the embedding, if the graph has one (the Transpose of an initializer also gathered)."""
    heads = _lm_head_nodes(model.graph)
    for node in model.graph:
        if id(node) not in heads or node.op_type != "MatMul":
            continue
        t = node.inputs[1].producer()
        if t is None or t.op_type != "Transpose" or list(t.attributes.get_ints("perm", [])) != [1, 0]:
            continue
        w = t.inputs[0]
        uses = {u.node.op_type for u in w.uses()}
        if w.const_value is not None and len(w.shape) == 2 and uses <= {"Transpose", "Gather"} and "Gather" in uses:
            return TiedHead(node, w)
    return None


def quantize_tied_head(model: ir.Model, tied: TiedHead, q: np.ndarray, scale: np.ndarray, block_size: int,
                       report: QuantizationReport, detail: str) -> None:
    """W [V, H] -> DequantizeLinear(q [V, H] int4, scale [V, H/B], axis 1, blocked) feeding the embedding Gather
    and the lm_head's Transpose -> MatMul: one INT4 copy for both uses. ``q`` [H, V] / ``scale`` [H/B, V] are the
    head's quantization as a [K, N] weight (blocks along K = H, which are blocks along axis 1 of W)."""
    graph = model.graph
    w = tied.embedding
    v, h = w.shape
    qv = _constant(graph, f"{w.name}_quantized", np.ascontiguousarray(q.T).astype(ml_dtypes.int4))
    sv = _constant(graph, f"{w.name}_scale", np.ascontiguousarray(scale.T))
    dq = ir.node("DequantizeLinear", [qv, sv], attributes={"axis": 1, "block_size": block_size},
                 name=_node_name(graph, f"{w.name}/dq"))
    dq.outputs[0].name = f"{w.name}_dequantized"
    dq.outputs[0].type, dq.outputs[0].shape = ir.TensorType(w.const_value.dtype), ir.Shape([v, h])
    graph.insert_before(_first(graph, [u.node for u in w.uses()]), dq)
    for use in list(w.uses()):
        use.node.replace_input_with(use.idx, dq.outputs[0])
    _drop_if_unused(graph, w)
    nbytes = qv.const_value.nbytes + sv.const_value.nbytes
    report.entries.append(Entry(f"embedding ({w.name})", (v, h), "quantized",
                                f"int4, blocks of {block_size} along the hidden axis; shared with the tied lm_head; "
                                + detail, w.const_value.nbytes, nbytes))
    report.entries.append(Entry(tied.name, (h, v), "quantized",
                                f"tied to the embedding: reads its INT4 weight through Transpose ({detail})", 0, 0))


def group_by_activation(linears: list[Linear]) -> list[list[Linear]]:
    """Linears that read the same activation (q/k/v, gate/up), in graph order: they share one input scale."""
    groups: dict[int, list[Linear]] = {}
    for linear in linears:
        groups.setdefault(id(linear.activation), []).append(linear)
    return list(groups.values())


def _constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    name = _fresh_name(name, graph.initializers)
    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
    value.shape = ir.Shape(array.shape)
    value.type = ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    return value


def _fresh_name(name: str, taken) -> str:
    """name, or name_1, name_2, ... : the first one not in ``taken``."""
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    return candidate


def _set_constant(value: ir.Value, array: np.ndarray) -> None:
    value.const_value = ir.Tensor(array.astype(value.const_value.numpy().dtype), name=value.name)


def _drop_if_unused(graph: ir.Graph, value: ir.Value) -> None:
    if not value.uses() and value.name in graph.initializers and value not in graph.outputs:
        graph.initializers.pop(value.name)


def _first(graph: ir.Graph, nodes: list[ir.Node]) -> ir.Node:
    order = {id(n): i for i, n in enumerate(graph)}
    return min(nodes, key=lambda n: order[id(n)])


def scale_inputs(model: ir.Model, group: list[Linear], s: np.ndarray, report: QuantizationReport, why: str) -> str:
    """x -> x / s for the group's input, W -> diag(s) W for each weight; the function is unchanged.

    1/s is folded into the op that makes x when that is exact and x feeds only this
    group: a norm's constant weight (RMSNorm's Mul, LayerNormalization's scale and
    bias), or the columns of the MatMul whose output is one factor of an elementwise
    Mul (the MLP's up_proj feeding down_proj). Otherwise a Mul by 1/s is inserted.
    Returns how 1/s was applied, for the report.
    """
    graph = model.graph
    x = group[0].activation
    for linear in group:
        w = linear.weight_array()
        _set_constant(linear.weight, w.astype(np.float32) * s[:, None])
    inv = (1.0 / s).astype(np.float32)
    how = _fold(x, inv) if input_scale_foldable(model, group) else None
    if how is None:
        c = _constant(graph, f"{group[0].name}.input_inv_scale", inv.astype(x.dtype.numpy()))
        mul = ir.node("Mul", [x, c], name=_node_name(graph, f"{group[0].name}/input_inv_scale"))
        mul.outputs[0].name = f"{group[0].name}.input_scaled"
        mul.outputs[0].type, mul.outputs[0].shape = x.type, x.shape
        graph.insert_before(_first(graph, [linear.node for linear in group]), mul)
        for linear in group:
            linear.node.replace_input_with(0, mul.outputs[0])
        how = "Mul by 1/s inserted"
    report.notes.append(f"{why} on the input of {', '.join(lin.name for lin in group)}: {how}")
    return how


def _node_name(graph: ir.Graph, name: str) -> str:
    return _fresh_name(name, {n.name for n in graph})


def _is_vector(value: ir.Value | None, k: int) -> bool:
    return value is not None and value.const_value is not None and tuple(value.const_value.shape) == (k,)


def _scale_operand(node: ir.Node, index: int, factor: np.ndarray) -> None:
    """Multiply the constant node.inputs[index] by factor, for this node only.

    The exporter shares equal initializers between nodes (every fresh norm weight
    is all ones), so a constant used elsewhere is copied rather than changed.
    """
    value = node.inputs[index]
    array = (value.const_value.numpy().astype(np.float32) * factor).astype(value.const_value.numpy().dtype)
    if len(value.uses()) == 1:
        _set_constant(value, array)
    else:
        node.replace_input_with(index, _constant(node.graph, f"{value.name}.scaled_for_{node.name}", array))


def _last_dim(value: ir.Value) -> int | None:
    return value.shape[-1] if value.shape is not None and len(value.shape) and isinstance(value.shape[-1], int) else None


def _fold(x: ir.Value, inv: np.ndarray | int, apply: bool = True) -> str | None:
    """Fold x -> x * inv into the node producing x, if exact; returns what it did (or would do: ``apply`` False,
    ``inv`` may then be just its length), or None."""
    node = x.producer()
    k = inv if isinstance(inv, int) else inv.shape[0]
    if node is None:
        return None
    if node.op_type == "Reshape" and _last_dim(node.inputs[0]) == k == _last_dim(x) and len(node.inputs[0].uses()) == 1:
        return _fold(node.inputs[0], inv, apply)  # GPT-2 flattens [B, T, C] -> [B*T, C] before its Gemm
    if node.op_type == "LayerNormalization" and _is_vector(node.inputs[1], k):
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and not _is_vector(bias, k):
            return None
        if apply:
            _scale_operand(node, 1, inv)
            if bias is not None:
                _scale_operand(node, 2, inv)
        return f"folded into {node.name} (LayerNormalization scale and bias)"
    if node.op_type != "Mul":
        return None
    for i, operand in enumerate(node.inputs):
        if _is_vector(operand, k):
            if apply:
                _scale_operand(node, i, inv)
            return f"folded into {node.name} (the norm's weight)"
    for operand in node.inputs:
        up = operand.producer() if operand is not None else None
        if (up is not None and up.op_type == "MatMul" and len(operand.uses()) == 1 and up.inputs[1] is not None
                and up.inputs[1].const_value is not None and tuple(up.inputs[1].const_value.shape)[-1] == k):
            if apply:
                _scale_operand(up, 1, inv[None, :])
            return f"folded into the output columns of {up.name}"
    return None


def input_scale_foldable(model: ir.Model, group: list[Linear]) -> bool:
    """Whether ``scale_inputs`` on this group folds 1/s into the op making its input (no Mul added per call)."""
    x = group[0].activation
    members = {id(linear.node) for linear in group}
    return (all(id(use.node) in members for use in x.uses()) and x not in model.graph.outputs
            and _fold(x, group[0].weight.const_value.shape[0], apply=False) is not None)


def quantize_weights(model: ir.Model, linears: list[Linear], fmt: str, report: QuantizationReport,
                     block_size: int = 0, clips: dict[str, np.ndarray] | None = None,
                     quantized: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    """W [K, N] -> DequantizeLinear(q, scale) feeding the MatMul: per output channel, or int4 blocked along K.

    ``clips``: per MatMul name, int4 range ratios [K/B, N] from AWQ's clipping search. ``quantized``: per
    MatMul name, an int4 (q, scale) already computed (GPTQ) to use instead of round-to-nearest.
    """
    graph = model.graph
    q_dtype, _ = FORMATS[fmt]
    padded: dict[int, ir.Value] = {}  # activation -> its zero-padded copy, shared by the MatMuls reading it
    for linear in linears:
        w = linear.weight_array()
        k, n = w.shape
        if fmt == "int8":
            q, scale = numerics.int8_per_channel(w)
            attrs, layout = {"axis": 1}, "per output channel"
        elif fmt == "fp8":
            q, scale = numerics.fp8_per_channel(w)
            attrs, layout = {"axis": 1}, "per output channel"
        elif quantized and linear.name in quantized:
            q, scale = quantized[linear.name]
            attrs, layout = {"axis": 0, "block_size": block_size}, f"blocks of {block_size} along K"
        else:
            q, scale = numerics.int4_blocked(w, block_size, (clips or {}).get(linear.name))
            attrs, layout = {"axis": 0, "block_size": block_size}, f"blocks of {block_size} along K"
        if q.shape[0] != k:  # a ragged last block, padded with zero rows: the input gets as many zero columns
            x = linear.activation
            if id(x) not in padded:
                padded[id(x)] = _pad_last_axis(graph, x, q.shape[0] - k, linear)
            linear.node.replace_input_with(0, padded[id(x)])
            layout += f", the last one {k % block_size} wide (zero-padded to {block_size}, the input too)"
        qv = _constant(graph, f"{linear.name}.weight_quantized", q.astype(q_dtype))
        sv = _constant(graph, f"{linear.name}.weight_scale", scale)
        dq = ir.node("DequantizeLinear", [qv, sv], attributes=attrs, name=_node_name(graph, f"{linear.name}/weight_dq"))
        dq.outputs[0].name = f"{linear.name}.weight_dequantized"
        dq.outputs[0].type = ir.TensorType(linear.weight.const_value.dtype)
        dq.outputs[0].shape = ir.Shape(list(q.shape))
        graph.insert_before(linear.node, dq)
        old = linear.weight
        linear.node.replace_input_with(1, dq.outputs[0])
        _drop_if_unused(graph, old)
        detail = report.entry(linear.name).detail
        report.update(linear.name, action="quantized", bytes_after=qv.const_value.nbytes + sv.const_value.nbytes,
                      detail="; ".join(filter(None, [f"{fmt} weight, {layout}", detail])))


def _pad_last_axis(graph: ir.Graph, x: ir.Value, extra: int, linear: Linear) -> ir.Value:
    """x [..., K] -> Pad(x) [..., K + extra] with zeros at the end of the last axis, inserted before the linear."""
    rank = len(x.shape) if x.shape is not None else None
    if rank is not None:  # explicit pads on every axis (no ``axes`` input)
        pads, inputs = [0] * (2 * rank), None
        pads[-1] = extra
    else:
        pads, inputs = [0, extra], [_constant(graph, f"{linear.name}.input_pad_axes", np.array([-1], np.int64))]
    pad_value = _constant(graph, f"{linear.name}.input_pads", np.array(pads, np.int64))
    zero = _constant(graph, f"{linear.name}.input_pad_value", np.zeros((), x.dtype.numpy()))
    node = ir.node("Pad", [x, pad_value, zero, *(inputs or [])], name=_node_name(graph, f"{linear.name}/input_pad"))
    node.outputs[0].name = f"{linear.name}.input_padded"
    node.outputs[0].type = x.type
    if rank is not None:
        dims = list(x.shape)
        dims[-1] = dims[-1] + extra if isinstance(dims[-1], int) else None
        node.outputs[0].shape = ir.Shape(dims)
    graph.insert_before(linear.node, node)
    return node.outputs[0]


def quantize_activations(model: ir.Model, group: list[Linear], amax: float, fmt: str,
                         report: QuantizationReport) -> None:
    """The group's input x -> QuantizeLinear -> DequantizeLinear with one per-tensor scale (amax / qmax)."""
    graph = model.graph
    q_dtype, _ = FORMATS[fmt]
    x = group[0].activation
    dtype = x.dtype.numpy()
    scale = numerics.activation_scale(amax, fmt, dtype)
    sv = _constant(graph, f"{group[0].name}.input_scale", np.asarray(scale))
    zp = _constant(graph, f"{group[0].name}.input_zero_point", np.zeros((), q_dtype))
    first = _first(graph, [linear.node for linear in group])
    q = ir.node("QuantizeLinear", [x, sv, zp], name=_node_name(graph, f"{group[0].name}/input_q"))
    dq = ir.node("DequantizeLinear", [q.outputs[0], sv, zp], name=_node_name(graph, f"{group[0].name}/input_dq"))
    q.outputs[0].name, dq.outputs[0].name = f"{group[0].name}.input_quantized", f"{group[0].name}.input_dequantized"
    q.outputs[0].type, q.outputs[0].shape = ir.TensorType(FORMATS[fmt][1]), x.shape
    dq.outputs[0].type, dq.outputs[0].shape = x.type, x.shape
    graph.insert_before(first, [q, dq])
    for linear in group:
        linear.node.replace_input_with(0, dq.outputs[0])
        entry = report.entry(linear.name)
        entry.detail = f"{entry.detail}; {fmt} input, per tensor (amax {amax:.4g})"
