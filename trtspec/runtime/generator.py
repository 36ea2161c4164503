"""Generator: batched generation over engines, plain or speculative, greedy or sampled.

One loop serves every drafter. Each round, for the rows still running:
  1. the drafter proposes up to k tokens per row (none: k = 0),
  2. the target scores [last token, drafts...] in one call at each row's positions,
  3. each row keeps its longest accepted prefix plus one token from the target.
Rejected tokens stay in the caches beyond the row's length: the mask hides them
and the next write overwrites them (DESIGN.md §2). Finished rows leave the batch
(the last running row's cache row moves into the free one), so they cost nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..engines import load_engine
from ..errors import CapacityError
from .adaptive import AdaptiveK
from .drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter
from .sampling import SamplingParams, sample
from .speculative import accept_greedy, accept_sampling
from .text import IncrementalText
from .vocab import check_same_vocabulary

DRAFTERS = ("draft", "prompt_lookup", "none")


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    elapsed_s: float = 0.0
    time_to_first_token_s: float = 0.0
    target_calls: int = 0  # prefill included
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended at a rejected draft (the rest accepted all they proposed)
    accepted_histogram: list[int] = field(default_factory=list)  # rounds that accepted i drafts, i = 0..k

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def token_acceptance(self) -> float:
        """Per-token acceptance probability alpha: accepted / drafts actually checked (DESIGN.md §4)."""
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else 0.0

    @property
    def mean_tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    def record_accept(self, accepted: int, proposed: int):
        if proposed == 0:  # a plain decoding round: nothing was up for acceptance
            return
        self.proposed += proposed
        self.accepted += accepted
        self.rejected += accepted < proposed
        if len(self.accepted_histogram) <= accepted:
            self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[accepted] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_s=self.tokens_per_s,
            acceptance_rate=self.acceptance_rate,
            token_acceptance=self.token_acceptance,
            mean_tokens_per_target_call=self.mean_tokens_per_target_call,
        )
        return d


@dataclass
class BatchStats(RequestStats):
    requests: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    k_chosen: list[int] = field(default_factory=list)  # k per round (adaptive k)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens or the cache's capacity)
    stats: RequestStats


class GenerationOutput(list):
    """The results of a batch of prompts, in prompt order, with ``stats`` for the whole batch."""

    def __init__(self, results, stats: BatchStats):
        super().__init__(results)
        self.stats = stats


class Stream:
    """Iterate for text deltas as blocks are accepted; ``result`` holds the GenerationResult afterwards."""

    def __init__(self, events):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self):
        for _, delta in self._events:
            if delta:
                yield delta
        self.result = self._events.output[0][0]


class _Row:
    """One request's state; lives in engine row ``slot`` while it runs."""

    def __init__(self, index, prompt_len, text):
        self.index = index
        self.prompt_len = prompt_len
        self.text = text
        self.stats = RequestStats(prompt_tokens=prompt_len)
        self.finish_reason = None
        self.token_ids: list[int] | None = None


def _as_engine(engine_or_path, num_threads):
    if isinstance(engine_or_path, (str, os.PathLike)):
        return load_engine(engine_or_path, num_threads=num_threads)
    return engine_or_path


def _load_tokenizer(engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(engine.path) / engine.manifest["tokenizer"])


