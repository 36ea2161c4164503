"""Sliding-window layers keep a ring buffer of window + max_call_tokens - 1 slots: logits equal HF's and the
full-size cache's beyond the window, at the wrap, under rollback, through speculation and prefix reuse."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import S_MAX, hf_logits, random_ids
from trtspec import CapacityError, Generator, Scheduler, load_engine, quantize
from trtspec.exporter.contract import contract_violations

WINDOW = 16  # the tiny models' sliding window (trtspec.testing.tiny_config)
CALL = 4  # max_call_tokens of the ring exports
RING = WINDOW + CALL - 1
TOL = 1e-4
WINDOWED = ["mistral", "phi3", "gemma2", "gemma3"]  # every layer windowed; Gemma: local/global layers


@pytest.fixture(scope="module")
def ring_engine(exported, built):
    def get(arch: str, form: str = "export", seed: int = 0, **options):
        if form == "export":
            return load_engine(exported(arch, seed, max_call_tokens=CALL, **options))
        return load_engine(built(arch, max_call_tokens=CALL, **options))

    return get


def _chunked(engine, ids, sizes):
    # one row read in calls of the given sizes (each <= CALL): logits [len(ids), V]
    out, p = [], 0
    for size in sizes:
        size = min(size, len(ids) - p)
        if size <= 0:
            break
        out.append(engine.forward(ids[None, p : p + size], np.arange(p, p + size)[None])[0].copy())
        p += size
    return np.concatenate(out)


def test_local_layers_hold_only_their_window(exported):
    path = exported("gemma3", max_call_tokens=CALL)  # layer 0 local (window 16), layer 1 global
    manifest = json.loads((path / "manifest.json").read_text())
    m = manifest["model"]
    assert (m["cache_slots"], m["max_call_tokens"], m["sliding_windows"]) == ([RING, S_MAX], CALL, [WINDOW, None])
    model = onnx.load(str(path / "model.onnx"))
    graph = model.graph
    assert contract_violations(model, m["num_layers"]) == []
    modes = {n.input[0]: next((a.s.decode() for a in n.attribute if a.name == "mode"), "linear")
             for n in graph.node if n.op_type == "TensorScatter"}
    assert modes == {"past_key_0": "circular", "past_value_0": "circular", "past_key_1": "linear",
                     "past_value_1": "linear"}
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim][2] for i in graph.input[2:]}
    assert dims == {"past_key_0": RING, "past_value_0": RING, "past_key_1": S_MAX, "past_value_1": S_MAX}
    engine = load_engine(path)
    assert [b.shape[2] for b in engine.cache.values()] == [RING, RING, S_MAX, S_MAX]
    # without rings (or where the ring would not be smaller) every layer keeps S_max slots and calls are unbounded
    for options in ({"ring_cache": False}, {}):
        m = json.loads((exported("gemma3", **options) / "manifest.json").read_text())["model"]
        assert (m["cache_slots"], m["max_call_tokens"]) == ([S_MAX, S_MAX], S_MAX)


@pytest.mark.parametrize("form", ["export", "fused"])
@pytest.mark.parametrize("arch", WINDOWED)
def test_ring_logits_equal_hf_and_the_full_cache_beyond_the_window(arch, form, ring_engine, exported, model_dir,
                                                                    hf_model):
    ring = ring_engine(arch, form)
    full = load_engine(exported(arch, ring_cache=False))
    ids = random_ids(60, seed=3)  # almost 4 windows: the ring wraps three times, inside calls too
    sizes = [4, 3, 4, 1, 4, 2, 1, 4, 4, 3, 4, 4, 4, 4, 4, 4, 4, 2]
    got = _chunked(ring, ids, sizes)
    np.testing.assert_allclose(got, hf_logits(hf_model(model_dir(arch)), ids), atol=TOL, rtol=0)
    np.testing.assert_allclose(got, _chunked(full, ids, sizes), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_rollback_across_the_wrap_in_a_ragged_batch_stays_exact(arch, ring_engine, model_dir, hf_model):
    # rounds of CALL-token calls (as verify calls) per row, each keeping a random number of them (0..CALL);
    # the rejected ones stay in the ring, overwritten later, and every call's logits must equal HF's
    engine, model = ring_engine(arch), hf_model(model_dir(arch))
    rng = np.random.default_rng(0)
    seqs = [list(random_ids(3, seed=20)), list(random_ids(9, seed=21))]
    engine.forward(np.stack([seqs[0] + [0] * 6, seqs[1]])[:, :CALL], np.tile(np.arange(CALL), (2, 1)))
    engine.forward(np.stack([[0] * CALL, seqs[1][CALL : 2 * CALL]]), np.stack([np.arange(3, 3 + CALL),
                                                                                np.arange(CALL, 2 * CALL)]))
    engine.forward(np.array([[0] * CALL, [seqs[1][8], 0, 0, 0]]), np.stack([np.arange(3, 7), np.arange(8, 12)]))
    lengths = [3, 9]  # row 0's pads at 3..6 and row 1's at 9..11 are stale, like rejected drafts
    rounds = kept_none = 0
    while max(lengths) + CALL <= S_MAX:
        cands = [list(rng.integers(3, 300, CALL)) for _ in seqs]
        pos = np.stack([np.arange(n, n + CALL) for n in lengths])
        out = engine.forward(np.array(cands), pos)
        for r in range(2):
            ref = hf_logits(model, np.array(seqs[r] + cands[r]))
            np.testing.assert_allclose(out[r], ref[lengths[r] :], atol=TOL, rtol=0,
                                       err_msg=f"round {rounds}, row {r} at length {lengths[r]}")
            keep = int(rng.integers(0, CALL + 1))
            kept_none += keep == 0
            seqs[r] += cands[r][:keep]
            lengths[r] += keep
        rounds += 1
    assert rounds >= 15 and kept_none >= 2 and min(lengths) > 2 * RING  # wrapped, and rolled back at the wrap


def test_a_call_longer_than_the_ring_allows_is_refused(ring_engine):
    engine = ring_engine("mistral")
    with pytest.raises(CapacityError, match=f"at most {CALL}.*--max-call-tokens 5"):
        engine.forward(np.ones((1, CALL + 1), np.int64), np.arange(CALL + 1)[None])


def _prompts():
    return [random_ids(n, seed=30 + n).tolist() for n in (5, 23, 41)]  # shorter and longer than the ring


@pytest.mark.parametrize("drafter", ["draft", "prompt_lookup"])
def test_greedy_speculation_on_rings_equals_full_cache_target_greedy(drafter, ring_engine, exported):
    target = ring_engine("mistral")
    reference = [r.token_ids for r in Generator(load_engine(exported("mistral", ring_cache=False))).generate(
        _prompts(), max_new_tokens=18)]
    draft = ring_engine("mistral", seed=1) if drafter == "draft" else None
    for policy in ("fixed", "load-aware"):
        gen = Generator(target, draft, drafter=drafter, num_draft_tokens=CALL - 1, k_policy=policy)
        out = gen.generate(_prompts(), max_new_tokens=18)
        assert [r.token_ids for r in out] == reference, policy


@pytest.mark.parametrize("drafter", ["none", "draft", "prompt_lookup"])
def test_a_grammar_forcing_more_tokens_than_a_call_carries_runs_on_rings(drafter, ring_engine, exported):
    # jump-forward verifies forced tokens and a draft chain takes them: on rings both stay within CALL tokens a call
    fmt = {"type": "regex", "regex": "(ab|cd) = the quick brown fox, (x|y){4}"}
    prompts = ["x = ", "def f():"]
    reference = [r.text for r in Generator(load_engine(exported("mistral", ring_cache=False))).generate(
        prompts, max_new_tokens=40, response_format=fmt)]
    draft = ring_engine("mistral", seed=1) if drafter == "draft" else None
    gen = Generator(ring_engine("mistral"), draft, drafter=drafter, num_draft_tokens=CALL - 1, k_policy="fixed")
    out = gen.generate(prompts, max_new_tokens=40, response_format=fmt)
    assert [r.text for r in out] == reference
    assert all(" = the quick brown fox, " in t for t in reference), reference
    assert all(r.stats.forced_tokens >= CALL for r in out)  # more forced tokens than one call carries


def test_prefix_reuse_on_rings_keeps_only_what_the_ring_still_holds(ring_engine, exported):
    target, draft = ring_engine("mistral"), ring_engine("mistral", seed=1)
    plain = Generator(load_engine(exported("mistral", ring_cache=False)))
    scheduler = Scheduler(target, draft, num_draft_tokens=CALL - 1, min_prefix_tokens=4)
    try:
        system = random_ids(30, seed=40).tolist()
        n = scheduler.register_prefix(system)
        question = system + random_ids(6, seed=41).tolist()
        got = scheduler.submit(question, max_new_tokens=12).result(timeout=60)
        assert got.token_ids == plain.generate([question], max_new_tokens=12)[0].token_ids
        assert got.stats.prefix_tokens_reused == n == 30
        # a prompt sharing only the first 10 tokens: the rings forgot the window before token 10, so nothing is
        # reused (a full cache would reuse 10) and the output is still the target's own
        other = system[:10] + random_ids(12, seed=42).tolist()
        got = scheduler.submit(other, max_new_tokens=12).result(timeout=60)
        assert got.stats.prefix_tokens_reused == 0
        assert got.token_ids == plain.generate([other], max_new_tokens=12)[0].token_ids
    finally:
        scheduler.close()


def test_torch_backend_keeps_the_export_rings(exported, model_dir, hf_model):
    import trtspec

    engine = trtspec.compile(exported("gemma3", max_call_tokens=CALL), backend="eager")
    assert [tuple(c.shape)[2] for c in engine.caches] == [RING, RING, S_MAX, S_MAX]
    ids = random_ids(40, seed=5)
    got = _chunked(engine, ids, [4, 1, 3, 4, 4, 2, 4, 4, 4, 4, 4, 2])
    np.testing.assert_allclose(got, hf_logits(hf_model(model_dir("gemma3")), ids), atol=TOL, rtol=0)


def test_calibrated_quantization_reads_a_ring_export(exported, tmp_path):
    src = exported("gemma3", max_call_tokens=CALL)
    out = quantize(src, tmp_path / "q", mode="int4-awq", block_size=32, calib_samples=4)
    made = json.loads((out / "manifest.json").read_text())
    assert made["quantization"]["calibration"]["seq_len"] == CALL  # one call per window
    assert made["model"]["cache_slots"] == [RING, S_MAX]
    ids = random_ids(40, seed=6)
    sizes = [CALL] * 10
    reference = _chunked(load_engine(src), ids, sizes)
    got = _chunked(load_engine(out), ids, sizes)
    assert np.abs(got - reference).max() / np.abs(reference).max() < 0.4  # test_quantize's int4 bound
    assert (got.argmax(-1) == reference.argmax(-1)).mean() >= 0.5


def test_tensorrt_is_told_to_take_the_full_cache(exported):
    from trtspec.builder.tensorrt_check import check_export
    from trtspec.builder.tensorrt_plan import profile_plan

    ring = exported("gemma3", max_call_tokens=CALL)
    problems = check_export(ring)
    assert [p.split(":")[0] for p in problems if "circular" in p] == [
        "node_kv_cache_write_ring", "node_kv_cache_write_ring_1"]  # layer 0's key and value writes, nothing else
    assert all("--no-ring-cache" in p for p in problems if "circular" in p)
    with pytest.raises(ValueError, match="ring-buffer caches.*--no-ring-cache"):
        profile_plan(json.loads((ring / "manifest.json").read_text())["model"])
    full = json.loads((exported("gemma3", ring_cache=False) / "manifest.json").read_text())["model"]
    assert profile_plan(full)["buffers"]["cache_shape"][2] == S_MAX


def test_export_cli_sets_the_ring_layout(model_dir, tmp_path, capsys):
    from trtspec.cli import main

    layouts = {}
    for name, flags in (("ring", ["--max-call-tokens", "8"]), ("full", ["--max-call-tokens", "8", "--no-ring-cache"])):
        out = tmp_path / name
        assert main(["export", str(model_dir("gemma3")), "-o", str(out), "--max-seq-len", "48", "--max-batch", "1",
                     *flags]) == 0
        m = json.loads((out / "manifest.json").read_text())["model"]
        layouts[name] = (m["cache_slots"], m["max_call_tokens"])
    assert layouts == {"ring": ([WINDOW + 7, 48], 8), "full": ([48, 48], 48)}
    capsys.readouterr()
    assert main(["export", str(model_dir("gemma3")), "-o", str(tmp_path / "bad"), "--max-seq-len", "48",
                 "--max-call-tokens", "64"]) != 0
    assert "max_call_tokens must be an integer in [1, max_seq_len=48], got 64" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before anything was written
