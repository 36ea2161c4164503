"""trtspec distill and the resumable training loop, on tiny random-init targets."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from trtspec import TrtspecError, UnsupportedModelError, distill
from trtspec.cli import main as cli_main
from trtspec.distill import draft_config, heldout_metrics, sample_continuations
from trtspec.testing import make_tiny_model, make_tokenizer, tiny_config
from trtspec.training import TrainConfig, TrainLoop, random_windows

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for p in sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("*.py"))[:12]:
        shutil.copy(p, d / p.name)
    return d


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model("llama-gqa-rope3", tmp_path_factory.mktemp("target") / "m")


def test_distill_reduces_kl_and_writes_a_usable_draft(tmp_path, target, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "draft"
    report = distill(target, out, [corpus], steps=40, batch=4, seq=64, eval_prompts=3, eval_tokens=12,
                     checkpoint_every=20)
    teacher = AutoModelForCausalLM.from_pretrained(target).eval()
    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    # the draft has the target's family, a smaller shape, and the target's tokenizer, file for file
    assert draft.config.model_type == teacher.config.model_type
    assert draft.config.hidden_size == teacher.config.hidden_size // 2
    assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    assert not (out / ".distill").exists()
    # distillation moved the draft toward the target's distribution: held-out KL below the untrained
    # draft's, and below that of the same draft trained on the text alone (kd_weight 0) for as long
    # (a random tiny target is near-uniform, so the KL starts small)
    baseline = tmp_path / "baseline"
    distill(target, baseline, [corpus], steps=40, batch=4, seq=64, kd_weight=0.0, eval_prompts=0)
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(draft_config(teacher.config)).eval()
    tok = AutoTokenizer.from_pretrained(target)
    held = np.asarray(tok((corpus / "decoder.py").read_text())["input_ids"], dtype=np.int32)
    before = heldout_metrics(untrained, teacher, held, 64)["heldout_kl"]
    after = heldout_metrics(draft, teacher, held, 64)["heldout_kl"]
    plain = heldout_metrics(AutoModelForCausalLM.from_pretrained(baseline).eval(), teacher, held, 64)["heldout_kl"]
    assert after < 0.9 * before and after < 0.9 * plain, (before, after, plain)
    # the report is on disk and agrees with the returned one; alpha was measured through engines
    on_disk = json.loads((out / "distill_report.json").read_text())
    assert on_disk["heldout_kl"] == pytest.approx(report["heldout_kl"])
    acc = on_disk["acceptance"]
    assert acc["k"] == 4 and acc["prompts"] == 3 and 0.0 <= acc["alpha"] <= 1.0 and acc["tokens_per_target_call"] > 0
    assert len(on_disk["loss_curve"]) >= 2 and on_disk["loss_curve"][-1]["loss"] < on_disk["loss_curve"][0]["loss"]


def test_a_minutes_budget_is_timed_past_the_slow_first_steps(monkeypatch):
    """The step count of a --minutes budget comes from the steps after the first two: a run whose first steps are
    slow (its data touched for the first time) still trains for its budget, not for a fraction of it. (The loop's
    clock is one that the batches move: 0.5 s for each of the first two steps, 1/64 s for each after.)"""
    from trtspec import training

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(training, "time", clock)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.ones(4))

    def batches(step):
        clock.now += 0.5 if step < 2 else 1 / 64

    loop = TrainLoop(model, TrainConfig(minutes=0.025, batch=1, seq=1, lr=1e-3, seed=0, log_every=1000), None,
                     log=lambda m: None)
    seconds = loop.run(batches, lambda m, b, step: (m.weight ** 2).sum())
    # 1.5 s at 1/64 s a step (the first five steps' mean, 0.21 s, would have made it 7 steps)
    assert loop.total_steps == loop.step == 96
    assert seconds == pytest.approx(2 * 0.5 + 94 / 64)


def test_stopped_training_resumes_to_the_same_weights(tmp_path):
    tok = make_tokenizer()
    data = np.arange(5000, dtype=np.int32) % len(tok)

    def model():
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok) + 16))

    def loss(m, w, step):
        return torch.nn.functional.cross_entropy(m(input_ids=w[:, :-1]).logits.flatten(0, 1).float(), w[:, 1:].flatten())

    def batches(step):
        return torch.from_numpy(random_windows(data, 2, 16, 7, step))

    cfg = TrainConfig(steps=12, batch=2, seq=16, lr=1e-3, seed=7, checkpoint_every=5, log_every=100)
    whole = model()
    TrainLoop(whole, cfg, tmp_path / "a", log=lambda m: None).run(batches, loss)

    class Stop(Exception):
        pass

    def stopping(step):
        if step == 7:  # killed after the step-5 checkpoint
            raise Stop
        return batches(step)

    with pytest.raises(Stop):
        TrainLoop(model(), cfg, tmp_path / "b", log=lambda m: None).run(stopping, loss)
    resumed_model = model()
    loop = TrainLoop(resumed_model, cfg, tmp_path / "b", log=lambda m: None)
    assert loop.step == 5
    loop.run(batches, loss)
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed_model.state_dict().items()):
        assert torch.equal(a, b), name
    # a checkpoint from other settings is refused, not silently mixed in
    with pytest.raises(TrtspecError, match="different run"):
        TrainLoop(model(), TrainConfig(steps=12, batch=2, seq=16, lr=2e-3, seed=7), tmp_path / "b")


def test_sampled_continuations_keep_the_prompt_and_follow_the_seed(target):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(target).eval()
    w = torch.randint(3, 300, (2, 17))
    a = sample_continuations(teacher, w, 5, seed=1, step=3, eos_id=2)
    b = sample_continuations(teacher, w, 5, seed=1, step=3, eos_id=2)
    c = sample_continuations(teacher, w, 5, seed=1, step=4, eos_id=2)
    assert a.shape == w.shape and torch.equal(a[:, :5], w[:, :5])
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_distill_refuses_bad_input(tmp_path, target, corpus):
    quiet = dict(steps=1, batch=2, seq=16, eval_prompts=0)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(TrtspecError, match="not empty"):
        distill(target, busy, [corpus], **quiet)
    assert (busy / "notes.txt").read_text() == "mine" and len(list(busy.iterdir())) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrtspecError, match="no training text"):
        distill(target, tmp_path / "d1", [empty], **quiet)
    with pytest.raises(TrtspecError, match="does not exist"):
        distill(target, tmp_path / "d2", [tmp_path / "nope"], **quiet)
    with pytest.raises(TrtspecError, match="kd_weight"):
        distill(target, tmp_path / "d3", [corpus], kd_weight=1.5, **quiet)
    # a family the step graph does not support
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 100}))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        distill(foreign, tmp_path / "d4", [corpus], **quiet)
    # a tokenizer that does not belong to the model (more tokens than the vocabulary)
    mismatched = tmp_path / "mismatched"
    shutil.copytree(target, mismatched)
    cfg = json.loads((mismatched / "config.json").read_text())
    cfg["vocab_size"] = 100
    (mismatched / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TrtspecError, match="do not belong together"):
        distill(mismatched, tmp_path / "d5", [corpus], **quiet)
    # options of one method given to another
    with pytest.raises(TrtspecError, match="unknown method 'lora'"):
        distill(target, tmp_path / "d6", [corpus], method="lora", **quiet)
    with pytest.raises(TrtspecError, match="layers, kd_weight apply to a draft model .method=.draft.., not to eagle3 heads"):
        distill(target, tmp_path / "d7", [corpus], method="eagle3", layers=2, kd_weight=0.5, **quiet)
    with pytest.raises(TrtspecError, match="intermediate applies to a draft model .method=.draft.., not to medusa heads"):
        distill(target, tmp_path / "d8", [corpus], method="medusa", intermediate=64, **quiet)
    with pytest.raises(TrtspecError, match="draft_vocab sizes a head's vocabulary"):
        distill(target, tmp_path / "d9", [corpus], draft_vocab=256, **quiet)
    for d in ("d1", "d2", "d3", "d4", "d5", "d6", "d7", "d8", "d9"):
        assert not (tmp_path / d).exists()


def test_cli_reports_errors(tmp_path, target, capsys):
    rc = cli_main(["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--data", str(tmp_path / "nope")])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_float16_target_trains_a_float32_draft_and_stores_it_as_float16(tmp_path, target, corpus):
    from transformers import AutoModelForCausalLM

    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(target).to(torch.float16).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, half / name)
    report = distill(half, tmp_path / "d", [corpus], steps=6, batch=2, seq=32, eval_prompts=0)
    assert np.isfinite(report["heldout_kl"]) and np.isfinite(report["heldout_perplexity"])  # fp16 master weights diverge
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    assert next(draft.parameters()).dtype == torch.float16
