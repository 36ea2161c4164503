"""Distil a small draft model from a target, and `distill()`, the entry point of every method (`trtspec distill`).

    trtspec.distill("models/target", "models/draft", ["src/"], steps=1200)

The draft has the target's family and tokenizer (so trtspec's vocabulary check passes), a smaller shape
(default: half the hidden size, a third of the layers, the target's head size, tied embeddings) and
embeddings initialised from the target's: copied when the hidden sizes match, otherwise the target's
embedding projected on its leading principal directions. Its loss is the KL divergence from the target's
next-token distribution at a temperature (``kd_weight`` = 1), optionally mixed with cross-entropy on the
text (``kd_weight`` < 1; 0 trains without distillation, the baseline) and with rows of the target's own
sampled continuations (``sampled_fraction``).

Training resumes from ``OUT/.distill/checkpoint.pt`` when the same command is run again, is deterministic
under ``seed`` for a ``steps`` budget, and ends with a report (``OUT/distill_report.json``): the loss curve,
the held-out KL and perplexity, and the greedy per-token acceptance alpha against the target at k = 4,
measured by running speculative decoding through trtspec onnxruntime engines.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np

from ..errors import UnsupportedModelError
from .acceptance import measure_acceptance
from ..training import (  # (shared with distill/heads.py: the data, the teacher, the output directory)
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


# -- the draft's shape -----------------------------------------------------------------------------------------------
def draft_config(target_config, *, layers=None, hidden=None, heads=None, kv_heads=None, intermediate=None):
    """The target's config class and settings at a smaller shape, with tied embeddings."""
    from ..exporter.architectures import arch_spec

    spec = arch_spec(target_config)
    d = target_config.to_dict()
    hidden = hidden or max(spec.head_dim, spec.hidden_size // 2)
    layers = layers or max(1, spec.num_layers // 3)
    head_dim = spec.head_dim if hidden % spec.head_dim == 0 else None
    heads = heads or (hidden // head_dim if head_dim else spec.num_heads)
    if hidden % heads:
        raise DistillError(f"hidden size {hidden} is not a multiple of the head count {heads}; pass --heads")
    if spec.family == "gpt2":
        if kv_heads not in (None, heads):
            raise DistillError("gpt2 has no grouped-query attention: --kv-heads must equal --heads")
        d.update(n_embd=hidden, n_layer=layers, n_head=heads,
                 n_inner=intermediate or (None if target_config.n_inner is None else target_config.n_inner * hidden // spec.hidden_size),
                 tie_word_embeddings=True)
    else:
        ratio = max(1, spec.num_heads // spec.num_kv_heads)
        kv_heads = kv_heads or max(1, heads // ratio)
        if heads % kv_heads:
            raise DistillError(f"the head count {heads} is not a multiple of the KV head count {kv_heads}; pass --kv-heads")
        intermediate = intermediate or max(1, round(target_config.intermediate_size * hidden / spec.hidden_size))
        d.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 intermediate_size=intermediate, tie_word_embeddings=True)
        if "head_dim" in d:
            d["head_dim"] = hidden // heads
        if isinstance(d.get("layer_types"), list):
            types = d["layer_types"]
            d["layer_types"] = [types[i] if i < len(types) else types[-1] for i in range(layers)]
        if "max_window_layers" in d:
            d["max_window_layers"] = min(d["max_window_layers"], layers)
    for key in ("architectures", "_name_or_path", "transformers_version"):
        d.pop(key, None)
    return type(target_config).from_dict(d)


def init_embeddings(draft, target) -> str:
    """Copy the target's input embedding into the draft, or its projection on the top principal directions."""
    import torch

    src = target.get_input_embeddings().weight.detach().float()
    dst = draft.get_input_embeddings().weight
    rows = min(src.shape[0], dst.shape[0])
    with torch.no_grad():
        if src.shape[1] == dst.shape[1]:
            dst[:rows] = src[:rows].to(dst.dtype)
            return "copied from the target"
        h = dst.shape[1]
        if h > src.shape[1]:
            return f"random (the draft's hidden size {h} exceeds the target's {src.shape[1]})"
        centred = src - src.mean(0, keepdim=True)
        u, s, _ = torch.linalg.svd(centred, full_matrices=False)
        proj = u[:, :h] * s[:h]
        proj *= src.std() / proj.std()
        dst[:rows] = proj[:rows].to(dst.dtype)
        kept = float((s[:h] ** 2).sum() / (s**2).sum())
        return f"the target's embedding on its top {h} principal directions ({kept:.0%} of its variance)"


# -- losses and evaluation ---------------------------------------------------------------------------------------------
def kd_loss(draft_logits, target_logits, labels, temperature: float, kd_weight: float):
    """kd_weight * T^2 KL(target_T || draft_T) + (1 - kd_weight) * CE(draft, labels), mean per token."""
    import torch.nn.functional as F

    v = draft_logits.shape[-1]
    d = draft_logits.float().reshape(-1, v)
    loss = 0.0
    if kd_weight > 0:
        t = target_logits.float().reshape(-1, v)
        kl = F.kl_div(F.log_softmax(d / temperature, -1), F.log_softmax(t / temperature, -1),
                      log_target=True, reduction="batchmean")
        loss = loss + kd_weight * temperature**2 * kl
    if kd_weight < 1:
        loss = loss + (1 - kd_weight) * F.cross_entropy(d, labels.reshape(-1))
    return loss


def heldout_metrics(draft, target, held: np.ndarray, seq: int, max_tokens: int = 65_536, batch: int = 8) -> dict:
    """Mean per-token KL(target || draft) and the draft's and target's perplexity on the held-out stream."""
    import torch
    import torch.nn.functional as F

    n = min(held.size - 1, max_tokens) // seq * seq
    if n == 0:
        return {}
    kl_sum = ce_d = ce_t = 0.0
    count = 0
    with torch.no_grad():
        for s in range(0, n, seq * batch):
            e = min(s + seq * batch, n)
            x = torch.from_numpy(held[s:e].astype(np.int64)).reshape(-1, seq)
            y = torch.from_numpy(held[s + 1 : e + 1].astype(np.int64)).reshape(-1)
            d = draft(input_ids=x).logits.float().reshape(-1, draft.config.vocab_size)
            t = target(input_ids=x).logits.float().reshape(-1, target.config.vocab_size)
            v = min(d.shape[-1], t.shape[-1])
            kl_sum += float(F.kl_div(F.log_softmax(d[:, :v], -1), F.log_softmax(t[:, :v], -1), log_target=True,
                                     reduction="sum"))
            ce_d += float(F.cross_entropy(d, y, reduction="sum"))
            ce_t += float(F.cross_entropy(t, y, reduction="sum"))
            count += y.numel()
    return {"heldout_tokens": count, "heldout_kl": kl_sum / count, "heldout_perplexity": math.exp(ce_d / count),
            "target_heldout_perplexity": math.exp(ce_t / count)}


# -- the command -------------------------------------------------------------------------------------------------------
METHODS = ("draft", "eagle3", "medusa")
_DRAFT_ONLY = {"layers": None, "hidden": None, "heads": None, "kv_heads": None, "temperature": 1.0, "kd_weight": 1.0,
               "sampled_fraction": 0.0, "dtype": None}


def distill(target, out, data=None, *, method: str = "draft", heldout=None, pattern: str = "*.py",
            layers: int | None = None, hidden: int | None = None, heads: int | None = None,
            kv_heads: int | None = None, intermediate: int | None = None, steps: int | None = None,
            minutes: float | None = None, batch: int | None = None, seq: int = 256, lr: float | None = None,
            temperature: float = 1.0, kd_weight: float = 1.0, sampled_fraction: float = 0.0, seed: int = 0,
            dtype: str | None = None, bf16: bool = True, eval_prompts: int = 16, eval_k: int = 4,
            eval_tokens: int = 64, threads: int | None = None, checkpoint_every: int = 50,
            draft_vocab: int | None = None, ttt_steps: int | None = None, medusa_heads: int = 4,
            prompts: str = "humaneval,chat,docstring,completion,text", text: str | None = None,
            stdlib: str | None = None,
            data_dir: str | None = None, data_tokens: int | None = None, samples: int = 0,
            max_new_tokens: int = 256, coverage: float = 0.97, device: str = "cpu",
            eval_every: int = 500, init: str | None = None) -> dict:
    """Train a draft for ``target`` into ``out`` (an HF model directory) and return the report (see module doc).

    ``method``: "draft" (a small model of the target's family; batch 16, lr 3e-3 by default), "eagle3" (an
    EAGLE-3 head on the target's low/mid/high features, distill/heads.distill_eagle3: ``draft_vocab`` 2048,
    ``ttt_steps``, ``intermediate``) or "medusa" (Medusa heads on its last hidden state, distill/heads.distill_medusa:
    ``draft_vocab`` 1024, ``medusa_heads``); heads train with batch 8, lr 2e-3 by default. ``trtspec distill
    --method`` is this call. Progress goes to the "trtspec" logger.
    data/heldout: text files or directories (searched for ``pattern``). Without ``heldout``, files whose
    relative path hashes to 0 mod 20 are held out (and never trained on). The acceptance check measures
    ``eval_prompts`` held-out prompts at k = ``eval_k`` for ``eval_tokens`` new tokens each (0 prompts: skipped).
    """
    if method not in METHODS:
        raise DistillError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if (Path(target) / "manifest.json").is_file():  # a built engine: its own answers and features
        if text is None:
            prompts = ",".join(p for p in prompts.split(",") if p != "text")
        if method != "eagle3" or data is not None:
            raise DistillError(f"{target} is a built engine: it trains an EAGLE-3 head on its own answers "
                               "(--method eagle3, no --data); for the other methods pass the HF directory or GGUF file")
        from .eagle3_engine import distill_eagle3_engine

        return distill_eagle3_engine(
            target, out, prompts=[p for p in prompts.split(",") if p], text=text, stdlib=stdlib, data_dir=data_dir,
            data_tokens=data_tokens, samples=samples, max_new_tokens=max_new_tokens, draft_vocab=draft_vocab,
            coverage=coverage, intermediate=intermediate, ttt_steps=ttt_steps or 4, steps=steps, minutes=minutes,
            batch=batch or 8, seq=seq, lr=lr or 2e-3, seed=seed, bf16=bf16, device=device,
            eval_every=eval_every, eval_k=eval_k, eval_tokens=eval_tokens, threads=threads,
            checkpoint_every=checkpoint_every, init=init)
    if init is not None:
        raise DistillError("--init (training an EAGLE-3 head on) takes a built engine as --target (--method eagle3)")
    if data is None:
        raise DistillError("--data (text files or directories) is needed to distill from a model directory; a built "
                           "engine (--target ENGINE, --method eagle3) writes its own data")
    if ttt_steps is None:
        ttt_steps = 3
    if method != "draft":
        given = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, temperature=temperature,
                     kd_weight=kd_weight, sampled_fraction=sampled_fraction, dtype=dtype)
        wrong = [name for name, value in given.items() if value != _DRAFT_ONLY[name]]
        if method == "medusa" and intermediate is not None:
            wrong.append("intermediate")
        if wrong:
            raise DistillError(f"{', '.join(wrong)} {'apply' if len(wrong) > 1 else 'applies'} to a draft model "
                               f"(method='draft'), not to {method} heads: drop {'them' if len(wrong) > 1 else 'it'}")
        from .heads import distill_eagle3, distill_medusa

        common = dict(heldout=heldout, pattern=pattern, steps=steps, minutes=minutes, batch=batch or 8, seq=seq,
                      lr=lr or 2e-3, seed=seed, bf16=bf16, eval_prompts=eval_prompts, threads=threads,
                      checkpoint_every=checkpoint_every)
        if method == "eagle3":
            return distill_eagle3(target, out, data, draft_vocab=draft_vocab or 2048, intermediate=intermediate,
                                  ttt_steps=ttt_steps, eval_k=eval_k, eval_tokens=eval_tokens, **common)
        return distill_medusa(target, out, data, draft_vocab=draft_vocab or 1024, num_heads=medusa_heads, **common)
    if draft_vocab is not None:
        raise DistillError("draft_vocab sizes a head's vocabulary (method 'eagle3' or 'medusa'); a draft model "
                           "keeps the target's")
    batch, lr = batch or 16, lr or 3e-3
    if not 0.0 <= kd_weight <= 1.0:
        raise DistillError(f"kd_weight must be in [0, 1] (1: pure distillation, 0: no distillation), got {kd_weight}")
    if temperature <= 0:
        raise DistillError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= sampled_fraction < 1.0:
        raise DistillError(f"sampled_fraction must be in [0, 1), got {sampled_fraction}")
    if seq < 8 or batch < 1:
        raise DistillError(f"seq must be >= 8 and batch >= 1 (got seq {seq}, batch {batch})")
    return _distill_draft(Path(target), Path(out), data, heldout=heldout, pattern=pattern,
                          shape=dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                     intermediate=intermediate),
                          steps=1000 if steps is None and minutes is None else steps, minutes=minutes, batch=batch,
                          seq=seq, lr=lr, temperature=temperature, kd_weight=kd_weight,
                          sampled_fraction=sampled_fraction, seed=seed, dtype=dtype, bf16=bf16,
                          eval_prompts=eval_prompts, eval_k=eval_k, eval_tokens=eval_tokens, threads=threads,
                          checkpoint_every=checkpoint_every)


def _target_and_tokenizer(target: Path, out: Path):
    """(the target's HF config, its ArchSpec, its tokenizer), each checked before any training; ``out`` checked
    to be a new or empty directory."""
    from transformers import AutoConfig, AutoTokenizer

    from ..exporter.architectures import arch_spec
    from ..exporter.gguf import hf_source

    folder, source = hf_source(target)
    if not source and not (target / "config.json").is_file():
        raise UnsupportedModelError(f"{target} has no config.json; pass the target's Hugging Face model directory "
                                    "or GGUF file")
    target_config = AutoConfig.from_pretrained(folder, **source)
    spec = arch_spec(target_config)  # unknown families are refused here, before any work
    check_out_dir(out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **source)
    except (OSError, ValueError, TypeError) as e:
        raise UnsupportedModelError(f"{target} has no usable tokenizer ({type(e).__name__}); the draft must share "
                                    f"the target's, so save it into {target} first") from None
    if len(tokenizer) > spec.vocab_size:
        raise DistillError(f"{target}'s tokenizer has {len(tokenizer)} tokens but its model's vocabulary has "
                           f"{spec.vocab_size}: they do not belong together")
    return target_config, spec, tokenizer


def _distill_draft(target: Path, out: Path, data, *, heldout, pattern, shape: dict, steps, minutes, batch, seq, lr,
                   temperature, kd_weight, sampled_fraction, seed, dtype, bf16, eval_prompts, eval_k, eval_tokens,
                   threads, checkpoint_every) -> dict:
    """distill() of a draft model, its options checked."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..exporter.architectures import arch_spec

    target_config, spec, tokenizer = _target_and_tokenizer(target, out)
    if threads:
        torch.set_num_threads(threads)
    train_ids, held_ids, train_files, held_files = load_text(tokenizer, data, heldout, pattern, seq, spec.vocab_size,
                                                             log.info)

    teacher = frozen_teacher(target)
    config = draft_config(target_config, **shape)
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # float32 master weights, whatever the target is stored in
    draft.config.use_cache = True
    emb_init = init_embeddings(draft, teacher)
    n_params = sum(p.numel() for p in draft.parameters())
    draft_spec = arch_spec(config)
    log.info(f"[distill] target {spec.model_type} {spec.num_layers} layers x {spec.hidden_size}; draft "
             f"{draft_spec.num_layers} layers x {draft_spec.hidden_size}, {draft_spec.num_heads} heads "
             f"({draft_spec.num_kv_heads} KV), {n_params / 1e6:.2f}M parameters; embeddings: {emb_init}")

    cfg = TrainConfig(steps=steps, minutes=minutes if steps is None else None, batch=batch, seq=seq, lr=lr, seed=seed,
                      bf16=bf16, checkpoint_every=checkpoint_every,
                      extra={"target": str(target.resolve()), "draft_config": config.to_diff_dict(),
                             "temperature": temperature, "kd_weight": kd_weight, "sampled_fraction": sampled_fraction,
                             "train_tokens": int(train_ids.size)})
    loop = TrainLoop(draft, cfg, out / WORK, name="distill", log=log.info)
    n_sampled = round(sampled_fraction * batch)

    def batch_fn(step):
        windows = torch.from_numpy(random_windows(train_ids, batch, seq, seed, step))
        if n_sampled:
            windows[:n_sampled] = sample_continuations(teacher, windows[:n_sampled], seq // 4, seed, step,
                                                       tokenizer.eos_token_id)
        return windows

    def loss_fn(model, w, step):
        x, y = w[:, :-1], w[:, 1:]
        with torch.no_grad():
            t_logits = teacher(input_ids=x).logits if kd_weight > 0 else None
        return kd_loss(model(input_ids=x).logits, t_logits, y, temperature, kd_weight)

    seconds = loop.run(batch_fn, loss_fn)

    log.info("[distill] evaluating on the held-out text")
    metrics = heldout_metrics(draft, teacher, held_ids, seq)
    report = {
        "target": str(target), "draft": str(out), "parameters": n_params, "config": config.to_diff_dict(),
        "embedding_init": emb_init, "data": {"train_files": len(train_files), "heldout_files": len(held_files),
                                             "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size)},
        "training": {"steps": loop.total_steps, "batch": batch, "seq": seq, "tokens_seen": loop.total_steps * batch * seq,
                     "peak_lr": lr, "temperature": temperature, "kd_weight": kd_weight,
                     "sampled_fraction": sampled_fraction, "seed": seed, "bf16_autocast": loop.autocast,
                     "train_minutes": seconds / 60},
        "loss_curve": loop.history, **metrics,
    }
    _save_draft(draft, tokenizer, target, out, dtype or getattr(target_config, "dtype", None), report)
    if eval_prompts:
        prompts = heldout_prompts(held_files, tokenizer, eval_prompts)
        if not prompts:  # held out as the end of the stream: prompts are windows of it
            starts = range(0, max(0, held_ids.size - 48), max(48, held_ids.size // eval_prompts))
            prompts = [tokenizer.decode(held_ids[s : s + 48]) for s in starts][:eval_prompts]
        if prompts:
            log.info(f"[distill] measuring greedy acceptance at k={eval_k} through trtspec engines ({len(prompts)} prompts)")
            report["acceptance"] = measure_acceptance(target, out, prompts, method="draft", k=eval_k,
                                                      max_new_tokens=eval_tokens, threads=threads)
            (out / REPORT).write_text(json.dumps(report, indent=2))
    log.info(f"[distill] wrote {out}: held-out KL {metrics.get('heldout_kl', float('nan')):.3f}, perplexity "
             f"{metrics.get('heldout_perplexity', float('nan')):.2f} (target "
             f"{metrics.get('target_heldout_perplexity', float('nan')):.2f})"
             + (f", alpha {report['acceptance']['alpha']:.3f} at k={eval_k}" if "acceptance" in report else ""))
    return report


def _save_draft(draft, tokenizer, target: Path, out: Path, dtype, report: dict) -> None:
    """The draft in ``dtype`` (a name or a torch dtype; None: float32), its tokenizer and the target's generation
    config into ``out``, which holds the model only once it is complete; then the report."""
    import torch

    final = out / WORK / "final"
    save_dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
    draft.to(save_dtype).save_pretrained(final)
    tokenizer.save_pretrained(final)
    if (target / "generation_config.json").is_file():
        shutil.copy(target / "generation_config.json", final / "generation_config.json")
    for f in final.iterdir():
        f.replace(out / f.name)
    (out / REPORT).write_text(json.dumps(report, indent=2))
    shutil.rmtree(out / WORK)


def sample_continuations(teacher, windows, prompt_len: int, seed: int, step: int, eos_id):
    """Replace each row after its first prompt_len tokens by the target's own sample (temperature 1)."""
    import torch

    rows, total = windows.shape
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = windows[:, :prompt_len].clone()
    with torch.no_grad():
        out = teacher(input_ids=ids, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1].float()
        pieces = [ids]
        for _ in range(total - prompt_len):
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            pieces.append(nxt)
            out = teacher(input_ids=nxt, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.cat(pieces, 1)
