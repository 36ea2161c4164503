"""An EAGLE-3 head trained on what a built engine writes (distill/data.py, distill/eagle3_engine.py): the shards
hold the engine's own greedy answers and features, a stopped data run resumes, and a stopped training run resumes
to the same losses as one that was not stopped."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCH, random_ids
from trtspec import Generator, load_engine
from trtspec.distill.data import TargetData, done_pairs, top_distribution, write_target_data

FEATURES = "low,mid,high"


@pytest.fixture(scope="module")
def engine(built):
    return built(ARCH, hidden_states=FEATURES)


def _requests(n=5):
    return [(f"r{i}", random_ids(6 + i, seed=40 + i, vocab=200).tolist()) for i in range(n)]


def test_target_data_holds_the_engines_greedy_answers_and_resumes_where_it_stopped(engine, tmp_path):
    requests = _requests()
    first = write_target_data(engine, tmp_path, requests, max_new_tokens=12, max_tokens=15)  # a budget: stops early
    assert 0 < first["answers"] < len(requests) and first["remaining"] == len(requests) - first["answers"]
    second = write_target_data(engine, tmp_path, requests, max_new_tokens=12)
    assert first["answers"] + second["answers"] == len(requests) and second["remaining"] == 0
    assert done_pairs(tmp_path) == {(name, 0) for name, _ in requests}
    assert write_target_data(engine, tmp_path, requests, max_new_tokens=12)["answers"] == 0  # nothing left to do

    data = TargetData(tmp_path)
    target = load_engine(engine)
    gen = Generator(target)
    eos = set(target.manifest["model"]["special_tokens"]["eos_token_ids"])
    for i, name in enumerate(data.names):
        tokens, prompt_len, features, top_ids, top_probs = data.sequence(i)
        ids = dict(requests)[name]
        answer = gen.generate([ids], max_new_tokens=12)[0].token_ids  # a fresh greedy run (its EOS left out)
        assert tokens[:prompt_len].tolist() == ids
        assert [t for t in tokens[prompt_len:].tolist() if t not in eos] == answer
        # the features and distributions of every fed position: the engine's over the whole sequence at once
        target.reset()
        logits = target.forward(tokens[None, :-1].astype(np.int64), np.arange(len(tokens) - 1)[None])
        np.testing.assert_allclose(features.astype(np.float32), target.features[0], atol=2e-2, rtol=1e-2)
        ref_ids, ref_probs = top_distribution(logits[0])
        assert (top_ids[:, 0] == ref_ids[:, 0]).all()
        np.testing.assert_allclose(top_probs.astype(np.float32), ref_probs.astype(np.float32), atol=2e-3)
        assert (top_ids[prompt_len - 1 : -1, 0] == tokens[prompt_len:-1]).all()  # greedy: each token the top one
    gen.close()

    # a shard of another engine (features of another width) beside them is refused, naming it
    from trtspec.training import DistillError

    shards = sorted(tmp_path.glob("shard-*.npz"))
    assert len(shards) == 2  # (the two runs': the data above came from both)
    with np.load(shards[0]) as z:
        parts = dict(z)
    parts["features"] = parts["features"][:, :-8]
    np.savez(tmp_path / "shard-99999.npz", **parts)
    with pytest.raises(DistillError, match=r"shard-99999.npz: its features .* foreign or damaged shard"):
        TargetData(tmp_path)


def test_head_training_resumes_to_the_losses_of_an_uninterrupted_run(engine, tmp_path, monkeypatch):
    from trtspec.distill import eagle3_engine

    requests = _requests(6)
    write_target_data(engine, tmp_path / "data", requests, max_new_tokens=24)
    held = _requests(2)
    options = dict(data_dir=tmp_path / "data", data_tokens=0, steps=6, batch=2, seq=32, checkpoint_every=2,
                   eval_every=0, eval_tokens=8, heldout=[(f"h{n}", ids) for n, ids in held], bf16=False, draft_vocab=64)
    whole = eagle3_engine.distill_eagle3_engine(engine, tmp_path / "whole", **options)

    real = eagle3_engine.Batches.batch

    def stop_at_5(self, step, size, device="cpu"):
        if step == 4:
            raise KeyboardInterrupt
        return real(self, step, size, device)

    monkeypatch.setattr(eagle3_engine.Batches, "batch", stop_at_5)
    with pytest.raises(KeyboardInterrupt):
        eagle3_engine.distill_eagle3_engine(engine, tmp_path / "stopped", **options)
    monkeypatch.setattr(eagle3_engine.Batches, "batch", real)
    resumed = eagle3_engine.distill_eagle3_engine(engine, tmp_path / "stopped", **options)
    losses = [(h["step"], h["loss"]) for h in whole["loss_curve"]]
    assert [(h["step"], h["loss"]) for h in resumed["loss_curve"]] == losses and losses[-1][0] == 6
    assert resumed["heldout"]["heldout_agreement"] == whole["heldout"]["heldout_agreement"]
    acceptance = whole["heldout"]["acceptance"]
    assert acceptance["prompts"] == 2 and 0.0 <= acceptance["alpha"] <= 1.0
    assert whole["draft_vocab"]["size"] == 64


def test_training_on_from_a_head_starts_from_its_weights_and_vocabulary(engine, tmp_path):
    """--init: a run from a trained head (at a learning rate too small to move it) measures what that head measured,
    over the same vocabulary; another vocabulary size is refused."""
    import torch

    from trtspec.distill import eagle3_engine
    from trtspec.heads.eagle3 import load_head
    from trtspec.training import DistillError

    write_target_data(engine, tmp_path / "data", _requests(4), max_new_tokens=24)
    options = dict(data_dir=tmp_path / "data", data_tokens=0, batch=2, seq=32, eval_every=0, eval_tokens=8,
                   heldout=[(f"h{n}", ids) for n, ids in _requests(2)], bf16=False)
    first = eagle3_engine.distill_eagle3_engine(engine, tmp_path / "first", steps=8, draft_vocab=48, lr=5e-3, **options)
    on = eagle3_engine.distill_eagle3_engine(engine, tmp_path / "on", steps=1, lr=1e-12, init=tmp_path / "first",
                                             **options)
    assert on["draft_vocab"]["size"] == 48 and on["training"]["init"] == str(tmp_path / "first")
    assert on["heldout"]["heldout_agreement"] == first["heldout"]["heldout_agreement"]
    target = eagle3_engine.engine_source(engine, load_engine(engine).manifest)
    a, _ = load_head(tmp_path / "first", target_dir=target)
    b, _ = load_head(tmp_path / "on", target_dir=target)
    assert torch.equal(a.d2t, b.d2t)
    assert torch.allclose(a.fc.weight, b.fc.weight, atol=1e-6) and not torch.equal(a.fc.weight, torch.zeros_like(a.fc.weight))
    with pytest.raises(DistillError, match="vocabulary of 48 tokens"):
        eagle3_engine.distill_eagle3_engine(engine, tmp_path / "other", steps=1, draft_vocab=64,
                                            init=tmp_path / "first", **options)


def test_packed_rows_hold_every_answer_once_an_epoch_and_the_head_attends_within_each_answer(engine, tmp_path):
    """Training rows pack several answers' windows end to end: an epoch's rows hold each answer once, batches take
    the epochs' rows in turn, and the head's outputs on a packed row equal its outputs on each window alone (from
    place j on at step j: what the loss counts)."""
    import torch

    from trtspec.distill.eagle3_engine import Batches
    from trtspec.heads.eagle3 import Eagle3Config, make_head

    write_target_data(engine, tmp_path, _requests(6), max_new_tokens=24)
    data = TargetData(tmp_path)
    vocab = load_engine(engine).manifest["model"]["vocab_size"]
    batches = Batches(data, np.arange(vocab), seq=64, seed=3, pack=True)
    lengths = {i: min(int(data.offsets[i + 1] - data.offsets[i]) - 2, 64) for i in batches.usable}
    rows = batches._packed_rows(0)
    assert sorted(i for row in rows for i in row) == sorted(batches.usable)
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows) and len(rows) < len(batches.usable)
    stream = rows + batches._packed_rows(1) + batches._packed_rows(2)
    for step in range(3):
        places = batches.batch(step, 2)[5]
        # each row's places restart at 0 where its windows start: the rows stream[2 * step], stream[2 * step + 1]
        for r, row in enumerate(stream[2 * step : 2 * step + 2]):
            starts = np.cumsum([0] + [lengths[i] for i in row])[:-1]
            assert (np.flatnonzero(places[r].numpy() == 0)[: len(row)] == starts).all()

    torch.manual_seed(0)
    feats_size = batches.make([(batches.usable[0], None)])[0].shape[-1] // 3
    head = make_head(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=feats_size)).eval()
    row = max(rows, key=len)
    assert len(row) >= 2
    feats, toks, ids, w, mask, places = batches.make([[(i, None) for i in row]])
    alone = [batches.make([(i, None)]) for i in row]
    with torch.no_grad():
        packed = head.forward_steps(feats, toks, 4, hidden_only=True, positions=places)
        each = [head.forward_steps(a[0], a[1], 4, hidden_only=True) for a in alone]
    at = 0
    for a, outs in zip(alone, each):
        n = a[1].shape[1]
        torch.testing.assert_close(feats[0, at : at + n], a[0][0])
        assert torch.equal(mask[0, at : at + n], a[4][0])
        for j in range(4):
            torch.testing.assert_close(packed[j][0, at + j : at + n], outs[j][0, j:], atol=1e-5, rtol=1e-5)
        at += n
