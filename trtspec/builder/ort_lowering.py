"""Rewrites of the step graph for onnxruntime's CPU kernels, applied at `build` (the export keeps the portable form).

Each rule matches one pattern and replaces it by what onnxruntime runs best, with every weight stored once:

- ``tied_head_transposed``: a tied lm_head reads the embedding through ``Transpose(W) -> MatMul``. onnxruntime
  would constant-fold the Transpose into a second float copy of the embedding; ``FusedMatMul(x, W, transB=1)``
  reads the one copy (and measured no slower than the folded MatMul: 0.53 vs 0.51 ms at T=1, 0.57 vs 0.80 ms at
  T=5 for an 8192x512 head, 2 threads).
- ``tied_int4``: the tied weight quantized to INT4 (one ``DequantizeLinear`` blocked along the hidden axis,
  feeding both the embedding ``Gather`` and the lm_head's ``Transpose -> MatMul``). The head becomes
  ``MatMulNBits``; the embedding lookup gathers the rows of the *same* packed initializer and scales and unpacks
  them (a few element-wise ops over B*T rows). onnxruntime's ``GatherBlockQuantized`` wants the data [V, H/2] or
  int4 [V, H], ``MatMulNBits`` wants [V, H/B, B/2], and both check shapes: the one kernel reads the other's bytes
  through a Reshape, which onnxruntime's offline optimisation would fold into a second copy in the file. The
  decode graph, saved after that optimisation, does use it (ort_decode.packed_lookup).

- ``ragged_int4``: a block size that does not divide K: the export pads the weight's last block and the
  MatMul's input with zeros; onnxruntime takes the ragged block directly (see the function).

``lower(model, fuse_qdq=...)`` applies the rules and returns how often each fired (the manifest records it).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ..engine_contract import MATMUL_NBITS_ACCURACY_LEVEL
from ..exporter.contract import TREE_MASK
from ..int4_packing import pack_uint4

MS = "com.microsoft"
log = logging.getLogger("trtspec.build")


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


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    base, i = name, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
    value.shape, value.type = ir.Shape(array.shape), ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    return value


def _op(graph: ir.Graph, anchor: ir.Node, op: str, inputs, name: str, domain: str = "", **attributes) -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes, name=name, domain=domain)
    graph.insert_before(anchor, node)
    return node.outputs[0]


PACKED_LOOKUP = "/int4/rows_out"  # the name ending of the last node of a lookup made by _embedding_from_packed


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
    _take_over(out, _op(graph, gather, "Reshape", [deq, shape], f"{gather.name}{PACKED_LOOKUP}"))
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


def _const_ints(value: ir.Value | None):
    return None if value is None or value.const_value is None else value.const_value.numpy().reshape(-1).tolist()


def _end_padding(pad: ir.Node) -> int | None:
    """How many zeros ``pad`` appends to the last axis, if that is all it does (constant mode, value 0)."""
    if pad.op_type != "Pad" or pad.domain != "" or pad.attributes.get_string("mode", "constant") != "constant":
        return None
    pads = _const_ints(pad.inputs[1] if len(pad.inputs) > 1 else None)
    value = pad.inputs[2] if len(pad.inputs) > 2 else None
    axes = _const_ints(pad.inputs[3]) if len(pad.inputs) > 3 and pad.inputs[3] is not None else None
    if pads is None or value is not None and (value.const_value is None or value.const_value.numpy().any()):
        return None
    rank = len(pad.inputs[0].shape) if pad.inputs[0].shape is not None else None
    if axes is not None and not (len(axes) == 1 and (axes[0] == -1 or axes[0] == (rank or 0) - 1)):
        return None
    if any(pads[:-1]) or pads[-1] <= 0:
        return None
    return pads[-1]


def ragged_int4(graph: ir.Graph) -> int:
    """``Pad(x) -> MatMul(., DequantizeLinear(q [K', N]))`` where the Pad appends K' - K < block zeros to x's
    last axis (how `quantize` writes a block size that does not divide K: TensorRT's blocked DequantizeLinear
    takes whole blocks) -> ``MatMul(x, DequantizeLinear(q[:K]))``, a ragged last block, which onnxruntime
    fuses into one ``MatMulNBits`` with that K (it pads blocks itself): no Pad at run time, no padding stored."""
    fired = 0
    for pad in [n for n in graph if n.op_type == "Pad"]:
        extra = _end_padding(pad)
        uses = list(pad.outputs[0].uses())
        if extra is None or not uses or any(u.node.op_type != "MatMul" or u.idx != 0 for u in uses):
            continue
        dqs = [_weight_of(u.node) for u in uses]
        if any(w is None or w[0] != "dq" or w[1].inputs[0].const_value.dtype != ir.DataType.INT4
               or not 0 < extra < w[1].attributes.get_int("block_size", 0) for w in dqs):
            continue
        for use, (_, dq) in zip(uses, dqs):
            q = dq.inputs[0]
            kept = q.const_value.numpy()[: q.shape[0] - extra]
            dq.replace_input_with(0, _const(graph, f"{q.name}.ragged", kept))
            dq.outputs[0].shape = ir.Shape(kept.shape)
            graph.initializers.pop(q.name)
            use.node.replace_input_with(0, pad.inputs[0])
        graph.remove(pad, safe=True)
        fired += 1
    return fired


def _input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def _int64(graph: ir.Graph, name: str, values) -> ir.Value:
    return _const(graph, name, np.asarray(values, dtype=np.int64))


def rms_norm(model: ir.Model) -> int:
    """RMSNorm (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul) -> SimplifiedLayerNormalization; with the residual
    Add before it -> SkipSimplifiedLayerNormalization (onnxscript's rules)."""
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    fired = fuse_rms_normalization(model)
    return fired + fuse_skip_rms_normalization(model) if fired else 0


def _rope_table(value: ir.Value, position_ids: ir.Value):
    """cos/sin as ``Unsqueeze(Gather(table, position_ids), [1])`` with a [S, D] table whose halves repeat:
    -> the table's first half [S, D/2] (RotaryEmbedding's cache), else None."""
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze":
        return None
    gather = node.inputs[0].producer()
    if (gather is None or gather.op_type != "Gather" or gather.inputs[1] is not position_ids
            or gather.inputs[0].const_value is None):
        return None
    axes = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if axes is None or axes.numpy().tolist() not in ([1], [-3]):
        return None
    table = gather.inputs[0].const_value.numpy()
    half = table.shape[-1] // 2
    if table.ndim != 2 or not np.array_equal(table[:, :half], table[:, half:]):
        return None
    return table[:, :half]


def rotary_embedding(model: ir.Model) -> int:
    """x * cos + rotate_half(x) * sin, cos/sin gathered from position tables -> com.microsoft RotaryEmbedding
    (position_ids, cos/sin caches [S_max, D/2]); onnxscript's rule finds the pattern, this one lowers it."""
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding

    graph = model.graph
    position_ids = _input(graph, "position_ids")
    if position_ids is None or not fuse_rotary_embedding(model):
        return 0
    caches: dict[int, tuple[ir.Value, ir.Value] | None] = {}
    fired = kept = 0
    for node in [n for n in graph if n.op_type == "RotaryEmbedding" and n.domain == "ai.onnxruntime._fusion"]:
        x, cos, sin = node.inputs
        key = id(cos)
        if key not in caches:
            c, s = _rope_table(cos, position_ids), _rope_table(sin, position_ids)
            caches[key] = None if c is None or s is None else (
                _const(graph, "rope_cos_cache", np.ascontiguousarray(c)),
                _const(graph, "rope_sin_cache", np.ascontiguousarray(s)))
        if caches[key] is None:  # cos/sin not a position-table lookup: the node stays a local function
            log.info("%s: RoPE cos/sin are not a position-table lookup; left unfused", node.name)
            kept += 1
            continue
        cos_cache, sin_cache = caches[key]
        new = ir.node("RotaryEmbedding", [x, position_ids, cos_cache, sin_cache], domain=MS, name=f"{node.name}/ort",
                      attributes={"interleaved": 0})
        graph.insert_before(node, new)
        _take_over(node.outputs[0], new.outputs[0])
        graph.remove(node, safe=True)
        fired += 1
    if not kept:
        for key in [k for k in model.functions if k[0] == "ai.onnxruntime._fusion"]:
            del model.functions[key]
        model.opset_imports.pop("ai.onnxruntime._fusion", None)
    return fired


def attention_live_length(model: ir.Model) -> int:
    """Attention over the live part of the cache: slots [0, L) with L = max(position_ids) + 1, so a call's
    attention cost follows the longest sequence in the batch instead of the capacity S_max (the mask hides a
    shorter row's slots beyond its own positions, as before)."""
    graph = model.graph
    position_ids = _input(graph, "position_ids")
    nodes = [n for n in graph if n.op_type == "Attention" and n.domain == ""
             and len(n.inputs) >= 4 and n.inputs[3] is not None
             and all(n.inputs[i].producer() is not None and n.inputs[i].producer().op_type == "TensorScatter"
                     for i in (1, 2))]
    if position_ids is None or not nodes:
        return 0
    anchor = next(iter(graph))  # position_ids is a graph input: compute L once, first
    if _input(graph, TREE_MASK) is not None:
        # a tree call writes T slots from position_ids[:, 0], though its nodes' positions reach only the tree's depth
        first = _op(graph, anchor, "Gather", [position_ids, _int64(graph, "live_length.first", [0])],
                    "live_length/first", axis=1)  # [B, 1]
        calls = _op(graph, anchor, "Gather", [_op(graph, anchor, "Shape", [position_ids], "live_length/shape"),
                                              _int64(graph, "live_length.t_axis", [1])], "live_length/tokens")
        top = _op(graph, anchor, "ReduceMax", [first], "live_length/max", keepdims=0)
        length = _op(graph, anchor, "Add", [_op(graph, anchor, "Reshape", [top, _int64(graph, "live_length.shape", [1])],
                                                "live_length/max1"), calls], "live_length/value")
    else:
        top = _op(graph, anchor, "ReduceMax", [position_ids], "live_length/max", keepdims=0)
        length = _op(graph, anchor, "Add", [_op(graph, anchor, "Reshape", [top, _int64(graph, "live_length.shape", [1])],
                                                "live_length/max1"),
                                            _int64(graph, "live_length.one", [1])], "live_length/value")
    zero, seq_axis, mask_axis = (_int64(graph, "live_length.zero", [0]), _int64(graph, "live_length.kv_axis", [2]),
                                 _int64(graph, "live_length.mask_axis", [3]))
    masks: dict[int, ir.Value] = {}
    for node in nodes:
        mask = node.inputs[3]
        if id(mask) not in masks:
            masks[id(mask)] = _op(graph, node, "Slice", [mask, zero, length, mask_axis], f"{node.name}/live_mask")
        k = _op(graph, node, "Slice", [node.inputs[1], zero, length, seq_axis], f"{node.name}/live_key")
        v = _op(graph, node, "Slice", [node.inputs[2], zero, length, seq_axis], f"{node.name}/live_value")
        node.replace_input_with(1, k)
        node.replace_input_with(2, v)
        node.replace_input_with(3, masks[id(mask)])
    return len(nodes)


def _weight_of(matmul: ir.Node):
    """A MatMul's constant weight [K, N]: ("float", W) or ("dq", DequantizeLinear node) for a weight-only Q/DQ
    weight blocked along K (what onnxruntime fuses into MatMulNBits); None for anything else."""
    w = matmul.inputs[1]
    if w.const_value is not None and len(w.shape or ()) == 2:
        if w.const_value.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16) and len(w.uses()) == 1:
            return "float", w
        return None
    dq = w.producer()
    if (dq is None or dq.op_type != "DequantizeLinear" or len(w.uses()) != 1 or dq.attributes.get_int("axis", 1) != 0
            or any(i is not None and (i.const_value is None or len(i.uses()) != 1) for i in dq.inputs)
            or len(dq.inputs[0].shape or ()) != 2):
        return None
    return "dq", dq


def _pack_matmuls(graph: ir.Graph, names: tuple[str, ...], kinds: tuple[str, ...] = ("float", "dq")) -> int:
    """MatMuls that read one input with constant weights [K, N_i] -> one MatMul with the weights concatenated
    along N, then Split: one larger GEMV reads the same bytes with fewer kernel launches. Float weights, or
    weight-only Q/DQ weights of one block size (concatenated with their scales, still Q/DQ: onnxruntime then
    fuses the one DequantizeLinear -> MatMul into one MatMulNBits)."""
    fired = 0
    for x in list(graph.inputs) + [o for n in graph for o in n.outputs]:
        group = [u.node for u in x.uses() if u.node.op_type == "MatMul" and u.node.domain == "" and u.idx == 0
                 and any(u.node.name.endswith(suffix) for suffix in names)]
        weights = [_weight_of(n) for n in group]
        if (len(group) < 2 or any(w is None for w in weights) or len({w[0] for w in weights}) != 1
                or weights[0][0] not in kinds):
            continue
        order = sorted(range(len(group)), key=lambda i: names.index(next(s for s in names if group[i].name.endswith(s))))
        group, weights = [group[i] for i in order], [weights[i] for i in order]
        kind, base = weights[0][0], group[0].name
        nodes = list(graph)
        anchor = min(group, key=nodes.index)  # the new nodes go before the first of the group
        if kind == "float":
            values = [w.const_value.numpy() for _, w in weights]
            if len({v.shape[0] for v in values}) != 1:
                continue
            sizes = [v.shape[1] for v in values]
            w = _const(graph, f"{base}/packed.weight", np.concatenate(values, axis=1))
            dropped = [w_ for _, w_ in weights]
        else:
            dqs = [dq for _, dq in weights]
            if (len({dq.attributes.get_int("block_size", 0) for dq in dqs}) != 1
                    or len({tuple(dq.inputs[0].shape)[0] for dq in dqs}) != 1
                    or len({len([i for i in dq.inputs if i is not None]) for dq in dqs}) != 1):
                continue
            sizes = [dq.inputs[0].shape[1] for dq in dqs]
            parts = [_const(graph, f"{base}/packed.{role}", np.concatenate([dq.inputs[i].const_value.numpy() for dq in dqs], 1))
                     for i, role in enumerate(("weight_quantized", "weight_scale", "weight_zero_point")[: len(
                         [i for i in dqs[0].inputs if i is not None])])]
            dq_new = ir.node("DequantizeLinear", parts, attributes={"axis": 0, "block_size": dqs[0].attributes.get_int(
                "block_size", 0)}, name=f"{base}/packed_dq")
            graph.insert_before(anchor, dq_new)
            w = dq_new.outputs[0]
            dropped = [i for dq in dqs for i in dq.inputs if i is not None]
        y = _op(graph, anchor, "MatMul", [x, w], f"{base}/packed")
        split = ir.node("Split", [y, _int64(graph, f"{base}/packed.sizes", sizes)],
                        attributes={"axis": -1}, num_outputs=len(group), name=f"{base}/split")
        graph.insert_before(anchor, split)
        for node, out in zip(group, split.outputs):
            _take_over(node.outputs[0], out)
            graph.remove(node, safe=True)
        if kind == "dq":
            for _, dq in weights:
                graph.remove(dq, safe=True)
        for w_ in dropped:
            graph.initializers.pop(w_.name, None)
        fired += 1
    return fired


def packed_qkv(model: ir.Model) -> int:
    return _pack_matmuls(model.graph, ("q_proj", "k_proj", "v_proj"))


def packed_gate_up(model: ir.Model) -> int:
    """Float weights only: INT4 gate and up as two MatMulNBits, no Split, made a one-token call 0.95-0.97x the
    time (tied 27.8M and bundled INT4 targets, 20 interleaved repetitions; a 4-token call 1.00-1.03x; float32
    unchanged within 0.3 %)."""
    return _pack_matmuls(model.graph, ("gate_proj", "up_proj"), kinds=("float",))


# Storage rules (every weight once) run on every build; the fusions only without --no-fusion.
STORAGE_RULES = {"tied_int4": lambda m: tied_int4(m.graph), "tied_head_transposed": lambda m: tied_head_transposed(m.graph),
                 "ragged_int4": lambda m: ragged_int4(m.graph)}
FUSION_RULES = {"rms_norm": rms_norm, "rotary_embedding": rotary_embedding, "attention_live_length": attention_live_length,
                "packed_qkv": packed_qkv, "packed_gate_up": packed_gate_up}


def lower(model: ir.Model, *, fuse_qdq: bool, fusion: bool = True, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Apply the rules to ``model`` in place; returns {rule: times fired} for the rules that fired."""
    applied = {}
    rules = {**STORAGE_RULES, **(FUSION_RULES if fusion else {})}
    for name, rule in rules.items():
        if name in skip or (name in ("tied_int4", "ragged_int4") and not fuse_qdq):
            continue  # without Q/DQ fusion the engine computes exactly what the Q/DQ nodes say
        fired = rule(model)
        if fired:
            applied[name] = fired
    if applied:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)  # e.g. the RoPE tables' lookups the RotaryEmbedding caches replaced
        model.opset_imports.setdefault(MS, 1)
        model.graph.sort()
    return applied
