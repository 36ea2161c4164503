"""The TensorRT backend: profile plan, static compatibility check, aliasing/binding/version logic (all on CPU).

Tests marked ``tensorrt`` need TensorRT and an NVIDIA GPU and skip elsewhere.
Nothing else here runs TensorRT: FakeTensorRT below is a recording stand-in
used only to test how our plan is handed to the builder API.
"""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from trtspec import ArtifactError, BackendUnavailableError, CapacityError, build, load_engine
from trtspec.builder.tensorrt import _add_profiles, _load_timing_cache, _save_timing_cache, network_flags
from trtspec.builder.tensorrt_check import check_export, tensorrt_violations
from trtspec.builder.tensorrt_plan import profile_plan
from trtspec.cli import main
from trtspec.engine_contract import is_static, select_profile
from trtspec.engines.tensorrt import call_bindings, engine_aliases
from trtspec.engines.tensorrt_compat import check_plan_compatible
from trtspec.manifest import ENGINE_FORMAT, MANIFEST, atomic_artifact, sha256_file

from conftest import ARCHITECTURES, MAX_BATCH, S_MAX

# The llama tiny model's manifest section, as the export writes it (conftest: S_MAX 64, MAX_BATCH 3).
MODEL = {
    "vocab_size": 336, "num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "max_seq_len": 64, "max_batch": 3,
    "dtype": "float32",
    "kv_aliases": {f"present_{kv}_{i}": f"past_{kv}_{i}" for i in range(2) for kv in ("key", "value")},
}


def _tensorrt_or_skip():
    try:
        import tensorrt
    except Exception as e:
        pytest.skip(f"needs TensorRT and an NVIDIA GPU; `import tensorrt` failed: {e}")
    return tensorrt


# -- profile plan -----------------------------------------------------------------------------


def test_plan_has_prefill_decode_and_one_verify_profile_per_size():
    plan = profile_plan(MODEL, max_prefill=32, verify_tokens=[8, 2, 6, 4])
    assert [p["name"] for p in plan["profiles"]] == ["prefill", "decode", "verify_2", "verify_4", "verify_6", "verify_8"]
    assert plan["verify_tokens"] == [2, 4, 6, 8]
    prefill, decode, verify4 = plan["profiles"][0], plan["profiles"][1], plan["profiles"][3]
    assert prefill["shapes"]["input_ids"] == {"min": [1, 1], "opt": [3, 32], "max": [3, 32]}
    assert decode["shapes"]["position_ids"] == {"min": [1, 1], "opt": [3, 1], "max": [3, 1]}
    assert verify4["shapes"]["input_ids"] == {"min": [1, 4], "opt": [3, 4], "max": [3, 4]}
    assert verify4["shapes"]["past_value_1"] == {"min": [1, 4, 64, 16], "opt": [3, 4, 64, 16], "max": [3, 4, 64, 16]}
    assert sorted(verify4["shapes"]) == sorted(["input_ids", "position_ids", *MODEL["kv_aliases"].values()])
    assert [is_static(p) for p in plan["profiles"]] == [False, True, True, True, True, True]


def test_plan_buffers_are_the_cache_and_the_largest_logits_call():
    buffers = profile_plan(MODEL, max_prefill=32, verify_tokens=[2, 4, 6, 8])["buffers"]
    assert buffers["cache_shape"] == [3, 4, 64, 16]
    assert buffers["cache_tensor_bytes"] == 4 * 3 * 4 * 64 * 16 == 49152
    assert buffers["num_cache_tensors"] == 4 and buffers["cache_bytes_total"] == 4 * 49152
    assert buffers["logits_shape"] == [3, 32, 336] and buffers["logits_bytes"] == 4 * 3 * 32 * 336
    assert buffers["token_buffer_elements"] == 3 * 32


def test_plan_defaults_and_other_option_sets():
    default = profile_plan(MODEL)
    assert default["max_prefill"] == 64 and default["max_batch"] == 3
    assert default["verify_tokens"] == list(range(2, 10))
    assert default["buffers"]["logits_shape"] == [3, 64, 336]
    # a verify size above max_prefill sizes the logits buffer
    small = profile_plan(MODEL, max_prefill=4, verify_tokens=[9], max_batch=1)
    assert small["buffers"]["logits_shape"] == [1, 9, 336]
    assert small["profiles"][2]["shapes"]["past_key_0"]["max"] == [1, 4, 64, 16]
    # no verify sizes: prefill and decode only (plain decoding)
    assert [p["name"] for p in profile_plan(MODEL, verify_tokens=[])["profiles"]] == ["prefill", "decode"]
    half = profile_plan({**MODEL, "dtype": "float16"}, max_prefill=32, verify_tokens=[5])["buffers"]
    assert half["cache_tensor_bytes"] == 2 * 3 * 4 * 64 * 16 and half["logits_bytes"] == 2 * 3 * 32 * 336


