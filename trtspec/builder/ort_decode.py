"""The decode graph of an onnxruntime engine: each layer's attention as one ``GroupQueryAttention``.

onnxruntime's CPU ``GroupQueryAttention`` (com.microsoft) is its own in-place decoder attention: it takes the
layer's new q/k/v in [B, T, heads * D], applies RoPE itself (``do_rotary``, from cos/sin caches), writes the new
keys and values into the cache buffer it shares with the present output (the engine binds both to one buffer,
as for ``TensorScatter``), and attends over each row's live length only (``seqlens_k``). It replaces about a
dozen nodes per layer (the Split of the packed q/k/v projection, Reshape/Transpose of q/k/v and of the output,
two RotaryEmbedding, two TensorScatter, the live-length Slices, Attention).

It cannot run every step call: onnxruntime 1.32 refuses a call of several rows x several tokens once the cache
holds a past ("batch_size must be 1 when sequence_length > 1 and past context is given"). So an engine keeps
both graphs over one weights file: ``decode.onnx`` for calls of one row or one token (every decode, draft and
batch-1 verify or prefill call), ``model.onnx`` for the rest (a batched verify or chunk), loaded only when such
a call comes.

``make_decode_graph`` derives the decode graph from the built (lowered, onnxruntime-optimised) graph; both
reference the same external weights file, so the weights are stored once.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..exporter.contract import TREE_MASK
from .ort_lowering import MS, PACKED_LOOKUP, _const, _op, _take_over


class NotApplicable(Exception):
    """Why a graph gets no decode graph (the reason goes to the build log and manifest)."""


def _producer(value: ir.Value, op: str, domain: str = "") -> ir.Node:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op or node.domain != domain:
        raise NotApplicable(f"{value.name if value is not None else 'a value'} is not made by {op}")
    return node


def _to_heads(value: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """value = [RotaryEmbedding](Transpose(Reshape(x3), [0, 2, 1, 3])) -> (x3, the RotaryEmbedding or None)."""
    node = value.producer()
    rotary = None
    if node is not None and node.op_type == "RotaryEmbedding" and node.domain == MS:
        rotary, value = node, node.inputs[0]
    transpose = _producer(value, "Transpose")
    if list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        raise NotApplicable(f"{transpose.name} is not the [B, T, H, D] -> [B, H, T, D] transpose")
    reshape = _producer(transpose.inputs[0], "Reshape")
    return reshape.inputs[0], rotary


def _cache_write(value: ir.Value) -> ir.Node:
    """The TensorScatter behind the (live-length Slice of the) key or value input of an Attention."""
    node = value.producer()
    if node is not None and node.op_type == "Slice":
        value = node.inputs[0]
    return _producer(value, "TensorScatter")


def rewrite(model: ir.Model, *, num_heads: int, num_kv_heads: int) -> int:
    """Replace every layer's attention by GroupQueryAttention in place; returns the layer count.

    Raises NotApplicable (the model left unusable: work on a copy) when a layer does not have the expected
    form: sliding windows (several masks), softcap, or a layout this rule does not know.
    """
    graph = model.graph
    position_ids = next((v for v in graph.inputs if v.name == "position_ids"), None)
    attentions = [n for n in graph if n.op_type == "Attention" and n.domain == ""]
    if position_ids is None or not attentions:
        raise NotApplicable("no step-graph attention to rewrite")
    masks = {id(n.inputs[3]) for n in attentions if len(n.inputs) > 3}
    if len(masks) != 1:
        raise NotApplicable("layers with sliding windows (several attention masks)")
    tree_mask = next((v for v in graph.inputs if v.name == TREE_MASK), None)
    mask = attentions[0].inputs[3].producer()
    if mask is not None and mask.op_type == "Slice":  # the live-length slice
        mask = mask.inputs[0].producer()
    # slot <= position, and nothing else; a tree graph's mask is that one for every call this graph runs (calls
    # without a tree: the engine sends tree calls to the built graph), and the decode graph drops the tree input
    if tree_mask is None and (mask is None or mask.op_type != "LessOrEqual"):
        raise NotApplicable("the attention mask is not the plain causal one (a sliding window?)")
    anchor = next(iter(graph))
    last = _op(graph, anchor, "Gather", [position_ids, _const(graph, "gqa.last", np.array(-1, np.int64))],
               "gqa/last_position", axis=1)  # [B]: each row's last position
    seqlens_k = _op(graph, anchor, "Cast", [last], "gqa/seqlens_k", to=ir.DataType.INT32)
    top = _op(graph, anchor, "ReduceMax", [position_ids], "gqa/max_position", keepdims=0)
    total = _op(graph, anchor, "Cast", [_op(graph, anchor, "Add", [top, _const(graph, "gqa.one", np.array(1, np.int64))],
                                            "gqa/total_plus")], "gqa/total_sequence_length", to=ir.DataType.INT32)
    for attention in attentions:
        if attention.attributes.get_float("softcap", 0.0) or attention.attributes.get_int("is_causal", 0):
            raise NotApplicable(f"{attention.name} uses softcap or is_causal")
        q3, q_rot = _to_heads(attention.inputs[0])
        k_write, v_write = _cache_write(attention.inputs[1]), _cache_write(attention.inputs[2])
        k3, k_rot = _to_heads(k_write.inputs[1])
        v3, v_rot = _to_heads(v_write.inputs[1])
        if (q_rot is None) != (k_rot is None) or v_rot is not None:
            raise NotApplicable(f"{attention.name}: RoPE on q and k only was expected")
        out_t = attention.outputs[0].uses()
        if len(out_t) != 1 or out_t[0].node.op_type != "Transpose":
            raise NotApplicable(f"{attention.name}: its output is not transposed back to [B, T, H, D]")
        out_reshape = out_t[0].node.outputs[0].uses()
        if len(out_reshape) != 1 or out_reshape[0].node.op_type != "Reshape":
            raise NotApplicable(f"{attention.name}: its output is not reshaped to [B, T, H * D]")
        reshape = out_reshape[0].node  # reads [B, T, H, D] contiguous, the same elements as GQA's [B, T, H * D]
        head_dim = k_write.inputs[0].shape[-1] if k_write.inputs[0].shape is not None else None
        out_shape = reshape.outputs[0].shape
        plain_view = (out_shape is not None and len(out_shape) == 3 and isinstance(head_dim, int)
                      and out_shape[-1] == num_heads * head_dim)  # [B, T, H * D]: GQA's own output shape
        split = q3.producer()
        if (split is not None and split.op_type == "Split" and len(split.outputs) == 3
                and all(a is b for a, b in zip(split.outputs, (q3, k3, v3)))
                and split.attributes.get_int("axis", 0) in (-1, 2)):
            q3, k3, v3 = split.inputs[0], None, None  # the packed q/k/v projection: GQA splits it itself
        inputs = [q3, k3, v3, k_write.inputs[0], v_write.inputs[0], seqlens_k, total]
        attrs = {"num_heads": num_heads, "kv_num_heads": num_kv_heads}
        scale = attention.attributes.get_float("scale", 0.0)
        if scale:
            attrs["scale"] = scale
        if q_rot is not None:
            for rot in (q_rot, k_rot):
                if rot.inputs[1] is not position_ids or rot.attributes.get_int("interleaved", 0):
                    raise NotApplicable(f"{rot.name}: RoPE not at position_ids, or interleaved")
            inputs += [q_rot.inputs[2], q_rot.inputs[3]]
            attrs.update(do_rotary=1, rotary_interleaved=0)
        gqa = ir.node("GroupQueryAttention", inputs, attributes=attrs, domain=MS, num_outputs=3,
                      name=f"{attention.name}/gqa")
        graph.insert_before(attention, gqa)
        if plain_view:  # the Reshape does nothing: its readers take GQA's output
            _take_over(reshape.outputs[0], gqa.outputs[0])
        else:
            reshape.replace_input_with(0, gqa.outputs[0])
        for old, new in ((k_write.outputs[0], gqa.outputs[1]), (v_write.outputs[0], gqa.outputs[2])):
            new.type, new.shape = old.type, old.shape
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            name, old.name = old.name, None
            new.name = name
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    if tree_mask is not None:
        _drop_tree_input(graph, tree_mask)
    model.opset_imports.setdefault(MS, 1)
    graph.sort()
    return len(attentions)


def _drop_tree_input(graph: ir.Graph, tree_mask: ir.Value) -> None:
    """The decode graph has no tree input: its attention no longer reads the mask, though the exporter may have
    taken the call's size from the mask's shape; those Shape nodes read a [B, T, T] tensor made here instead."""
    users = [use.node for use in tree_mask.uses()]
    if any(node.op_type != "Shape" for node in users):
        raise NotApplicable(f"the tree mask still feeds {sorted({n.op_type for n in users})} after the rewrite")
    if users:
        input_ids = next(v for v in graph.inputs if v.name == "input_ids")
        anchor = next(iter(graph))
        ids_shape = _op(graph, anchor, "Shape", [input_ids], "tree_shape/ids")
        tail = _op(graph, anchor, "Shape", [input_ids], "tree_shape/tokens", start=1)
        shape = _op(graph, anchor, "Concat", [ids_shape, tail], "tree_shape/value", axis=0)
        stand_in = _op(graph, anchor, "Expand", [_const(graph, "tree_shape.true", np.array(True)), shape],
                       "tree_shape/stand_in")
        for node in users:
            node.replace_input_with(0, stand_in)
    graph.inputs.remove(tree_mask)
    graph.sort()


def packed_lookup(model: ir.Model) -> int:
    """The tied INT4 table's lookup (ort_lowering: the rows of the lm_head's packed bytes gathered and unpacked by
    a dozen element-wise nodes) as one ``GatherBlockQuantized``, reading the same bytes through a Reshape to
    [V, K/2] and the same scales. onnxruntime folds that Reshape when it loads the graph, a copy in memory only:
    the file keeps one table, and MatMulNBits prepacks its own layout from the original, which is then freed
    (the same two copies in memory as before). Measured on the bundled draft's INT4 build (3.5 MB, 4 layers):
    a one-token call 7 % faster. Returns how many lookups were replaced."""
    graph = model.graph
    nodes = {n.name: n for n in graph}
    fired = 0
    for out in [n for n in graph if n.op_type == "Reshape" and n.name.endswith(PACKED_LOOKUP)]:
        base = out.name[: -len(PACKED_LOOKUP)] + "/int4"
        rows, scales = nodes.get(f"{base}/rows"), nodes.get(f"{base}/scales")
        if rows is None or scales is None or rows.inputs[1] is not scales.inputs[1]:
            continue
        packed, scale = rows.inputs[0], scales.inputs[0]
        if (packed.const_value is None or scale.const_value is None or packed.const_value.dtype != ir.DataType.UINT8
                or len(packed.shape) != 3 or len(scale.shape) != 2):
            continue
        v, blocks, half = packed.shape
        flat = _op(graph, out, "Reshape", [packed, _const(graph, f"{base}/table_shape", np.array([v, blocks * half], np.int64))],
                   f"{base}/table")
        lookup = ir.node("GatherBlockQuantized", [flat, rows.inputs[1], scale], domain=MS, name=f"{base}/gather_block_quantized",
                         attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": 2 * half, "bits": 4})
        graph.insert_before(out, lookup)
        _take_over(out.outputs[0], lookup.outputs[0])
        fired += 1
    if fired:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
        graph.sort()
    return fired
