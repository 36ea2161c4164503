"""Continuous batching with speculation: one loop thread owns the engines; requests come and go between rounds.

Engine rows are slots (llama.cpp's server, DESIGN.md §7). Each round:
  1. admission: waiting requests (highest priority first, aged so none starves) take free rows; a
     prompt that starts with tokens already computed (a finished request's, or a registered prefix)
     gets those cache slots copied in instead of recomputed;
  2. k: each decoding row may draft up to its own k; load-aware k picks this round's k from the
     measured call costs at the current batch size, 0 when drafting does not pay;
  3. draft: one catch-up call (decoding rows feed what the draft has not seen; rows still reading
     their prompt feed this round's chunk of it), then k - 1 one-token calls;
  4. target: ONE call [B, T] for every row. A decoding row brings [last token, drafts...]; a row
     reading its prompt brings its next chunk (up to ``prefill_chunk`` tokens). Rows with fewer than
     T tokens are padded beyond their length: the pads' cache writes land in slots the mask hides
     from every real token, and the row's next real tokens overwrite them. So a long prompt is read
     a chunk per round while the other rows keep emitting tokens, each round costing one call;
  5. acceptance per row with its own sampling parameters and randomness, stop checks, and
     retirement: finished or cancelled rows leave at once (the last row moves into the hole).
Everything a caller can get wrong is checked in the caller's thread before the request is queued.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..engines import load_engine
from ..engines.base import SavedPrefix, greedy_steps, lease
from ..errors import CapacityError
from .adaptive import LoadAwareK
from .drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter
from .sampling import SPECULATIVE_SAMPLING, RowSampler, SamplingParams
from .self_draft import SELF, self_draft
from .text import IncrementalText
from .vocab import check_same_vocabulary

DRAFTERS = ("draft", "prompt_lookup", "none")


class RequestFailedError(RuntimeError):
    """An engine call failed while this request was running (other requests are not affected)."""
K_POLICIES = ("load-aware", "fixed")


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    elapsed_s: float = 0.0  # from submission to the last token
    queue_s: float = 0.0  # from submission to admission into an engine row
    time_to_first_token_s: float = 0.0  # from submission
    inter_token_s: list[float] = field(default_factory=list)  # per token after the first: block gap / block size
    prefix_tokens_reused: int = 0
    target_calls: int = 0  # prefill chunks included
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
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or capacity), "cancelled"
    stats: RequestStats
    replica: str | None = None  # the server replica that produced it (set by the Ray Serve front)


@dataclass
class SchedulerStats:
    """Counters of one scheduler since it was made (a snapshot)."""

    running: int = 0
    waiting: int = 0
    rounds: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0  # rounds that carried prompt chunks (their target call)
    draft_s: float = 0.0
    verify_s: float = 0.0  # target calls of rounds without prompt chunks
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_tokens_reused: int = 0
    prefix_cache_bytes: int = 0
    proposed: int = 0
    accepted: int = 0
    k_histogram: dict[int, int] = field(default_factory=dict)  # rounds that chose k


class _Request:
    """One request's state; lives in an engine row while it runs."""

    __slots__ = ("id", "seq", "prompt_ids", "max_new_tokens", "stop", "k", "priority", "sampler", "sink",
                 "submitted", "admitted", "last_emit", "cancelled", "prefix_only", "stats", "text", "finish_reason",
                 "token_ids", "streaming")

    def __init__(self, seq, prompt_ids, max_new_tokens, stop, k, priority, sampler, sink, prefix_only=False):
        self.id = f"req-{uuid.uuid4().hex[:16]}"
        self.seq = seq
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.k = k
        self.priority = priority
        self.sampler = sampler
        self.sink = sink
        self.submitted = time.perf_counter()
        self.admitted = None
        self.last_emit = None
        self.cancelled = False
        self.prefix_only = prefix_only
        self.stats = RequestStats(prompt_tokens=int(prompt_ids.size))
        self.text = None
        self.finish_reason = None
        self.token_ids = None
        self.streaming = True  # False: nobody reads text deltas, the text is decoded once when it finishes


class RequestHandle:
    """A submitted request: iterate for text deltas, ``result()`` for the GenerationResult, ``cancel()`` to stop it.

    Deltas are buffered here; only a thread iterating the handle is woken for each one, so a caller
    waiting on ``result()`` does not take CPU from the engine loop every round.
    """

    def __init__(self, scheduler, request):
        self._scheduler = scheduler
        self._request = request
        self.id = request.id
        self._cond = threading.Condition()
        self._deltas: deque[str] = deque()
        self._done = threading.Event()
        self._result = None
        self._error = None

    def _push(self, event):
        kind, value = event
        with self._cond:
            if kind == "delta":
                self._deltas.append(value)
            elif kind == "done":
                self._result = value
            else:
                self._error = value
            if kind != "delta":
                self._done.set()
            self._cond.notify_all()

    def __iter__(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._deltas or self._done.is_set())
                deltas = list(self._deltas)
                self._deltas.clear()
                done = self._done.is_set()
            yield from deltas
            if done:
                break
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the request to finish (raises what failed it)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self):
        """Stop the request: its row is freed within one round; it ends with finish_reason "cancelled"."""
        self._scheduler._cancel(self._request)


