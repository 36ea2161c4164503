"""The build of a GGUF export for onnxruntime: each linear layer on the file's own 4- and 8-bit blocks
(exporter/gguf.py keeps them beside the float graph), as MatMulNBits over its codes and scales, so the engine
computes with the file's weights exactly; the types without an exact MatMulNBits form quantized to 4 bits here.
The general rewrites every build gets are in ort_lowering.py; `build` (builder/onnxruntime.py) calls
``gguf_weights`` before them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from pathlib import Path

import numpy as np
import onnx_ir as ir

from ..engine_contract import MATMUL_NBITS_ACCURACY_LEVEL
from ..int4_packing import minimum_digits, pack_codes, pack_uint4, pack_zero_points
from .ort_lowering import MS, _const, _int64, _op, _take_over

log = logging.getLogger("trtspec.build")

# Layers of one input packed into one MatMulNBits (and one minimums' term), as packed_qkv packs float weights.
# gate/up only where they have minimums: packed, two MatMulNBits cost about what they cost apart (packed_gate_up),
# but one minimums' term is saved.
GGUF_PACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# MatMulNBits' accuracy level for the 4-bit layers: 0 computes in float32 from the exact weights. Level 4 (int8
# activations, as llama.cpp's Q8 dot products) is faster, but an int8 rounding turns the float noise between a
# one-token and a several-token call (1e-7: onnxruntime's one-row GEMM kernel) into logit differences of 1-2 over 30
# layers. `build --int8-activations` chooses level 4 and runs every call with 2 tokens or more on one graph, which
# makes each row's logits the same in every call (engine_contract.EXACT_MIN_CALL_TOKENS); it stays an option because
# int8 activations move the predictions further from the float weights' (benchmarks/bench_gguf_quality.py: top-1
# agreement 0.974 against 0.986 at level 0; 0.956 before the minimums were centred, see ``centred``). SmolLM2's
# decode call: 10.0 ms at level 0, 8.6 at level 4 (one pad token; 7.9 on its decode graph); a 5-token call 23.9 vs
# 12.8 ms (benchmarks/bench_gguf_kernels.py). 8-bit MatMulNBits at level 0 is a float32 fallback 260x slower here:
# the 8-bit head keeps level 4 (it rounds its input once, nothing after it amplifies that), and other 8-bit layers
# stay float MatMuls of the same weights.
GGUF_ACCURACY_LEVEL = 0


def _gguf_weight(graph: ir.Graph, node: ir.Node) -> ir.Value | None:
    """The constant (or Transpose of a constant) a linear MatMul reads, to drop once replaced."""
    w = node.inputs[1]
    if w.const_value is not None:
        return w
    producer = w.producer()
    return producer.outputs[0] if producer is not None and producer.op_type == "Transpose" else None


def _block_sums(graph: ir.Graph, anchor: ir.Node, x: ir.Value, k: int, cache: dict) -> ir.Value:
    """x [B, T, K] -> the sum of each block of 32 along K [B, T, K/32]: a Reshape to [B, T, K/32, 32] and a
    ReduceSum. A MatMul with a 0/1 block matrix did the same, but read that [K, K/32] matrix, one for each layer
    (12.5 MB a token over SmolLM2's 30 layers): the default build's decode call takes 0.92-0.95x the time this way
    (in one process, alternating with the same graph otherwise)."""
    if x.shape is not None and len(x.shape) != 3:
        raise ValueError(f"{anchor.name}: a GGUF layer's input {x.name} has shape {x.shape}, not [batch, tokens, {k}]")
    if ("sums", id(x)) not in cache:
        if ("shape", k) not in cache:  # the shape constant, one for each K, and the axis, one
            cache["shape", k] = _int64(graph, f"gguf.blocks.{k}", [0, 0, k // 32, 32])
        if ("axis",) not in cache:
            cache["axis",] = _int64(graph, "gguf.last_axis", [-1])
        blocks = _op(graph, anchor, "Reshape", [x, cache["shape", k]], f"{anchor.name}/blocks")
        cache["sums", id(x)] = _op(graph, anchor, "ReduceSum", [blocks, cache[("axis",)]], f"{anchor.name}/block_sums",
                                   keepdims=0)
    return cache["sums", id(x)]


def centred(scales: np.ndarray, minimums: np.ndarray, zero_point: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks d * (q - z0) + m (codes q in 0..15) -> the same weights as d * (q - z) + r: (z [N, G] uint8, r [N, G]),
    z = z0 + j with j the integer nearest -m / d that keeps z in 0..15, and r = m + d * j, exactly (a block where
    that sum rounds keeps j = 0). Q4_1's m is about -7.5 d, so the term the block sums carry shrinks about 30x
    (SmolLM2: mean |r| / |m| = 0.033), and with it the error of any rounding of those sums (the int8 activations'
    ``minimum_digits`` form)."""
    d, m = scales.astype(np.float64), minimums.astype(np.float64)
    j = np.where(d != 0, np.clip(np.rint(-m / np.where(d == 0, 1, d)), -zero_point, 15 - zero_point), 0)
    r = (minimums + scales * j.astype(np.float32)).astype(np.float32)
    exact = r.astype(np.float64) - d * j == m
    return (zero_point + np.where(exact, j, 0)).astype(np.uint8), np.where(exact, r, minimums).astype(np.float32)


def _padded_block_sums(graph: ir.Graph, anchor: ir.Node, x: ir.Value, k: int, padded: int, cache: dict) -> ir.Value:
    """x [..., K] -> its sums over each block of 32 along K, padded with zeros to `padded` [..., padded]: one
    MatMul with a 0/1 matrix [K, padded], one constant for every layer of that K (it stays in cache)."""
    if ("indicator", k, padded) not in cache:
        indicator = np.zeros((k, padded), np.float32)
        indicator[np.arange(k), np.arange(k) // 32] = 1.0
        cache["indicator", k, padded] = _const(graph, f"gguf.block_sums.{k}", indicator)
    if ("padded sums", id(x), padded) not in cache:
        cache["padded sums", id(x), padded] = _op(graph, anchor, "MatMul", [x, cache["indicator", k, padded]],
                                                  f"{anchor.name}/block_sums")
    return cache["padded sums", id(x), padded]


def _family(name: str, minimums: bool) -> tuple[int, int] | None:
    """(which GGUF_PACKED family, the position in it) of a layer that packs with others, else None."""
    for f, family in enumerate(GGUF_PACKED):
        for i, suffix in enumerate(family):
            if name.endswith(suffix) and (f == 0 or minimums):
                return f, i
    return None


def gguf_linears(model: ir.Model, arrays, kept: dict[str, dict], accuracy_level: int = GGUF_ACCURACY_LEVEL
                 ) -> dict[str, list[str]]:
    """Each linear layer a GGUF export kept blocks for -> ``MatMulNBits`` over the file's own codes and scales
    (block 32). Where the type has a per-block minimum m (Q4_1, Q4_K), the block is d * (q - z) + r (``centred``:
    z the integer zero point nearest -m / d, r = m + d * z), and the remainder's term sum_i x_i r over each block
    is added from the block sums of x:
    - with int8 activations (level 4), r as 4-bit blocks of the same kernel, whose input is x followed by D copies
      of its block sums (``minimum_digits``): no node reads float r, and the kernel's threads read the digits with
      the codes. SmolLM2's decode call (2 tokens a row) takes 0.90-0.93x the time of the float term below, at
      100-300 tokens of context (in one process, alternating), and the int8 rounding of the block sums costs
      little because r is small (bench_gguf_quality.py: top-1 agreement 0.9743 against 0.9748 with the float term);
    - at level 0, a float MatMul ``block_sums(x) @ R^T`` and an Add: there the digits' wider K cost more than the
      float term (1.03x the call time in the same kernel, 1.04x as a MatMulNBits of their own).
    Either way the weights the engine computes with are d * q + m exactly. q/k/v of one input become one
    MatMulNBits and a Split (one kernel launch instead of three). Returns {MatMulNBits node: the layers it
    computes, in order}."""
    graph = model.graph
    # 8-bit layers have no fast float-activation kernel: at level 0 they stay the export's float MatMul (the same
    # weights, dequantized), except the head, which rounds only its input (see GGUF_ACCURACY_LEVEL)
    found = [n for n in graph if n.op_type == "MatMul" and n.domain == "" and n.name in kept
             and (kept[n.name]["bits"] == 4 or accuracy_level == MATMUL_NBITS_ACCURACY_LEVEL or n.name == "lm_head")]
    groups: dict[tuple, list[ir.Node]] = {}
    for node in found:
        info = kept[node.name]
        family = _family(node.name, info["minimums"])
        key = ((id(node.inputs[0]), family[0], info["bits"], info.get("block", 32), info["zero_point"],
                info["minimums"]) if family else (id(node),))
        groups.setdefault(key, []).append(node)
    sums: dict[tuple, ir.Value] = {}  # the block sums' nodes and constants, by what they are of
    made = {}
    for group in groups.values():
        group.sort(key=lambda n: (_family(n.name, kept[n.name]["minimums"]) or (0, 0))[1])
        info, x, base = kept[group[0].name], group[0].inputs[0], group[0].name
        block = info.get("block", 32)  # Q6_K's scales are per 16 weights; every other type's per 32
        b = np.concatenate([arrays[f"{n.name}/B"] for n in group])
        scales = np.concatenate([arrays[f"{n.name}/scales"] for n in group])
        n_out, k = b.shape[0], b.shape[1] * block
        zp = np.full((n_out, k // block), info["zero_point"], np.uint8) if info["bits"] == 4 else None
        anchor = min(group, key=list(graph).index)
        digits = remainders = None
        if info["minimums"]:
            minimums = np.concatenate([arrays[f"{n.name}/minimums"] for n in group])  # [N, K/32]
            # 8-bit codes of a 5-bit type (Q5_1, Q5_K): the minimums' float term, uncentred
            zp, remainders = centred(scales, minimums, info["zero_point"]) if info["bits"] == 4 else (zp, minimums)
            if accuracy_level == MATMUL_NBITS_ACCURACY_LEVEL and info["bits"] == 4:
                digits = minimum_digits(remainders)
        if digits is not None:  # the minimums as further 4-bit blocks of the same kernel, over the block sums
            codes, digit_scales, d = digits
            padded = codes.shape[1] // d
            x = _op(graph, anchor, "Concat", [x] + [_padded_block_sums(graph, anchor, x, k, padded, sums)] * d,
                    f"{base}/gguf_with_block_sums", axis=-1)
            b = np.concatenate([b, pack_codes(codes, 4, 32)], axis=1)
            scales = np.concatenate([scales, digit_scales], axis=1)
            zp = np.concatenate([zp, np.full(digit_scales.shape, 8, np.uint8)], axis=1)
        inputs = [x, _const(graph, f"{base}/gguf.B", b), _const(graph, f"{base}/gguf.scales", scales.reshape(-1))]
        if zp is not None and (zp != 8).any():  # MatMulNBits' default zero point is 2^(bits-1)
            inputs.append(_const(graph, f"{base}/gguf.zero_points", pack_zero_points(zp)))
        y = _op(graph, anchor, "MatMulNBits", inputs, f"{base}/gguf", domain=MS, K=b.shape[1] * block, N=n_out,
                bits=info["bits"], block_size=block,
                accuracy_level=accuracy_level if info["bits"] == 4 else MATMUL_NBITS_ACCURACY_LEVEL)
        if remainders is not None and digits is None:
            r = _const(graph, f"{base}/gguf.minimums", np.ascontiguousarray(remainders.T))
            y = _op(graph, anchor, "Add", [y, _op(graph, anchor, "MatMul", [_block_sums(graph, anchor, x, k, sums), r],
                                                  f"{base}/gguf_minimums")], f"{base}/gguf_plus_minimums")
        outs = [y]
        if len(group) > 1:
            split = ir.node("Split", [y, _int64(graph, f"{base}/gguf.sizes", [arrays[f"{n.name}/B"].shape[0] for n in group])],
                            attributes={"axis": -1}, num_outputs=len(group), name=f"{base}/gguf_split")
            graph.insert_before(anchor, split)
            outs = list(split.outputs)
        for node, out in zip(group, outs):
            w = _gguf_weight(graph, node)
            _take_over(node.outputs[0], out)
            graph.remove(node, safe=True)
            if w is not None and not w.uses():
                if w.producer() is not None:
                    graph.remove(w.producer(), safe=True)
                else:
                    graph.initializers.pop(w.name, None)
        made[f"{base}/gguf"] = [n.name for n in group]
    return made


def requantize_linears(model: ir.Model, names, accuracy_level: int = GGUF_ACCURACY_LEVEL) -> dict[str, float]:
    """Linear layers a GGUF export could not keep (their type has no exact MatMulNBits form) -> 4-bit blocks of 32
    of our own (round to nearest, symmetric): {layer: relative L2 error of its weights}."""
    from ..quantization.numerics import dequantize, int4_blocked

    graph, errors = model.graph, {}
    for node in [n for n in graph if n.op_type == "MatMul" and n.domain == "" and n.name in names]:
        w = _gguf_weight(graph, node)
        if w is None or w.const_value is None or len(w.shape) != 2 or w.shape[0] % 32:
            continue  # a tied head (Transpose) or ragged K: left in float
        wk = w.const_value.numpy().astype(np.float32)  # [K, N]
        q, scale = int4_blocked(wk, 32)
        errors[node.name] = float(np.linalg.norm(dequantize(q, scale, 32) - wk) / max(np.linalg.norm(wk), 1e-30))
        k, n = wk.shape
        y = _op(graph, node, "MatMulNBits", [node.inputs[0], _const(graph, f"{node.name}/int4.B", pack_uint4(
            q.astype(np.int8).T, 32)), _const(graph, f"{node.name}/int4.scales", np.ascontiguousarray(scale.T).reshape(-1))],
                f"{node.name}/int4", domain=MS, K=k, N=n, bits=4, block_size=32, accuracy_level=accuracy_level)
        _take_over(node.outputs[0], y)
        graph.remove(node, safe=True)
        graph.initializers.pop(w.name, None)
    return errors


def gguf_weights(model, export_dir: Path, export_manifest: dict, int8_activations: bool) -> dict:
    """A GGUF export's linear layers on the file's own blocks (gguf_linears), the others quantized to 4 bits here
    (requantize_linears); returns the engine manifest's "quantization" section."""
    section = export_manifest["gguf"]
    level = MATMUL_NBITS_ACCURACY_LEVEL if int8_activations else GGUF_ACCURACY_LEVEL
    kept, not_kept = section.get("kept", {}), section.get("not_kept", {})
    with np.load(export_dir / section["blocks"]) if kept else contextlib.nullcontext({}) as arrays:
        made = gguf_linears(model, arrays, kept, accuracy_level=level)
    fired = sum(map(len, made.values()))
    done = {layer for layers in made.values() for layer in layers}
    in_float = sorted(set(kept) - done)  # 8-bit layers without int8 activations: float MatMul, the same weights
    errors = requantize_linears(model, set(not_kept), accuracy_level=level)
    types = collections.Counter(info["type"] for info in kept.values())
    log.info("GGUF blocks: %d linear layers on the file's own codes (%s)%s%s", fired,
             ", ".join(f"{k} x{v}" for k, v in sorted(types.items())) or "none",
             f"; {len(in_float)} 8-bit layers as float MatMul (pass --int8-activations for MatMulNBits)"
             if in_float else "",
             f"; {len(errors)} quantized to 4 bits here (relative weight error up to {max(errors.values()):.2%})"
             if errors else "")
    names = [node.name for node in model.graph]
    minimums = {"4-bit blocks over the block sums": sum(n.endswith("/gguf_with_block_sums") for n in names),
                "float MatMul over the block sums": sum(n.endswith("/gguf_minimums") for n in names)}
    return {"mode": "gguf", "block_size": 32, "weights": dict(types), "activations": None,
            "kept": fired, "requantized": errors, "float": in_float, "minimums": minimums,
            "matmul_nbits_accuracy_level": {"4-bit": level, "8-bit": MATMUL_NBITS_ACCURACY_LEVEL},
            "packed": {k: v for k, v in made.items() if len(v) > 1}}
