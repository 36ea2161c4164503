"""`trtspec distill --method eagle3 --target ENGINE`: an EAGLE-3 head trained on what a built target engine writes.

1. The engine (built with a hidden_states output: ``--hidden-states low,mid,high`` or ``--head``) answers requests
   from the registry's data (prompts.py) and its answers, features and next-token distributions go to shards
   (data.py; ``OUT/.distill/data`` unless ``data_dir`` is given). Resumable: a rerun skips what the shards hold.
2. The head trains on the stored features, never recomputing them: batches of whole sequences (windows of at most
   ``seq`` positions, packed several to a row, every answer once an epoch), the loss on the answers' positions
   only (where the head drafts), soft labels from the target's top-8 distribution restricted to the head's
   vocabulary, ``ttt_steps`` training-time test steps.
   The head's vocabulary is the smallest set of the answers' most frequent tokens that covers ``coverage`` of
   them. Checkpoints (distill's TrainLoop) resume a stopped run to the same result.
3. Every ``eval_every`` steps and at the end, held-out acceptance: the head exported for the engine drafts for it
   on the held-out requests (prompts.heldout_chats: 8 HumanEval problems, 8 chats), greedy, k = ``eval_k``, and
   the head's per-step agreement with the target on those answers' stored features.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from ..training import WORK, DistillError, TrainConfig, TrainLoop, check_out_dir, frozen_teacher
from .data import TargetData, request_ids, write_target_data
from .heads import EAGLE3_STEP_WEIGHT, _publish, eagle3_head
from .prompts import SOURCES, heldout_chats, training_requests

log = logging.getLogger("trtspec")
HELDOUT = "heldout"


def engine_source(engine_dir: Path, manifest: dict) -> Path:
    """The GGUF file or HF directory a built engine was made from (its weights initialise the head)."""
    from ..manifest import read_manifest

    source = manifest.get("source") or {}
    if source.get("model_dir") and Path(source["model_dir"]).exists():
        return Path(source["model_dir"])
    if source.get("export_dir") and (Path(source["export_dir"]) / "manifest.json").is_file():
        return engine_source(Path(source["export_dir"]), read_manifest(source["export_dir"]))
    raise DistillError(f"{engine_dir} does not say which model it was built from (or that file has moved); "
                       "rebuild the engine from the GGUF file or HF directory")


def vocabulary_for(tokens: np.ndarray, vocab_size: int, coverage: float, multiple: int = 256) -> int:
    """The smallest number of most frequent tokens covering ``coverage`` of ``tokens``, rounded up to ``multiple``."""
    counts = np.sort(np.bincount(tokens.astype(np.int64), minlength=vocab_size))[::-1]
    need = int(np.searchsorted(np.cumsum(counts), coverage * tokens.size) + 1)
    return min(vocab_size, -(-need // multiple) * multiple)


class Batches:
    """Training windows from TargetData: features [B, N, F], the token after each position [B, N], soft labels
    (draft ids [B, N, K], -1 off the head's vocabulary; weights [B, N, K] summing to 1), the positions that
    count [B, N] (the head at position q drafts token q + 2: counted from the answer's second token on, the first
    being the target's own after the prompt) and each position's place in its window [B, N].

    ``pack``: each row holds several windows end to end (the head's attention stays within each), every answer
    once an epoch in a shuffled order; rows of one window each pad to the batch's longest and train on about 40 %
    answer positions here (the answers average 143 tokens after 78 of prompt), packed rows on about 60 %."""

    def __init__(self, data: TargetData, target_to_draft: np.ndarray, seq: int, seed: int, pack: bool = False):
        self.data, self.t2d, self.seq, self.seed, self.pack = data, target_to_draft, seq, seed, pack
        self.usable = [i for i in range(len(data)) if data.offsets[i + 1] - data.offsets[i] - data.prompt_lens[i] >= 3]
        if not self.usable:
            raise DistillError("the target data holds no answer of 3 tokens or more to train on")
        self._epochs: list[list[list[int]]] = []  # packed rows (lists of items) of each epoch so far

    def window(self, i: int, rng: np.random.Generator | None):
        tokens, prompt, feats, top_ids, top_probs = self.data.sequence(i)
        n = len(tokens)
        last = n - 3  # the last position with a label (the distribution at n - 2)
        first_counted = max(0, prompt - 1)
        start = 0
        if last + 1 > self.seq:  # too long: a window that ends after the answer starts
            lo = max(0, min(first_counted - self.seq // 4, last + 1 - self.seq))
            start = lo if rng is None else int(rng.integers(lo, last + 2 - self.seq))
        stop = min(last + 1, start + self.seq)
        pos = np.arange(start, stop)
        ids = self.t2d[top_ids[pos + 1]]
        w = np.where(ids >= 0, top_probs[pos + 1].astype(np.float32), 0.0)
        total = w.sum(-1, keepdims=True)
        mask = (pos + 1 >= prompt) & (total[:, 0] > 0)  # drafts start at the answer's second token
        return feats[pos], tokens[pos + 1], ids, w / np.maximum(total, 1e-12), mask

    def make(self, rows, device="cpu"):
        """rows: lists of (item, rng or None) windows, end to end in one row each (or single pairs)."""
        import torch

        rows = [r if isinstance(r, list) else [r] for r in rows]
        parts = [[self.window(i, g) for i, g in row] for row in rows]
        n = max(sum(len(p[1]) for p in row) for row in parts)
        b, f, k = len(parts), parts[0][0][0].shape[-1], parts[0][0][2].shape[-1]
        feats = np.zeros((b, n, f), np.float32)
        toks = np.zeros((b, n), np.int64)
        ids = np.full((b, n, k), -1, np.int64)
        w = np.zeros((b, n, k), np.float32)
        mask = np.zeros((b, n), bool)
        places = np.tile(np.arange(n), (b, 1))
        for j, row in enumerate(parts):
            at = 0
            for fe, to, i_, w_, m in row:
                s = slice(at, at + len(to))
                feats[j, s], toks[j, s], ids[j, s], w[j, s], mask[j, s] = fe, to, i_, w_, m
                places[j, at:] = np.arange(n - at)  # (the padding after the last window: a sequence of its own)
                at += len(to)
        return tuple(torch.from_numpy(a).to(device) for a in (feats, toks, ids, w, mask, places))

    def _packed_rows(self, epoch: int) -> list[list[int]]:
        """The epoch's rows: its shuffled answers placed first-fit among the last 16 rows still open (each answer
        once)."""
        while len(self._epochs) <= epoch:
            order = np.random.default_rng([self.seed, len(self._epochs), 7]).permutation(self.usable)
            lengths = np.minimum(self.data.offsets[order + 1] - self.data.offsets[order] - 2, self.seq)
            rows, room = [], []
            for item, size in zip(order.tolist(), lengths.tolist()):
                first = len(rows) - min(len(rows), 16)
                at = next((r for r in range(first, len(rows)) if room[r] >= size), None)
                if at is None:
                    rows.append([])
                    room.append(self.seq)
                    at = len(rows) - 1
                rows[at].append(item)
                room[at] -= size
            self._epochs.append(rows)
        return self._epochs[epoch]

    def batch(self, step: int, size: int, device="cpu"):
        rng = np.random.default_rng([self.seed, step])
        if not self.pack:
            picks = rng.choice(len(self.usable), size=size, replace=len(self.usable) < size)
            return self.make([(self.usable[p], rng) for p in picks], device)
        rows, epoch, at = [], 0, step * size  # the epochs' rows one after another
        while len(rows) < size:
            epoch_rows = self._packed_rows(epoch)
            if at < len(epoch_rows):
                rows += epoch_rows[at : at + size - len(rows)]
                at = 0
            else:
                at -= len(epoch_rows)
            epoch += 1
        return self.make([[(i, rng) for i in row] for row in rows], device)


@functools.cache
def _sparse_soft_ce():
    """-sum_k w_k log softmax(logits)[ids_k] per row, with its gradient softmax * sum(w) - scatter(w) made in one
    pass over the logits (autograd's log_softmax, gather and their backward make [rows, V] tensors five times)."""
    import torch

    class SparseSoftCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, ids, w):
            logits = logits.float()
            lse = torch.logsumexp(logits, -1, keepdim=True)
            picked = logits.gather(-1, ids) - lse
            ctx.save_for_backward(logits, lse, ids, w)
            return -(picked * w).sum(-1)

        @staticmethod
        def backward(ctx, grad):
            logits, lse, ids, w = ctx.saved_tensors
            g = torch.exp(logits - lse).mul_((w.sum(-1, keepdim=True) * grad[:, None]))
            g.scatter_add_(-1, ids, -w * grad[:, None])
            return g, None, None

    return SparseSoftCE.apply


def soft_loss(head, hiddens, ids, w, mask, places):
    """EAGLE-3's weighted loss over the training-time steps: step j at position q (q >= j in its sequence) against
    the target's distribution of token q + 2, on the counted positions."""
    total, norm = 0.0, 0.0
    for j, h in enumerate(hiddens):
        m = mask & (places >= j)
        if not bool(m.any()):
            continue
        logits = head.logits(h[m])
        i, wj = ids[m], w[m]  # (weights of ids off the vocabulary are 0)
        total = total + EAGLE3_STEP_WEIGHT**j * _sparse_soft_ce()(logits, i.clamp_min(0), wj).mean()
        norm += EAGLE3_STEP_WEIGHT**j
    return total / max(norm, 1e-12)


def heldout_agreement(head, batches: Batches, steps: int, device="cpu") -> list[float]:
    """Per training-time step, how often the head's top token is the target's on the held-out answers."""
    import torch

    hits, count = np.zeros(steps), np.zeros(steps)
    with torch.no_grad():
        for s in range(0, len(batches.usable), 8):
            feats, toks, ids, w, mask, places = batches.make([(i, None) for i in batches.usable[s : s + 8]], device)
            hiddens = head.forward_steps(feats, toks, steps, hidden_only=True)
            for j, h in enumerate(hiddens):
                m = mask & (places >= j)
                if bool(m.any()):
                    best = head.logits(h[m]).argmax(-1)
                    hits[j] += float((best == ids[m][:, 0]).sum())
                    count[j] += int(m.sum())
    return (hits / np.maximum(count, 1)).tolist()


def engine_acceptance(engine_dir: Path, head_dir: Path, prompts, *, k: int, max_new_tokens: int, threads=None) -> dict:
    """Greedy speculative decoding with the head drafting for the engine on ``prompts`` (token id lists)."""
    from ..heads.export import export_head
    from ..runtime import Generator

    quiet = logging.getLogger("trtspec.export")
    level = quiet.level
    with tempfile.TemporaryDirectory(prefix="trtspec-head-") as tmp:
        quiet.setLevel(logging.WARNING)
        try:
            exported = export_head(head_dir, Path(tmp) / "head", target=engine_dir)
        finally:
            quiet.setLevel(level)
        gen = Generator(str(engine_dir), str(exported), drafter="eagle3", num_draft_tokens=k, k_policy="fixed",
                        num_threads=threads)
        try:
            out = gen.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        finally:
            gen.close()
    calls = sum(r.stats.target_calls for r in out)
    return {"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "alpha": out.stats.token_acceptance,
            "tokens_per_target_call": out.stats.new_tokens / calls if calls else 0.0}


def _new_head(target: Path, manifest: dict, layers, answers: np.ndarray, size: int, intermediate, seed: int):
    """A head for the engine's model over the answers' ``size`` most frequent tokens -> (head, config, d2t, t2d)."""
    from ..exporter.architectures import arch_spec

    teacher = frozen_teacher(engine_source(target, manifest))
    return eagle3_head(teacher, arch_spec(teacher.config), layers, answers, size, intermediate, seed)


def _init_head(init: Path, target: Path, manifest: dict, layers, draft_vocab: int | None):
    """The EAGLE-3 head in ``init`` to train on (its weights and its vocabulary) -> (head, config, d2t, t2d);
    refused when it was made for another model or reads other layers."""
    from ..heads.eagle3 import load_head

    head, config = load_head(init, target_dir=engine_source(target, manifest))
    model = manifest["model"]
    per_layer = model["hidden_states"]["size"] // len(model["hidden_states"]["layers"])
    if (config.vocab_size, config.target_hidden_size) != (model["vocab_size"], per_layer):
        raise DistillError(f"--init {init} is a head for a model of {config.vocab_size} tokens and hidden size "
                           f"{config.target_hidden_size}; {target}'s has {model['vocab_size']} and {per_layer}")
    if list(config.target_layers or layers) != list(layers):
        raise DistillError(f"--init {init} reads the target's layers {config.target_layers}; this training feeds "
                           f"it layers {list(layers)}")
    if draft_vocab is not None and draft_vocab != config.draft_vocab_size:
        raise DistillError(f"--init {init} has a vocabulary of {config.draft_vocab_size} tokens; drop --draft-vocab "
                           f"{draft_vocab} (a head keeps its vocabulary when it trains on)")
    return head, config, head.d2t.numpy().copy(), head.t2d.numpy().copy()


def _feature_layers(target: Path, model: dict) -> list[int]:
    """The target layers an EAGLE-3 head reads (EAGLE-3's low, mid, high), refused where the engine lacks them."""
    from ..heads.eagle3 import default_layers

    if model.get("head"):
        raise DistillError(f"{target} is a draft head; --target takes the target's engine")
    layers = default_layers(model["num_layers"])
    have = (model.get("hidden_states") or {}).get("layers") or []
    if any(i not in have for i in layers):
        raise DistillError(f"{target} outputs the hidden states of layers {have or 'none'}; an EAGLE-3 head reads "
                           f"{layers}: build the target with --hidden-states low,mid,high")
    return layers


def distill_eagle3_engine(target, out, *, prompts=SOURCES, text=None, stdlib=None, data_dir=None,
                          data_tokens: int | None = None, samples: int = 0, max_new_tokens: int = 256,
                          draft_vocab: int | None = None, coverage: float = 0.97, intermediate: int | None = None,
                          ttt_steps: int = 4, steps: int | None = None, minutes: float | None = None, batch: int = 8,
                          seq: int = 512, lr: float = 2e-3, seed: int = 0, bf16: bool = True, device: str = "cpu",
                          eval_every: int | None = 500, eval_k: int = 4, eval_tokens: int = 64,
                          threads: int | None = None, checkpoint_every: int = 100, requests=None,
                          heldout=None, init=None) -> dict:
    """Train an EAGLE-3 head for the built engine ``target`` into ``out`` (module docstring); returns the report.
    ``requests`` / ``heldout``: (name, messages or token ids) pairs instead of the sources' and heldout_chats().
    ``init``: a head to start from (its weights and vocabulary: training it on, e.g. on more answers)."""
    import torch

    from ..heads.eagle3 import head_parameters, save_head
    from ..manifest import read_manifest
    from transformers import AutoTokenizer

    say = log.info
    target, out = Path(target), Path(out)
    manifest = read_manifest(target)
    model = manifest["model"]
    layers = _feature_layers(target, model)
    if steps is None and minutes is None:
        steps = 2000
    if ttt_steps < 1 or not 0 < coverage <= 1:
        raise DistillError(f"ttt_steps must be >= 1 and coverage in (0, 1], got {ttt_steps} and {coverage}")
    check_out_dir(out)
    if threads:
        torch.set_num_threads(threads)
    data_dir = Path(data_dir) if data_dir else out / WORK / "data"
    engine_tok = AutoTokenizer.from_pretrained(target / manifest["tokenizer"])
    if heldout is None:
        heldout = [(f"heldout:{name}", messages) for _, name, messages in heldout_chats()]
    heldout = [(name, request_ids(engine_tok, prompt)) for name, prompt in heldout]
    heldout_prompts = [ids for _, ids in heldout]
    if data_tokens != 0:  # the target writes (the rest of) its answers, then the held-out ones
        if requests is None:
            requests = training_requests(prompts, text=text, stdlib=stdlib)
        write_target_data(target, data_dir, requests, samples=samples, max_new_tokens=max_new_tokens,
                          max_tokens=data_tokens)
    write_target_data(target, data_dir / HELDOUT, heldout, max_new_tokens=eval_tokens)
    data, held = TargetData(data_dir), TargetData(data_dir / HELDOUT)
    answers = data.answer_tokens()
    if init is not None:
        head, config, d2t, t2d = _init_head(Path(init), target, manifest, layers, draft_vocab)
    else:
        size = draft_vocab or vocabulary_for(answers, model["vocab_size"], coverage)
        head, config, d2t, t2d = _new_head(target, manifest, layers, answers, size, intermediate, seed)
    size = config.draft_vocab_size
    to_draft = np.full(config.vocab_size, -1, np.int64)
    to_draft[np.arange(size) + d2t] = np.arange(size)
    held_cov = float(np.isin(held.answer_tokens(), np.arange(size) + d2t).mean())
    say(f"[distill] EAGLE-3 head for {target}: {head_parameters(head) / 1e6:.2f}M parameters, features of layers "
        f"{layers} from the engine, {len(data)} answers ({answers.size} tokens) written by it, draft vocabulary "
        f"{size} (covers {(t2d[answers]).mean():.1%} of them and {held_cov:.1%} of the held-out answers), "
        f"{ttt_steps} training-time steps, on {device}" + (f", starting from {init}" if init is not None else ""))
    head.to(device)
    train, heldout_batches = Batches(data, to_draft, seq, seed, pack=True), Batches(held, to_draft, seq, seed)
    cfg = TrainConfig(steps=steps, minutes=minutes if steps is None else None, batch=batch, seq=seq, lr=lr, seed=seed,
                      bf16=bf16, checkpoint_every=checkpoint_every,
                      extra={"method": "eagle3-engine", "target": str(target.resolve()), "config": config.to_dict(),
                             "init": str(Path(init).resolve()) if init is not None else None,
                             "ttt_steps": ttt_steps, "answers": len(data), "answer_tokens": int(answers.size),
                             "rows": "packed"})
    cfg_report = {"batch": batch, "seq": seq, "rows": "packed", "peak_lr": lr, "ttt_steps": ttt_steps, "seed": seed,
                  "device": device, "init": init and str(init)}
    evals_path = out / WORK / "evaluations.json"  # kept beside the checkpoint: a resumed run reports them all
    evals: list[dict] = json.loads(evals_path.read_text()) if evals_path.is_file() else []
    counted = [0]

    def evaluate(step: int):
        head.eval()
        entry = {"step": step, "tokens_trained": counted[0],
                 "heldout_agreement": heldout_agreement(head, heldout_batches, ttt_steps, device)}
        with tempfile.TemporaryDirectory(prefix="trtspec-ckpt-") as tmp:
            save_head(head.cpu(), Path(tmp), include_embedding=True)
            head.to(device)
            entry["acceptance"] = engine_acceptance(target, Path(tmp), heldout_prompts, k=eval_k,
                                                    max_new_tokens=eval_tokens, threads=threads)
        evals.append(entry)
        evals_path.parent.mkdir(parents=True, exist_ok=True)
        evals_path.write_text(json.dumps(evals, indent=1))
        say(f"[distill] step {step}: held-out agreement per step "
            f"{', '.join(f'{a:.3f}' for a in entry['heldout_agreement'])}; through the engines alpha "
            f"{entry['acceptance']['alpha']:.3f}, {entry['acceptance']['tokens_per_target_call']:.2f} tokens a call")

    def on_checkpoint(step: int):
        if eval_every and step % eval_every == 0:
            evaluate(step)

    loop = TrainLoop(head, cfg, out / WORK, name="distill", log=say, device=device, on_checkpoint=on_checkpoint)

    def loss_fn(model, b, step):
        feats, toks, ids, w, mask, places = b
        counted[0] += int(mask.sum())
        hiddens = model.forward_steps(feats, toks, ttt_steps, hidden_only=True, positions=places)
        return soft_loss(model, hiddens, ids, w, mask, places)

    t0 = time.perf_counter()
    seconds = loop.run(lambda step: train.batch(step, batch, device), loss_fn)
    evaluate(loop.total_steps)
    final = out / WORK / "final"
    save_head(head.cpu(), final, include_embedding=False)
    engine_tok.save_pretrained(final / "tokenizer")
    report = {"method": "eagle3", "target_engine": str(target), "head": str(out), "parameters": head_parameters(head),
              "config": config.to_dict(),
              "data": {"answers": len(data), "answer_tokens": int(answers.size), "sources": list(prompts),
                       "max_new_tokens": max_new_tokens, "samples": samples},
              "draft_vocab": {"size": size, "coverage_train": float(t2d[answers].mean()), "coverage_heldout": held_cov},
              "training": {**cfg_report, "steps": loop.total_steps, "bf16_autocast": loop.autocast,
                           "train_minutes": seconds / 60, "positions_counted_this_run": counted[0],
                           "positions_per_s_this_run": counted[0] / max(time.perf_counter() - t0, 1e-9)},
              "loss_curve": loop.history, "evaluations": evals, "heldout": evals[-1]}
    _publish(final, out, report)
    say(f"[distill] wrote {out}: held-out alpha {evals[-1]['acceptance']['alpha']:.3f} at k={eval_k}, "
        f"{evals[-1]['acceptance']['tokens_per_target_call']:.2f} tokens a target call")
    return report
