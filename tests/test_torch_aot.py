"""`trtspec build --backend torch`: the step module as an AOTInductor package (engines/torch_aot.py).

Its logits equal the onnxruntime engine's of the same export (a GGUF file's, on our kernels; an HF model's, with
tree calls and features), each row's logits are the same in every call with int8 activations, speculation over it
is its own greedy output for every drafter, and a fresh process loads it without compiling anything; an engine
whose kernels or torch are missing at load time is refused with the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import trtspec
from conftest import MAX_BATCH, S_MAX, hf_logits, random_ids
from trtspec import ArtifactError, Generator, load_engine
from trtspec.engines.base import tree_positions
from trtspec.runtime.picks import coupled_pick
from trtspec.engines.torch_aot import TorchAOTEngine
from trtspec.testing import make_tiny_gguf

TOL = 1e-4
PROMPT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n"
FEATURES = "low,mid,high,last"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The int8 engine is built from the file itself, without the export (the other three's)."""
    root = tmp_path_factory.mktemp("aot-gguf")
    file = make_tiny_gguf(root / "tiny.gguf")
    exp = trtspec.export(file, root / "export", max_seq_len=S_MAX, max_batch=2)
    return {"file": file, "export": exp, "float": trtspec.build(exp, root / "float", weights="float"),
            "torch": trtspec.build(exp, root / "torch"),  # the default backend for an export of a GGUF file
            "int8": trtspec.build(file, root / "int8", backend="torch", int8_activations=True, max_seq_len=S_MAX,
                                  max_batch=2)}


def _calls(engine, ids):
    """Logits of a prefill chunk, a decode call and a verify-sized call on row 0, and a chunk on row 1."""
    engine.reset()
    return [engine.forward(ids[None, start:end], np.arange(start, end)[None], first_row=row)
            for start, end, row in ((0, 13, 0), (13, 14, 0), (14, 20, 0), (0, 7, 1))]


def test_gguf_engine_on_our_kernels_computes_with_the_files_weights(gguf):
    """Float activations: the onnxruntime float build's logits (the file's dequantized weights; the IQ4_NL layer
    stays float in both). Int8 activations, built from the file without an export: the eager torch engine's of the
    export on the same kernels (only the fusion of the float operations around them differs)."""
    engine = load_engine(gguf["torch"])
    assert isinstance(engine, TorchAOTEngine) and engine.manifest["build"]["gguf"]["kernels"] == 14
    assert engine.manifest["build"]["gguf"]["float"] == {"model.layers.1.mlp.down_proj": "IQ4_NL: not a type kept "
                                                                                         "as it is"}
    ids = random_ids(20, seed=2, vocab=200)
    for got, want in zip(_calls(engine, ids), _calls(load_engine(gguf["float"]), ids)):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    eager = trtspec.compile(gguf["export"], backend="eager", weights="gguf", int8_activations=True)
    direct = load_engine(gguf["int8"])
    assert direct.manifest["model"] == engine.manifest["model"]
    assert direct.manifest["source"]["model_dir"] == str(gguf["file"].resolve())
    for got, want in zip(_calls(direct, ids), _calls(eager, ids)):
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)


def test_int8_rows_are_the_same_in_every_call_and_speculation_is_exact(gguf):
    """A row's logits, bit for bit, whether it runs alone or beside another row, as a decode call or inside a
    verify-sized call: so greedy speculation over the engine equals its own greedy output, for every drafter."""
    engine = load_engine(gguf["int8"])
    ids = random_ids(24, seed=5, vocab=200)
    engine.reset()
    alone = [engine.forward(ids[None, :16], np.arange(16)[None])[0, -1].copy()]
    for j in range(16, 20):  # decode calls
        alone.append(engine.forward(ids[None, j : j + 1], np.array([[j]]))[0, 0].copy())
    engine.reset()
    other = random_ids(20, seed=6, vocab=200)
    both = engine.forward(np.stack([ids[:16], other[:16]]), np.tile(np.arange(16), (2, 1)))
    together = [both[0, -1]]
    verify = engine.forward(np.stack([ids[16:20], other[16:20]]), np.tile(np.arange(16, 20), (2, 1)))
    together += list(verify[0])
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)
    want = Generator(engine).generate(PROMPT, max_new_tokens=24).token_ids
    for drafter in ("prompt_lookup", "suffix"):
        assert Generator(engine, drafter=drafter).generate(PROMPT, max_new_tokens=24).token_ids == want, drafter