@pytest.mark.parametrize(
    "options, message",
    [
        ({"verify_tokens": [1, 4]}, "T = 1 is the decode profile"),
        ({"verify_tokens": [65]}, "at most the KV cache capacity 64"),
        ({"verify_tokens": ["4"]}, "must be an integer"),
        ({"max_prefill": 0}, "max_prefill is 0"),
        ({"max_prefill": 65}, "cannot write more than the KV cache's 64 positions"),
        ({"max_batch": 4}, "re-export with --max-batch 4"),
    ],
)
def test_plan_options_are_validated_with_what_to_do(options, message):
    with pytest.raises(ValueError, match=message):
        profile_plan(MODEL, **options)


def test_plan_refuses_a_cache_dtype_tensorrt_cannot_update():
    with pytest.raises(ValueError, match="Re-export with --dtype float16"):
        profile_plan({**MODEL, "dtype": "int8"})


def test_each_call_shape_goes_to_its_profile():
    plan = profile_plan(MODEL, max_prefill=32, verify_tokens=[2, 4, 6, 8])
    assert select_profile(plan, 1, 1) == 1
    assert select_profile(plan, 3, 4) == 3
    assert select_profile(plan, 2, 8) == 5
    assert select_profile(plan, 2, 5) == 0  # not a verify size: the dynamic prefill profile
    assert select_profile(plan, 3, 32) == 0
    with pytest.raises(CapacityError, match="rebuild with --max-prefill 33"):
        select_profile(plan, 1, 33)
    with pytest.raises(CapacityError, match="built for 3"):
        select_profile(plan, 4, 1)


# -- static TensorRT check ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_exported_graphs_of_every_architecture_pass_the_check(exported, arch):
    problems = check_export(exported(arch))
    if arch == "gemma2":  # soft-capped attention scores: one Attention(softcap) per layer, which TensorRT refuses
        assert len(problems) == 2 and all("Attention softcap=5.0; TensorRT does not support softcap" in p
                                          for p in problems)
    else:
        assert problems == []


def _graph(exported):
    path = exported("llama")
    manifest = json.loads((path / MANIFEST).read_text())
    return path, manifest, onnx.load(str(path / manifest["graph"]))


def _scatter_of(model, past: str):
    return next(n for n in model.graph.node if n.op_type == "TensorScatter" and n.input[0] == past)


def test_cache_through_a_cast_before_tensorscatter_is_reported(exported):
    _, manifest, model = _graph(exported)
    scatter = _scatter_of(model, "past_key_0")
    scatter.input[0] = "past_key_0_cast"
    model.graph.node.insert(0, helper.make_node("Cast", ["past_key_0"], ["past_key_0_cast"], name="cast_cache", to=TensorProto.FLOAT))
    problems = tensorrt_violations(model, manifest["model"])
    assert f"{scatter.name}: TensorScatter's cache input 'past_key_0_cast' comes from Cast node 'cast_cache'" in "\n".join(problems)
    assert any(p.startswith("contract: past_key_0 must feed exactly one TensorScatter") for p in problems)
    assert len(problems) == 2


def test_attention_with_past_key_input_or_softcap_is_reported(exported):
    _, manifest, model = _graph(exported)
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    attention[0].input.extend(["present_key_0"])  # past_key: the op would keep a cache of its own
    next(a for a in attention[1].attribute if a.name == "softcap").f = 30.0
    problems = tensorrt_violations(model, manifest["model"])
    assert problems == [
        f"contract: {attention[0].name}: Attention must not take past_key/past_value/nonpad_kv_seqlen inputs",
        f"{attention[1].name}: Attention softcap=30.0; TensorRT does not support softcap",
    ]


def test_attention_mask_must_cover_every_cache_slot(exported):
    _, manifest, model = _graph(exported)
    problems = tensorrt_violations(model, {**manifest["model"], "max_seq_len": 128, "cache_slots": [128, 128]})
    attention = [n.name for n in model.graph.node if n.op_type == "Attention"]
    assert len(problems) == 2
    for name, problem in zip(attention, problems):
        assert problem.startswith(f"{name}: Attention mask") and "expected [B, 1, T, 128]" in problem


