"""Quantization passes and TensorRT's Q/DQ rules on graphs: weights, input scaling, rule checker, INT4 storage."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import hf_logits, random_ids
from quant_reference import CALIB, MODES, ref_fp8, ref_int4, ref_int8, step_logits
from trtspec import build, load_engine
from trtspec.builder.tensorrt_check import check_export
from trtspec.quantization import passes, qdq_violations, quantize
from trtspec.quantization.report import QuantizationReport


def weights_of(path) -> dict[str, np.ndarray]:
    """MatMul name -> the [K, N] weight it multiplies by, dequantized in numpy from the graph's initializers."""
    model = onnx.load(str(path / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        w = node.input[1]
        if w in inits:
            out[node.name] = inits[w].astype(np.float32)
        elif w in dq:
            d = dq[w]
            q, s = inits[d.input[0]].astype(np.float32), inits[d.input[1]].astype(np.float32)
            block = next((a.i for a in d.attribute if a.name == "block_size"), 0)
            out[node.name] = q * (np.repeat(s, block, axis=0) if block else s)
    return out


# -- passes on graphs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,fmt", [("int8-wo", "int8"), ("fp8", "fp8"), ("int4-rtn", "int4")])
def test_quantized_weights_in_the_graph_equal_the_reference_quantization(exported, quantized, mode, fmt):
    before = weights_of(exported("llama"))
    after = weights_of(quantized("llama", mode))
    reference = {"int8": ref_int8, "fp8": ref_fp8, "int4": lambda w: ref_int4(w, 32)}[fmt]
    assert set(after) == set(before)
    for name, w in before.items():
        if name == "lm_head":
            np.testing.assert_array_equal(after[name], w)  # stays in float32
        else:
            np.testing.assert_allclose(after[name], reference(w), rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3", "gemma2", "gemma3"])
def test_input_scaling_pass_leaves_the_function_unchanged(exported, tmp_path, arch):
    import onnx_ir as ir

    src = exported(arch)
    model = ir.load(src / "model.onnx")
    report = QuantizationReport("test")
    linears = passes.find_linears(model, report, include_lm_head=True)
    rng = np.random.default_rng(3)
    for group in passes.group_by_activation(linears):
        k = group[0].weight.const_value.shape[0]
        passes.scale_inputs(model, group, rng.uniform(0.25, 4.0, k).astype(np.float32), report, "test")
    out = tmp_path / "scaled"
    out.mkdir()
    ir.save(model, out / "model.onnx")
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["files"] = {}
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "tokenizer").symlink_to(src / "tokenizer")
    ids = random_ids(12, seed=4)
    np.testing.assert_allclose(step_logits(out, ids), step_logits(src, ids), atol=2e-4, rtol=1e-4)
    notes = "\n".join(report.notes)
    if arch == "llama":
        assert "q_proj, layers.0.self_attn.k_proj, layers.0.self_attn.v_proj: folded into" in notes  # the norm
        assert "layers.0.mlp.down_proj: folded into the output columns of layers.0.mlp.up_proj" in notes
        assert "layers.0.self_attn.o_proj: Mul by 1/s inserted" in notes
    elif arch == "gpt2":
        assert "layers.0.attn.c_attn: folded into" in notes and "(LayerNormalization scale and bias)" in notes
    else:  # Phi-3's fused qkv_proj; Gemma's (1 + w) norms fold too
        assert "layers.0.self_attn.q" in notes and "folded into" in notes


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_satisfies_tensorrt_rules_and_the_step_contract(quantized, exported, mode):
    out = quantized("llama", mode)
    model = onnx.load(str(out / "model.onnx"))
    assert qdq_violations(model) == []
    assert check_export(out) == []  # TensorRT support + the step-graph contract
    manifest = json.loads((out / "manifest.json").read_text())
    q = manifest["quantization"]
    assert q["mode"] == mode and q["block_size"] == (32 if mode.startswith("int4") else None)
    if mode in CALIB:
        assert q["calibration"]["samples"] == CALIB[mode] and len(q["calibration"]["tokens_sha256"]) == 64
        assert q["calibration"]["file"].startswith("default")
    else:
        assert q["calibration"] is None
    report = json.loads((out / "quantization_report.json").read_text())
    assert report["summary"]["quantized"] == 14 and [e["name"] for e in report["entries"] if e["action"] == "skipped"] == ["lm_head"]
    # the KV cache I/O is untouched
    src = onnx.load(str(exported("llama") / "model.onnx"))
    assert [(i.name, i.type) for i in model.graph.input] == [(i.name, i.type) for i in src.graph.input]
    assert [(o.name, o.type) for o in model.graph.output] == [(o.name, o.type) for o in src.graph.output]


def test_int4_weights_are_stored_packed_so_the_file_shrinks(quantized, exported):
    sizes = {m: (quantized("llama", m) / "model.onnx").stat().st_size for m in ("int8-wo", "int4-rtn")}
    fp32 = (exported("llama") / "model.onnx").stat().st_size
    report = json.loads((quantized("llama", "int4-rtn") / "quantization_report.json").read_text())["summary"]
    # MatMul weights: 4 bytes -> 1/2 byte per value (+ one fp32 scale per 32 values)
    assert report["matmul_weight_bytes_after"] == pytest.approx(report["matmul_weight_bytes_before"] * (0.5 + 4 / 32) / 4, rel=0.15)
    assert fp32 - sizes["int4-rtn"] == pytest.approx(report["matmul_weight_bytes_before"] - report["matmul_weight_bytes_after"], rel=0.05)
    assert sizes["int4-rtn"] < sizes["int8-wo"] < fp32


# -- the rule checker ----------------------------------------------------------------------------------


def _qdq_graph(quantized):
    return onnx.load(str(quantized("llama", "int8-sq") / "model.onnx"))


def test_rule_checker_rejects_asymmetric_zero_points(quantized):
    model = _qdq_graph(quantized)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    zp = next(i for i in model.graph.initializer if i.name == q.input[2])
    zp.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), zp.name))
    problems = qdq_violations(model)
    assert len(problems) == 2  # the Q and its DQ share the zero point
    assert all("nonzero zero point (asymmetric quantization)" in p for p in problems)


