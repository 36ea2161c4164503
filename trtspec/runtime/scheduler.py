"""Continuous batching with speculation: the plan of every round; requests come and go between rounds.

The scheduler decides and never calls an engine: its loop thread holds the engines' leases, and every call is the
worker's (runtime/worker.py), which hands back what came of it. Engine rows are slots (llama.cpp's server,
DESIGN.md §7). Each round:
  1. admission: waiting requests (highest priority first, aged so none starves) take free rows; a
     prompt that starts with tokens already computed (a finished request's, or a registered prefix)
     gets those cache slots copied in instead of recomputed;
  2. prompts: rows still reading their prompt (after the decoding rows) share ``prefill_chunk``
     tokens, first come first served (the first its next part, the others only whole prompts), in one
     target call (shorter chunks padded beyond their length: the pads' cache writes land in slots the
     mask hides and later writes overwrite). A row that finishes its prompt emits its first token (then
     the draft reads the same chunks) and joins the decoding rows, verifying in this very round. So a
     long prompt never stalls the others;
  3. k: each decoding row may draft up to its own k; load-aware k picks this round's k from the
     measured call costs at the current batch size, 0 when drafting does not pay;
  4. draft (the worker asks drafters.Drafter.propose) and verify: ONE target call [D, k+1] over the decoding
     rows' [last token, drafts...] (rows with fewer drafts padded; a tree mask where rows drafted trees). A request that arrived while the round
     drafted is admitted and reads its prompt before the verify call (its first token does not wait for
     the rest of the round and the next one's admission);
  5. acceptance per row with its own sampling parameters and randomness (verify.verify_rows: one walk for
     chains and trees); the
     accepted tokens join the request through the one stop rule (output.RequestOutput); retirement:
     finished or cancelled rows leave at once (the last row moves into the hole).
A lone decoding row (nobody else running, nobody waiting who could get a row) repeats steps 3-5 without
the admission and retirement around them; a lone greedy row that drafts nothing decodes in the engine's own
loop (engines.base.greedy_steps). Both are the round's own code with a loop around it, not a second copy.
Everything a caller can get wrong is checked in the caller's thread before the request is queued.

Isolation: what one request's own processing raises inside a round — its grammar (which fails or dead-ends only
while decoding), logits processing, sampling, its sink — fails that request alone (``_fault``): per-row steps
are guarded, and a batched drafter step that a row's sampler fails (verify.RowFault) loses only this round's
drafts for the others (drafts never change an output). Only an engine's failure fails the round's requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import numpy as np

from .adaptive import LoadAwareK
from .drafters import DRAFTERS, HEADS, Drafter, Proposal, SuffixThenDraft, make_drafter
from .drafters.self_draft import SELF, self_draft
from .drafters.suffix import MAX_MATCH as CONTEXT_TOKENS
from .forced import ahead_of_forced, constrain, forced_counts, forced_tokens
from .output import RequestOutput
from .prefix_cache import PrefixCache
from .request import (
    AsyncRequestHandle,
    GenerationResult,
    InvalidRequestError,
    Request,
    RequestBuilder,
    RequestFailedError,
    RequestHandle,
    SchedulerStats,
    check_k,
)
from .sampling import SamplingParams, log_probs, logprob_entry
from .verify import SPECULATIVE_SAMPLING, RowFault
from .tokenizer import load_tokenizer
from .vocab import check_same_vocabulary
from .worker import Worker, open_engine

K_POLICIES = ("load-aware", "fixed")

log = logging.getLogger("trtspec.scheduler")


class Scheduler:
    """Continuous batching with speculation over a target engine and an optional drafter.

    ``target``/``draft`` are engine or export directories, or loaded engines; ``draft="self"`` drafts with
    the target's own INT4 build (made once, see runtime/drafters/self_draft.py). ``drafter`` is one of DRAFTERS:
    "draft" (default when a draft is given), "eagle3"/"medusa" (a head), "prompt_lookup", "suffix" (with a draft
    model: suffix drafting, the model for rows it has no match for) or "none";
    ``tree_width``/``tree_nodes`` shape token trees (a --tree target). ``num_draft_tokens`` is the
    default k of a request (each may ask for its own). ``k_policy`` "load-aware" chooses each
    round's k from measured costs at the current batch size (down to 0); "fixed" drafts every
    row's own k. ``prefill_chunk`` bounds the prompt tokens read per round (one call).
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
        prefill_chunk: int = 128,
        prefix_cache_mb: float = 256.0,
        min_prefix_tokens: int = 16,
        sampling: str = "coupled",
        aging_s: float = 10.0,
        num_threads: int | None = None,
        tree_width: int = 1,
        tree_nodes: int | None = None,
    ):
        self.target = open_engine(target, num_threads)
        self.tokenizer = load_tokenizer(self.target)
        if isinstance(draft, str) and draft == SELF:  # the target's own INT4 build (runtime/drafters/self_draft.py)
            draft = self_draft(self.target)
        drafter = drafter or ("draft" if draft is not None else "none")
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if drafter == "draft" and draft is None:
            raise ValueError("drafter 'draft' needs a draft model: pass draft=PATH (or choose prompt_lookup/none)")
        if drafter in HEADS and draft is None:
            raise ValueError(f"drafter {drafter!r} needs its head: pass draft=PATH of the exported head (trtspec export-head)")
        if drafter in HEADS and not hasattr(self.target, "features"):
            raise ValueError(f"drafter {drafter!r} reads the target's hidden states, which the {self.target.backend} "
                             "engine does not return; use the onnxruntime engine of a --hidden-states export")
        if drafter not in ("draft", "suffix", *HEADS) and draft is not None:
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
        if drafter in ("draft", "eagle3") or (drafter == "suffix" and draft is not None):
            self.draft = open_engine(draft, num_threads)
            if drafter == "suffix" and self.draft.manifest["model"].get("head"):
                raise ValueError("drafter 'suffix' takes a draft model under it, not a head: pass a draft model's "
                                 "engine, or drafter='eagle3'/'medusa' for the head alone")
            check_same_vocabulary(self.target, self.draft)
            engines.append(self.draft)
        self.engines = engines
        self.capacity = min(e.max_seq_len for e in engines)
        # tokens one call may carry (engines whose sliding-window layers keep rings take fewer than S_max)
        self.max_call = min(e.max_call_tokens for e in engines)
        self.max_drafts = self.max_call - 1  # the tokens a verify call carries past a row's last one
        engine_batch = min(e.max_batch for e in engines)
        if max_batch is None:
            max_batch = engine_batch
        if not isinstance(max_batch, int) or not 1 <= max_batch <= engine_batch:
            raise ValueError(f"max_batch must be an integer in [1, {engine_batch}] (the engines' rows), got {max_batch!r}")
        self.max_batch = max_batch
        for engine in engines:  # (an exact int8 build picks its one graph for the session from it: engines/onnxruntime.py)
            plan = getattr(engine, "plan_rows", None)
            if plan is not None:
                plan(max_batch)
        self.drafter: Drafter
        self.tree_width, self.tree_nodes = self._check_tree(tree_width, tree_nodes, drafter)
        # a head drafter's draft is its head: an engine (eagle3) or the heads' directory (medusa)
        self.drafter = make_drafter(drafter, target=self.target, draft=self.draft if self.draft is not None else draft,
                                    max_batch=max_batch, pad_id=self.pad_id, tree_width=self.tree_width,
                                    tree_nodes=tree_nodes)
        self.drafter_name = drafter
        # the k values the engines can verify in one call (TensorRT engines have fixed profiles)
        sizes = getattr(self.target, "verify_tokens", None)
        self.allowed_k = [k for k in range(1, min(self.capacity, self.max_call)) if sizes is None or k + 1 in sizes]
        if drafter != "none":
            check_k(num_draft_tokens, self.allowed_k, allow_any=k_policy == "load-aware")
        self.num_draft_tokens = num_draft_tokens if drafter != "none" else 0
        widths = (1, self.tree_width) if drafter in ("draft", "eagle3") else (1,)
        self.policy = (LoadAwareK(self.num_draft_tokens, self.allowed_k, widths=widths, nodes=tree_nodes)
                       if k_policy == "load-aware" else None)
        # a drafter that shapes its own rounds (suffix: per row, from its match's scores) gets the measured call
        # costs instead of a k chosen for it
        self._self_shaping = self.policy is not None and hasattr(self.drafter, "costs")
        if self._self_shaping:
            self.drafter.costs = self._verify_cost
        self._width = self.tree_width  # the tree width of the current round
        self._expected = None  # the tokens the load-aware policy expects of the current round
        self._sampled = False  # whether a row of the current round samples
        self.prefill_chunk = min(prefill_chunk, self.max_call)
        self.sampling = sampling
        self.aging_s = float(aging_s)
        self.prefix_cache = (
            PrefixCache(int(prefix_cache_mb * 2**20), min_prefix_tokens) if prefix_cache_mb > 0 else None
        )
        # the engines, the drafter and the rows' token buffers: every engine call is the worker's
        self.worker = Worker(self.target, self.draft, self.drafter, max_batch=max_batch, capacity=self.capacity,
                             max_drafts=self.max_drafts, pad_id=self.pad_id, k_room=max(self.num_draft_tokens, 1))
        self._tokens, self._n, self._tc = self.worker.tokens, self.worker.n, self.worker.tc  # (the same arrays)
        self._rows: list[Request] = []  # engine row i runs self._rows[i]
        self._decoding = 0  # rows [0, D) decode; rows [D, B) are still reading their prompts
        self._waiting: list[Request] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats = SchedulerStats()
        self.failure: Exception | None = None  # the last engine error (a server reports itself unhealthy on it)
        self.round_log: deque = deque(maxlen=1 << 16)  # (round number, k chosen, rows)
        # a lone row repeats its rounds without admission and retirement around them (_decode_round), a greedy
        # one without a drafter in the engine's own loop (_decode_alone); False sends every round through the
        # whole loop (the same tokens and statistics; tests and benchmarks compare the two)
        self.lone_row_loops = True
        # every check of a request, in the caller's thread (request.py): the server's too
        self.requests = RequestBuilder(self.tokenizer, vocab_size=self.target.vocab_size, bos_id=self.bos_id,
                                       eos_ids=self.eos_ids, capacity=self.capacity, sampling=sampling,
                                       drafting=drafter != "none", default_k=self.num_draft_tokens,
                                       allowed_k=self.allowed_k)

    def _check_tree(self, width, nodes, drafter):
        """tree_width / tree_nodes checked against the drafter and the target (a tree needs a --tree export)."""
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"tree_width must be an integer >= 1 (1: chains), got {width!r}")
        if nodes is not None and (not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1):
            raise ValueError(f"tree_nodes must be an integer >= 1 (or None: depth x width), got {nodes!r}")
        if width > 1 or nodes is not None:
            if width > 1 and drafter not in ("draft", *HEADS):
                raise ValueError(f"tree_width applies to the draft-model and head drafters, not {drafter!r}")
            if drafter not in ("draft", *HEADS, "suffix"):
                raise ValueError(f"tree_nodes applies to the draft-model, head and suffix drafters, not {drafter!r}")
            if not getattr(self.target, "tree_verify", False):
                raise ValueError(f"the target {self.target.path} cannot verify token trees: re-export it with "
                                 "--tree (trtspec export) or compile it with tree=True (torch backend), or use "
                                 "tree_width=1 (chains)")
        return width, nodes

    # -- submitting ------------------------------------------------------------------------

    def encode(self, prompt) -> np.ndarray:
        """Token ids of a prompt (a string, or a list of token ids), checked against the engines' capacity."""
        return self.requests.encode(prompt)

    def make_request(self, prompt, **params) -> Request:
        """Validate everything about one request (raising the user's error) without queuing it: the parameters of
        Generator.generate (request.RequestBuilder.make, the one validation source)."""
        return self.requests.make(prompt, **params)

    def submit(self, prompt, **params) -> RequestHandle:
        """Queue one request; returns its handle at once. Parameters as Generator.generate, plus
        ``num_draft_tokens`` (this request's k; 0: no drafting), ``priority`` (higher first) and
        ``include_stop_str_in_output`` (the text keeps the stop string that ended it; vLLM's name)."""
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

    def submit_n(self, prompt, n: int, **params) -> list[RequestHandle]:
        """n independent samples of one prompt sharing its prompt's computation (sample i: seed + i)."""
        requests = self.requests.group(prompt, n, params)
        handles = []
        for r in requests:
            handles.append(RequestHandle(self, r))
            r.sink = handles[-1]._push
        self._enqueue(requests)
        return handles

    def submit_async_n(self, prompt, n: int, **params) -> list[AsyncRequestHandle]:
        """submit_n from a coroutine."""
        loop = asyncio.get_running_loop()
        requests = self.requests.group(prompt, n, params)
        handles = [self._async_handle(r, loop) for r in requests]
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
        request = self.make_request(prompt, **params)
        handle = self._async_handle(request, asyncio.get_running_loop())
        self._enqueue([request])
        return handle

    async def asubmit(self, prompt, n: int = 1, **params) -> list[AsyncRequestHandle]:
        """``submit_async`` (n = 1) or ``submit_async_n`` for a server: the request is validated — a grammar compiled
        and probed, which a hostile schema can make slow — in a worker thread, so the event loop never waits on it;
        then it is queued from the loop."""
        loop = asyncio.get_running_loop()
        if n == 1:
            requests = [await asyncio.to_thread(self.make_request, prompt, **params)]
        else:
            requests = await asyncio.to_thread(self.requests.group, prompt, n, dict(params))
        handles = [self._async_handle(r, loop) for r in requests]
        self._enqueue(requests)
        return handles

    def _async_handle(self, request, loop) -> AsyncRequestHandle:
        handle = AsyncRequestHandle(self, request)
        request.sink = lambda event: loop.call_soon_threadsafe(handle._queue.put_nowait, event)
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

    def backlog(self, arriving: int = 0) -> int:
        """Requests that wait for a row beyond those the free rows take at the next admission, counting
        ``arriving`` more as queued (a server's requests still being validated): what a queue limit bounds."""
        with self._cv:
            return max(0, len(self._waiting) + arriving - (self.max_batch - len(self._rows)))

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

    warm_up_tokens = 32  # the widest call warm_up makes per row (a verify call's drafts and forced tokens fit)

    def warm_up(self) -> bool:
        """Call each engine once at its widest batched call (every row, ``warm_up_tokens`` each), before requests
        come. onnxruntime's first multi-row, multi-token call pays 50-100 ms while its memory arena grows (measured
        on the bundled target, 8 rows); after one wide call, no later call shape pays it, so the first burst of
        traffic does not. The call writes cache slots that no request holds: it runs only while the scheduler is
        idle (False, and nothing done, otherwise)."""
        with self._cv:
            if self._rows or self._waiting or self._closed:
                return False
            locks = self.worker.locks()
            for lock in locks:
                lock.acquire()
            try:
                self.worker.warm_up(self.max_batch, max(1, min(self.warm_up_tokens, self.max_call, self.capacity)))
            finally:
                for lock in reversed(locks):
                    lock.release()
        return True

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
            s.by_drafter = {name: list(counts) for name, counts in self._stats.by_drafter.items()}
            s.running = len(self._rows)
            s.waiting = len(self._waiting)
            s.prefix_cache_bytes = self.prefix_cache.nbytes if self.prefix_cache else 0
        return s

    # -- the loop --------------------------------------------------------------------------

    def _loop(self):
        locks = self.worker.locks()
        for lock in locks:
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
            for lock in reversed(locks):
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
            self._deliver(r, ("error", error))

    def _fault(self, r, exc):
        """Request r's own processing failed with ``exc`` during a round: r alone ends (retired with the round's
        finished rows), with an InvalidRequestError as it came (a request that cannot be honoured: its grammar),
        or a RequestFailedError naming the cause (a server fault, logged with its traceback)."""
        if r.finish_reason == "error":
            return
        cause = exc.cause if isinstance(exc, RowFault) else exc
        if isinstance(cause, RequestFailedError):
            error = cause
        else:
            log.error("request %s failed alone: its own processing raised %s", r.id, type(cause).__name__,
                      exc_info=cause)
            error = RequestFailedError(f"request {r.id} failed: its processing raised {type(cause).__name__}: {cause}")
            error.__cause__ = cause
        r.finish_reason = "error"
        r.error = error

    def _fault_owner(self, rows, fault: RowFault):
        """A batched step failed in one row's sampler: fail that row (the step's other rows are not at fault)."""
        owner = next((r for r in rows if r.sampler is fault.owner), None)
        if owner is None:
            raise fault
        self._fault(owner, fault)

    def _deliver(self, r, event):
        """Hand ``event`` to r's sink. A sink that raises (its caller's event loop is gone) must not take the round
        down with it: nobody can read r any more, so r is cancelled."""
        try:
            r.sink(event)
        except Exception:  # noqa: BLE001 - the caller's failure, not the round's
            log.warning("request %s: its sink raised; cancelling it", r.id, exc_info=True)
            r.cancelled = True

    def _admit(self):
        now = time.perf_counter()
        with self._cv:
            cancelled = [r for r in self._waiting if r.cancelled]
            self._waiting = [r for r in self._waiting if not r.cancelled]
            admitted = []
            ready = [r for r in self._waiting if r.leader is None or r.leader.prompt_read
                     or r.leader.finish_reason is not None]  # n samples: the others wait for the first's prompt
            while ready and len(self._rows) + len(admitted) < self.max_batch:
                # priority, aged: waiting aging_s counts as one level more; FIFO within a level
                best = max(ready, key=lambda r: (r.priority + (now - r.submitted) / self.aging_s, -r.seq))
                ready.remove(best)
                self._waiting.remove(best)
                admitted.append(best)
        for r in cancelled:
            r.finish_reason = "cancelled"
            self._finish(r, None)
        for r in admitted:
            row = len(self._rows)  # newcomers join the prompt-reading rows at the end
            r.admitted = now
            r.stats.queue_s = now - r.submitted
            plen = r.prompt_ids.size
            r.output = RequestOutput(self.tokenizer, eos_ids=self.eos_ids, limit=min(r.max_new_tokens, self.capacity - plen),
                                     stop=r.stop, include_stop=r.include_stop, streaming=r.streaming)
            if r.sampler.params.logprobs is not None:
                r.output.logprobs = []
            if r.prompt_logprobs is not None:
                r.prompt_entries = [None]  # the first token has no log-probability
                r.output.prompt_logprobs = (r.leader or r).prompt_entries  # complete when the first piece goes out
            if r.leader is not None and r.leader.shared_prefix:
                hit = r.leader.shared_prefix
            elif self.prefix_cache and r.prompt_logprobs is None:  # prompt logprobs need every position computed
                hit = self.prefix_cache.lookup(r.prompt_ids)
            else:
                hit = None
            reused = self.worker.admit(row, r.prompt_ids, hit)
            if reused > 0:
                self._stats.prefix_hits += 1
                self._stats.prefix_tokens_reused += reused
            elif self.prefix_cache is not None:
                self._stats.prefix_misses += 1
            r.stats.prefix_tokens_reused = reused
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
        # this very round, instead of waiting one decode call longer (unless that token ended it)
        if len(self._rows) > self._decoding:
            self._prefill_round()
            self._retire()
        if self._decoding:
            self._decode_round()
        self._retire()

    def _decode_round(self):
        """Rows [0, D): draft up to k tokens each, verify them in one target call, accept per row.

        A lone row goes on round after round here while it runs alone (_keeps_going), without the admission
        and retirement around each round; a lone greedy row without drafts decodes in the engine's own loop.
        """
        b = self._decoding
        rows = self._rows[:b]
        lone = b == 1 and len(self._rows) == 1 and self.lone_row_loops
        while True:
            caps = self._caps(rows)
            if lone and not caps.any() and rows[0].sampler.plain and rows[0].sampler.mode == "greedy":
                return self._decode_alone(rows[0])
            self._speculate(rows, caps)
            if not (lone and self._keeps_going(rows[0])):
                return

    def _caps(self, rows) -> np.ndarray:
        """The most drafts each row may have this round: its k, the room left in the cache and in its output."""
        return np.minimum(self._room(rows), [r.k for r in rows])

    def _room(self, rows) -> np.ndarray:
        """The most tokens past the last one each row may verify this round: room in the cache and its output."""
        # every row writes [n - 1, n - 1 + T): no row may pass the cache's capacity
        n = self._n[: len(rows)]
        t_cap = int((self.capacity - (n - 1)).min())
        return np.array([max(0, min(t_cap - 1, r.output.limit - len(r.output.token_ids) - 1)) for r in rows], np.int64)

    def _keeps_going(self, r) -> bool:
        """A lone row's loop goes on: it runs, it is still alone, and nobody arrived whom a free row could take."""
        return r.finish_reason is None and not r.cancelled and len(self._rows) == 1 and not self._arrival_fits()

    def _arrival_fits(self) -> bool:
        """A request is waiting and a row is free for it: the lone-row loops hand back to the round loop."""
        return bool(self._waiting) and len(self._rows) < self.max_batch

    def _speculate(self, rows, caps):
        """One round over rows [0, B): propose, ONE target call over [last token, drafts...] per row, accept."""
        b = len(rows)
        stats, policy = self._stats, self.policy
        width = self.tree_width
        self._expected = None  # the tokens the policy expects of this round (rows' own acceptance)
        self._sampled = any(r.sampler.mode != "greedy" for r in rows)  # such rounds are measured apart
        if policy is not None and caps.any() and not self._self_shaping:
            k, width = policy.choose_shape(b, caps, [(r.stats.accepted, r.stats.accepted + r.stats.rejected,
                                                      r.sampler.mode != "greedy") for r in rows], self._sampled)
            self._expected = policy.last_expected
            caps = np.minimum(caps, k)
        else:
            k = int(caps.max())
        if width != getattr(self.drafter, "tree_width", width):
            self.drafter.tree_width = width  # this round's shape (the load-aware policy weighs trees and chains)
        self._width = width
        stats.k_histogram[k] = stats.k_histogram.get(k, 0) + 1
        self.round_log.append((stats.rounds, k, b))

        t0 = time.perf_counter()
        forced = self._forced(rows, caps)  # rows whose grammar forces the next tokens: drafts after them, if any
        if k:
            ahead = self._ahead(rows, forced, caps)
            try:
                proposal = self.worker.propose(ahead, caps, [r.sampler for r in rows])
            except RowFault as fault:  # one row's processing failed mid-step: that row ends, the others verify
                self._fault_owner(rows, fault)  # without drafts this round (their output is the same)
                proposal = Proposal.empty(b)
        else:
            proposal = Proposal.empty(b)
        if forced is not None:
            self._constrain(rows, proposal, forced)
        t1 = time.perf_counter()
        if self._arrival_fits():
            # a request arrived while this round drafted: it reads its prompt (and gets its first token) now, not
            # after this round's verify and the next round's admission; its rows are past these, untouched here
            self._admit()
            if len(self._rows) > self._decoding:
                self._prefill_round()
            shift = time.perf_counter() - t1  # counted as prefill: the round's own timings leave it out
            t0, t1 = t0 + shift, t1 + shift
        self._verify(rows, proposal, forced, k, t0, t1)

    def _verify(self, rows, proposal, forced, k, t0, t1):
        """The rest of a round: the worker's one verify call and every row's verdict (chains and trees alike), the
        accepted tokens emitted, the statistics and the policy told."""
        b = len(rows)
        stats, policy = self._stats, self.policy
        n_before = self._n[:b].copy()
        failed = {s for s, r in enumerate(rows) if r.finish_reason == "error"}  # in the drafter's step this round
        verdicts = self.worker.verify([r.sampler for r in rows], proposal, failed)
        t2 = t1 + verdicts.seconds
        self._count_round(proposal, t0, t1, t2)
        tree = proposal.parents is not None
        if tree:
            stats.tree_shapes[proposal.shape] = stats.tree_shapes.get(proposal.shape, 0) + 1
        # rounds that verify forced tokens before the drafts are left out (their cost and tokens are the grammar's),
        # and so are those whose chains held forced tokens (_learn_round)
        learn = policy is not None and not forced
        if learn:
            per_draft_s = (t1 - t0) / max(k if tree else proposal.drafts.shape[1], 1)
            self._learn_calls(b, verdicts.width, verdicts.seconds, proposal, per_draft_s)
        emitted = stats.generated_tokens
        for s, (r, verdict) in enumerate(zip(rows, verdicts.rows)):
            r.stats.target_calls += 1
            if verdict is None:
                continue
            if isinstance(verdict, Exception):  # this request's own failure: it alone ends
                self._fault(r, verdict)
                continue
            path, x = verdict
            m = int(proposal.counts[s])
            # a chain's drafts, or the deepest path of a tree: the most this row's drafts could have given
            proposed = m if not tree else int(verdicts.depth[s, : m + 1].max())
            try:
                self._record_verdict(r, len(path), proposed, self._width if tree else 1,
                                     *forced_counts(proposal, s, m, path), source=self._source(proposal, s))
                self._emit(s, r, [*proposal.drafts[s, path].tolist(), x])
            except Exception as exc:  # noqa: BLE001 - this request's own failure: it alone ends
                self._fault(r, exc)
        self.worker.settle(n_before, verdicts)
        if learn:
            self._learn_round(b, k, proposal, stats.generated_tokens - emitted, time.perf_counter() - t0)

    def _count_round(self, proposal, t0, t1, t2):
        """A round's one target call and its drafting in the scheduler's counters (t0..t1 drafting, t1..t2 verify)."""
        stats = self._stats
        stats.rounds += 1
        stats.target_calls += 1
        stats.draft_calls += len(proposal.calls)
        stats.verify_s += t2 - t1
        stats.draft_s += t1 - t0

    def _source(self, proposal, s) -> str:
        return proposal.sources[s] if proposal.sources is not None else self.drafter.name

    def _record_verdict(self, r, accepted: int, proposed: int, width: int, forced_accepted: int = 0,
                        forced: int = 0, source: str | None = None):
        """One row's verdict in its request's and the scheduler's statistics and the load-aware policy's acceptance
        (``proposed``: drafts of a chain, the deepest path of a tree); of them, ``forced`` tokens a grammar forced
        (``forced_accepted`` accepted) count apart, as forced tokens, not as the drafter's."""
        r.stats.rounds += 1
        if forced:
            r.stats.forced_tokens += forced_accepted
            accepted, proposed = accepted - forced_accepted, proposed - forced
        r.stats.record_accept(accepted, proposed)
        if proposed and self.policy is not None:
            self.policy.record_acceptance(proposed, accepted, width, r.sampler.mode != "greedy")
        self._stats.proposed += proposed
        self._stats.accepted += accepted
        if proposed:
            counts = self._stats.by_drafter.setdefault(source or self.drafter.name, [0, 0])
            counts[0] += proposed
            counts[1] += accepted

    max_forced = 16  # forced tokens verified per round at most (the verify call's width)

    # jump-forward (runtime/forced.py): the tokens a row's grammar forces, verified without asking the drafter
    def _forced(self, rows, caps):
        return forced_tokens(rows, caps, lambda: self._room(rows), getattr(self.drafter, "drafts_after_forced", False),
                             min(self.max_forced, self.max_drafts), self.max_drafts)

    def _ahead(self, rows, forced, caps):
        return ahead_of_forced(rows, forced, caps, self._tokens, self._n[: len(rows)])

    def _constrain(self, rows, proposal, forced):
        constrain(rows, proposal, forced, self._room(rows), self.max_drafts)

    def _verify_cost(self, b: int, t: int, tree: bool = False) -> float | None:
        """Seconds of a target call over b rows of t tokens (tree calls apart), as measured or fitted so far; None
        before any was measured. A self-shaping drafter's costs."""
        costs = self.policy.tree_target if tree else self.policy.target
        return costs.estimate(b, t)

    def _learn_calls(self, b, width, verify_s, proposal, per_draft_token_s):
        """Tell the load-aware policy what a round's calls cost (before its acceptance is known): the draft
        engine's calls at their sizes (a long catch-up is not a token), or per token of a drafter without one."""
        (self.policy.target if proposal.parents is None else self.policy.tree_target).record(b, width, verify_s)
        for calls, tokens, seconds in proposal.calls:
            self.policy.draft.record(calls, tokens, seconds)
        if not proposal.calls and proposal.drafts.shape[1]:
            self.policy.draft.record(b, 1, per_draft_token_s)

    def _learn_round(self, b, k, proposal, emitted, seconds):
        """Tell the load-aware policy what a whole round at (b, k) emitted and took. A round whose chains held tokens
        a grammar forced is not recorded: they come whatever k is and cost what the grammar's work costs, so such
        a round says little about k. (Counted as output, a k = 1 chain that reached a forced run looked better than
        any longer one, and drafting stayed at k = 1; left out of the output but not of the time, longer chains,
        which reach more forced runs, looked slower, and plain rows at the same batch size drafted too few.)
        Grammar rows learn from their rounds of free text, with their own acceptance."""
        if proposal.forced is not None and proposal.forced.any():
            return
        if proposal.calls and proposal.calls[0][1] > 2:
            # a long catch-up pays for earlier rounds that did not draft: charge this round a usual one
            seconds += self.policy.draft.estimate(b, 2) - proposal.calls[0][2]
        self.policy.record_round(b, k, emitted, seconds, self._width if proposal.parents is not None else 1,
                                 self._expected, self._sampled)

    def _decode_alone(self, r):
        """A lone greedy row with no drafts: one-token target calls in the engine's own loop
        (engines.base.greedy_steps) instead of a round per token, while the row runs alone. Each call counts
        as a round; every token joins the request through _emit as it comes, as in a round."""
        stats = self._stats

        def on_token(token):
            self._emit(0, r, [token])
            return self._keeps_going(r)

        t0 = time.perf_counter()
        steps = max(1, r.output.limit - len(r.output.token_ids))  # the output's limit keeps it inside the cache
        calls, seconds = self.worker.decode_alone(steps, on_token)
        self.round_log.extend((stats.rounds + i, 0, 1) for i in range(calls))
        stats.k_histogram[0] = stats.k_histogram.get(0, 0) + calls
        stats.rounds += calls
        stats.target_calls += calls
        stats.verify_s += seconds
        r.stats.target_calls += calls
        r.stats.rounds += calls
        if self.policy is not None:
            self.policy.target.record(1, 1, seconds / calls)
            self.policy.record_round(1, 0, 1, (time.perf_counter() - t0) / calls)

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
            if chunks and rest > budget:
                break  # after the first row, only whole prompts: a part would delay the first's token for nothing
            chunks.append(min(rest, budget))
            budget -= chunks[-1]
            if budget == 0 or chunks[-1] < rest:
                break  # a row served only in part ends the run: completions stay rows first, first + 1, ...
        p = len(chunks)
        t0 = time.perf_counter()
        read = tc[:p].copy()  # each row's tokens read before this chunk
        ids, pos, chunk, logits = self.worker.read_prompts(first, chunks)
        self._stats.target_calls += 1
        completed = 0
        for i in range(p):
            s, r = first + i, self._rows[first + i]
            r.stats.target_calls += 1
            if r.prompt_entries is not None:
                self._prompt_logprobs(r, logits[i, : chunk[i]], int(read[i]))
            if tc[i] < plen[i]:
                continue
            completed += 1  # served first come first served: completions are rows first, first + 1, ...
            r.prompt_read = True
            if r.prefix_only:
                r.finish_reason = "stop"
                continue
            try:
                tok = r.sampler.choose(logits[i, chunk[i] - 1], int(self._n[s]))
                self._emit(s, r, [tok])
            except Exception as exc:  # noqa: BLE001 - this request's own failure: it alone ends
                self._fault(r, exc)
                continue
            r.stats.time_to_first_token_s = r.last_emit - r.submitted
        # the draft reads the same chunks after the first tokens went out: they need only the target
        self.worker.draft_reads(ids, pos, first, chunk)
        if self.drafter_name == "draft" or isinstance(self.drafter, SuffixThenDraft):
            self._stats.draft_calls += 1
        for i in range(completed):
            s, r = first + i, self._rows[first + i]
            if r.shared_prefix is not None:  # the other samples of this prompt start from its slots
                keep = r.prompt_ids.size - 1
                r.shared_prefix = (keep, *self.worker.save(s, keep)) if keep else None
        self._stats.prefill_s += time.perf_counter() - t0
        self._decoding += completed

    def _prompt_logprobs(self, r, logits, start):
        # logits [T, V] of prompt positions start.. ; position j's logits give the prompt's token j + 1
        prompt, n = r.prompt_ids, r.prompt_logprobs
        greedy = SamplingParams()
        for c in range(min(logits.shape[0], prompt.size - 1 - start)):
            r.prompt_entries.append(logprob_entry(log_probs(greedy, logits[c]), int(prompt[start + c + 1]), n))

    def _emit(self, s, r, new):
        """Accepted tokens join request r in row s: THE place every path hands tokens over. The output's stop rule
        (output.RequestOutput) takes them up to where the request ends; the row's buffer gets what it took."""
        out = r.output
        taken = out.extend(new)
        sampler = r.sampler
        if not sampler.plain:
            if out.logprobs is not None:
                out.logprobs.extend(sampler.take_logprobs(taken))
            if sampler.processor is not None:
                sampler.processor.commit(new[:taken])
                if sampler.processor.constraint is not None:
                    self._check_grammar(r, sampler.processor.constraint, out)
        n = int(self._n[s])
        self._tokens[s, n : n + taken] = new[:taken]
        self._n[s] = n + taken
        r.stats.new_tokens += taken
        self._stats.generated_tokens += taken
        if out.finish_reason is not None:
            r.finish_reason = out.finish_reason
        now = time.perf_counter()
        if r.last_emit is not None and taken:
            r.stats.inter_token_s.extend([(now - r.last_emit) / taken] * taken)
        r.last_emit = now
        if r.streaming:
            delta = out.delta()
            if delta:
                self._deliver(r, ("delta", out.piece(delta)))

    def _check_grammar(self, r, constraint, out):
        """After r's grammar took its new tokens: EOS once the document is complete; InvalidRequestError (raised,
        r alone ends with it: a 400) when the grammar failed or the output ended (at an EOS) short of a complete
        document. So a structured output that ends "stop" always parses; a stop string or the token limit
        ("length") may still cut it short, as at OpenAI."""
        if constraint.error is not None:
            raise InvalidRequestError(f"response_format cannot be honoured: {constraint.error} (after "
                                      f"{len(out.token_ids)} generated tokens); simplify the schema or grammar")
        if out.finish_reason is None and constraint.finished:
            out.extend([min(self.eos_ids)])  # the grammar is complete: nothing but EOS may follow
        elif out.finish_reason == "stop" and not out.cut_by_stop_string and not constraint.accepting:
            raise InvalidRequestError("response_format cannot be honoured: the output ended before its document "
                                      "was complete; simplify the schema or grammar")

    def _finish(self, r, output):
        r.stats.elapsed_s = time.perf_counter() - r.submitted
        if r.finish_reason == "error":  # its own failure (_fault): only the error goes out
            self._stats.requests_failed += 1
            self._deliver(r, ("error", r.error))
            return
        if r.finish_reason == "cancelled":
            self._stats.requests_cancelled += 1
        else:
            self._stats.requests_finished += 1
        if output is None:  # cancelled before it had a row
            result = GenerationResult("", [], r.finish_reason, r.stats)
        else:
            output.finish(r.finish_reason)
            if r.streaming:  # what a stream has not had yet: a held-back partial stop string, a cancelled row's rest
                delta = output.delta()
                if delta or output.unsent_logprobs():
                    self._deliver(r, ("delta", output.piece(delta)))
            prompt_entries = r.prompt_entries if r.leader is None else r.leader.prompt_entries
            result = GenerationResult(output.text, list(output.token_ids), r.finish_reason, r.stats,
                                      logprobs=output.logprobs, prompt_logprobs=prompt_entries)
        self._deliver(r, ("done", result))

    def _retire(self):
        """Finished rows leave: their KV slots go to the prefix cache; the rows after them close the gap."""
        s = 0
        while s < len(self._rows):
            r = self._rows[s]
            if r.finish_reason is None:
                s += 1
                continue
            if self.prefix_cache is not None and r.finish_reason not in ("cancelled", "error"):
                keep = min(int(self._tc[s]), int(self._n[s]))
                if keep >= self.prefix_cache.min_tokens:
                    self.prefix_cache.add(self._tokens[s, :keep], *self.worker.save(s, keep), pinned=r.prefix_only)
            if r.finish_reason not in ("cancelled", "error"):
                # the output, after the prompt's last tokens: what it followed is matchable too
                self.worker.learn_output(s, max(0, r.prompt_ids.size - CONTEXT_TOKENS))
            self._finish(r, r.output)
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
        self.worker.move_row(src, dst)
        self._rows[dst] = self._rows[src]

