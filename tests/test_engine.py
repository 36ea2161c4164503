"""The onnxruntime engine: in-place cache writes, builds, and bad input that leaves the engine usable."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import MAX_BATCH, S_MAX, hf_logits, random_ids
from trtspec import ArtifactError, CapacityError, build, load_engine

TOL = 1e-4


@pytest.fixture(scope="module")
def engine_dir(exported, tmp_path_factory):
    return build(exported("llama-gqa-rope3"), tmp_path_factory.mktemp("engines") / "llama")


def test_built_engine_matches_hf_and_records_its_source(engine_dir, exported, model_dir, hf_model):
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["backend"] == "onnxruntime" and manifest["format"] == "trtspec-engine"
    assert manifest["source"]["export_dir"] == str(exported("llama-gqa-rope3").resolve())
    engine = load_engine(engine_dir, num_threads=1)
    ids = random_ids(10, seed=7)
    out = engine.forward(ids[None], np.arange(10)[None])
    np.testing.assert_allclose(out[0], hf_logits(hf_model(model_dir("llama-gqa-rope3")), ids), atol=TOL, rtol=0)


def test_cache_is_written_in_place_at_exactly_the_written_slots(engine_dir):
    engine = load_engine(engine_dir)
    buffers = list(engine.cache.values())
    addresses = [b.ctypes.data for b in buffers]
    engine.forward(random_ids(5, seed=1)[None].repeat(2, 0), np.tile(np.arange(5), (2, 1)))
    before = [b.copy() for b in buffers]
    # row 0 writes slots 5..7, row 1 writes slots 9..11
    engine.forward(random_ids(6, seed=2).reshape(2, 3), np.array([[5, 6, 7], [9, 10, 11]]))
    for buf, old, addr in zip(buffers, before, addresses):
        assert buf.ctypes.data == addr  # the same buffer, never reallocated
        changed = np.any(buf != old, axis=(1, 3))  # [max_batch, S_max]: which (row, slot) changed
        expected = np.zeros_like(changed)
        expected[0, 5:8] = True
        expected[1, 9:12] = True
        np.testing.assert_array_equal(changed, expected)
    # onnxruntime returned the present_* outputs in our buffers: no copy of the cache was made, by the graph
    # of several-token calls and (after a one-token call) by the decode graph
    engine.forward(random_ids(2, seed=3).reshape(2, 1), np.array([[8], [12]]))
    for (b, t) in ((2, 3), (2, 1)):
        g = engine._graph_for(b, t)
        outputs = g.small[(b, t)].io.get_outputs()
        assert len(outputs) == len(g.session.get_outputs())
        assert set(addresses) <= {o.data_ptr() for o in outputs}
    assert engine._graph_for(2, 3) is not engine._graph_for(2, 1)  # the fused build has both


def test_position_beyond_capacity_is_refused_and_the_cache_is_untouched(engine_dir, model_dir, hf_model):
    engine = load_engine(engine_dir)
    ids = random_ids(8, seed=3)
    engine.forward(ids[None, :6], np.arange(6)[None])
    snapshot = [b.copy() for b in engine.cache.values()]
    with pytest.raises(CapacityError, match=f"holds {S_MAX} positions"):
        engine.forward(np.array([[5, 6, 7]]), np.array([[S_MAX - 2, S_MAX - 1, S_MAX]]))
    with pytest.raises(CapacityError, match="--max-batch"):
        engine.forward(np.ones((MAX_BATCH + 1, 1), np.int64), np.zeros((MAX_BATCH + 1, 1), np.int64))
    with pytest.raises(ValueError, match="consecutive"):
        engine.forward(np.array([[5, 6]]), np.array([[6, 8]]))
    with pytest.raises(ValueError, match="token ids must lie in"):
        engine.forward(np.array([[10**6]]), np.array([[6]]))
    for buf, old in zip(engine.cache.values(), snapshot):
        np.testing.assert_array_equal(buf, old)
    out = engine.forward(ids[None, 6:8], np.arange(6, 8)[None])
    np.testing.assert_allclose(out[0], hf_logits(hf_model(model_dir("llama-gqa-rope3")), ids)[6:8], atol=TOL, rtol=0)


def _copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_truncated_graph_is_refused(engine_dir, tmp_path):
    path = _copy(engine_dir, tmp_path)
    data = (path / "model.onnx").read_bytes()
    (path / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="model.onnx does not match the sha256"):
        load_engine(path)


def test_manifest_with_wrong_hash_is_refused(engine_dir, tmp_path):
    path = _copy(engine_dir, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer.json"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json does not match"):
        load_engine(path)


def test_missing_tokenizer_file_is_refused(engine_dir, tmp_path):
    path = _copy(engine_dir, tmp_path)
    (path / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json named in the manifest is missing"):
        load_engine(path)


def test_foreign_directories_are_refused(tmp_path):
    with pytest.raises(ArtifactError, match="not a trtspec artifact"):
        load_engine(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(ArtifactError, match="not a trtspec manifest"):
        load_engine(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_engine(tmp_path)


def test_wrong_backend_for_an_artifact_is_refused(engine_dir):
    with pytest.raises(ArtifactError, match="built for onnxruntime, not for backend 'tensorrt'"):
        load_engine(engine_dir, backend="tensorrt")


def test_build_refuses_to_overwrite_a_foreign_directory_and_replaces_its_own(exported, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a trtspec artifact; refusing to overwrite"):
        build(exported("llama"), foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    out = build(exported("llama"), tmp_path / "eng")
    first = json.loads((out / "manifest.json").read_text())
    build(exported("llama"), tmp_path / "eng")
    assert json.loads((out / "manifest.json").read_text())["files"] == first["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng", "mine"]  # no temp dirs left behind


def test_a_call_over_later_rows_writes_only_those_rows_and_matches_hf(engine_dir, model_dir, hf_model):
    engine = load_engine(engine_dir)
    hf = hf_model(model_dir("llama-gqa-rope3"))
    ids = random_ids(14, seed=11).reshape(2, 7)
    engine.forward(random_ids(7, seed=12)[None], np.arange(7)[None])  # row 0 holds another sequence
    before = [b.copy() for b in engine.cache.values()]
    out = engine.forward(ids, np.tile(np.arange(7), (2, 1)), first_row=1)  # rows 1 and 2
    for row in range(2):
        np.testing.assert_allclose(out[row], hf_logits(hf, ids[row]), atol=TOL, rtol=0)
    for buf, old in zip(engine.cache.values(), before):
        np.testing.assert_array_equal(buf[0], old[0])
    # the sequence in row 2 continues from row 0 after a move of its 7 slots, as if it had been there
    engine.move_row(2, 0, 7)
    nxt = random_ids(1, seed=13)
    logits = engine.forward(nxt[None], np.array([[7]]))
    np.testing.assert_allclose(logits[0, 0], hf_logits(hf, np.append(ids[1], nxt))[-1], atol=TOL, rtol=0)
    with pytest.raises(CapacityError, match="rows 2..3 asked for but the engine holds 3"):
        engine.forward(ids, np.tile(np.arange(7), (2, 1)), first_row=2)


def test_a_saved_prefix_loaded_into_another_row_continues_the_same_sequence(engine_dir, model_dir, hf_model):
    engine = load_engine(engine_dir)
    hf = hf_model(model_dir("llama-gqa-rope3"))
    ids = random_ids(9, seed=21)
    engine.forward(ids[None, :8], np.arange(8)[None])
    saved = engine.save_prefix(0, 8)
    assert saved.nbytes == sum(b[0, :, :8].nbytes for b in engine.cache.values())
    engine.reset()
    engine.load_prefix(saved, 2)
    logits = engine.forward(ids[None, 8:9].repeat(3, 0), np.full((3, 1), 8))
    np.testing.assert_allclose(logits[2, 0], hf_logits(hf, ids)[-1], atol=TOL, rtol=0)


def test_fused_engine_runs_single_row_and_single_token_calls_on_its_decode_graph(built, model_dir, hf_model):
    engine_dir = built("llama-gqa-rope3")
    decode = json.loads((engine_dir / "manifest.json").read_text())["build"]["decode_graph"]
    assert decode["graph"] == "decode.onnx" and decode["group_query_attention"] == 2
    engine = load_engine(engine_dir)
    model = hf_model(model_dir("llama-gqa-rope3"))
    a, b = random_ids(12, seed=21), random_ids(10, seed=22)
    ref_a, ref_b = hf_logits(model, a), hf_logits(model, b)
    # one row at a time (prefill, then a 3-token verify), then both rows one token each: the decode graph only
    np.testing.assert_allclose(engine.forward(a[None, :8], np.arange(8)[None])[0], ref_a[:8], atol=TOL, rtol=0)
    np.testing.assert_allclose(engine.forward(b[None, :6], np.arange(6)[None], first_row=1)[0], ref_b[:6], atol=TOL, rtol=0)
    np.testing.assert_allclose(engine.forward(a[None, 8:11], np.arange(8, 11)[None])[0], ref_a[8:11], atol=TOL, rtol=0)
    out = engine.forward(np.array([[a[11]], [b[6]]]), np.array([[11], [6]]))
    np.testing.assert_allclose(out[:, 0], np.stack([ref_a[11], ref_b[6]]), atol=TOL, rtol=0)
    assert engine._full is None  # the built graph was never needed
    # two rows x three tokens: the built graph, over the same cache
    out = engine.forward(np.stack([b[7:10], b[7:10]]), np.stack([np.arange(7, 10), np.arange(7, 10)]))
    np.testing.assert_allclose(out[1], ref_b[7:10], atol=TOL, rtol=0)
    assert engine._full is not None


def test_greedy_steps_equal_a_loop_of_forward_calls_and_stop_when_told(built, model_dir, hf_model):
    from trtspec.engines.base import greedy_steps

    class Plain:  # the generic loop over forward (a wrapper without the engine's own greedy_steps)
        def __init__(self, engine):
            self.engine = engine

        def forward(self, ids, pos, first_row=0):
            return self.engine.forward(ids, pos, first_row=first_row)

    fast, slow = load_engine(built("llama-gqa-rope3")), load_engine(built("llama-gqa-rope3"))
    prompt = random_ids(9, seed=31)
    for e in (fast, slow):
        e.forward(prompt[None, :8], np.arange(8)[None], first_row=2)
    got = {}
    for name, e in (("fast", fast), ("slow", Plain(slow))):
        tokens = []
        calls, seconds = greedy_steps(e, 2, int(prompt[8]), 8, 12, lambda t: tokens.append(t) or True)
        assert calls == 12 and seconds > 0
        got[name] = tokens
    assert got["fast"] == got["slow"]
    for a, b in zip(fast.cache.values(), slow.cache.values()):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    # HF's own greedy continuation of the same 9 tokens
    import torch

    model = hf_model(model_dir("llama-gqa-rope3"))
    want = model.generate(torch.tensor(prompt[None]), max_new_tokens=12, do_sample=False)[0, 9:].tolist()
    assert got["fast"] == want
    # a coupled sampler's pick in place of the argmax: the engine's own loop and forward's give the same tokens
    from trtspec.runtime.picks import coupled_pick

    picked = {}
    for name, e in (("fast", fast), ("slow", Plain(slow))):
        tokens = []
        greedy_steps(e, 2, int(prompt[8]), 8, 12, lambda t: tokens.append(t) or True,
                     pick=lambda x, i: coupled_pick(x, 2.0, 11, 9 + i))
        picked[name] = tokens
    assert picked["fast"] == picked["slow"] != got["fast"]
    # on_token returning False ends the run after that token
    seen = []
    calls, _ = greedy_steps(fast, 0, 5, 0, 10, lambda t: seen.append(t) or len(seen) < 3)
    assert calls == 3 and len(seen) == 3
    # a run that would pass the capacity is refused before any call
    snapshot = [b.copy() for b in fast.cache.values()]
    with pytest.raises(CapacityError, match=f"holds {S_MAX} positions"):
        greedy_steps(fast, 1, 5, S_MAX - 4, 5, lambda t: True)
    for buf, old in zip(fast.cache.values(), snapshot):
        np.testing.assert_array_equal(buf, old)


def test_calls_of_many_shapes_keep_bindings_of_their_own_and_stay_exact(built, model_dir, hf_model):
    # each small call shape keeps its own binding (8 at most, least recently used dropped): ten shapes in turn,
    # then the first again after its binding was dropped, every call against HF's logits
    engine = load_engine(built("llama-gqa-rope3"))
    ids = random_ids(60, seed=41)
    ref = hf_logits(hf_model(model_dir("llama-gqa-rope3")), ids)
    start, outputs = 0, []
    for t in [*range(1, 11), 1, 3]:
        out = engine.forward(ids[None, start : start + t], np.arange(start, start + t)[None])
        np.testing.assert_allclose(out[0], ref[start : start + t], atol=TOL, rtol=0)
        outputs.append((out, start, t))
        start += t
    assert len(engine._decode.small) == engine._decode.SMALL_BINDINGS
    # a result stays valid until the next call of its own shape
    out, s, t = outputs[-2]  # the last 1-token call; calls of 3 tokens came after it
    np.testing.assert_allclose(out[0], ref[s : s + t], atol=TOL, rtol=0)