def test_the_package_calls_our_kernels_as_c_functions(gguf):
    """Built on the native kernels, the generated code calls their C shims (kernels.c_shims), never the proxy
    executor's boxed dispatch: every linear layer of the file's blocks and, with int8 activations, every layer's
    attention."""
    import zipfile

    for name, rowwise in (("torch", False), ("int8", True)):
        manifest = json.loads((gguf[name] / "manifest.json").read_text())
        assert manifest["build"]["kernel_calls"] == "c_shims"
        with zipfile.ZipFile(gguf[name] / manifest["graph"]) as package:
            [wrapper] = [package.read(n).decode() for n in package.namelist() if n.endswith(".wrapper.cpp")]
        layers = manifest["model"]["num_layers"]
        # each function's declaration, then its calls: q/k/v, o, gate/up and down a layer (one of the tiny file's
        # down layers is float), and one attention a layer (its rows written as the output projection's input)
        assert wrapper.count("aoti_torch_cpu_gguf_linear(") >= 1 + 3 * layers, name
        assert wrapper.count("aoti_torch_cpu_attention_rows_tokens(") == 1 + (layers if rowwise else 0), name
        assert wrapper.count("aoti_torch_cpu_attention_rows(") == 1, name  # (declared, not called)
        assert "call_function(" not in wrapper, name