def _quantize_first_matmul_weight(model, zero_point: int, *, scale_from_graph=False):
    matmul = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in {i.name for i in model.graph.initializer})
    weight = matmul.input[1]
    model.graph.initializer.extend([
        helper.make_tensor("w_scale", TensorProto.FLOAT, [], [0.01]),
        helper.make_tensor("w_zp", TensorProto.INT8, [], [zero_point]),
    ])
    scale = "w_scale"
    nodes = []
    if scale_from_graph:
        nodes.append(helper.make_node("Identity", ["w_scale"], ["w_scale_run"], name="scale_at_run_time"))
        scale = "w_scale_run"
    nodes += [
        helper.make_node("QuantizeLinear", [weight, scale, "w_zp"], ["w_q"], name="q_weight"),
        helper.make_node("DequantizeLinear", ["w_q", scale, "w_zp"], ["w_dq"], name="dq_weight"),
    ]
    for i, node in enumerate(nodes):
        model.graph.node.insert(i, node)
    matmul.input[1] = "w_dq"


def test_symmetric_qdq_passes_and_asymmetric_qdq_is_reported(exported):
    _, manifest, model = _graph(exported)
    symmetric = copy.deepcopy(model)
    _quantize_first_matmul_weight(symmetric, 0)
    assert tensorrt_violations(symmetric, manifest["model"]) == []
    _quantize_first_matmul_weight(model, 3)
    problems = tensorrt_violations(model, manifest["model"])
    assert problems == [
        f"{name}: {op} has a nonzero zero point (asymmetric quantization); TensorRT supports only symmetric Q/DQ (zero point 0)"
        for name, op in (("q_weight", "QuantizeLinear"), ("dq_weight", "DequantizeLinear"))
    ]


def test_qdq_scales_must_be_constant(exported):
    _, manifest, model = _graph(exported)
    _quantize_first_matmul_weight(model, 0, scale_from_graph=True)
    problems = tensorrt_violations(model, manifest["model"])
    assert [p.split(":")[0] for p in problems] == ["q_weight", "dq_weight"]
    assert all("comes from Identity node 'scale_at_run_time'; TensorRT needs constant scales" in p for p in problems)


def test_int4_is_accepted_only_as_blocked_weight_only_dequantize_of_2d_weights(exported):
    _, manifest, model = _graph(exported)
    packed = bytes([0xE1]) * 32  # 64 INT4 values (1, -2), two per byte
    model.graph.initializer.extend([
        helper.make_tensor("w4", TensorProto.INT4, [64, 1], packed, raw=True),
        helper.make_tensor("w4_3d", TensorProto.INT4, [2, 2, 16], packed, raw=True),
        helper.make_tensor("s4", TensorProto.FLOAT, [2, 1], [0.1, 0.1]),
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("zp4", TensorProto.INT4, [], [0]),
    ])
    model.graph.node.extend([
        helper.make_node("DequantizeLinear", ["w4", "s4"], ["w4_dq"], name="dq_int4_ok", axis=0, block_size=32),
        helper.make_node("DequantizeLinear", ["w4_3d", "s"], ["w4_3d_dq"], name="dq_int4_3d"),
        helper.make_node("QuantizeLinear", ["w4_dq", "s", "zp4"], ["act_q4"], name="q_int4_activation"),
    ])
    problems = tensorrt_violations(model, manifest["model"])
    assert [p.split(":")[0] for p in problems] == ["dq_int4_3d", "dq_int4_3d", "q_int4_activation"]
    assert "3-D; TensorRT's INT4 DequantizeLinear takes 2-D weights" in problems[0]
    assert "without block_size" in problems[1]
    assert "INT4 QuantizeLinear; TensorRT takes INT4 only as weight-only" in problems[2]


def test_int8_kv_cache_is_reported(exported):
    _, manifest, model = _graph(exported)
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.endswith("key_1"):
            value.type.tensor_type.elem_type = TensorProto.INT8
    problems = tensorrt_violations(model, manifest["model"])
    assert problems == [
        "past_key_1: KV cache dtype INT8; TensorRT's KV cache update takes float32, float16, bfloat16 "
        "(an INT8/FP8 KV cache is not supported); keep the cache in float16 or bfloat16"
    ]


def test_custom_domain_and_unsupported_ops_are_reported(exported):
    _, manifest, model = _graph(exported)
    model.graph.node.extend([
        helper.make_node("MatMulNBits", ["logits"], ["x"], name="ort_kernel", domain="com.microsoft"),
        helper.make_node("Unique", ["logits"], ["y"], name="unique"),
    ])
    assert tensorrt_violations(model, manifest["model"]) == [
        "ort_kernel: com.microsoft.MatMulNBits is a custom-domain op; TensorRT's ONNX parser imports only standard ONNX ops (or plugins)",
        "unique: Unique is not supported by TensorRT's ONNX parser",
    ]


