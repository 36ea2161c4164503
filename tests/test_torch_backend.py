"""The torch backend: HF's logits, a KV cache written in place, no recompiles, lossless next to onnxruntime."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

import trtspec
from conftest import MAX_BATCH, S_MAX, hf_logits, random_ids
from trtspec import BackendUnavailableError, Generator, load_engine
from trtspec.cli import main as cli_main
from trtspec.torch_backend.dynamo_backend import torch_tensorrt_importable

TOL = 1e-4
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick"]
NEW_TOKENS = 16
LOGIT_CASES = [("llama", "eager"), ("qwen3", "eager"), ("gpt2", "eager"), ("llama", "inductor")]
TRT_IMPORTABLE = torch_tensorrt_importable()


@pytest.fixture(scope="module")
def torch_engine(model_dir):
    cache = {}

    def get(arch: str, backend: str):
        if (arch, backend) not in cache:
            cache[arch, backend] = trtspec.compile(model_dir(arch), max_seq_len=S_MAX, max_batch=MAX_BATCH, backend=backend)
        engine = cache[arch, backend]
        engine.reset()
        return engine

    return get


def compilations() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("arch,backend", LOGIT_CASES)
def test_prefill_decode_chunk_logits_match_hf(arch, backend, torch_engine, model_dir, hf_model):
    engine = torch_engine(arch, backend)
    ids = random_ids(12, seed=1)
    ref = hf_logits(hf_model(model_dir(arch)), ids)
    prefill = engine.forward(ids[None, :7], np.arange(7)[None])
    decode = engine.forward(ids[None, 7:8], np.array([[7]]))
    chunk = engine.forward(ids[None, 8:12], np.arange(8, 12)[None])
    np.testing.assert_allclose(prefill[0], ref[:7], atol=TOL, rtol=0)
    np.testing.assert_allclose(decode[0], ref[7:8], atol=TOL, rtol=0)
    np.testing.assert_allclose(chunk[0], ref[8:12], atol=TOL, rtol=0)


@pytest.mark.parametrize("arch,backend", LOGIT_CASES)
def test_ragged_batch_logits_match_hf(arch, backend, torch_engine, model_dir, hf_model):
    engine = torch_engine(arch, backend)  # 2 rows of MAX_BATCH 3: the first rows of each cache buffer
    model = hf_model(model_dir(arch))
    a, b = random_ids(12, seed=2), random_ids(9, seed=3)
    ref_a, ref_b = hf_logits(model, a), hf_logits(model, b)
    ids = np.stack([a[:7], np.concatenate([b[:4], [0, 0, 0]])])
    out = engine.forward(ids, np.tile(np.arange(7), (2, 1)))
    np.testing.assert_allclose(out[0], ref_a[:7], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1, :4], ref_b[:4], atol=TOL, rtol=0)
    out = engine.forward(np.array([[a[7]], [b[4]]]), np.array([[7], [4]]))
    np.testing.assert_allclose(out[:, 0], np.stack([ref_a[7], ref_b[4]]), atol=TOL, rtol=0)
    out = engine.forward(np.stack([a[8:12], b[5:9]]), np.stack([np.arange(8, 12), np.arange(5, 9)]))
    np.testing.assert_allclose(out[0], ref_a[8:12], atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], ref_b[5:9], atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_greedy_steps_on_the_device_equal_the_forward_loop_and_stop_where_told(backend, torch_engine):
    from trtspec.engines.base import forward_greedy_steps
    from trtspec.engines.base import GREEDY_CHUNK
    from trtspec.runtime.picks import coupled_pick

    engine = torch_engine("llama", backend)
    prompt = random_ids(6, seed=5)
    steps = GREEDY_CHUNK + 4  # two chunks

    def run(loop, stop_after=None, **options):
        engine.reset()
        engine.forward(prompt[None, :5], np.arange(5)[None])
        got = []
        calls, _ = loop(engine, 0, int(prompt[5]), 5, steps, lambda t: got.append(t) or len(got) != stop_after,
                        **options)
        return calls, got

    calls, reference = run(forward_greedy_steps)
    assert (calls, len(reference)) == (steps, steps)
    assert run(type(engine).greedy_steps) == (steps, reference)
    # a coupled sampler's pick in place of the argmax: each token read on the host, as forward's loop does
    pick = {"pick": lambda x, i: coupled_pick(x, 2.0, 3, 6 + i)}
    sampled = run(forward_greedy_steps, **pick)
    assert run(type(engine).greedy_steps, **pick) == sampled and sampled[1] != reference
    stop = GREEDY_CHUNK + 2  # inside the second chunk: the rest of it ran on the device, past the stop
    calls, got = run(type(engine).greedy_steps, stop_after=stop)
    assert (calls, got) == (stop, reference[:stop])
    # the slots written past the stop are hidden: decoding on from the stop gives the reference's next tokens
    rest = []
    type(engine).greedy_steps(engine, 0, got[-1], 5 + stop, steps - stop, lambda t: rest.append(t) or True)
    assert got + rest == reference


def test_a_new_thread_adopts_the_cudagraph_tree_state_of_the_engine():
    # The CUDA-graphed calls of a torch engine run on the scheduler's thread; torch < 2.13 keeps the graphs'
    # manager only in the thread that imported its cudagraph trees and fails an assertion elsewhere.
    import threading

    from torch._inductor import cudagraph_trees

    from trtspec.torch_backend.engine import adopt_cudagraph_tree_state, cudagraph_tree_state

    state = cudagraph_tree_state()
    assert state is not None and set(state) == {"tree_manager_containers", "tree_manager_locks"}
    seen = {}

    def worker():
        seen["before"] = hasattr(cudagraph_trees.local, "tree_manager_containers")
        adopt_cudagraph_tree_state(state)
        seen["after"] = {name: cudagraph_trees.get_obj(cudagraph_trees.local, name) for name in state}

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["before"] is False  # what fails on a GPU without the adoption
    assert all(seen["after"][name] is state[name] for name in state)


def test_the_tensorrt_guard_sees_the_in_place_cache_write_and_passes_the_functional_one(model_dir):
    # backend="trtspec" hands a graph to Torch-TensorRT only when it stores into no tensor it was given
    from trtspec.torch_backend.dynamo_backend import writes_in_place

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, pos = torch.tensor([[5, 6]]), torch.tensor([[0, 1]])
    in_place = trtspec.compile(model_dir("llama"), max_seq_len=S_MAX, max_batch=1, backend="eager")
    torch.compile(in_place.module, backend=capture, fullgraph=True)(ids, pos)
    functional = _functional_engine(model_dir)
    caches = [c[:1] for c in functional.caches]
    torch.compile(functional.module.step, backend=capture, fullgraph=True)(ids, pos, *caches)
    assert [writes_in_place(gm) for gm in graphs] == [True, False]


def test_bfloat16_engine_logits_match_hf_in_bfloat16(model_dir):
    # The dtype GPU users run: the torch backend used to refuse it (the ONNX export's dtype list), so
    # bench_torch.py --dtype bfloat16 and gpu_check.py failed before their first call.
    import torch
    from transformers import AutoModelForCausalLM

    engine = trtspec.compile(model_dir("llama"), max_seq_len=S_MAX, max_batch=1, backend="eager", dtype="bfloat16")
    assert engine.caches[0].dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.bfloat16).eval()
    ids = random_ids(12, seed=4)
    ref = hf_logits(model, ids)
    out = np.concatenate([engine.forward(ids[None, :7], np.arange(7)[None])[0],
                          engine.forward(ids[None, 7:8], np.array([[7]]))[0],
                          engine.forward(ids[None, 8:12], np.arange(8, 12)[None])[0]])
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cache_is_written_in_place_only_at_the_new_positions(backend, torch_engine):
    engine = torch_engine("llama", backend)
    addresses = [c.data_ptr() for c in engine.caches]
    engine.forward(random_ids(10, seed=4).reshape(2, 5), np.tile(np.arange(5), (2, 1)))
    before = [c.clone() for c in engine.caches]
    # a verify-shaped call: row 0 appends at 5..7, row 1 overwrites 2..4 (what follows a rejected draft)
    engine.forward(random_ids(6, seed=5).reshape(2, 3), np.array([[5, 6, 7], [2, 3, 4]]))
    expected = torch.zeros(MAX_BATCH, S_MAX, dtype=torch.bool)
    expected[0, 5:8] = expected[1, 2:5] = True
    for cache, old, address in zip(engine.caches, before, addresses):
        assert cache.data_ptr() == address
        assert torch.equal((cache != old).any(dim=3).any(dim=1), expected)  # [max_batch, S_max] slots that changed


def test_decoding_at_ten_positions_compiles_at_most_once(torch_engine):
    engine = torch_engine("llama", "inductor")
    ids = random_ids(16, seed=6)
    engine.forward(ids[None, :5], np.arange(5)[None])
    start = compilations()
    engine.forward(ids[None, 5:6], np.array([[5]]))  # may compile the decode graph (T = 1 is specialised)
    after_first = compilations()
    for p in range(6, 15):
        engine.forward(ids[None, p : p + 1], np.array([[p]]))
    assert after_first - start <= 1
    assert compilations() == after_first


@pytest.fixture(scope="module")
def ort_llama(exported):
    return load_engine(exported("llama"))


@pytest.fixture(scope="module")
def reference(ort_llama):
    """Target-only greedy tokens of the tiny llama on onnxruntime."""
    return [r.token_ids for r in Generator(ort_llama).generate(PROMPTS, max_new_tokens=NEW_TOKENS)]


def test_torch_target_alone_equals_onnxruntime_target(torch_engine, reference):
    out = Generator(torch_engine("llama", "eager")).generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in out] == reference


def force_device_picks(monkeypatch):
    """The round's picks as a GPU makes them (torch ops on the engine's tensor, runtime/picks.py), here on the CPU."""
    from trtspec.runtime import picks, verify, worker

    def forced(*args, **kwargs):
        return picks.target_picks(*args, **{**kwargs, "on_device_ops": True})

    monkeypatch.setattr(verify, "target_picks", forced)
    monkeypatch.setattr(worker, "target_picks", forced)


@pytest.mark.parametrize("device_picks", [False, True], ids=["host picks", "device picks"])
def test_torch_target_with_onnxruntime_draft_equals_target_greedy(torch_engine, perturbed_export, reference,
                                                                  device_picks, monkeypatch):
    if device_picks:
        force_device_picks(monkeypatch)
    draft = load_engine(perturbed_export("llama", 0.3))
    gen = Generator(torch_engine("llama", "eager"), draft, num_draft_tokens=3, k_policy="fixed")
    out = gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in out] == reference
    assert 0 < out.stats.accepted < out.stats.proposed  # multi-token verify writes and rollbacks both happened


def test_device_picks_sample_the_hosts_tokens(torch_engine, perturbed_export, monkeypatch):
    draft = load_engine(perturbed_export("llama", 0.3))

    def sampled():
        gen = Generator(torch_engine("llama", "eager"), draft, num_draft_tokens=3, k_policy="fixed")
        out = gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=20, seed=5)
        return [r.token_ids for r in out], out.stats.accepted

    host, accepted = sampled()
    force_device_picks(monkeypatch)
    assert sampled() == (host, accepted) and accepted > 0


@pytest.fixture(scope="module")
def torch_draft(perturbed_export):
    return trtspec.compile(perturbed_export("llama", 0.3), backend="eager")  # compiled from the export's source


def test_onnxruntime_target_with_torch_draft_from_an_export_equals_target_greedy(ort_llama, torch_draft, reference):
    assert (torch_draft.max_seq_len, torch_draft.max_batch) == (S_MAX, MAX_BATCH)  # the export's own capacity
    out = Generator(ort_llama, torch_draft, num_draft_tokens=3, k_policy="fixed").generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in out] == reference
    assert 0 < out.stats.accepted < out.stats.proposed


def test_cli_generate_backend_torch_compiles_target_and_draft(model_dir, perturbed_export, torch_engine, torch_draft,
                                                              reference, capsys, monkeypatch):
    import trtspec.torch_backend as torch_backend

    target, draft = str(model_dir("llama")), str(perturbed_export("llama", 0.3))
    compiled = {target: torch_engine("llama", "eager"), draft: torch_draft}  # compiling them is tested above
    asked = []
    monkeypatch.setattr(torch_backend, "compile", lambda path, **options: asked.append((path, options)) or compiled[path])
    code = cli_main(["generate", "--backend", "torch", "--target", target, "--draft", draft,
                     "--max-new-tokens", str(NEW_TOKENS), "--json", *[arg for p in PROMPTS for arg in ("--prompt", p)]])
    # chains from a draft model: no tree input or features asked for (an export's own would be kept)
    assert code == 0 and asked == [(target, {"tree": None, "hidden_states": None, "device": "cpu", "dtype": None}),
                                   (draft, {"device": "cpu", "dtype": None})]
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["token_ids"] for r in results] == reference


def test_cli_generate_backend_torch_on_a_device(model_dir, torch_engine, capsys, monkeypatch):
    """--device and --dtype reach trtspec.compile for the target; without --backend torch they are refused, and a
    GPU asked for where torch sees none is refused by name, before anything is compiled."""
    import trtspec.torch_backend as torch_backend

    target = str(model_dir("llama"))
    compiled = torch_engine("llama", "eager")
    asked = []
    monkeypatch.setattr(torch_backend, "compile", lambda path, **options: asked.append((path, options)) or compiled)
    code = cli_main(["generate", "--backend", "torch", "--device", "cuda", "--dtype", "bfloat16", "--target", target,
                     "--max-new-tokens", "2", "--json", "--prompt", PROMPTS[0]])
    assert code == 0 and asked == [(target, {"tree": None, "hidden_states": None, "device": "cuda",
                                             "dtype": "bfloat16"})]
    capsys.readouterr()
    assert cli_main(["generate", "--device", "cuda", "--target", target, "--prompt", "x"]) == 2
    assert "go with backend torch (--backend torch)" in capsys.readouterr().err
    monkeypatch.undo()
    if torch.cuda.is_available():
        return
    assert cli_main(["generate", "--backend", "torch", "--device", "cuda", "--target", target, "--prompt", "x"]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_engine_from_an_hf_dir_points_at_its_tokenizer(torch_engine, model_dir, ort_llama):
    engine = torch_engine("llama", "eager")
    assert engine.path == model_dir("llama") and engine.manifest["tokenizer"] == "."
    for key in ("architecture", "vocab_size", "num_kv_heads", "head_dim", "special_tokens", "tokenizer_fingerprint",
                "kv_aliases"):
        assert engine.manifest["model"][key] == ort_llama.manifest["model"][key]


def test_unknown_backend_and_missing_cuda_are_refused(model_dir):
    with pytest.raises(ValueError, match="unknown torch backend 'tvm'.*inductor, eager, torch_tensorrt"):
        trtspec.compile(model_dir("llama"), backend="tvm")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="no CUDA GPU; use device='cpu'"):
            trtspec.compile(model_dir("llama"), device="cuda")


@pytest.mark.skipif(TRT_IMPORTABLE, reason="torch_tensorrt is importable here")
def test_torch_tensorrt_backend_is_refused_when_not_importable(model_dir):
    with pytest.raises(BackendUnavailableError, match="torch_tensorrt.*not importable.*backend='inductor'"):
        trtspec.compile(model_dir("llama"), backend="torch_tensorrt")


@pytest.mark.skipif(not (TRT_IMPORTABLE and torch.cuda.is_available()),
                    reason="torch_tensorrt is not importable or no CUDA GPU (needs TensorRT and an NVIDIA GPU)")
def test_torch_tensorrt_engine_logits_match_hf(model_dir, hf_model):
    engine = trtspec.compile(model_dir("llama"), max_seq_len=S_MAX, max_batch=MAX_BATCH, backend="torch_tensorrt", device="cuda")
    ids = random_ids(12, seed=1)
    ref = hf_logits(hf_model(model_dir("llama")), ids)
    prefill = engine.forward(ids[None, :8], np.arange(8)[None])
    verify = engine.forward(ids[None, 8:12], np.arange(8, 12)[None])
    np.testing.assert_allclose(np.concatenate([prefill[0], verify[0]]), ref, atol=1e-3, rtol=0)


def _functional_engine(model_dir):
    """The engine layout trtspec.compile builds for torch_tensorrt (caches in and out), run by eager PyTorch."""
    from trtspec.torch_backend.engine import TorchEngine
    from trtspec.torch_backend.source import load_source

    source = load_source(model_dir("llama"), max_seq_len=S_MAX, max_batch=MAX_BATCH, dtype=None)
    return TorchEngine(source, compile_backend="eager", device="cpu", functional_cache=True)


def test_functional_cache_engine_matches_hf_and_writes_only_its_own_buffers(model_dir, hf_model):
    engine = _functional_engine(model_dir)
    addresses = [c.data_ptr() for c in engine.caches]
    ids = random_ids(12, seed=1)
    ref = hf_logits(hf_model(model_dir("llama")), ids)
    prefill = engine.forward(ids[None, :7], np.arange(7)[None])
    decode = engine.forward(ids[None, 7:8], np.array([[7]]))
    chunk = engine.forward(ids[None, 8:12], np.arange(8, 12)[None])
    np.testing.assert_allclose(np.concatenate([prefill[0], decode[0], chunk[0]]), ref, atol=TOL, rtol=0)
    assert [c.data_ptr() for c in engine.caches] == addresses
    before = [c.clone() for c in engine.caches]
    engine.forward(random_ids(6, seed=5).reshape(2, 3), np.array([[12, 13, 14], [2, 3, 4]]))  # ragged verify
    expected = torch.zeros(MAX_BATCH, S_MAX, dtype=torch.bool)
    expected[0, 12:15] = expected[1, 2:5] = True
    for cache, old in zip(engine.caches, before):
        assert torch.equal((cache != old).any(dim=3).any(dim=1), expected)


def test_tensorrt_converter_adds_a_linear_in_place_kv_cache_update():
    from trtspec.torch_backend.tensorrt_converter import add_kv_cache_update

    class Layer:
        name = None

        def get_output(self, index):
            return f"output {index}"

    class Network:
        def __init__(self, layer):
            self.layer, self.calls = layer, []

        def add_kv_cache_update(self, *args):
            self.calls.append(args)
            return self.layer

    class StandInTensorRT:  # a stand-in for the tensorrt module: only what the converter touches
        class KVCacheMode:
            LINEAR = "LINEAR"

    network = Network(Layer())
    out = add_kv_cache_update(network, StandInTensorRT, "cache", "update", "write_indices", "layers.0.key")
    assert network.calls == [("cache", "update", "write_indices", "LINEAR")]
    assert (out, network.layer.name) == ("output 0", "layers.0.key")
    with pytest.raises(RuntimeError, match="refused the KV cache update 'layers.1.value': it needs TensorRT >= 10.15"):
        add_kv_cache_update(Network(None), StandInTensorRT, "c", "u", "w", "layers.1.value")


@pytest.mark.skipif(TRT_IMPORTABLE, reason="torch_tensorrt is importable here: the backend would not fall back")
def test_trtspec_dynamo_backend_falls_back_to_inductor(caplog):
    import trtspec.torch_backend.dynamo_backend  # noqa: F401  (registers "trtspec")

    fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend="trtspec", fullgraph=True)
    x = torch.tensor([-1.0, 0.5, 2.0])
    with caplog.at_level(logging.INFO, logger="trtspec.torch"):
        out = fn(x)
    assert torch.equal(out, torch.tensor([1.0, 2.0, 5.0]))
    assert "torch_tensorrt is not importable; compiling" in caplog.text and "with inductor" in caplog.text
