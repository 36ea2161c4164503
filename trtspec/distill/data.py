"""Training data that the target writes itself: its answers to requests (prompts.py), run on the built engine that
the head will draft for, with the features that engine computes.

``write_target_data(engine, out, requests)`` answers each request greedily (and ``samples`` more times sampled),
several requests at a time (one engine row each, new requests taking rows as others finish), and stores per
sequence (prompt + answer, the answer's EOS included):

    tokens     int32 [n]                   what the sequence holds
    features   float16 [n - 1, F]          the engine's hidden_states output at positions 0 .. n - 2 (the ones fed)
    top_ids    int32 [n - 1, K]            the target's K most likely next tokens at each of those positions
    top_probs  float16 [n - 1, K]          and their probabilities (temperature 1)

in shards ``OUT/shard-NNNNN.npz`` (a shard is written whole, then renamed: a stopped run loses at most the shard it
was filling). Running the same command again skips the (request, variant) pairs the shards hold.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..progress import Progress
from ..training import DistillError

log = logging.getLogger("trtspec")
TOP = 8  # next-token probabilities kept per position (the rest of the mass is left out of the soft labels)


@dataclass
class _Row:
    name: str
    variant: int  # 0: greedy; i >= 1: the i-th sampled answer
    tokens: list
    prompt_len: int
    features: list = field(default_factory=list)
    top_ids: list = field(default_factory=list)
    top_probs: list = field(default_factory=list)
    rng: np.random.Generator | None = None


def top_distribution(logits: np.ndarray, k: int = TOP) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, V] -> (ids [T, k] int32 most likely first, probabilities [T, k] float16 at temperature 1)."""
    logits = logits.astype(np.float32, copy=False)
    ids = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits, ids, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids, vals = np.take_along_axis(ids, order, -1), np.take_along_axis(vals, order, -1)
    top = logits.max(-1, keepdims=True)
    lse = top + np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return ids.astype(np.int32), np.exp(vals - lse).astype(np.float16)


def _next_token(logits: np.ndarray, row: _Row, temperature: float) -> int:
    if row.rng is None:
        return int(logits.argmax())
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(row.rng.choice(p.size, p=p / p.sum()))