def _broken_export(exported, tmp_path):
    """A copy of the llama export with a Cast between past_key_0 and its TensorScatter, manifest re-hashed."""
    src, manifest, model = _graph(exported)
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    _scatter_of(model, "past_key_0").input[0] = "cast_out"
    model.graph.node.insert(0, helper.make_node("Cast", ["past_key_0"], ["cast_out"], name="cast_cache", to=TensorProto.FLOAT))
    onnx.save(model, str(dst / manifest["graph"]))
    manifest["files"][manifest["graph"]] = sha256_file(dst / manifest["graph"])
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def test_check_command_exit_codes_and_report(exported, tmp_path, capsys):
    assert main(["check", str(exported("llama"))]) == 0
    assert "no TensorRT incompatibilities found" in capsys.readouterr().out
    assert main(["check", str(_broken_export(exported, tmp_path))]) == 1
    out = capsys.readouterr().out
    assert "2 TensorRT incompatibilities" in out and "Cast node 'cast_cache'" in out


def test_tensorrt_build_runs_the_check_first_and_refuses_with_the_report(exported, tmp_path):
    with pytest.raises(ArtifactError, match="(?s)Cast node 'cast_cache'.*fix the export"):
        build(_broken_export(exported, tmp_path), tmp_path / "trt", backend="tensorrt")
    assert not (tmp_path / "trt").exists()


def test_tensorrt_build_options_are_checked_before_tensorrt_is_needed(exported, tmp_path):
    with pytest.raises(ValueError, match="T = 1 is the decode profile"):
        build(exported("llama"), tmp_path / "trt", backend="tensorrt", verify_tokens=[1])
    with pytest.raises(ValueError, match="apply only to --backend tensorrt"):
        build(exported("llama"), tmp_path / "ort", max_prefill=8)


def test_tensorrt_build_without_tensorrt_says_what_to_install(exported, tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except Exception:
        pass
    with pytest.raises(BackendUnavailableError, match="install TensorRT 11.*NVIDIA GPU"):
        build(exported("llama"), tmp_path / "trt", backend="tensorrt")
    assert not (tmp_path / "trt").exists()


# -- engine logic on CPU -------------------------------------------------------------------------


def test_aliasing_map_comes_from_the_engine_and_must_match_the_graph():
    outputs = ["logits", *MODEL["kv_aliases"]]
    assert engine_aliases(outputs, MODEL["kv_aliases"].get, MODEL["kv_aliases"]) == MODEL["kv_aliases"]
    missing = {**MODEL["kv_aliases"], "present_value_1": None}
    with pytest.raises(ArtifactError, match=r"present_value_1 -> None \(expected past_value_1\).*trtspec check"):
        engine_aliases(outputs, missing.get, MODEL["kv_aliases"])
    swapped = {**MODEL["kv_aliases"], "present_key_0": "past_value_0"}
    with pytest.raises(ArtifactError, match=r"present_key_0 -> past_value_0 \(expected past_key_0\)"):
        engine_aliases(outputs, swapped.get, MODEL["kv_aliases"])


def test_each_present_output_is_bound_to_its_past_input_address():
    pointers = {"input_ids": 0x100, "position_ids": 0x200, "logits": 0x300}
    pointers.update({past: 0x1000 * (i + 1) for i, past in enumerate(MODEL["kv_aliases"].values())})
    shapes, addresses = call_bindings(MODEL, MODEL["kv_aliases"], 2, 5, pointers)
    assert shapes["input_ids"] == shapes["position_ids"] == [2, 5]
    assert shapes["past_key_1"] == [2, 4, 64, 16] and "present_key_1" not in shapes
    for present, past in MODEL["kv_aliases"].items():
        assert addresses[present] == addresses[past] == pointers[past]
    assert (addresses["input_ids"], addresses["logits"]) == (0x100, 0x300)
    assert len(set(addresses[p] for p in MODEL["kv_aliases"].values())) == 4


def test_a_call_over_later_rows_binds_the_cache_that_many_rows_in():
    pointers = {"input_ids": 0x100, "position_ids": 0x200, "logits": 0x300}
    pointers.update({past: 0x100000 * (i + 1) for i, past in enumerate(MODEL["kv_aliases"].values())})
    row_bytes = 4 * 64 * 16 * 2  # Hkv * S_max * D * sizeof(float16)
    shapes, addresses = call_bindings(MODEL, MODEL["kv_aliases"], 2, 5, pointers, first_row=3, row_bytes=row_bytes)
    assert shapes["past_key_0"] == [2, 4, 64, 16]
    for present, past in MODEL["kv_aliases"].items():
        assert addresses[present] == addresses[past] == pointers[past] + 3 * row_bytes
    assert addresses["logits"] == 0x300


def test_a_plan_is_refused_on_another_tensorrt_version_or_gpu():
    manifest = {"tensorrt": {"version": "11.0.0.5", "compute_capability": "9.0"}}
    check_plan_compatible(manifest, "11.0.0.5", "9.0")
    with pytest.raises(ArtifactError, match="built with TensorRT 11.0.0.5 but TensorRT 11.1.0.2 is installed.*Rebuild"):
        check_plan_compatible(manifest, "11.1.0.2", "9.0")
    with pytest.raises(ArtifactError, match="compute capability 9.0 but this GPU has 8.9; rebuild"):
        check_plan_compatible(manifest, "11.0.0.5", "8.9")


def test_loading_a_tensorrt_engine_without_tensorrt_says_what_to_install(tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except Exception:
        pass
    manifest = {"format": ENGINE_FORMAT, "backend": "tensorrt", "plan_file": "model.plan"}
    with atomic_artifact(tmp_path / "eng", manifest) as tmp:
        (tmp / "model.plan").write_bytes(b"not a plan")
    with pytest.raises(BackendUnavailableError, match="NVIDIA GPU"):
        load_engine(tmp_path / "eng")


class FakeTensorRT:
    """A recording stand-in for the tensorrt module's builder objects; it runs nothing."""

    class NetworkDefinitionCreationFlag:
        STRONGLY_TYPED = 5

    class Builder:
        def __init__(self):
            self.profiles = []

        def create_optimization_profile(self):
            profile = SimpleNamespace(shapes={})
            profile.set_shape = lambda name, lo, opt, hi: profile.shapes.__setitem__(name, (lo, opt, hi))
            return profile

    class Config:
        def __init__(self):
            self.profiles, self.timing = [], None

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, data):
            return SimpleNamespace(data=data, serialize=lambda: bytearray(data + b"+new"))

        def set_timing_cache(self, cache, ignore_mismatch):
            self.timing = (cache, ignore_mismatch)


def test_network_is_created_strongly_typed_where_the_flag_exists():
    assert network_flags(FakeTensorRT) == 1 << 5
    assert network_flags(SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace())) == 0