def test_rule_checker_rejects_scales_computed_at_run_time(quantized):
    model = _qdq_graph(quantized)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    model.graph.node.insert(0, helper.make_node("Abs", [q.input[1]], ["scale_at_run_time"], name="abs_scale"))
    q.input[1] = "scale_at_run_time"
    assert qdq_violations(model) == [
        f"{q.name}: QuantizeLinear scale 'scale_at_run_time' comes from Abs node 'abs_scale'; "
        "TensorRT needs constant scales (an initializer)"
    ]


def test_rule_checker_rejects_int4_activations_unpacked_int4_and_per_channel_activation_scales(quantized):
    model = onnx.load(str(quantized("llama", "int4-rtn") / "model.onnx"))
    bad = copy.deepcopy(model)
    matmul = next(n for n in bad.graph.node if n.op_type == "MatMul" and n.name == "layers.0.self_attn.o_proj")
    bad.graph.initializer.extend([helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
                                  helper.make_tensor("zp4", TensorProto.INT4, [], [0]),
                                  helper.make_tensor("s_channel", TensorProto.FLOAT, [64], [0.1] * 64),
                                  helper.make_tensor("zp8", TensorProto.INT8, [64], [0] * 64)])
    bad.graph.node.extend([
        helper.make_node("QuantizeLinear", [matmul.input[0], "s", "zp4"], ["x4"], name="q_int4_activation"),
        helper.make_node("DequantizeLinear", ["x4", "s", "zp4"], ["x4_dq"], name="dq_int4_activation"),
        helper.make_node("QuantizeLinear", [matmul.input[0], "s_channel", "zp8"], ["x8"], name="q_per_channel", axis=2),
        helper.make_node("DequantizeLinear", ["x8", "s_channel", "zp8"], ["x8_dq"], name="dq_per_channel", axis=2),
    ])
    problems = qdq_violations(bad)
    assert [p.split(":")[0] for p in problems] == ["q_int4_activation", "dq_int4_activation", "q_per_channel"]
    assert "INT4 QuantizeLinear; TensorRT takes INT4 only as weight-only" in problems[0]
    assert "not a constant weight; INT4 is weight-only" in problems[1]
    assert "quantized per tensor (a scalar scale)" in problems[2]

    unpacked = copy.deepcopy(model)
    init = next(i for i in unpacked.graph.initializer if i.data_type == TensorProto.INT4)
    values = numpy_helper.to_array(init).astype(np.int32).reshape(-1).tolist()
    init.ClearField("raw_data")
    init.int32_data.extend(values)  # one value per int32: valid ONNX, not packed
    problems = qdq_violations(unpacked)
    assert len(problems) == 1 and "is not stored packed" in problems[0]


