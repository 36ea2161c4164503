"""A small resumable training loop for the causal LMs trtspec trains itself (the bundled pair, `distill`).

    loop = TrainLoop(model, TrainConfig(steps=2400, lr=1.5e-3), work_dir=Path(".train/target"))
    loop.run(batch_fn, loss_fn)     # resumes from work_dir/checkpoint.pt if one is there

Deterministic under a seed: batch `i` is drawn from `np.random.default_rng([seed, i])`, so a run that was
stopped and resumed sees the same batches in the same order as one that was not. The learning rate is
linear warmup then cosine to `min_lr_ratio` of the peak. On CPUs with AVX512-BF16 the forward and
backward run under bfloat16 autocast (`benchmarks/bench_train_step.py`: 1,884 vs 922 tok/s in float32 on the
development machine, 27M-parameter Llama, batch 16 x 256); master weights and the optimiser stay float32.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import TrtspecError


@dataclass
class TrainConfig:
    steps: int | None = None  # total optimiser steps; None: derived from `minutes` after the first steps
    minutes: float | None = None  # wall-clock budget, used only when steps is None
    batch: int = 16
    seq: int = 256
    lr: float = 1.5e-3
    warmup_fraction: float = 1 / 15
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    seed: int = 0
    bf16: bool = True
    checkpoint_every: int = 50
    log_every: int = 20
    extra: dict = field(default_factory=dict)  # anything else that defines the run (compared on resume)

    def __post_init__(self):
        if self.steps is None and self.minutes is None:
            raise TrtspecError("give a training budget: steps or minutes")
        if self.steps is not None and self.steps < 1:
            raise TrtspecError(f"steps must be >= 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise TrtspecError(f"minutes must be > 0, got {self.minutes}")
        if self.lr <= 0:
            raise TrtspecError(f"lr must be > 0, got {self.lr}")

    def identity(self) -> dict:
        """What must match for a checkpoint to be resumed (not the budget form, not logging)."""
        d = asdict(self)
        for key in ("minutes", "checkpoint_every", "log_every", "steps"):
            d.pop(key)
        d["betas"] = list(d["betas"])
        return d


def bf16_supported() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


_UNTIMED_STEPS, _TIMED_STEPS = 2, 10  # a --minutes budget's step count: the time of steps 3 to 12


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warmup = max(1, round(total * cfg.warmup_fraction))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def random_windows(data: np.ndarray, batch: int, seq: int, seed: int, step: int) -> np.ndarray:
    """batch windows of seq+1 tokens from a packed token stream, a pure function of (seed, step): [batch, seq+1]."""
    if data.size < seq + 2:
        raise TrtspecError(f"training data has {data.size} tokens; at least {seq + 2} are needed for windows of {seq}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, data.size - seq - 1, size=batch)
    return np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int64)


class TrainLoop:
    """AdamW + warmup/cosine + clipping, checkpointed to work_dir every `checkpoint_every` steps."""

    def __init__(self, model, cfg: TrainConfig, work_dir: Path | None, name: str = "train", log=None,
                 device: str = "cpu", on_checkpoint: Callable[[int], None] | None = None):
        import torch

        self.model, self.cfg, self.name = model, cfg, name
        self.device = torch.device(device)
        self.on_checkpoint = on_checkpoint  # called with the step after each checkpoint is written
        self.log = log or (lambda msg: print(msg, flush=True))
        self.work_dir = Path(work_dir) if work_dir is not None else None
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
        self.step = 0
        self.total_steps = cfg.steps
        self.history: list[dict] = []  # {"step", "loss", "lr", "seconds"} every log_every steps
        self.seconds = 0.0  # training time so far, across resumes
        if self.device.type == "cuda":
            self.autocast = cfg.bf16 and torch.cuda.is_bf16_supported()
        else:
            self.autocast = cfg.bf16 and bf16_supported()
        if self.work_dir is not None:
            self._resume()

    # -- checkpoints -------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.work_dir / "checkpoint.pt"

    def _resume(self) -> None:
        import torch

        path = self.checkpoint_path
        if not path.exists():
            return
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
            identity = state["identity"]
        except Exception as e:  # noqa: BLE001 - a torn or foreign file
            raise TrtspecError(f"{path} is not a readable trtspec training checkpoint ({e}); "
                               f"remove it to start over") from e
        if identity != json.loads(json.dumps(self.cfg.identity())):
            raise TrtspecError(f"{path} is from a different run (its settings differ from this one's: "
                               f"{_diff(identity, self.cfg.identity())}); remove {self.work_dir} to start over, "
                               f"or use another work directory")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.history, self.seconds = state["history"], state["seconds"]
        self.log(f"[{self.name}] resumed from {path} at step {self.step}/{self.total_steps} "
                 f"({self.seconds / 60:.1f} min trained)")

    def save(self) -> None:
        import torch

        if self.work_dir is None:
            return
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save({"identity": self.cfg.identity(), "model": self.model.state_dict(),
                    "optimizer": self.opt.state_dict(), "step": self.step, "total_steps": self.total_steps,
                    "history": self.history, "seconds": self.seconds}, tmp)
        os.replace(tmp, self.checkpoint_path)  # a kill mid-save leaves the previous checkpoint intact

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self, batch_fn: Callable[[int], "object"], loss_fn: Callable[["object", "object", int], "object"]) -> float:
        """batch_fn(step) -> batch; loss_fn(model, batch, step) -> scalar loss. Returns training seconds."""
        import torch

        cfg = self.cfg
        self.model.train()
        t_run, tokens_run, steps_run = time.perf_counter(), 0, 0
        while self.total_steps is None or self.step < self.total_steps:
            t0 = time.perf_counter()
            lr = lr_at(self.step, self.total_steps or 10**9, cfg)
            for group in self.opt.param_groups:
                group["lr"] = lr
            batch = batch_fn(self.step)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = loss_fn(self.model, batch, self.step)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            steps_run += 1
            tokens_run += cfg.batch * cfg.seq
            self.seconds += time.perf_counter() - t0
            if self.total_steps is None and steps_run == _UNTIMED_STEPS:
                timed_from = (self.seconds, self.step)
            if self.total_steps is None and steps_run == _UNTIMED_STEPS + _TIMED_STEPS:
                # a --minutes budget: fix the step count from the measured step time (then it is checkpointed); the
                # first steps are left out of it (a run's first touches of its data and allocations made them 1.6x
                # as slow as the rest, and a 45-minute budget ran 27)
                per_step = (self.seconds - timed_from[0]) / (self.step - timed_from[1])
                self.total_steps = max(self.step + 1, int(cfg.minutes * 60 / per_step))
                self.log(f"[{self.name}] {per_step:.2f} s/step: {cfg.minutes:g} min is {self.total_steps} steps")
            if self.step % cfg.log_every == 0 or self.step == self.total_steps or self.step == 1:
                value = float(loss.item())
                self.history.append({"step": self.step, "loss": value, "lr": lr, "seconds": self.seconds})
                el = time.perf_counter() - t_run
                rate = tokens_run / el
                total = self.total_steps or self.step
                eta = (total - self.step) * el / steps_run / 60
                self.log(f"[{self.name}] step {self.step}/{total} loss {value:.3f} lr {lr:.2e} "
                         f"{rate:,.0f} tok/s, {self.seconds / 60:.1f} min, eta {eta:.1f} min")
            if self.step % cfg.checkpoint_every == 0:
                self.save()
                if self.on_checkpoint is not None and self.step < (self.total_steps or 0):
                    self.on_checkpoint(self.step)
                    self.model.train()
        self.save()
        self.model.eval()
        return self.seconds


def repeated_line_mask(pieces: list[str], start: int) -> np.ndarray:
    """Tokens that repeat a line: [len(pieces)] bool, for unlikelihood training against greedy loops.

    ``pieces`` are the decoded texts of a sequence's tokens, the generated ones from ``start``. A generated
    complete line whose text (stripped) equals an earlier generated line is a repeat; the tokens lying
    wholly inside it after its indentation are marked (not the newline-and-indent token that starts it,
    nor the unfinished last line).
    """
    mask = np.zeros(len(pieces), bool)
    text, spans = "", []
    for piece in pieces[start:]:
        spans.append((len(text), len(text) + len(piece)))
        text += piece
    seen, pos = set(), 0
    lines = text.split("\n")
    for line in lines[:-1]:
        key = line.strip()
        first, end = pos + len(line) - len(line.lstrip()), pos + len(line)
        pos = end + 1
        if not key:
            continue
        if key in seen:
            for j, (a, b) in enumerate(spans):
                if first <= a < b <= end + 1:  # a token may end with the line's own newline
                    mask[start + j] = True
        seen.add(key)
    return mask


def _diff(a: dict, b: dict) -> str:
    b = json.loads(json.dumps(b))
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys) or "unknown"


# -- what every distillation shares (distill/draft.py: a draft model; distill/heads.py: EAGLE-3 and Medusa heads) -
WORK = ".distill"
REPORT = "distill_report.json"


class DistillError(TrtspecError, ValueError):
    """Bad input to distill: no data, a non-empty output directory, impossible shapes."""


def collect_files(paths, pattern: str = "*.py") -> list[tuple[Path, str]]:
    """(file, key) for every file given or found under a directory given; key = path relative to the argument."""
    found = []
    for arg in paths:
        arg = Path(arg)
        if arg.is_dir():
            for p in sorted(arg.rglob(pattern)):
                if p.is_file():
                    found.append((p, p.relative_to(arg).as_posix()))
        elif arg.is_file():
            found.append((arg, arg.name))
        else:
            raise DistillError(f"training data {arg} does not exist; pass text files or directories of them")
    return found


def heldout_key(key: str) -> bool:
    """The held-out rule of the bundled pair: sha256(relative path) mod 20 == 0 (~5 % of files)."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 20 == 0