class AsyncRequestHandle:
    """A request submitted from a coroutine. Leaving the ``async for`` early cancels the request."""

    def __init__(self, scheduler, request):
        self._scheduler = scheduler
        self._request = request
        self.id = request.id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.result: GenerationResult | None = None

    async def start(self):
        """Nothing to wait for here (the request is queued); a remote handle's ``start`` waits to be routed."""

    async def __aiter__(self):
        """Text deltas; what has arrived together comes as one piece, and when that includes the end,
        ``result`` is already set as the last piece is handed out."""
        try:
            while True:
                events = [await self._queue.get()]
                while not self._queue.empty():
                    events.append(self._queue.get_nowait())
                text = "".join(v for k, v in events if k == "delta")
                kind, value = events[-1]
                if kind == "error":
                    raise value
                if kind == "done":
                    self.result = value
                if text:
                    yield text
                if kind == "done":
                    return
        finally:
            if self.result is None and self._request.finish_reason is None:
                self.cancel()  # the consumer went away (or was cancelled): free the row

    def cancel(self):
        self._scheduler._cancel(self._request)


class PrefixCache:
    """KV slots of already-processed token sequences, bounded in bytes, least recently used out first.

    Entries hold copies of a row's first n cache slots (target and draft). A new prompt
    reuses the longest common token prefix with any entry. Registered prefixes are pinned.
    """

    def __init__(self, max_bytes: int, min_tokens: int):
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.entries: OrderedDict[int, tuple] = OrderedDict()  # id -> (tokens, target block, draft block, pinned)
        self.nbytes = 0
        self._ids = itertools.count()

    @staticmethod
    def _size(target, draft):
        return target.nbytes + (draft.nbytes if draft is not None else 0)

    def lookup(self, prompt: np.ndarray):
        """(tokens reusable, target block, draft block) of the best entry for ``prompt``, or None."""
        best, best_len = None, 0
        for key, (tokens, *_rest) in self.entries.items():
            m = min(tokens.size, prompt.size - 1)  # at least one prompt token is left to compute
            common = int(np.argmin(tokens[:m] == prompt[:m])) if m and not np.array_equal(tokens[:m], prompt[:m]) else m
            if common > best_len:
                best, best_len = key, common
        if best is None or best_len < self.min_tokens:
            return None
        self.entries.move_to_end(best)
        _, target, draft, _ = self.entries[best]
        return best_len, target, draft

    def add(self, tokens: np.ndarray, target, draft, pinned: bool = False) -> bool:
        size = self._size(target, draft)
        if tokens.size < self.min_tokens or size > self.max_bytes:
            return False
        for key, (old, t_old, d_old, old_pinned) in list(self.entries.items()):
            if old.size >= tokens.size and np.array_equal(old[: tokens.size], tokens):
                if pinned and not old_pinned:
                    self.entries[key] = (old, t_old, d_old, True)
                self.entries.move_to_end(key)
                return True  # already covered
            if old.size < tokens.size and np.array_equal(tokens[: old.size], old) and not old_pinned:
                del self.entries[key]  # the new entry covers it
                self.nbytes -= self._size(t_old, d_old)
        for key in list(self.entries):
            if self.nbytes + size <= self.max_bytes:
                break
            if not self.entries[key][3]:
                _, t_old, d_old, _ = self.entries.pop(key)
                self.nbytes -= self._size(t_old, d_old)
        if self.nbytes + size > self.max_bytes:
            return False  # what is left is pinned
        self.entries[next(self._ids)] = (tokens.copy(), target, draft, pinned)
        self.nbytes += size
        return True


def _as_engine(engine_or_path, num_threads):
    if isinstance(engine_or_path, (str, os.PathLike)):
        return load_engine(engine_or_path, num_threads=num_threads)
    return engine_or_path


def _load_tokenizer(engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(engine.path) / engine.manifest["tokenizer"])