class Generator:
    """Generate text with a target engine, optionally drafting with a draft engine or prompt lookup.

    ``target``/``draft`` are engine or export directories, or loaded engines.
    ``drafter`` is "draft" (default when a draft is given), "prompt_lookup" or "none".
    With ``adaptive_k`` the draft length is chosen each round, up to ``num_draft_tokens``.
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        num_draft_tokens: int = 4,
        drafter: str | None = None,
        adaptive_k: bool = False,
        num_threads: int | None = None,
    ):
        self.target = _as_engine(target, num_threads)
        self.tokenizer = _load_tokenizer(self.target)
        drafter = drafter or ("draft" if draft is not None else "none")
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if drafter == "draft" and draft is None:
            raise ValueError("drafter 'draft' needs a draft model: pass draft=PATH (or choose prompt_lookup/none)")
        if drafter != "draft" and draft is not None:
            raise ValueError(f"a draft model was given but drafter is {drafter!r}; drop one of them")
        special = self.target.manifest["model"]["special_tokens"]
        self.eos_ids = frozenset(special["eos_token_ids"])
        self.pad_id = special["pad_token_id"] if special["pad_token_id"] is not None else 0
        self.draft = None
        engines = [self.target]
        if drafter == "draft":
            self.draft = _as_engine(draft, num_threads)
            check_same_vocabulary(self.target, self.draft)
            engines.append(self.draft)
            self.drafter = DraftModelDrafter(self.draft, self.pad_id)
        elif drafter == "prompt_lookup":
            self.drafter = PromptLookupDrafter()
        else:
            self.drafter = NoDrafter()
        self.capacity = min(e.max_seq_len for e in engines)
        self.max_batch = min(e.max_batch for e in engines)
        # the k values every engine can verify/draft in one call (TensorRT engines have fixed profiles)
        sizes = [getattr(e, "verify_tokens", None) for e in engines[:1]]
        max_k = self.capacity - 1
        self.allowed_k = [k for k in range(1, max_k + 1) if all(s is None or k + 1 in s for s in sizes)]
        if drafter != "none":
            if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
                raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
            if num_draft_tokens not in self.allowed_k and not adaptive_k:
                raise ValueError(
                    f"num_draft_tokens={num_draft_tokens} is not supported by the engines "
                    f"(verify sizes k+1 allowed for k in {self.allowed_k[:8]}{'...' if len(self.allowed_k) > 8 else ''})"
                )
        self.num_draft_tokens = num_draft_tokens if drafter != "none" else 0
        self.adaptive_k = adaptive_k and drafter != "none"

    # -- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[str],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
    ):
        """Generate for one prompt (-> GenerationResult) or a list (-> GenerationOutput, a list with .stats)."""
        single = isinstance(prompts, str)
        events = _Events(self._run([prompts] if single else list(prompts), max_new_tokens,
                                   SamplingParams(temperature, top_k, top_p, seed), stop))
        for _ in events:
            pass
        results, stats = events.output
        return results[0] if single else GenerationOutput(results, stats)

    def stream(self, prompt: str, max_new_tokens: int = 128, **kwargs) -> Stream:
        """Like generate() for one prompt, yielding text deltas as each block of tokens is accepted."""
        if not isinstance(prompt, str):
            raise TypeError("stream() takes one prompt string; use generate() for a batch")
        params = SamplingParams(
            kwargs.pop("temperature", 0.0), kwargs.pop("top_k", None), kwargs.pop("top_p", None), kwargs.pop("seed", None)
        )
        stop = kwargs.pop("stop", None)
        if kwargs:
            raise TypeError(f"unexpected arguments: {', '.join(kwargs)}")
        events = _Events(self._run([prompt], max_new_tokens, params, stop))
        stream = Stream(events)
        return stream

    # -- the loop ---------------------------------------------------------------------------

    def _encode(self, prompts):
        encoded = []
        for p in prompts:
            if not isinstance(p, str):
                raise TypeError(f"prompts must be strings, got {type(p).__name__}")
            ids = self.tokenizer(p)["input_ids"]
            if not ids:
                bos = self.target.manifest["model"]["special_tokens"]["bos_token_id"]
                if bos is None:
                    raise ValueError("empty prompt and the tokenizer has no BOS token to start from")
                ids = [bos]
            if len(ids) >= self.capacity:
                raise CapacityError(
                    f"prompt has {len(ids)} tokens but the engine holds {self.capacity} positions (prompt and "
                    f"output together); shorten the prompt or re-export with --max-seq-len {2 * len(ids)}"
                )
            encoded.append(np.asarray(ids, dtype=np.int64))
        return encoded

    def _run(self, prompts, max_new_tokens, params, stop):
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        if not prompts:
            raise ValueError("no prompts given")
        encoded = self._encode(prompts)  # validate every prompt before any engine call
        rng = np.random.default_rng(params.seed)
        results = [None] * len(prompts)
        batch_stats = BatchStats(requests=len(prompts))
        t_start = time.perf_counter()
        for chunk_start in range(0, len(prompts), self.max_batch):
            chunk = list(range(chunk_start, min(chunk_start + self.max_batch, len(prompts))))
            yield from self._run_batch(chunk, encoded, max_new_tokens, params, stop, rng, results, batch_stats, t_start)
        batch_stats.elapsed_s = time.perf_counter() - t_start
        batch_stats.other_s = max(
            0.0, batch_stats.elapsed_s - batch_stats.prefill_s - batch_stats.draft_s - batch_stats.verify_s
        )
        batch_stats.new_tokens = sum(r.stats.new_tokens for r in results)
        batch_stats.prompt_tokens = sum(r.stats.prompt_tokens for r in results)
        batch_stats.time_to_first_token_s = min(r.stats.time_to_first_token_s for r in results)
        return results, batch_stats

    def _run_batch(self, chunk, encoded, max_new_tokens, params, stop, rng, results, bstats, t_start):
        t0 = time.perf_counter()
        target, drafter = self.target, self.drafter
        b = len(chunk)
        lengths = np.array([encoded[i].size for i in chunk], dtype=np.int64)
        k_max = self.num_draft_tokens
        tokens = np.full((b, self.capacity + k_max + 1), self.pad_id, dtype=np.int64)
        for row, i in enumerate(chunk):
            tokens[row, : lengths[row]] = encoded[i]
        n = lengths.copy()  # tokens per row; the last one is not in any cache yet
        rows = [_Row(i, int(lengths[r]), IncrementalText(self.tokenizer, int(lengths[r]), stop)) for r, i in enumerate(chunk)]

        # Prefill: every prompt at once, right-padded (pads sit beyond each row's length).
        width = int(lengths.max())
        positions = np.broadcast_to(np.arange(width), (b, width))
        logits = target.forward(tokens[:, :width], positions)
        last = logits[np.arange(b), lengths - 1]
        first = last.argmax(axis=-1) if params.greedy else [sample(p, rng) for p in params.probs(last)]
        drafter.prefill(tokens[:, :width], positions, lengths)
        t_first = time.perf_counter()
        bstats.prefill_s += t_first - t0
        bstats.target_calls += 1
        if self.draft is not None:
            bstats.draft_calls += 1
        for r, row in enumerate(rows):
            row.stats.target_calls = 1
            row.stats.time_to_first_token_s = t_first - t_start
            yield row.index, self._emit(row, tokens[r], n, r, [int(first[r])], max_new_tokens)

        adaptive = AdaptiveK(k_max, self.allowed_k) if self.adaptive_k else None
        slots = rows[:]  # slot s runs in engine row s; finished rows are compacted away
        self._compact(slots, tokens, n, t_start, results)
        while slots:
            b = len(slots)
            nb = n[:b]
            remaining = max(max_new_tokens - row.stats.new_tokens for row in slots)
            limit = min(int(self.capacity - nb.max()), remaining - 1)
            k = adaptive.choose(limit) if adaptive else min(k_max, limit)
            bstats.k_chosen.append(k)
            t_round = time.perf_counter()
            if k > 0:
                drafts, counts, draft_probs = drafter.propose(tokens[:b], nb, k, params, rng)
                k = drafts.shape[1]
            else:
                drafts, counts, draft_probs = np.zeros((b, 0), np.int64), np.zeros(b, np.int64), None
            t_verify = time.perf_counter()
            ids = np.concatenate([tokens[np.arange(b), nb - 1][:, None], drafts], axis=1)
            logits = target.forward(ids, (nb - 1)[:, None] + np.arange(k + 1))
            t_accept = time.perf_counter()
            if self.draft is not None and k > 0:
                bstats.draft_calls += k
                bstats.draft_s += t_verify - t_round
                if adaptive:
                    adaptive.record_draft(t_verify - t_round, k)
            bstats.verify_s += t_accept - t_verify
            if adaptive:
                adaptive.record_target(k + 1, t_accept - t_verify)
            n_before = nb.copy()
            accepted = np.zeros(b, np.int64)
            for s in range(b):
                m = int(counts[s])
                if params.greedy:
                    a, x = accept_greedy(drafts[s, :m], logits[s, : m + 1])
                else:
                    p = params.probs(logits[s, : m + 1])
                    q = None if draft_probs is None else draft_probs[s, :m]
                    a, x = accept_sampling(drafts[s, :m], q, p, rng)
                accepted[s] = a
                row = slots[s]
                row.stats.rounds += 1
                row.stats.target_calls += 1
                row.stats.record_accept(a, m)
                bstats.record_accept(a, m)
                if adaptive:
                    adaptive.record_round(m, a)
                new = [*drafts[s, :a].tolist(), x]
                yield row.index, self._emit(row, tokens[s], n, s, new, max_new_tokens)
            bstats.rounds += 1
            bstats.target_calls += 1
            drafter.accepted(n_before + accepted)
            self._compact(slots, tokens, n, t_start, results)

    def _emit(self, row, row_tokens, n, slot, new, max_new_tokens) -> str:
        """Append accepted tokens to a row, stopping at EOS, a stop string, max_new_tokens or capacity."""
        text = row.text
        delta = ""
        for tok in new:
            if row.stats.new_tokens >= max_new_tokens:
                row.finish_reason = "length"
                break
            row_tokens[n[slot]] = tok
            n[slot] += 1
            row.stats.new_tokens += 1
            if tok in self.eos_ids:
                row.finish_reason = "stop"
                break
            if text.stop:
                # token by token, so a stop string completed mid-block ends the output at that token
                piece = text.advance(row_tokens, n[slot])
                kept = text.cut_at_stop(piece)
                if kept is not None:
                    row.finish_reason = "stop"
                    return delta + kept
                delta += piece
            if n[slot] >= self.capacity:
                row.finish_reason = "length"
                break
        else:
            if row.stats.new_tokens >= max_new_tokens:
                row.finish_reason = "length"
        if not text.stop or row.finish_reason:
            delta += text.advance(row_tokens, n[slot], final=row.finish_reason is not None)
        return delta

    def _compact(self, slots, tokens, n, t_start, results):
        """Retire finished rows: the last running row moves into each freed engine row."""
        s = 0
        while s < len(slots):
            row = slots[s]
            if row.finish_reason is None:
                s += 1
                continue
            row.token_ids = tokens[s, row.prompt_len : n[s]].tolist()
            row.stats.elapsed_s = time.perf_counter() - t_start
            results[row.index] = GenerationResult(row.text.text, row.token_ids, row.finish_reason, row.stats)
            last = len(slots) - 1
            if s != last:
                self.target.move_row(last, s)
                self.drafter.move_row(last, s)
                tokens[s] = tokens[last]
                n[s] = n[last]
                slots[s] = slots[last]
            slots.pop()


class _Events:
    """Iterate a generator of (index, delta) events and keep its return value in ``output``."""

    def __init__(self, gen):
        self._gen = gen
        self.output = None

    def __iter__(self):
        self.output = yield from self._gen