def request_ids(tokenizer, prompt) -> list[int]:
    """A request's token ids: given as such, or its chat (messages) in the model's chat template."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return tokenizer(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]


def done_pairs(out: Path) -> set[tuple[str, int]]:
    """The (request name, variant) pairs the shards under ``out`` hold."""
    done = set()
    for shard in sorted(Path(out).glob("shard-*.npz")):
        with np.load(shard) as z:
            done.update(zip(z["names"].tolist(), z["variants"].tolist()))
    return done


def _seed(name: str, variant: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}#{variant}".encode()).digest()[:8], "little")


def _write_shard(out: Path, rows: list[_Row]) -> Path:
    index = len(list(out.glob("shard-*.npz")))
    path = out / f"shard-{index:05d}.npz"
    tmp = out / f".shard-{index:05d}.tmp.npz"
    lengths = np.array([len(r.tokens) for r in rows], np.int64)
    np.savez(tmp, names=np.array([r.name for r in rows]), variants=np.array([r.variant for r in rows], np.int32),
             offsets=np.concatenate([[0], np.cumsum(lengths)]), prompt_lens=np.array([r.prompt_len for r in rows]),
             tokens=np.concatenate([np.asarray(r.tokens, np.int32) for r in rows]),
             features=np.concatenate([np.concatenate(r.features) for r in rows]),
             top_ids=np.concatenate([np.concatenate(r.top_ids) for r in rows]),
             top_probs=np.concatenate([np.concatenate(r.top_probs) for r in rows]))
    os.replace(tmp, path)
    return path


def write_target_data(engine, out, requests, *, samples: int = 0, temperature: float = 0.8, max_new_tokens: int = 256,
                      shard_tokens: int = 32_768, max_tokens: int | None = None) -> dict:
    """Answer ``requests`` ((name, messages) pairs, or (name, token ids)) with ``engine`` (a loaded engine or its
    directory; built with a hidden_states output) into shards under ``out``; returns a summary. ``max_tokens``
    stops after that many new tokens written by this call (a budget); the run resumes from the shards."""
    from ..engines import load_engine
    from ..runtime.tokenizer import load_tokenizer

    if temperature <= 0:
        raise DistillError(f"temperature must be > 0 for sampled answers, got {temperature}")
    engine = load_engine(engine) if isinstance(engine, (str, os.PathLike)) else engine
    if not getattr(engine, "features_size", None):
        raise DistillError(f"{engine.path} has no hidden_states output: build the target with --hidden-states "
                           "low,mid,high (or --head) so that its features can be stored")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(engine)
    eos = set((engine.manifest["model"].get("special_tokens") or {}).get("eos_token_ids") or [])
    capacity = engine.max_seq_len
    done = done_pairs(out)
    jobs, skipped = [], 0
    for name, prompt in requests:
        ids = None
        for variant in range(1 + samples):
            if (name, variant) in done:
                continue
            if ids is None:
                ids = request_ids(tokenizer, prompt)
            if len(ids) + 16 > capacity:
                skipped += 1
                break
            jobs.append((name, variant, list(ids)))
    say = log.info
    say(f"[distill] target data: {len(jobs)} answers to write ({len(done)} already in {out}"
        + (f", {skipped} prompts too long for the engine's {capacity} positions" if skipped else "") + ")")
    rows: list[_Row | None] = [None] * engine.max_batch
    finished: list[_Row] = []
    pending_tokens = written = new_total = 0
    shards = []
    progress = Progress("target data", len(jobs), "answers", log)
    t0 = time.perf_counter()
    next_job = 0

    def flush():
        nonlocal pending_tokens
        if finished:
            shards.append(_write_shard(out, finished).name)
            finished.clear()
            pending_tokens = 0

    def start(r, job):
        name, variant, ids = job
        row = _Row(name, variant, list(ids), len(ids), rng=np.random.default_rng(_seed(name, variant)) if variant else None)
        step = engine.max_call_tokens
        for s in range(0, len(ids), step):  # the prompt in calls of at most max_call_tokens
            chunk = np.asarray(ids[s : s + step], np.int64)[None]
            logits = engine.forward(chunk, np.arange(s, s + chunk.shape[1], dtype=np.int64)[None], first_row=r)
            _record(row, logits[0], engine.features[0])
        row.tokens.append(_next_token(logits[0, -1], row, temperature))
        rows[r] = row

    def _record(row, logits, features):
        ids, probs = top_distribution(logits)
        row.features.append(features.astype(np.float16))
        row.top_ids.append(ids)
        row.top_probs.append(probs)

    while True:
        for r in range(len(rows)):
            if rows[r] is None and next_job < len(jobs) and (max_tokens is None or new_total < max_tokens):
                start(r, jobs[next_job])
                next_job += 1
        active = [r for r in range(len(rows)) if rows[r] is not None]
        if not active:
            break
        b = max(active) + 1  # rows [0, b) in one call; a free row below b writes a pad at its position 0
        ids = np.zeros((b, 1), np.int64)
        pos = np.zeros((b, 1), np.int64)
        for r in active:
            ids[r, 0], pos[r, 0] = rows[r].tokens[-1], len(rows[r].tokens) - 1
        logits = engine.forward(ids, pos)
        for r in active:
            row = rows[r]
            _record(row, logits[r], engine.features[r])
            token = _next_token(logits[r, 0], row, temperature)
            row.tokens.append(token)
            new = len(row.tokens) - row.prompt_len
            if token in eos or new >= max_new_tokens or len(row.tokens) >= capacity:
                rows[r] = None
                finished.append(row)
                written += 1
                new_total += new
                pending_tokens += len(row.tokens)
                progress.update(written, f"{new_total / (time.perf_counter() - t0):.0f} new tok/s")
                if pending_tokens >= shard_tokens:
                    flush()
    flush()
    progress.close()
    seconds = time.perf_counter() - t0
    summary = {"answers": written, "new_tokens": new_total, "seconds": seconds,
               "new_tokens_per_s": new_total / seconds if seconds else 0.0, "shards": shards,
               "remaining": len(jobs) - written, "skipped_too_long": skipped}
    say(f"[distill] target data: {written} answers, {new_total} new tokens in {seconds:.0f} s "
        f"({summary['new_tokens_per_s']:.0f} tok/s), {summary['remaining']} left")
    return summary


class TargetData:
    """Every shard under a directory, in memory: the sequences' tokens, features and next-token distributions."""

    def __init__(self, path):
        path = Path(path)
        shards = sorted(path.glob("shard-*.npz"))
        if not shards:
            raise DistillError(f"{path} holds no target data (shard-*.npz): write it first (trtspec distill "
                               "--method eagle3 with a built --target engine)")
        names, variants, prompt_lens, tokens, offsets, rows = [], [], [], [], [0], []
        for shard in shards:  # the small arrays first: the per-position ones fill arrays made once (no second copy)
            with np.load(shard) as z:
                names += z["names"].tolist()
                variants += z["variants"].tolist()
                prompt_lens.append(z["prompt_lens"])
                tokens.append(z["tokens"])
                o = z["offsets"]
                offsets += (o[1:] + offsets[-1]).tolist()
                rows.append(int(o[-1]) - (len(o) - 1))
        arrays = {}
        at = 0
        for shard, n in zip(shards, rows):
            with np.load(shard) as z:
                for key in ("features", "top_ids", "top_probs"):
                    part = z[key]
                    if key not in arrays:
                        arrays[key] = np.empty((sum(rows), *part.shape[1:]), part.dtype)
                    if part.shape != (n, *arrays[key].shape[1:]):
                        raise DistillError(f"{shard}: its {key} {part.shape} do not match its tokens or the other "
                                           "shards' (a foreign or damaged shard: move it out of the directory)")
                    arrays[key][at : at + n] = part
            at += n
        self.names, self.variants = names, np.array(variants)
        self.prompt_lens = np.concatenate(prompt_lens)
        self.tokens = np.concatenate(tokens)
        self.offsets = np.array(offsets, np.int64)
        # per-position arrays have one row fewer a sequence than tokens: sequence i's rows start at offsets[i] - i
        self.features, self.top_ids, self.top_probs = arrays["features"], arrays["top_ids"], arrays["top_probs"]
        if self.features.shape[0] != self.tokens.size - len(names):
            raise DistillError(f"{path}: the shards' features do not match their tokens (a foreign or damaged shard)")

    def __len__(self) -> int:
        return len(self.names)

    def sequence(self, i: int):
        """-> (tokens [n], prompt_len, features [n - 1, F], top_ids [n - 1, K], top_probs [n - 1, K])."""
        a, b = self.offsets[i], self.offsets[i + 1]
        fa, fb = a - i, b - i - 1
        return (self.tokens[a:b], int(self.prompt_lens[i]), self.features[fa:fb], self.top_ids[fa:fb],
                self.top_probs[fa:fb])

    def answer_tokens(self) -> np.ndarray:
        """Every answer's tokens (what the target wrote), concatenated."""
        return np.concatenate([self.tokens[self.offsets[i] + self.prompt_lens[i] : self.offsets[i + 1]]
                               for i in range(len(self))])