def encode_prompt(tokenizer, prompt, *, vocab_size: int, bos_id: int | None, capacity: int) -> np.ndarray:
    """Token ids of a prompt (a string, or a list of token ids), checked against an engine's capacity."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
    ):
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    else:
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        if bos_id is None:
            raise ValueError("empty prompt and the tokenizer has no BOS token to start from")
        ids = [bos_id]
    if len(ids) >= capacity:
        raise CapacityError(
            f"prompt has {len(ids)} tokens but the engine holds {capacity} positions (prompt and "
            f"output together); shorten the prompt or re-export with --max-seq-len {2 * len(ids)}"
        )
    return np.asarray(ids, dtype=np.int64)


class Scheduler:
    """Continuous batching with speculation over a target engine and an optional drafter.

    ``target``/``draft`` are engine or export directories, or loaded engines; ``draft="self"`` drafts with
    the target's own INT4 build (made once, see runtime/self_draft.py). ``drafter`` is
    "draft" (default when a draft is given), "prompt_lookup" or "none". ``num_draft_tokens`` is the
    default k of a request (each may ask for its own). ``k_policy`` "load-aware" chooses each
    round's k from measured costs at the current batch size (down to 0); "fixed" drafts every
    row's own k. ``prefill_chunk`` bounds the prompt tokens a row reads per round.
    ``prefix_cache_mb`` bounds the KV slots kept for reuse (0 disables it); prompts sharing at
    least ``min_prefix_tokens`` tokens with a cached sequence reuse them. ``sampling`` is how
    sampled requests verify drafts (sampling.RowSampler). ``aging_s``: waiting this long counts
    as one priority level more.
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        drafter: str | None = None,
        num_draft_tokens: int = 4,
        k_policy: str = "load-aware",
        max_batch: int | None = None,
        prefill_chunk: int = 64,
        prefix_cache_mb: float = 256.0,
        min_prefix_tokens: int = 16,
        sampling: str = "coupled",
        aging_s: float = 10.0,
        num_threads: int | None = None,
    ):
        self.target = _as_engine(target, num_threads)
        self.tokenizer = _load_tokenizer(self.target)
        if isinstance(draft, str) and draft == SELF:  # the target's own INT4 build (runtime/self_draft.py)
            draft = self_draft(self.target)
        drafter = drafter or ("draft" if draft is not None else "none")
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if drafter == "draft" and draft is None:
            raise ValueError("drafter 'draft' needs a draft model: pass draft=PATH (or choose prompt_lookup/none)")
        if drafter != "draft" and draft is not None:
            raise ValueError(f"a draft model was given but drafter is {drafter!r}; drop one of them")
        if k_policy not in K_POLICIES:
            raise ValueError(f"unknown k_policy {k_policy!r}; choose one of {', '.join(K_POLICIES)}")
        if sampling not in SPECULATIVE_SAMPLING:
            raise ValueError(f"unknown sampling {sampling!r}; choose one of {', '.join(SPECULATIVE_SAMPLING)}")
        for name, value, low in (("prefill_chunk", prefill_chunk, 1), ("min_prefix_tokens", min_prefix_tokens, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(prefix_cache_mb, (int, float)) and prefix_cache_mb >= 0):
            raise ValueError(f"prefix_cache_mb must be a number >= 0, got {prefix_cache_mb!r}")
        if not (isinstance(aging_s, (int, float)) and aging_s > 0):
            raise ValueError(f"aging_s must be a number > 0, got {aging_s!r}")
        special = self.target.manifest["model"]["special_tokens"]
        self.eos_ids = frozenset(special["eos_token_ids"])
        self.bos_id = special["bos_token_id"]
        self.pad_id = special["pad_token_id"] if special["pad_token_id"] is not None else 0
        self.draft = None
        engines = [self.target]
        if drafter == "draft":
            self.draft = _as_engine(draft, num_threads)
            check_same_vocabulary(self.target, self.draft)
            engines.append(self.draft)
        self.engines = engines
        self.capacity = min(e.max_seq_len for e in engines)
        engine_batch = min(e.max_batch for e in engines)
        if max_batch is None:
            max_batch = engine_batch
        if not isinstance(max_batch, int) or not 1 <= max_batch <= engine_batch:
            raise ValueError(f"max_batch must be an integer in [1, {engine_batch}] (the engines' rows), got {max_batch!r}")
        self.max_batch = max_batch
        if drafter == "draft":
            self.drafter = DraftModelDrafter(self.draft, self.pad_id)
        elif drafter == "prompt_lookup":
            self.drafter = PromptLookupDrafter(max_batch)
        else:
            self.drafter = NoDrafter()
        self.drafter_name = drafter
        # the k values the engines can verify in one call (TensorRT engines have fixed profiles)
        sizes = getattr(self.target, "verify_tokens", None)
        self.allowed_k = [k for k in range(1, self.capacity) if sizes is None or k + 1 in sizes]
        if drafter != "none":
            self._check_k(num_draft_tokens, allow_any=k_policy == "load-aware")
        self.num_draft_tokens = num_draft_tokens if drafter != "none" else 0
        self.policy = LoadAwareK(self.num_draft_tokens, self.allowed_k) if k_policy == "load-aware" else None
        self.prefill_chunk = prefill_chunk
        self.sampling = sampling
        self.aging_s = float(aging_s)
        self.prefix_cache = (
            PrefixCache(int(prefix_cache_mb * 2**20), min_prefix_tokens) if prefix_cache_mb > 0 else None
        )
        k_room = max(self.num_draft_tokens, 1)
        self._tokens = np.full((max_batch, self.capacity + k_room + 1), self.pad_id, dtype=np.int64)
        self._n = np.zeros(max_batch, np.int64)  # known tokens per row (prompt + output)
        self._tc = np.zeros(max_batch, np.int64)  # tokens in the target's cache per row
        self._rows: list[_Request] = []  # engine row i runs self._rows[i]
        self._decoding = 0  # rows [0, D) decode; rows [D, B) are still reading their prompts
        self._waiting: list[_Request] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats = SchedulerStats()
        self.failure: Exception | None = None  # the last engine error (a server reports itself unhealthy on it)
        self.round_log: deque = deque(maxlen=1 << 16)  # (round number, k chosen, rows)
        # a lone greedy row decodes in loops of its own (_decode_alone, _speculate_alone); False sends every
        # round through the batch path (the same tokens and statistics; tests and benchmarks compare the two)
        self.lone_row_loops = True

    def _check_k(self, k, allow_any=False):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
        if k not in self.allowed_k and not (allow_any and k <= (self.allowed_k[-1] if self.allowed_k else 0)):
            shown = f"{self.allowed_k[:8]}{'...' if len(self.allowed_k) > 8 else ''}"
            raise ValueError(f"num_draft_tokens={k} is not supported by the engines (verify sizes k+1 allowed for k in {shown})")

    # -- submitting ------------------------------------------------------------------------

    def encode(self, prompt) -> np.ndarray:
        """Token ids of a prompt (a string, or a list of token ids), checked against the engines' capacity."""
        return encode_prompt(self.tokenizer, prompt, vocab_size=self.target.vocab_size, bos_id=self.bos_id,
                             capacity=self.capacity)

    def make_request(self, prompt, *, max_new_tokens=128, temperature=0.0, top_k=None, top_p=None, seed=None,
                     stop=None, num_draft_tokens=None, priority=0, sink=None, prefix_only=False) -> _Request:
        """Validate everything about one request (raising the user's error) without queuing it."""
        if not prefix_only and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                                or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        params = SamplingParams(temperature, top_k, top_p, seed)
        if num_draft_tokens is None:
            k = self.num_draft_tokens
        elif self.drafter_name == "none":
            if num_draft_tokens != 0:
                raise ValueError("num_draft_tokens needs a drafter; this scheduler has none (it decodes one token a call)")
            k = 0
        else:
            if num_draft_tokens != 0:
                self._check_k(num_draft_tokens, allow_any=False)
            elif not isinstance(num_draft_tokens, int):
                raise ValueError(f"num_draft_tokens must be an integer >= 0, got {num_draft_tokens!r}")
            k = num_draft_tokens
        ids = self.encode(prompt)
        return _Request(next(self._seq), ids, max_new_tokens if not prefix_only else 0, stop, k, priority,
                        RowSampler(params, self.sampling), sink, prefix_only)

    def submit(self, prompt, **params) -> RequestHandle:
        """Queue one request; returns its handle at once. Parameters as Generator.generate, plus
        ``num_draft_tokens`` (this request's k; 0: no drafting) and ``priority`` (higher first)."""
        request = self.make_request(prompt, **params)
        handle = RequestHandle(self, request)
        request.sink = handle._push
        self._enqueue([request])
        return handle

    def submit_many(self, prompts, params_list, *, stream: bool = True) -> list[RequestHandle]:
        """Validate every request first, then queue them all (none is queued if one is invalid).

        ``stream=False``: the handles will only be asked for ``result()``; their text is decoded once, at the
        end (stop strings still end a request at the right token), not block by block every round.
        """
        requests = [self.make_request(p, **kw) for p, kw in zip(prompts, params_list)]
        handles = []
        for r in requests:
            r.streaming = stream
            h = RequestHandle(self, r)
            r.sink = h._push
            handles.append(h)
        self._enqueue(requests)
        return handles

    def register_prefix(self, prompt) -> int:
        """Compute and pin the KV slots of a shared prefix (e.g. a system prompt); returns its token count.

        Prompts that start with it then skip recomputing it. Blocks until it is cached."""
        if self.prefix_cache is None:
            raise ValueError("the prefix cache is disabled (prefix_cache_mb=0); enable it to register prefixes")
        request = self.make_request(prompt, prefix_only=True)
        handle = RequestHandle(self, request)
        request.sink = handle._push
        self._enqueue([request])
        handle.result()
        return int(request.prompt_ids.size)

    def submit_async(self, prompt, **params) -> AsyncRequestHandle:
        """Queue one request from a coroutine (validated here, raising the user's error); ``async for`` the
        returned handle for text deltas, then read ``handle.result``. The event loop never waits on an engine."""
        loop = asyncio.get_running_loop()
        request = self.make_request(prompt, **params)
        handle = AsyncRequestHandle(self, request)
        request.sink = lambda event: loop.call_soon_threadsafe(handle._queue.put_nowait, event)
        self._enqueue([request])
        return handle

    async def agenerate(self, prompt, **params) -> GenerationResult:
        """``await``: the finished GenerationResult."""
        handle = self.submit_async(prompt, **params)
        async for _ in handle:
            pass
        return handle.result

    async def astream(self, prompt, **params):
        """``async for delta in scheduler.astream(prompt, ...)``: text deltas as blocks are accepted."""
        async for delta in self.submit_async(prompt, **params):
            yield delta

    @property
    def waiting(self) -> int:
        """Requests queued and not yet in an engine row."""
        return len(self._waiting)

    def _enqueue(self, requests):
        with self._cv:
            if self._closed:
                raise RuntimeError("this scheduler is closed")
            self._waiting.extend(requests)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="trtspec-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _cancel(self, request):
        with self._cv:
            request.cancelled = True
            self._cv.notify()

    def close(self, timeout: float | None = None):
        """Cancel everything queued or running and stop the loop thread."""
        with self._cv:
            self._closed = True
            for r in self._waiting + self._rows:
                r.cancelled = True
            thread = self._thread
            self._cv.notify()
        if thread is not None:
            thread.join(timeout)

    def stats(self) -> SchedulerStats:
        with self._cv:
            s = SchedulerStats(**{k: v for k, v in vars(self._stats).items()})
            s.k_histogram = dict(self._stats.k_histogram)
            s.running = len(self._rows)
            s.waiting = len(self._waiting)
            s.prefix_cache_bytes = self.prefix_cache.nbytes if self.prefix_cache else 0
        return s

    # -- the loop --------------------------------------------------------------------------

    def _loop(self):
        locks = sorted({id(lease(e)): lease(e) for e in self.engines}.items())
        for _, lock in locks:
            lock.acquire()  # another scheduler on the same engines finishes its work first
        try:
            while True:
                with self._cv:
                    if not self._rows and not self._waiting:
                        self._thread = None
                        return
                try:
                    self._round()
                except Exception as exc:  # an engine failure fails the requests in flight, not the scheduler
                    self._fail_running(exc)
        finally:
            for _, lock in reversed(locks):
                lock.release()

    def _fail_running(self, exc):
        with self._cv:
            self.failure = exc
            rows, self._rows = self._rows, []
            self._decoding = 0
            self._stats.requests_failed += len(rows)
        for r in rows:
            r.finish_reason = "error"
            error = RequestFailedError(f"request {r.id} failed: the engine raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            r.sink(("error", error))

    def _admit(self):
        now = time.perf_counter()
        with self._cv:
            cancelled = [r for r in self._waiting if r.cancelled]
            self._waiting = [r for r in self._waiting if not r.cancelled]
            admitted = []
            while self._waiting and len(self._rows) + len(admitted) < self.max_batch:
                # priority, aged: waiting aging_s counts as one level more; FIFO within a level
                best = max(self._waiting, key=lambda r: (r.priority + (now - r.submitted) / self.aging_s, -r.seq))
                self._waiting.remove(best)
                admitted.append(best)
        for r in cancelled:
            r.finish_reason = "cancelled"
            self._finish(r, [])
        for r in admitted:
            row = len(self._rows)  # newcomers join the prompt-reading rows at the end
            r.admitted = now
            r.stats.queue_s = now - r.submitted
            r.text = IncrementalText(self.tokenizer, int(r.prompt_ids.size), r.stop)
            plen = r.prompt_ids.size
            self._tokens[row, :plen] = r.prompt_ids
            self._n[row] = plen
            reused = 0
            hit = self.prefix_cache.lookup(r.prompt_ids) if self.prefix_cache else None
            if hit is not None:
                common, t_block, d_block = hit
                # both caches must hold the reused slots: the draft then reads the rest of the prompt alongside
                reused = min(common, t_block.parts[0].shape[1])
                if self.draft is not None:
                    reused = min(reused, d_block.parts[0].shape[1] if d_block is not None else 0)
            if reused > 0:
                self.target.load_prefix(_head(t_block, reused), row)
                if self.draft is not None:
                    self.draft.load_prefix(_head(d_block, reused), row)
                self._stats.prefix_hits += 1
                self._stats.prefix_tokens_reused += reused
            elif self.prefix_cache is not None:
                self._stats.prefix_misses += 1
            self._tc[row] = reused
            r.stats.prefix_tokens_reused = reused
            self.drafter.admit(row, reused)
            self._stats.prompt_tokens += int(plen)
            with self._cv:
                self._rows.append(r)

    def _round(self):
        """One round: admit, then a chunk for the prompt-reading rows and a verify round for the decoding rows."""
        self._admit()
        with self._cv:
            for r in self._rows:
                if r.cancelled and r.finish_reason is None:
                    r.finish_reason = "cancelled"
        self._retire()
        # prompts first: a row that finishes reading its prompt emits its first token now and verifies in
        # this very round, instead of waiting one decode call longer
        if len(self._rows) > self._decoding:
            self._prefill_round()
        if self._decoding:
            self._decode_round()
        self._retire()

    def _decode_round(self):
        """Rows [0, D): draft up to k tokens each, verify them in one target call, accept per row."""
        b = self._decoding
        rows = self._rows[:b]
        n, tc = self._n[:b], self._tc[:b]
        # every row writes [n - 1, n - 1 + T): no row may pass the cache's capacity
        t_cap = int((self.capacity - (n - 1)).min())
        caps = np.array([max(0, min(r.k, t_cap - 1, r.max_new_tokens - r.stats.new_tokens - 1)) for r in rows], np.int64)
        if b == 1 and len(self._rows) == 1 and rows[0].sampler.mode == "greedy" and self.lone_row_loops:
            if self.drafter_name == "none" and not caps.any():
                return self._decode_alone(rows[0], t_cap)
            if self.drafter_name == "draft" and caps.any():
                return self._speculate_alone(rows[0])
        if self.policy is not None and caps.any():
            k = self.policy.choose(b, caps)
            caps = np.minimum(caps, k)
        else:
            k = int(caps.max())
        stats = self._stats
        stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1
        self.round_log.append((stats.rounds, k, b))

        t0 = time.perf_counter()
        samplers = [r.sampler for r in rows]
        if caps.any():
            drafts, counts, draft_probs = self.drafter.propose(self._tokens[:b], n, caps, samplers, self.capacity)
            if self.draft is not None:
                stats.draft_calls += max(1, drafts.shape[1])
        else:
            drafts, counts, draft_probs = np.zeros((b, 0), np.int64), np.zeros(b, np.int64), None
        t1 = time.perf_counter()
        kk = drafts.shape[1]
        width = int(counts.max()) + 1
        ids = np.full((b, width), self.pad_id, np.int64)  # rows with fewer drafts are padded beyond their length
        ids[:, 0] = self._tokens[np.arange(b), n - 1]
        ids[:, 1:] = np.where(np.arange(width - 1) < counts[:, None], drafts[:, : width - 1], self.pad_id)
        logits = self.target.forward(ids, (n - 1)[:, None] + np.arange(width))
        t2 = time.perf_counter()
        stats.rounds += 1
        stats.target_calls += 1
        stats.verify_s += t2 - t1
        stats.draft_s += t1 - t0
        if self.policy is not None:
            drafted = bool(caps.any()) if self.draft is not None else kk > 0
            self._learn_calls(b, width, t2 - t1, drafted, (t1 - t0) / max(kk, 1))

        valid = n.copy()
        emitted = stats.generated_tokens
        for s, r in enumerate(rows):
            r.stats.target_calls += 1
            m = int(counts[s])
            q = None if draft_probs is None else draft_probs[s, :m]
            a, x = r.sampler.verify(drafts[s, :m], q, logits[s, : m + 1], int(n[s]))
            r.stats.rounds += 1
            r.stats.record_accept(a, m)
            if m and self.policy is not None:
                self.policy.record_acceptance(m, a)
            stats.proposed += m
            stats.accepted += a
            n_before = int(n[s])
            self._emit(s, r, [*drafts[s, :a].tolist(), x])
            valid[s] = min(n_before + a, int(n[s]))  # the cache holds the verified tokens, not the last one
            tc[s] = valid[s]
        self.drafter.accepted(valid)
        if self.policy is not None:
            self._learn_round(b, k, caps.any(), stats.generated_tokens - emitted, time.perf_counter() - t0)

    def _learn_calls(self, b, width, verify_s, drafted, per_draft_token_s):
        """Tell the load-aware policy what a round's calls cost (before its acceptance is known); ``drafted``:
        the draft model ran this round (its calls are in drafter.calls), or another drafter proposed tokens."""
        self.policy.target.record(b, width, verify_s)
        if not drafted:
            return
        if self.draft is not None:  # each draft call at its size: a long catch-up is not a token
            for calls, tokens, seconds in self.drafter.calls:
                self.policy.draft.record(calls, tokens, seconds)
        else:
            self.policy.draft.record(b, 1, per_draft_token_s)

    def _learn_round(self, b, k, drafted, emitted, seconds):
        """Tell the load-aware policy what a whole round at (b, k) emitted and took."""
        if self.draft is not None and drafted and self.drafter.calls[0][1] > 2:
            # a long catch-up pays for earlier rounds that did not draft: charge this round a usual one
            seconds += self.policy.draft.estimate(b, 2) - self.drafter.calls[0][2]
        self.policy.record_round(b, k, emitted, seconds)

    def _arrival_fits(self) -> bool:
        """A request is waiting and a row is free for it: the lone-row loops hand back to the round loop."""
        return bool(self._waiting) and len(self._rows) < self.max_batch

    def _decode_alone(self, r, t_cap):
        """One row decoding greedily, no drafter, nobody else running: a run of one-token target calls in the
        engine's own loop (engines.base.greedy_steps) instead of a round of this loop per token, until the row
        finishes, is cancelled, or a request arrives that a free row could take. Each call counts as a round;
        tokens, text, streaming and stop rules are those of round-by-round decoding (every token goes through
        _emit as it comes)."""
        stats, n0 = self._stats, int(self._n[0])

        def on_token(token):
            self._emit(0, r, [token])
            return r.finish_reason is None and not r.cancelled and not self._arrival_fits()

        t0 = time.perf_counter()
        steps = max(1, min(t_cap, r.max_new_tokens - r.stats.new_tokens))
        calls, seconds = greedy_steps(self.target, 0, int(self._tokens[0, n0 - 1]), n0 - 1, steps, on_token)
        self.round_log.extend((stats.rounds + i, 0, 1) for i in range(calls))
        stats.k_histogram[0] = stats.k_histogram.get(0, 0) + calls
        stats.rounds += calls
        stats.target_calls += calls
        stats.verify_s += seconds
        r.stats.target_calls += calls
        r.stats.rounds += calls
        self._tc[0] = min(n0 - 1 + calls, int(self._n[0]))  # the cache holds every token fed
        if self.policy is not None:
            self.policy.target.record(1, 1, seconds / calls)
            self.policy.record_round(1, 0, 1, (time.perf_counter() - t0) / calls)

    def _speculate_alone(self, r):
        """One row decoding greedily with a draft model and nobody else running: rounds of draft chain, verify
        and accept in a loop of their own, without the batch bookkeeping of _decode_round (whose array work
        per round costs as much as a call of a small INT4 draft). The same calls, tokens, acceptance,
        statistics and load-aware choices of k as _decode_round; the loop ends when the row finishes or is
        cancelled, when a request arrives that a free row could take (with max_batch 1 the queue waits for this
        row, as in the batch path), or when the row's last tokens leave no room to draft."""
        stats, drafter, tokens, policy = self._stats, self.drafter, self._tokens[0], self.policy
        n_row, cached = self._n, drafter.cached
        draft_forward, target_forward, clock = self.draft.forward, self.target.forward, time.perf_counter
        while r.finish_reason is None and not r.cancelled and not self._arrival_fits():
            n = int(n_row[0])
            k = min(r.k, self.capacity - n, r.max_new_tokens - r.stats.new_tokens - 1)
            if k < 1:
                return  # the general round emits the last token
            if policy is not None:
                k = policy.choose(1, np.array([k]))
            stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1
            self.round_log.append((stats.rounds, k, 1))
            emitted = stats.generated_tokens
            t0 = clock()
            chain = []
            if k:
                c = int(cached[0])  # the draft lacks tokens [c, n): the last one, two after a full acceptance
                chain.append(int(draft_forward(tokens[None, c:n], np.arange(c, n)[None])[0, -1].argmax()))
                t_catch = clock() - t0
                calls, seconds = greedy_steps(self.draft, 0, chain[0], n, k - 1, lambda t: chain.append(t) or True)
                drafter.calls = [(1, n - c, t_catch), *([(1, 1, seconds / calls)] * calls if calls else [])]
                cached[0] = n + k - 1
                stats.draft_calls += k
            drafts = np.array(chain, np.int64)
            t1 = clock()
            ids = np.empty((1, k + 1), np.int64)
            ids[0, 0], ids[0, 1:] = tokens[n - 1], drafts
            logits = target_forward(ids, np.arange(n - 1, n + k)[None])
            t2 = clock()
            stats.rounds += 1
            stats.target_calls += 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            if policy is not None:
                self._learn_calls(1, k + 1, t2 - t1, k > 0, 0.0)
            r.stats.target_calls += 1
            a, x = r.sampler.verify(drafts, None, logits[0], n)
            r.stats.rounds += 1
            r.stats.record_accept(a, k)
            if k and policy is not None:
                policy.record_acceptance(k, a)
            stats.proposed += k
            stats.accepted += a
            self._emit(0, r, [*chain[:a], x])
            valid = min(n + a, int(n_row[0]))  # the cache holds the verified tokens, not the last one
            self._tc[0] = valid
            cached[0] = min(int(cached[0]), valid)
            if policy is not None:
                self._learn_round(1, k, k > 0, stats.generated_tokens - emitted, clock() - t0)

    def _prefill_round(self):
        """Rows [D, B) read their prompts: up to prefill_chunk tokens this round, first come first served.

        One call over the rows that get tokens (a contiguous run from D, since earlier rows are served
        first), shorter chunks padded beyond their length; the draft reads the same chunks. Rows that
        finish their prompt emit their first token and join the decoding rows (they are next to them).
        """
        first, last = self._decoding, len(self._rows)
        plen = np.array([r.prompt_ids.size for r in self._rows[first:last]], np.int64)
        tc = self._tc[first:last]
        t_cap = int((self.capacity - tc).min())  # every row of the call writes T slots: pads stay inside the cache
        chunks, budget = [], min(self.prefill_chunk, t_cap)
        for i in range(last - first):
            rest = int(plen[i] - tc[i])
            chunks.append(min(rest, budget))
            budget -= chunks[-1]
            if budget == 0 or chunks[-1] < rest:
                break  # a row served only in part ends the run: completions stay rows first, first + 1, ...
        p = len(chunks)
        chunk = np.array(chunks, np.int64)
        width = int(chunk.max())
        offsets = np.arange(width)
        pos = tc[:p, None] + offsets
        src = np.minimum(pos, self._tokens.shape[1] - 1)
        ids = np.where(offsets < chunk[:, None], np.take_along_axis(self._tokens[first : first + p], src, axis=1), self.pad_id)
        t0 = time.perf_counter()
        logits = self.target.forward(ids, pos, first_row=first)
        if self.draft is not None:
            self.drafter.prefill(ids, pos, first, chunk)
            self._stats.draft_calls += 1
        self._stats.prefill_s += time.perf_counter() - t0
        self._stats.target_calls += 1
        completed = 0
        for i in range(p):
            s, r = first + i, self._rows[first + i]
            r.stats.target_calls += 1
            tc[i] += chunk[i]
            if tc[i] < plen[i]:
                continue
            completed += 1  # served first come first served: completions are rows first, first + 1, ...
            if r.prefix_only:
                r.finish_reason = "stop"
                continue
            tok = r.sampler.choose(logits[i, chunk[i] - 1], int(self._n[s]))
            self._emit(s, r, [tok])
            r.stats.time_to_first_token_s = r.last_emit - r.submitted
        self._decoding += completed

    def _emit(self, s, r, new):
        """Append accepted tokens to row s, stopping at EOS, a stop string, max_new_tokens or capacity."""
        row_tokens, n = self._tokens[s], self._n
        text = r.text
        delta = ""
        before = r.stats.new_tokens
        cut = False
        for tok in new:
            if r.stats.new_tokens >= r.max_new_tokens:
                r.finish_reason = "length"
                break
            row_tokens[n[s]] = tok
            n[s] += 1
            r.stats.new_tokens += 1
            if tok in self.eos_ids:
                r.finish_reason = "stop"
                break
            if text.stop:
                # token by token, so a stop string completed mid-block ends the output at that token
                piece = text.advance(row_tokens, n[s])
                kept = text.cut_at_stop(piece)
                if kept is not None:
                    r.finish_reason = "stop"
                    delta += kept
                    cut = True
                    break
                delta += piece
            if n[s] >= self.capacity:
                r.finish_reason = "length"
                break
        else:
            if r.stats.new_tokens >= r.max_new_tokens:
                r.finish_reason = "length"
        if not cut and (not text.stop or r.finish_reason) and (r.streaming or r.finish_reason):
            delta += text.advance(row_tokens, n[s], final=r.finish_reason is not None)
        now = time.perf_counter()
        emitted = r.stats.new_tokens - before
        if r.last_emit is not None and emitted:
            r.stats.inter_token_s.extend([(now - r.last_emit) / emitted] * emitted)
        r.last_emit = now
        self._stats.generated_tokens += emitted
        if delta:
            r.sink(("delta", delta))

    def _finish(self, r, token_ids):
        r.token_ids = token_ids
        r.stats.elapsed_s = time.perf_counter() - r.submitted
        text = r.text.text if r.text is not None else ""
        if r.finish_reason == "cancelled":
            self._stats.requests_cancelled += 1
        else:
            self._stats.requests_finished += 1
        r.sink(("done", GenerationResult(text, token_ids, r.finish_reason, r.stats)))

    def _retire(self):
        """Finished rows leave: their KV slots go to the prefix cache; the rows after them close the gap."""
        s = 0
        while s < len(self._rows):
            r = self._rows[s]
            if r.finish_reason is None:
                s += 1
                continue
            plen = r.prompt_ids.size
            n = int(self._n[s])
            if self.prefix_cache is not None and r.finish_reason != "cancelled":
                keep = min(int(self._tc[s]), n)
                if keep >= self.prefix_cache.min_tokens:
                    t_block = self.target.save_prefix(s, keep)
                    d_block = None
                    if self.draft is not None:
                        d_keep = min(int(self.drafter.cached[s]), keep)
                        d_block = self.draft.save_prefix(s, d_keep) if d_keep else None
                    self.prefix_cache.add(self._tokens[s, :keep], t_block, d_block, pinned=r.prefix_only)
            if not r.streaming and r.text is not None:  # e.g. cancelled between rounds: its text so far
                r.text.advance(self._tokens[s], n, final=True)
            self._finish(r, self._tokens[s, plen:n].tolist())
            with self._cv:
                self._remove_row(s)

    def _remove_row(self, s):
        # Decoding rows stay in [0, D), prompt-reading rows in [D, B) in arrival order: a decoding row's hole
        # takes the last decoding row, and the reading rows after the hole each move down one.
        b = len(self._rows)
        hole = s
        if s < self._decoding:
            hole = self._decoding - 1
            if s != hole:
                self._move_row(hole, s)
            self._decoding -= 1
        for j in range(hole + 1, b):
            self._move_row(j, j - 1)
        self._rows.pop()

    def _move_row(self, src, dst):
        self.target.move_row(src, dst, int(self._tc[src]))
        self.drafter.move_row(src, dst)
        self._tokens[dst] = self._tokens[src]
        self._n[dst] = self._n[src]
        self._tc[dst] = self._tc[src]
        self._rows[dst] = self._rows[src]


def _head(block, n):
    """The first n slots of a saved prefix block."""
    return SavedPrefix([p[:, :n] for p in block.parts])
