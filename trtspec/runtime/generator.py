"""Generator: the blocking API over a Scheduler (runtime/scheduler.py), which owns the engines.

``generate(list)`` queues every prompt at once, so a list longer than the engines' rows refills
rows as requests finish; calls from several threads share one scheduler and batch together, and
each caller gets exactly the output its request would get alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .scheduler import DRAFTERS, GenerationResult, RequestStats, Scheduler

__all__ = ["DRAFTERS", "BatchStats", "GenerationOutput", "GenerationResult", "Generator", "RequestStats", "Stream"]


@dataclass
class BatchStats(RequestStats):
    """A generate() call's totals: its requests' counts, and the scheduler's work while it ran
    (which includes other callers' requests sharing the rounds)."""

    requests: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    k_chosen: list[int] = field(default_factory=list)  # k per round


class GenerationOutput(list):
    """The results of a batch of prompts, in prompt order, with ``stats`` for the whole batch."""

    def __init__(self, results, stats: BatchStats):
        super().__init__(results)
        self.stats = stats


class Stream:
    """Iterate for text deltas as blocks are accepted; ``result`` holds the GenerationResult afterwards."""

    def __init__(self, handle):
        self._handle = handle
        self.id = handle.id
        self.result: GenerationResult | None = None

    def __iter__(self):
        try:
            yield from self._handle
        finally:
            if not self._handle.done:  # the caller stopped iterating (break, Ctrl-C): free the row
                self._handle.cancel()
        self.result = self._handle.result()

    def cancel(self):
        self._handle.cancel()


class Generator:
    """Generate text with a target engine, optionally drafting with a draft engine or prompt lookup.

    ``target``/``draft`` are engine or export directories, or loaded engines.
    ``drafter`` is "draft" (default when a draft is given), "prompt_lookup" or "none".
    k is ``num_draft_tokens`` every round, or with ``adaptive_k`` chosen each round (up to it) from
    the measured costs at the current batch size. Other keyword arguments go to the Scheduler.
    Safe to share between threads.
    """

    def __init__(self, target, draft=None, *, num_draft_tokens: int = 4, drafter: str | None = None,
                 adaptive_k: bool = False, num_threads: int | None = None, **scheduler_options):
        self.scheduler = Scheduler(
            target, draft, drafter=drafter, num_draft_tokens=num_draft_tokens,
            k_policy="load-aware" if adaptive_k else "fixed", num_threads=num_threads, **scheduler_options,
        )
        self.target = self.scheduler.target
        self.draft = self.scheduler.draft
        self.tokenizer = self.scheduler.tokenizer
        self.capacity = self.scheduler.capacity
        self.max_batch = self.scheduler.max_batch
        self.num_draft_tokens = self.scheduler.num_draft_tokens

    def generate(self, prompts, max_new_tokens: int = 128, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop=None, **request_options):
        """Generate for one prompt (-> GenerationResult) or a list (-> GenerationOutput, a list with .stats).

        In a list with a ``seed``, prompt i samples with seed + i (so each reproduces alone with its seed).
        """
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        params = [dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=None if seed is None else seed + i, stop=stop, **request_options)
                  for i in range(len(prompts))]
        before = self.scheduler.stats()
        first_round = self.scheduler.round_log[-1][0] + 1 if self.scheduler.round_log else 0
        t0 = time.perf_counter()
        handles = self.scheduler.submit_many(prompts, params, stream=False)
        try:
            results = [h.result() for h in handles]
        except BaseException:  # Ctrl-C, or one request failed: the others stop too
            for h in handles:
                h.cancel()
            raise
        if single:
            return results[0]
        after = self.scheduler.stats()
        stats = BatchStats(requests=len(results))
        for r in results:
            for name in ("new_tokens", "prompt_tokens", "target_calls", "rounds", "proposed", "accepted", "rejected"):
                setattr(stats, name, getattr(stats, name) + getattr(r.stats, name))
            for i, count in enumerate(r.stats.accepted_histogram):
                if len(stats.accepted_histogram) <= i:
                    stats.accepted_histogram.append(0)
                stats.accepted_histogram[i] += count
        stats.elapsed_s = time.perf_counter() - t0
        stats.time_to_first_token_s = min(r.stats.time_to_first_token_s for r in results)
        stats.target_calls = after.target_calls - before.target_calls
        stats.rounds = after.rounds - before.rounds
        for name in ("draft_calls", "prefill_s", "draft_s", "verify_s"):
            setattr(stats, name, getattr(after, name) - getattr(before, name))
        stats.other_s = max(0.0, stats.elapsed_s - stats.prefill_s - stats.draft_s - stats.verify_s)
        stats.k_chosen = [k for rnd, k, _ in list(self.scheduler.round_log) if rnd >= first_round]
        return GenerationOutput(results, stats)

    def stream(self, prompt: str, max_new_tokens: int = 128, **kwargs) -> Stream:
        """Like generate() for one prompt, yielding text deltas as each block of tokens is accepted."""
        if not isinstance(prompt, str):
            raise TypeError("stream() takes one prompt string; use generate() for a batch")
        return Stream(self.scheduler.submit(prompt, max_new_tokens=max_new_tokens, **kwargs))

    def close(self):
        """Stop the scheduler's loop thread (requests still running end as cancelled)."""
        self.scheduler.close()
