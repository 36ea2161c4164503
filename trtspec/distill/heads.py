"""Training draft heads against a target: `trtspec distill --method eagle3` (and medusa).

The data handling is distill's (text files, the held-out rule, packed windows); each step runs the target on a
batch of windows (its hidden states and next-token distributions, no gradients) and trains the head on them.
Resumable from ``OUT/.distill/checkpoint.pt``; ends with a report (``OUT/distill_report.json``): the loss curve,
the head's held-out agreement with the target per drafted position, and the acceptance measured through trtspec
engines (speculative decoding with the head, greedy).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np

from .acceptance import measure_acceptance
from ..training import (
    REPORT,
    WORK,
    DistillError,
    TrainConfig,
    TrainLoop,
    check_out_dir,
    frozen_teacher,
    heldout_prompts,
    load_text,
    random_windows,
)

log = logging.getLogger("trtspec")

EAGLE3_STEP_WEIGHT = 0.8  # the loss of drafted position j weighs 0.8^j (EAGLE-3's choice)


def _prepare(target: Path, out: Path, data, heldout, pattern: str, seq: int, draft_vocab: int, threads, say):
    """What both head trainers start with: the checks, the text (distill's rules) and the frozen target.
    -> (spec, tokenizer, train_ids, held_ids, held_files, teacher)"""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from ..exporter.architectures import arch_spec

    if not (target / "config.json").is_file():
        raise DistillError(f"{target} has no config.json; pass the target's Hugging Face model directory")
    spec = arch_spec(AutoConfig.from_pretrained(target))
    if not 1 <= draft_vocab <= spec.vocab_size:
        raise DistillError(f"draft_vocab must lie in [1, {spec.vocab_size}], got {draft_vocab}")
    check_out_dir(out)
    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(target)
    train_ids, held_ids, _, held_files = load_text(tokenizer, data, heldout, pattern, seq, spec.vocab_size, say)
    return spec, tokenizer, train_ids, held_ids, held_files, frozen_teacher(target)


def _soft_cross_entropy(pairs, weights):
    """The weighted mean over (logits, target probabilities) pairs of the cross-entropy against the target's
    distribution (the weights of the pairs there are; later drafted positions weigh less)."""
    import torch

    loss = 0.0
    for w, (logits, probs) in zip(weights, pairs):
        loss = loss + w * -(probs * torch.log_softmax(logits.float(), -1)).sum(-1).mean()
    return loss / sum(weights[: len(pairs)])


def _publish(final: Path, out: Path, report: dict):
    """The trained files from the work directory into ``out`` with the report; the work directory goes."""
    for f in final.iterdir():
        f.replace(out / f.name)
    (out / REPORT).write_text(json.dumps(report, indent=2))
    shutil.rmtree(out / WORK)


def eagle3_targets(teacher, windows, layers, draft_ids):
    """One batch's training inputs from the target: features [B, N, 3H] at positions 0..N-1 (N = S - 1), the
    token after each position [B, N], and the target's distribution over the draft vocabulary for the token two
    ahead [B, N, V_draft] (position q's head output predicts token q + 2)."""
    import torch

    x = windows[:, :-1]  # [B, S]
    with torch.no_grad():
        out = teacher(input_ids=x, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)[:, :-1].float()
        probs = torch.softmax(out.logits[:, 1:, draft_ids].float(), dim=-1)
    return features, x[:, 1:], probs


def eagle3_head(teacher, spec, layers, token_ids: np.ndarray, draft_vocab: int, intermediate: int | None, seed: int):
    """A new EAGLE-3 head for ``teacher`` (its sizes; its embedding, lm_head rows, MLP and norm where the shapes
    agree) over the ``draft_vocab`` most frequent tokens of ``token_ids`` -> (head, config, d2t, t2d)."""
    import torch

    from ..heads.eagle3 import Eagle3Config, draft_vocabulary, init_from_target, make_head

    tc = teacher.config
    rope = getattr(tc, "rope_parameters", None) or {}
    config = Eagle3Config(hidden_size=spec.hidden_size,
                          intermediate_size=intermediate or min(tc.intermediate_size, 2 * spec.hidden_size),
                          num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, vocab_size=spec.vocab_size, draft_vocab_size=draft_vocab,
                          target_hidden_size=spec.hidden_size, rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
                          rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
                          max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
                          target_layers=list(layers))
    torch.manual_seed(seed)
    head = make_head(config)
    d2t, t2d = draft_vocabulary(token_ids, spec.vocab_size, draft_vocab)
    head.d2t.copy_(torch.from_numpy(d2t))
    head.t2d.copy_(torch.from_numpy(t2d))
    init_from_target(head, teacher)
    return head, config, d2t, t2d


def distill_eagle3(target, out, data, *, heldout=None, pattern: str = "*.py", draft_vocab: int = 2048,
                   intermediate: int | None = None, ttt_steps: int = 3, steps: int | None = None,
                   minutes: float | None = None, batch: int = 8, seq: int = 256, lr: float = 2e-3, seed: int = 0,
                   bf16: bool = True, eval_prompts: int = 16, eval_k: int = 4, eval_tokens: int = 64,
                   threads: int | None = None, checkpoint_every: int = 50) -> dict:
    """Train an EAGLE-3 head for ``target`` into ``out`` (the released layout, heads/eagle3.py); returns the report."""
    import torch

    from ..heads.eagle3 import default_layers, head_parameters, save_head

    say = log.info
    target, out = Path(target), Path(out)
    if steps is None and minutes is None:
        steps = 600
    if ttt_steps < 1:
        raise DistillError(f"ttt_steps must be >= 1, got {ttt_steps}")
    spec, tokenizer, train_ids, held_ids, held_files, teacher = _prepare(target, out, data, heldout, pattern, seq,
                                                                          draft_vocab, threads, say)
    layers = default_layers(spec.num_layers)
    head, config, _, _ = eagle3_head(teacher, spec, layers, train_ids, draft_vocab, intermediate, seed)
    draft_ids = torch.arange(draft_vocab) + head.d2t
    coverage = float(np.isin(held_ids, draft_ids.numpy()).mean()) if held_ids.size else float("nan")
    say(f"[distill] EAGLE-3 head: {head_parameters(head) / 1e6:.2f}M parameters (the target's embedding shared), "
        f"features of layers {layers}, draft vocabulary {draft_vocab} (covers {coverage:.1%} of held-out tokens), "
        f"{ttt_steps} training-time steps")

    cfg = TrainConfig(steps=steps, minutes=minutes if steps is None else None, batch=batch, seq=seq, lr=lr, seed=seed,
                      bf16=bf16, checkpoint_every=checkpoint_every,
                      extra={"method": "eagle3", "target": str(target.resolve()), "config": config.to_dict(),
                             "ttt_steps": ttt_steps, "train_tokens": int(train_ids.size)})
    loop = TrainLoop(head, cfg, out / WORK, name="distill", log=say)
    weights = [EAGLE3_STEP_WEIGHT**j for j in range(ttt_steps)]

    def batch_fn(step):
        return eagle3_targets(teacher, torch.from_numpy(random_windows(train_ids, batch, seq, seed, step)), layers, draft_ids)

    def loss_fn(model, b, step):
        features, tokens, probs = b
        outs = model.forward_steps(features, tokens, ttt_steps)  # step j predicts from position j on
        return _soft_cross_entropy([(logits[:, j:], probs[:, j:]) for j, logits in enumerate(outs)], weights)

    seconds = loop.run(batch_fn, loss_fn)
    say("[distill] evaluating on the held-out text")
    agreement = eagle3_agreement(head, teacher, held_ids, seq, layers, draft_ids, ttt_steps)
    final = out / WORK / "final"
    save_head(head, final, include_embedding=False)
    tokenizer.save_pretrained(final / "tokenizer")
    report = {"method": "eagle3", "target": str(target), "head": str(out), "parameters": head_parameters(head),
              "config": config.to_dict(), "draft_vocab_coverage": coverage,
              "training": {"steps": loop.total_steps, "batch": batch, "seq": seq, "peak_lr": lr, "ttt_steps": ttt_steps,
                           "seed": seed, "bf16_autocast": loop.autocast, "train_minutes": seconds / 60},
              "loss_curve": loop.history, **agreement}
    _publish(final, out, report)
    prompts = heldout_prompts(held_files, tokenizer, eval_prompts) if eval_prompts else []
    if prompts:
        say(f"[distill] measuring greedy acceptance with the head at k={eval_k} through trtspec engines")
        report["acceptance"] = measure_acceptance(target, out, prompts, method="eagle3", k=eval_k, max_new_tokens=eval_tokens,
                                                       threads=threads)
        (out / REPORT).write_text(json.dumps(report, indent=2))
    say(f"[distill] wrote {out}: held-out top-1 agreement per drafted position "
        f"{', '.join(f'{a:.3f}' for a in agreement['heldout_agreement'])}"
        + (f", alpha {report['acceptance']['alpha']:.3f} at k={eval_k}" if "acceptance" in report else ""))
    return report


def eagle3_agreement(head, teacher, held: np.ndarray, seq: int, layers, draft_ids, steps: int,
                     max_tokens: int = 32_768, batch: int = 8) -> dict:
    """Held-out: how often the head's top token (mapped to target ids) is the target's, per drafted position
    (training-time step j: j tokens drafted past the verified ones), and the mean KL at step 0."""
    import torch

    n = min(held.size - 1, max_tokens) // (seq + 1) * (seq + 1)
    if n == 0:
        return {"heldout_agreement": []}
    agree = np.zeros(steps)
    count = np.zeros(steps)
    kl, kl_n = 0.0, 0
    with torch.no_grad():
        windows = torch.from_numpy(held[:n].astype(np.int64)).reshape(-1, seq + 1)
        for s in range(0, windows.shape[0], batch):
            features, tokens, probs = eagle3_targets(teacher, windows[s : s + batch], layers, draft_ids)
            outs = head.forward_steps(features, tokens, steps)
            best = probs.argmax(-1)
            for j, logits in enumerate(outs):
                agree[j] += float((logits[:, j:].argmax(-1) == best[:, j:]).sum())
                count[j] += best[:, j:].numel()
            lp = torch.log_softmax(outs[0].float(), -1)
            kl += float((probs * (torch.log(probs.clamp_min(1e-12)) - lp)).sum())
            kl_n += probs.shape[0] * probs.shape[1]
    return {"heldout_agreement": (agree / count).tolist(), "heldout_kl_draft_vocab": kl / kl_n,
            "heldout_tokens": int(count[0])}


def medusa_targets(teacher, windows, num_heads: int, draft_ids):
    """One batch's training inputs: the target's last hidden state [B, N, H] at positions 0..N-1 and, per head i,
    its distribution over the draft vocabulary for the token i + 2 ahead ([B, N - i - 1, V_draft] each)."""
    import torch

    x = windows[:, :-1]
    with torch.no_grad():
        out = teacher(input_ids=x, output_hidden_states=True)
        probs = torch.softmax(out.logits[..., draft_ids].float(), -1)
    n = x.shape[1]
    return out.hidden_states[-1].float(), [probs[:, i + 1 :] for i in range(min(num_heads, n - 1))]


def distill_medusa(target, out, data, *, heldout=None, pattern: str = "*.py", num_heads: int = 4,
                   draft_vocab: int = 1024, steps: int | None = None, minutes: float | None = None, batch: int = 8,
                   seq: int = 256, lr: float = 2e-3, seed: int = 0, bf16: bool = True, eval_prompts: int = 16,
                   threads: int | None = None, checkpoint_every: int = 50) -> dict:
    """Train Medusa heads for ``target`` into ``out`` (heads/medusa.py); returns the report."""
    import torch

    from ..heads.eagle3 import draft_vocabulary
    from ..heads.medusa import make_heads, save_heads

    say = log.info
    target, out = Path(target), Path(out)
    if steps is None and minutes is None:
        steps = 400
    if num_heads < 1:
        raise DistillError(f"num_heads must be >= 1, got {num_heads}")
    spec, tokenizer, train_ids, held_ids, held_files, teacher = _prepare(target, out, data, heldout, pattern, seq,
                                                                          draft_vocab, threads, say)
    torch.manual_seed(seed)
    heads = make_heads(spec.hidden_size, spec.vocab_size, draft_vocab, num_heads)
    d2t, _ = draft_vocabulary(train_ids, spec.vocab_size, draft_vocab)
    heads.d2t.copy_(torch.from_numpy(d2t))
    draft_ids = torch.arange(draft_vocab) + heads.d2t
    with torch.no_grad():  # every head starts as the target's own lm_head on the draft vocabulary
        for head in heads.medusa_head:
            head[1].weight.copy_(teacher.lm_head.weight[draft_ids].float())
    params = sum(p.numel() for p in heads.parameters())
    say(f"[distill] Medusa: {num_heads} heads, {params / 1e6:.2f}M parameters, draft vocabulary {draft_vocab}")
    cfg = TrainConfig(steps=steps, minutes=minutes if steps is None else None, batch=batch, seq=seq, lr=lr, seed=seed,
                      bf16=bf16, checkpoint_every=checkpoint_every,
                      extra={"method": "medusa", "target": str(target.resolve()), "config": heads.config,
                             "train_tokens": int(train_ids.size)})
    loop = TrainLoop(heads, cfg, out / WORK, name="distill", log=say)
    weights = [EAGLE3_STEP_WEIGHT**i for i in range(num_heads)]

    def batch_fn(step):
        return medusa_targets(teacher, torch.from_numpy(random_windows(train_ids, batch, seq, seed, step)), num_heads, draft_ids)

    def loss_fn(model, b, step):
        hidden, probs = b
        outs = model(hidden)  # head i predicts i + 2 ahead: fewer positions have a target
        return _soft_cross_entropy([(logits[:, : p.shape[1]], p) for logits, p in zip(outs, probs)], weights)

    seconds = loop.run(batch_fn, loss_fn)
    say("[distill] evaluating on the held-out text")
    agreement = medusa_agreement(heads, teacher, held_ids, seq, num_heads, draft_ids)
    final = out / WORK / "final"
    save_heads(heads, final)
    report = {"method": "medusa", "target": str(target), "heads": str(out), "parameters": params,
              "config": heads.config, "training": {"steps": loop.total_steps, "batch": batch, "seq": seq, "peak_lr": lr,
                                                   "seed": seed, "train_minutes": seconds / 60},
              "loss_curve": loop.history, **agreement}
    _publish(final, out, report)
    prompts = heldout_prompts(held_files, tokenizer, eval_prompts) if eval_prompts else []
    if prompts:
        say("[distill] measuring greedy acceptance with the heads (a tree of 16 nodes) through trtspec engines")
        report["acceptance"] = measure_acceptance(target, out, prompts, method="medusa", threads=threads)
        (out / REPORT).write_text(json.dumps(report, indent=2))
    say(f"[distill] wrote {out}: held-out top-1 agreement per head "
        f"{', '.join(f'{a:.3f}' for a in agreement['heldout_agreement'])}")
    return report


def medusa_agreement(heads, teacher, held: np.ndarray, seq: int, num_heads: int, draft_ids,
                     max_tokens: int = 32_768, batch: int = 8) -> dict:
    """Held-out: how often head i's top token is the target's own top token i + 2 ahead."""
    import torch

    n = min(held.size - 1, max_tokens) // (seq + 1) * (seq + 1)
    if n == 0:
        return {"heldout_agreement": []}
    agree, count = np.zeros(num_heads), np.zeros(num_heads)
    with torch.no_grad():
        windows = torch.from_numpy(held[:n].astype(np.int64)).reshape(-1, seq + 1)
        for s in range(0, windows.shape[0], batch):
            hidden, probs = medusa_targets(teacher, windows[s : s + batch], num_heads, draft_ids)
            for i, (logits, p) in enumerate(zip(heads(hidden), probs)):
                agree[i] += float((logits[:, : p.shape[1]].argmax(-1) == p.argmax(-1)).sum())
                count[i] += p.shape[0] * p.shape[1]
    return {"heldout_agreement": (agree / np.maximum(count, 1)).tolist()}
