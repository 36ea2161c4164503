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

    def __init__(self, model, cfg: TrainConfig, work_dir: Path | None, name: str = "train", log=None):
        import torch

        self.model, self.cfg, self.name = model, cfg, name
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
            state = torch.load(path, map_location="cpu", weights_only=False)
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
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = loss_fn(self.model, batch, self.step)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            steps_run += 1
            tokens_run += cfg.batch * cfg.seq
            self.seconds += time.perf_counter() - t0
            if self.total_steps is None and steps_run == 5:
                # a --minutes budget: fix the step count from the measured step time (then it is checkpointed)
                per_step = self.seconds / self.step
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
