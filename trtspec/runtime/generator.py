"""Generator: the blocking API over a Scheduler (runtime/scheduler.py), which owns the engines.

``generate(list)`` queues every prompt at once, so a list longer than the engines' rows refills
rows as requests finish; calls from several threads share one scheduler and batch together, and
each caller gets exactly the output its request would get alone.
"""

from __future__ import annotations

import time

from .request import BatchStats, GenerationResult, RequestStats
from .scheduler import DRAFTERS, Scheduler
from .tokenizer import is_token_ids

__all__ = ["DRAFTERS", "BatchStats", "GenerationOutput", "GenerationResult", "Generator", "RequestStats", "Stream"]


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

    ``target``/``draft`` are engine or export directories, or loaded engines (``draft="self"``: the target's own
    INT4 build). ``drafter``: "draft" (default when a draft is given), "eagle3" or "medusa" (``draft`` is the
    exported head, on a target exported with ``--hidden-states``), "prompt_lookup", "suffix" (the request's own
    text and earlier outputs; with a draft, the draft model drafts the rows it has no match for) or "none".
    ``k_policy`` "load-aware" (default) chooses k each round, up to ``num_draft_tokens``, from the measured
    costs at the current batch size; "fixed" drafts ``num_draft_tokens`` every round. ``tree_width`` > 1 drafts
    token trees and ``tree_nodes`` caps a tree's nodes (a target exported with ``--tree``); ``sampling``
    ("coupled" or "rejection") is how sampled rows verify drafts. Other keyword arguments go to the Scheduler.
    A chat's prompt: ``chat_ids(messages)``, then generate() or stream() with it.
    Safe to share between threads.
    """

    def __init__(self, target, draft=None, *, num_draft_tokens: int = 4, drafter: str | None = None,
                 k_policy: str = "load-aware", num_threads: int | None = None, **scheduler_options):
        self.scheduler = Scheduler(
            target, draft, drafter=drafter, num_draft_tokens=num_draft_tokens,
            k_policy=k_policy, num_threads=num_threads, **scheduler_options,
        )
        self.target = self.scheduler.target
        self.draft = self.scheduler.draft
        self.tokenizer = self.scheduler.tokenizer
        self.capacity = self.scheduler.capacity
        self.max_batch = self.scheduler.max_batch
        self.num_draft_tokens = self.scheduler.num_draft_tokens
        self._prompts = None

    def generate(self, prompts, max_new_tokens: int = 128, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop=None, **request_options):
        """Generate for one prompt (-> GenerationResult) or a list (-> GenerationOutput, a list with .stats).

        A prompt is a string or its token ids (a list of ints, e.g. from chat_ids()); a list of prompts holds
        strings or lists of ids. In a list with a ``seed``, prompt i samples with seed + i (so each reproduces alone
        with its seed).
        Generation ends at an EOS, at a ``stop`` string (the text ends before it unless
        ``include_stop_str_in_output=True``) or at ``max_new_tokens`` (GenerationResult says where).
        """
        # (one prompt's token ids, not a batch: no prompt is an int, so the two never overlap)
        single = isinstance(prompts, str) or (is_token_ids(prompts) and len(prompts) > 0)
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
        k_chosen = [k for rnd, k, _ in list(self.scheduler.round_log) if rnd >= first_round]
        stats = BatchStats.of(results, before, self.scheduler.stats(), time.perf_counter() - t0, k_chosen)
        return GenerationOutput(results, stats)

    def stream(self, prompt, max_new_tokens: int = 128, **kwargs) -> Stream:
        """Like generate() for one prompt (a string or token ids), yielding text deltas as each block of tokens is
        accepted."""
        if not isinstance(prompt, str) and not is_token_ids(prompt):
            raise TypeError("stream() takes one prompt (a string or a list of token ids); use generate() for a batch")
        return Stream(self.scheduler.submit(prompt, max_new_tokens=max_new_tokens, **kwargs))

    def chat_ids(self, messages) -> list[int]:
        """The prompt of a chat (OpenAI's messages: [{"role": ..., "content": ...}]) in the model's chat template,
        the messages' content taken as text (as the server does); pass it to generate() or stream()."""
        from .prompts import PromptEncoder

        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; give a plain prompt instead")
        if self._prompts is None:
            self._prompts = PromptEncoder(self.tokenizer, self.capacity)
        return self._prompts.chat(list(messages))

    def close(self):
        """Stop the scheduler's loop thread (requests still running end as cancelled). A program that ends without
        it is closed at exit; ``with Generator(...) as gen:`` closes at the block's end."""
        self.scheduler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