def test_profiles_are_added_in_plan_order_with_min_opt_max_shapes():
    plan = profile_plan(MODEL, max_prefill=16, verify_tokens=[3])
    config = FakeTensorRT.Config()
    _add_profiles(FakeTensorRT.Builder(), config, plan)
    assert len(config.profiles) == 3
    assert config.profiles[0].shapes["input_ids"] == ([1, 1], [3, 16], [3, 16])
    assert config.profiles[2].shapes["position_ids"] == ([1, 3], [3, 3], [3, 3])
    assert config.profiles[1].shapes["past_value_0"] == ([1, 4, 64, 16], [3, 4, 64, 16], [3, 4, 64, 16])


def test_timing_cache_file_is_read_and_rewritten(tmp_path):
    path = tmp_path / "timing.cache"
    config = FakeTensorRT.Config()
    cache = _load_timing_cache(config, path)
    assert cache.data == b"" and config.timing[1] is False
    path.write_bytes(b"old")
    cache = _load_timing_cache(config, path)
    assert cache.data == b"old"
    _save_timing_cache(cache, path)
    assert path.read_bytes() == b"old+new"
    assert [p.name for p in tmp_path.iterdir()] == ["timing.cache"]


# -- on a machine with TensorRT --------------------------------------------------------------------


@pytest.mark.tensorrt
def test_tensorrt_logits_match_onnxruntime_and_cache_is_updated_in_place(exported, tmp_path):
    _tensorrt_or_skip()
    export_dir = exported("llama")
    trt_engine = load_engine(build(export_dir, tmp_path / "trt", backend="tensorrt", verify_tokens=[2, 5]))
    ort_engine = load_engine(export_dir)
    assert trt_engine.verify_tokens == [2, 5]
    assert trt_engine.max_batch == MAX_BATCH and trt_engine.max_seq_len == S_MAX
    ids = np.random.default_rng(0).integers(3, 300, size=(2, 12))
    pos = 0
    for t in (7, 1, 2, 2):  # prefill, decode, verify (eager, then CUDA graph replay)
        step = (ids[:, pos : pos + t], np.tile(np.arange(pos, pos + t), (2, 1)))
        np.testing.assert_allclose(trt_engine.forward(*step), ort_engine.forward(*step), atol=2e-3, rtol=2e-3)
        pos += t