def encode_files(tokenizer, files: list[Path]) -> np.ndarray:
    """Every file as <bos> text <eos>, concatenated into one packed stream: [N] int32."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for start in range(0, len(files), 64):
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in files[start : start + 64]]
        for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.extend([*bos, *enc, *eos])
    return np.asarray(ids, dtype=np.int32)


def heldout_prompts(files: list[Path], tokenizer, n: int, prompt_tokens: int = 64) -> list[str]:
    """Whole lines from a third of the way into each held-out file, about prompt_tokens long (the last newline
    left to the model)."""
    prompts = []
    for p in files:
        lines = Path(p).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        acc = ""
        for line in lines[len(lines) // 3 :]:
            if len(tokenizer(acc + line, add_special_tokens=False)["input_ids"]) > prompt_tokens:
                break
            acc += line
        if len(tokenizer(acc, add_special_tokens=False)["input_ids"]) >= prompt_tokens // 2:
            # without the last newline: byte-level BPEs write a newline and the next indentation as one token,
            # so a prompt ending in a bare newline would ask for a line at column 0
            prompts.append(acc.removesuffix("\n"))
        if len(prompts) == n:
            break
    return prompts


def load_text(tokenizer, data, heldout, pattern: str, seq: int, vocab_size: int, say):
    """The training and held-out token streams of ``data`` (held out: ``heldout``, else files whose path hashes to
    0 mod 20; too little held out: the last 5 % of the stream) -> (train_ids, held_ids, train_files, held_files)."""
    files = collect_files(data, pattern)
    if heldout is not None:
        held_files = [p for p, _ in collect_files(heldout, pattern)]
        held_set = {p.resolve() for p in held_files}
        train_files = [p for p, _ in files if p.resolve() not in held_set]
    else:
        train_files = [p for p, key in files if not heldout_key(key)]
        held_files = [p for p, key in files if heldout_key(key)]
    if not train_files:
        raise DistillError(f"no training text: no {pattern} files under {', '.join(map(str, data))}")
    t0 = time.perf_counter()
    train_ids = encode_files(tokenizer, train_files)
    held_ids = encode_files(tokenizer, held_files) if held_files else np.zeros(0, np.int32)
    if held_ids.size < seq + 1:  # too little held out: keep the last 5 % of the stream aside instead
        cut = int(train_ids.size * 0.95)
        train_ids, held_ids = train_ids[:cut], train_ids[cut:]
    if train_ids.size < seq + 2:
        raise DistillError(f"the training text is {train_ids.size} tokens; at least {seq + 2} are needed "
                           f"(or pass a smaller seq)")
    if int(train_ids.max()) >= vocab_size:
        raise DistillError(f"the tokenizer produced id {int(train_ids.max())} >= the model's vocabulary {vocab_size}")
    say(f"[distill] {len(train_files)} training files ({train_ids.size:,} tokens), {len(held_files)} held out "
        f"({held_ids.size:,} tokens); tokenized in {time.perf_counter() - t0:.1f} s")
    return train_ids, held_ids, train_files, held_files


def frozen_teacher(target):
    """The target in float32, in eval mode, without gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    from .exporter.gguf import hf_source

    folder, source = hf_source(target)
    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **source).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def check_out_dir(out: Path) -> None:
    """A new or empty directory for a distillation's model (a stopped run's WORK directory alone is taken)."""
    if out.exists() and not out.is_dir():
        raise DistillError(f"{out} exists and is not a directory; pass a new or empty --out directory")
    if out.exists() and any(p.name != WORK for p in out.iterdir()):
        raise DistillError(f"{out} is not empty; distill writes a new model directory there: pass a new or empty "
                           f"--out (a stopped run resumes when only its {WORK}/ directory is there)")