def _fresh_process(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_a_fresh_process_loads_the_engine_without_compiling(gguf, tmp_path):
    """The logits are this process's, and nothing is compiled but torch's probes of the CPU's vector ISA (which
    loading any package makes): the package is the whole engine."""
    inductor_cache = tmp_path / "inductor"
    inductor_cache.mkdir()
    ids = random_ids(6, seed=9, vocab=200)
    engine = load_engine(gguf["int8"])
    engine.reset()
    want = engine.forward(ids[None], np.arange(6)[None])
    out = tmp_path / "logits.npy"
    run = _fresh_process(f"""
        import numpy as np
        from trtspec import load_engine
        e = load_engine({str(gguf['int8'])!r})
        np.save({str(out)!r}, e.forward(np.array([{ids.tolist()}]), np.arange(6)[None]))
    """, {"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)})
    assert run.returncode == 0, run.stderr
    np.testing.assert_array_equal(np.load(out), want)
    sources = list(inductor_cache.rglob("*.cpp"))
    assert all("_chk_kernel" in p.read_text() for p in sources), [p.read_text()[:300] for p in sources]


def test_an_engine_whose_kernels_cannot_be_built_is_refused_with_the_fix(gguf, tmp_path):
    """Loading one, and building one (refused before the model loads; nothing written)."""
    env = {"TRTSPEC_CXX": str(tmp_path / "no-such-g++"), "TRTSPEC_CACHE": str(tmp_path / "cache")}
    run = _fresh_process(f"""
        from trtspec import load_engine
        load_engine({str(gguf['int8'])!r})
    """, env)
    assert run.returncode != 0
    assert "BackendUnavailableError" in run.stderr and "Install a C++ compiler" in run.stderr, run.stderr
    run = _fresh_process(f"""
        import trtspec
        trtspec.build({str(gguf['file'])!r}, {str(tmp_path / 'engine')!r}, backend="torch", int8_activations=True)
    """, env)
    assert "BackendUnavailableError" in run.stderr and "Install a C++ compiler" in run.stderr, run.stderr
    assert "de-quantizing GGUF tensors" not in run.stderr and not (tmp_path / "engine").exists()


@pytest.mark.parametrize("key,value,message", [("torch", "1.0.0", "runs only on the torch that built it"),
                                               ("cpu_isa", "neon", "which this CPU does not run")])
def test_an_engine_of_another_torch_or_cpu_is_refused(gguf, tmp_path, key, value, message):
    copy = tmp_path / "engine"
    shutil.copytree(gguf["int8"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["build"][key]  # (recorded at build)
    manifest["build"][key] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=message):
        load_engine(copy)


def test_build_options_are_checked(gguf, exported, tmp_path):
    with pytest.raises(ValueError, match="no blocks for --weights gguf"):
        trtspec.build(exported("llama"), tmp_path / "a", backend="torch", weights="gguf")
    with pytest.raises(ValueError, match="--int8-activations goes with the GGUF kernels"):
        trtspec.build(gguf["export"], tmp_path / "b", backend="torch", weights="float", int8_activations=True)
    with pytest.raises(ValueError, match="an export fixed its own"):
        trtspec.build(gguf["export"], tmp_path / "c", backend="torch", max_seq_len=64)
    with pytest.raises(ValueError, match="an export fixed its own"):
        trtspec.build(gguf["export"], tmp_path / "d", max_seq_len=64)
    with pytest.raises(ArtifactError, match="neither a Hugging Face model directory"):
        trtspec.build(tmp_path, tmp_path / "e", backend="torch")
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_the_default_backend_is_torch_for_a_gguf_file_and_its_export_and_onnxruntime_otherwise(
        gguf, exported, model_dir, tmp_path, monkeypatch):
    from trtspec import kernels
    from trtspec.builder import default_backend

    assert load_engine(gguf["torch"]).manifest["backend"] == "torch"  # built with no --backend
    assert default_backend(gguf["export"]) == "torch"
    assert default_backend(gguf["file"]) == "torch" and default_backend(model_dir("llama")) == "torch"
    assert default_backend(gguf["export"], weights="float") == "onnxruntime"
    assert default_backend(gguf["export"], fuse_qdq=False) == "onnxruntime"
    assert default_backend(gguf["export"], fusion=False) == "onnxruntime"
    assert default_backend(exported("llama")) == "onnxruntime"
    assert default_backend(gguf["torch"]) == "onnxruntime"  # an engine: build then says to pass its export
    assert default_backend(tmp_path) == "onnxruntime"  # nothing there: build then says what is missing
    with pytest.raises(ArtifactError, match="no manifest.json"):
        trtspec.build(tmp_path, tmp_path / "e")
    monkeypatch.setattr(kernels, "load", lambda progress=None: "torch")  # no C++ compiler here
    assert default_backend(gguf["export"]) == "onnxruntime"


def test_float_engine_of_a_tree_export_equals_hf_with_trees_and_features(exported, built, model_dir, hf_model,
                                                                          tmp_path):
    """An HF model's export with tree verification and features, built for torch: chain calls equal HF's logits
    and the onnxruntime engine's features; a tree call's logits and features equal the onnxruntime engine's."""
    options = dict(tree=True, hidden_states=FEATURES, ring_cache=False)
    engine = load_engine(trtspec.build(exported("llama", **options), tmp_path / "e", backend="torch"))
    ref = load_engine(built("llama", **options))
    assert engine.max_batch == MAX_BATCH and engine.max_seq_len == S_MAX
    ids = random_ids(14, seed=4)
    want = hf_logits(hf_model(model_dir("llama")), ids)
    for e in (engine, ref):
        e.reset()
    for start, end in ((0, 9), (9, 10), (10, 14)):
        got = engine.forward(ids[None, start:end], np.arange(start, end)[None])
        np.testing.assert_allclose(got[0], want[start:end], atol=TOL, rtol=0)
        ref.forward(ids[None, start:end], np.arange(start, end)[None])
        np.testing.assert_allclose(engine.features, ref.features, atol=TOL, rtol=0)
    mask, depth = tree_positions([[-1, 0, 0, 1, 2]])
    tokens = random_ids(5, seed=8)[None]
    got = engine.forward(tokens, 14 + depth, tree_mask=mask)
    np.testing.assert_allclose(got, ref.forward(tokens, 14 + depth, tree_mask=mask), atol=TOL, rtol=0)
    np.testing.assert_allclose(engine.features, ref.features, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3"])
def test_float_engine_equals_hf_on_other_families(arch, exported, model_dir, hf_model, tmp_path):
    """Qwen3 (q/k norms), Gemma 2 (soft-capped attention: a custom op whose fake result must have the real one's
    layout, and sliding-window layers) and Phi-3 (one fused qkv projection), built for torch: HF's logits on a
    prefill chunk, a decode call and a verify-sized call. Phi-3 is built as a CUDA build is: no live-length input,
    every call attends the whole capacity. The engine's greedy loop, its tokens kept as tensors, gives the tokens
    of a loop over forward."""
    from trtspec.engines.base import forward_greedy_steps
    from trtspec.torch_backend.aot import build_torch

    export = exported(arch)
    if arch == "phi3":
        manifest = json.loads((export / "manifest.json").read_text())
        engine = load_engine(build_torch(export, manifest, tmp_path / "e", live=False))
        assert engine.manifest["build"]["live"] is False and not engine._live_input
    else:
        engine = load_engine(trtspec.build(export, tmp_path / "e", backend="torch"))
    ids = random_ids(12, seed=1)
    want = hf_logits(hf_model(model_dir(arch)), ids)
    engine.reset()
    for start, end in ((0, 7), (7, 8), (8, 12)):
        got = engine.forward(ids[None, start:end], np.arange(start, end)[None])
        np.testing.assert_allclose(got[0], want[start:end], atol=TOL, rtol=0)
    loops = []
    pick = lambda x, i: coupled_pick(x, 2.0, 5, 1 + i)  # noqa: E731 - a coupled sampler's, in place of the argmax
    for loop in (engine.greedy_steps, lambda *a, **o: forward_greedy_steps(engine, *a, **o)):
        for options in ({}, {"pick": pick}):
            engine.reset()
            tokens = []
            assert loop(0, int(ids[0]), 0, 40, lambda t: tokens.append(t) or len(tokens) < 30, **options)[0] == 30
            loops.append(tokens)
    assert loops[0] == loops[2] != loops[1] == loops[3]