def test_rule_checker_rejects_a_quantize_without_its_dequantize(quantized):
    model = _qdq_graph(quantized)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    model.graph.node.append(helper.make_node("Cast", [q.output[0]], ["q_as_float"], to=TensorProto.FLOAT, name="cast_q"))
    problems = qdq_violations(model)
    assert problems == [f"{q.name}: QuantizeLinear output {q.output[0]!r} does not feed only DequantizeLinear; TensorRT needs Q/DQ pairs"]
    assert dq is not None


def test_rule_checker_rejects_a_blocked_int4_weight_with_a_partial_block():
    q = helper.make_tensor("q", TensorProto.INT4, [48, 4], bytes(48 * 4 // 2), raw=True)  # packed, as trtspec writes
    scale = numpy_helper.from_array(np.ones((2, 4), np.float32), "s")
    graph = helper.make_graph([helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=32, name="dq"),
                               helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [q, scale])
    (problem,) = qdq_violations(helper.make_model(graph))
    assert "has 48 rows along its blocked axis, not a multiple of block_size 32" in problem


# -- INT4 lowering: AWQ's scales, padded blocks, float16 scales ----------------------------------------


def test_awq_scales_only_inputs_whose_scale_folds_into_the_op_before(quantized):
    """The norms' outputs (q/k/v, gate/up) and up_proj's product (down_proj) take AWQ's 1/s into a constant;
    o_proj's input, the attention output, would need a Mul per call: it gets clipping only, no Mul."""
    out = quantized("llama", "int4-awq")
    proto = onnx.load(str(out / "model.onnx"))
    assert not [n.name for n in proto.graph.node if n.op_type == "Mul" and "input_inv_scale" in n.name]
    notes = json.loads((out / "quantization_report.json").read_text())["notes"]
    assert [n for n in notes if n.startswith("AWQ scale skipped")] == [
        f"AWQ scale skipped on the input of layers.{i}.self_attn.o_proj: 1/s would not fold into the op making it "
        "(a Mul per call); clipping only" for i in range(2)]
    assert any("folded into" in n and "down_proj" in n for n in notes)


def test_a_block_size_that_does_not_divide_k_pads_the_last_block_and_the_input(quantized, model_dir):
    """Block 128 on the tiny model (K = 64 for q/k/v/o/gate/up, 128 for down_proj): every weight is quantized, the
    K = 64 ones in one block zero-padded to 128 with a Pad of their input (TensorRT's rules: whole blocks); the
    Q/DQ graph computes the HF model with reference-quantized weights; the onnxruntime build drops the Pads into
    ragged MatMulNBits and stays close to it."""
    import torch
    from transformers import AutoModelForCausalLM

    out = quantized("llama", "int4-rtn", block_size=128)
    entries = json.loads((out / "quantization_report.json").read_text())["entries"]
    assert [e["name"] for e in entries if e["action"] != "quantized"] == ["lm_head"]  # tied: hidden 64, whole blocks only
    assert "the last one 64 wide (zero-padded to 128, the input too)" in next(
        e["detail"] for e in entries if e["name"] == "layers.0.self_attn.q_proj")
    proto = onnx.load(str(out / "model.onnx"))
    assert qdq_violations(proto) == []
    # one Pad per padded activation, shared by the MatMuls reading it: q/k/v's input, o_proj's, gate/up's, per layer
    assert sum(n.op_type == "Pad" for n in proto.graph.node) == 6
    ids = random_ids(16, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w = module.weight.numpy().T
                np.testing.assert_array_equal(weights_of(out)[name.removeprefix("model.")][w.shape[0]:], 0.0)
                module.weight.copy_(torch.from_numpy(ref_int4(w, 128).T))
    qdq = step_logits(out, ids)
    np.testing.assert_allclose(qdq, hf_logits(hf, ids), atol=2e-4, rtol=1e-4)

    fused = build(out, out.parent / "ragged-fused")
    made = json.loads((fused / "manifest.json").read_text())["build"]
    assert made["rewrites"]["ragged_int4"] == 6 and made["kernels"] == {"MatMulNBits": 10}
    engine = onnx.load(str(fused / "model.onnx"), load_external_data=False)
    assert not [n for n in engine.graph.node if n.op_type == "Pad"]
    got = step_logits(out, ids, fuse_qdq=True)
    assert np.abs(got - qdq).max() / np.abs(qdq).max() < 0.05  # accuracy_level 4: int8 activations per block


@pytest.mark.parametrize("mode", ["int8-sq", "int4-awq"])
def test_float16_exports_get_float16_scales_and_pass_the_rules(exported, tmp_path, mode):
    """The TensorRT path is float16: scales and inserted constants follow the graph's dtype."""
    src = exported("llama", dtype="float16")
    out = quantize(src, tmp_path / mode, mode=mode, calib_samples=4, **({"block_size": 32} if mode == "int4-awq" else {}))
    model = onnx.load(str(out / "model.onnx"))
    assert qdq_violations(model) == [] and check_export(out) == []
    inits = {i.name: i for i in model.graph.initializer}
    scales = [inits[n.input[1]] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert scales and all(s.data_type == TensorProto.FLOAT16 for s in scales)
    before, after = weights_of(src), weights_of(out)
    if mode == "int4-awq":  # the weights carry AWQ's scale, so compare what the MatMul computes on average
        assert all(np.isfinite(w).all() for w in after.values())
    else:
        assert set(after) == set(before)


# -- tied INT4 embeddings ------------------------------------------------------------------------------


def _initializers(path) -> dict:
    model = onnx.load(str(path / "model.onnx"))
    return {i.name: i for i in model.graph.initializer}, model


def _prefill_then_decode(engine, ids):
    """Logits [T, V]: a prefill of all but the last token, then one decode call for the last."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    head = engine.forward(ids[None, :-1], np.arange(n - 1)[None])[0].copy()
    last = engine.forward(ids[None, -1:], np.array([[n - 1]]))[0].copy()
    return np.concatenate([head, last])


def test_tied_int4_stores_the_shared_weight_once_and_matches_the_reference(quantized, model_dir):
    """--quantize-lm-head on a tied model: one INT4 table feeds the embedding and the lm_head (TensorRT's
    Q/DQ form, `trtspec check` passes); the graph equals the HF model whose Linear weights and tied table
    were quantized by the reference, in prefill and decode."""
    import torch
    from transformers import AutoModelForCausalLM

    out = quantized("llama", "int4-rtn", quantize_lm_head=True)
    inits, model = _initializers(out)
    hf = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    v, h = hf.model.embed_tokens.weight.shape
    assert not [n for n, i in inits.items() if tuple(i.dims) == (v, h) and i.data_type == TensorProto.FLOAT]
    (table,) = [n for n, i in inits.items() if tuple(i.dims) == (v, h)]
    assert inits[table].data_type == TensorProto.INT4 and len(inits[table].raw_data) == v * h // 2
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == table)
    users = sorted(n.op_type for n in model.graph.node if dq.output[0] in n.input)
    assert users == ["Gather", "Transpose"]
    assert qdq_violations(model) == [] and check_export(out) == []
    entries = {e["name"]: e for e in json.loads((out / "quantization_report.json").read_text())["entries"]}
    embedding = entries["embedding (embed.weight)"]
    assert embedding["action"] == "quantized" and embedding["bytes_before"] == v * h * 4
    assert embedding["bytes_after"] == v * h // 2 + v * (h // 32) * 4
    assert entries["lm_head"]["action"] == "quantized" and "tied to the embedding" in entries["lm_head"]["detail"]

    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(torch.from_numpy(ref_int4(module.weight.numpy().T, 32).T))
        table_ref = ref_int4(hf.model.embed_tokens.weight.numpy().T, 32).T  # the head's [H, V], blocks along H
        hf.model.embed_tokens.weight.copy_(torch.from_numpy(np.ascontiguousarray(table_ref)))
    ids = random_ids(16, seed=11)
    engine = load_engine(build(out, out.parent / "tied-unfused", fuse_qdq=False))
    np.testing.assert_allclose(_prefill_then_decode(engine, ids), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_tied_int4_engine_runs_matmul_nbits_and_an_exact_packed_lookup(quantized):
    import onnx_ir as ir
    import onnxruntime as ort

    from trtspec.builder.ort_lowering import lower

    out = quantized("llama", "int4-rtn", quantize_lm_head=True)
    fused = build(out, out.parent / "tied-fused")
    made = json.loads((fused / "manifest.json").read_text())["build"]
    # 14 linears in 10 MatMulNBits (q/k/v merged) and the tied lm_head
    assert made["rewrites"]["tied_int4"] == 1 and made["kernels"] == {"MatMulNBits": 11}
    ids = np.asarray(random_ids(12, seed=12))
    a = _prefill_then_decode(load_engine(fused), ids)
    b = _prefill_then_decode(load_engine(build(out, out.parent / "tied-plain", fuse_qdq=False)), ids)
    assert np.abs(a - b).max() / np.abs(b).max() < 0.05  # MatMulNBits' accuracy_level 4 rounds activations
    # the embedding rows gathered from the packed table equal the DequantizeLinear's rows exactly
    model = ir.load(out / "model.onnx")
    emb = next(n for n in model.graph if n.op_type == "Gather" and n.inputs[0].producer() is not None
               and n.inputs[0].producer().op_type == "DequantizeLinear").outputs[0]
    model.graph.outputs.append(emb)
    name, plain = emb.name, ir.to_proto(model)
    lower(model, fuse_qdq=True)
    feeds = {"input_ids": ids[None], "position_ids": np.arange(12)[None]}
    for cache in plain.graph.input[2:]:
        feeds[cache.name] = np.zeros([1] + [d.dim_value for d in cache.type.tensor_type.shape.dim[1:]], np.float32)
    got = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run([name], feeds)[0]
           for m in (plain, ir.to_proto(model))]
    np.testing.assert_array_equal(got[0], got[1])
    # the decode graph looks the rows up with one GatherBlockQuantized over the head's packed bytes, exactly
    decode = ir.load(fused / "decode.onnx")
    (gbq,) = [n for n in decode.graph if n.op_type == "GatherBlockQuantized"]
    (head,) = [n for n in decode.graph if n.op_type == "MatMulNBits" and n.inputs[1] is gbq.inputs[0].producer().inputs[0]]
    assert gbq.inputs[2] is head.inputs[2] and head.outputs[0].name == "logits"
    assert not [n for n in decode.graph if n.op_type in ("BitShift", "BitwiseAnd")]
    decode.graph.outputs.append(gbq.outputs[0])
    ir.save(decode, fused / "probe.onnx")  # beside the weights file it references
    sess = ort.InferenceSession(str(fused / "probe.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run([gbq.outputs[0].name], feeds)[0], got[0])
