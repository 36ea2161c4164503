"""Continuous batching with speculation: the plan of every step; requests come and go between steps.

vLLM v1's shape (runtime/README.md): ``schedule()`` returns a StepPlan (runtime/plan.py), the worker executes it
(runtime/worker.py, every engine and drafter call) and returns a StepResult, ``update()`` applies it. The
scheduler decides and never calls an engine; engine rows are slots (llama.cpp's server, DESIGN.md §7). A step:
  1. admission: waiting requests (highest priority first, aged so none starves) take free rows; a prompt that
     starts with tokens already computed (a finished request's, or a registered prefix) gets those cache slots
     copied in instead of recomputed (prefix_cache.py);
  2. prompts: rows still reading their prompt (after the decoding rows) share ``prefill_chunk`` tokens, first come
     first served (the first its next part, the others only whole prompts), in one target call; a row that finishes
     its prompt emits its first token and decodes from the next step: a long prompt never stalls the others;
  3. the round's shape: each decoding row may draft up to its own k; load-aware k (load_aware.py) picks this
     round's k and tree width from the measured call costs at the current batch size, 0 when drafting does not
     pay; a grammar's forced tokens go in front of a row's drafts (forced.py);
  4. the worker drafts, makes ONE target call over the decoding rows' [last token, drafts...] and walks every
     row's verdict (verify.py, one walk for chains and trees);
  5. update: the tokens join each request through the one stop rule (stop_rule.RequestOutput); statistics and the
     policy learn from the result (stats.py); finished or cancelled rows retire (the last decoding row moves into
     the hole), their slots saved for the prefix cache in a step of cache moves before their results go out.
A lone row that drafts nothing, greedy or coupled with no logits processing, decodes in the engine's own loop
(engines.base.greedy_steps), each token through the same stop rule. A caller's errors are caught in its own thread.

Isolation: what one request's own processing raises inside a step — its grammar (which fails or dead-ends only
while decoding), logits processing, sampling, its sink — fails that request alone (``_fault``): per-row steps are
guarded, and a batched drafter step that a row's sampler fails (verify.RowFault) loses only this round's drafts for
the others (drafts never change an output). Only an engine's failure fails the step's requests.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .drafters import DRAFTERS  # noqa: F401 - the names a Scheduler takes, as generator.py imports them
from .drafters import REGISTRY, check_datastore, check_drafter, check_tree, default_drafter, make_drafter
from .drafters.self_draft import SELF, self_draft
from .forced import forced_tokens
from .load_aware import LoadAwareK
from .picks import host_logits, on_device
from .plan import (DecodeResult, DraftShape, LearnOutput, Load, LoneDecode, Move, PromptChunks, PromptResult, Save,
                   StepPlan, StepResult)
from .prefix_cache import PrefixCache, reusable_slots
from .request import GenerationResult, InvalidRequestError, Request, RequestBuilder, RequestFailedError, check_k
from .stats import Statistics
from .stop_rule import RequestOutput
from .submission import Submission
from .tokenizer import load_tokenizer
from .verify import SPECULATIVE_SAMPLING, RowFault
from .vocab import check_same_vocabulary
from .worker import Worker, open_engine

K_POLICIES = ("load-aware", "fixed")

log = logging.getLogger("trtspec.scheduler")


class Scheduler(Submission):
    """Continuous batching with speculation over a target engine and an optional drafter.

    ``target``/``draft`` are engine or export directories, or loaded engines; ``draft="self"`` drafts with the
    target's own INT4 build (made once, see runtime/drafters/self_draft.py). ``drafter`` is one of DRAFTERS
    (runtime/drafters/__init__.py: what each is and needs; the draft model's drafter when a draft is given);
    ``tree_width``/``tree_nodes`` shape token trees (a --tree target). ``num_draft_tokens`` is the default k of a
    request (each may ask for its own). ``k_policy`` "load-aware" chooses each round's k from measured costs at the
    current batch size (down to 0); "fixed" drafts every row's own k. ``prefill_chunk`` bounds the prompt tokens read
    per step (one call). ``prefix_cache_mb`` bounds the KV slots kept for reuse (0 disables it); prompts sharing at
    least ``min_prefix_tokens`` tokens with a cached sequence reuse them. ``sampling`` is how sampled requests verify
    drafts (verify.RowSampler). ``aging_s``: waiting this long counts as one priority level more. ``datastore``: an
    index (``trtspec index``) suffix decoding also drafts from.
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
        datastore=None,
    ):
        self.target = open_engine(target, num_threads)
        self.tokenizer = load_tokenizer(self.target)
        if isinstance(draft, str) and draft == SELF:  # the target's own INT4 build (runtime/drafters/self_draft.py)
            draft = self_draft(self.target)
        drafter, draft = default_drafter(drafter, draft, datastore, self.target)
        self.datastore = check_datastore(drafter, datastore, self.tokenizer, f"the target {self.target.path}")
        self._check_options(drafter, draft, k_policy, sampling, prefill_chunk, min_prefix_tokens, prefix_cache_mb,
                            aging_s)
        special = self.target.manifest["model"]["special_tokens"]
        self.eos_ids = frozenset(special["eos_token_ids"])
        self.bos_id = special["bos_token_id"]
        self.pad_id = special["pad_token_id"] if special["pad_token_id"] is not None else 0
        kind = REGISTRY[drafter]
        self.draft = None
        if kind.needs_draft_model or (kind.combines_with_draft and draft is not None):
            self.draft = open_engine(draft, num_threads)
            if kind.combines_with_draft and self.draft.manifest["model"].get("head"):
                raise ValueError(f"drafter {drafter!r} takes a draft model under it, not a head: pass a draft "
                                 "model's engine, or the head's own drafter for the head alone")
            check_same_vocabulary(self.target, self.draft)
        self.engines = [self.target] if self.draft is None else [self.target, self.draft]
        self.capacity = min(e.max_seq_len for e in self.engines)
        # tokens one call may carry (engines whose sliding-window layers keep rings take fewer than S_max)
        self.max_call = min(e.max_call_tokens for e in self.engines)
        self.max_drafts = self.max_call - 1  # the tokens a verify call carries past a row's last one
        self.max_batch = self._check_batch(max_batch)
        self.tree_width, self.tree_nodes = check_tree(drafter, tree_width, tree_nodes, self.target)
        # a head drafter's draft is its head: an engine (eagle3) or the heads' directory (medusa)
        self.drafter = make_drafter(drafter, target=self.target, draft=self.draft if self.draft is not None else draft,
                                    max_batch=self.max_batch, pad_id=self.pad_id, tree_width=self.tree_width,
                                    tree_nodes=tree_nodes, datastore=self.datastore)
        self.drafter_name = drafter
        self._drafts_after_forced = kind.drafts_after_forced
        # the k values the engines can verify in one call (TensorRT engines have fixed profiles)
        sizes = getattr(self.target, "verify_tokens", None)
        self.allowed_k = [k for k in range(1, min(self.capacity, self.max_call)) if sizes is None or k + 1 in sizes]
        drafting = kind.proposes_drafts
        if drafting:
            check_k(num_draft_tokens, self.allowed_k, allow_any=k_policy == "load-aware")
        self.num_draft_tokens = num_draft_tokens if drafting else 0
        widths = (1, self.tree_width) if kind.branches else (1,)
        self.policy = (LoadAwareK(self.num_draft_tokens, self.allowed_k, widths=widths, nodes=tree_nodes)
                       if k_policy == "load-aware" else None)
        # a drafter shaping its own rounds (suffix: per row, from its matches' scores) gets the call costs, not a k
        self._self_shaping = self.policy is not None and kind.shapes_own_rounds
        # plain stretches (_plan_decode; not for a head drafter: it reads the target's features of every token); a
        # drafter that catches up skips the prompts while the policy does not draft (_plan_prompts)
        self._plain_stretches, self._plain_left = self.policy is not None and not kind.reads_features, 0
        self._lazy_prompts = self.policy is not None and kind.catches_up
        if self._self_shaping:
            self.drafter.costs = self.policy.call_cost
        self.prefill_chunk = min(prefill_chunk, self.max_call)
        self.sampling = sampling
        self.aging_s = float(aging_s)
        self.prefix_cache = (
            PrefixCache(int(prefix_cache_mb * 2**20), min_prefix_tokens) if prefix_cache_mb > 0 else None
        )
        # the engines, the drafter and the rows' token buffers: every engine call is the worker's
        self.worker = Worker(self.target, self.draft, self.drafter, max_batch=self.max_batch, capacity=self.capacity,
                             max_drafts=self.max_drafts, pad_id=self.pad_id, k_room=max(self.num_draft_tokens, 1))
        self._rows: list[Request] = []  # engine row i runs self._rows[i]
        self._decoding = 0  # rows [0, D) decode; rows [D, B) are still reading their prompts
        self._waiting: list[Request] = []
        self._appended: dict | None = {}  # row -> tokens its output took of the last result (None: void, it failed)
        self._cache_ops: list = []  # the cache moves of the next plan (plan.py)
        self._retired: list[Request] = []  # finished, their results sent once the next step made their cache moves
        self._cv = threading.Condition()
        self._thread = self._last_thread = None  # the loop thread while it has work; the last one (close joins it)
        self._closed = False
        self.statistics = Statistics(self.policy)
        self.failure: Exception | None = None  # the last engine error (a server reports itself unhealthy on it)
        # a lone plain row decodes in the engine's own loop (_plan_alone); False: a step a token (same tokens, stats)
        self.lone_row_loops = True
        self._host_logits = host_logits(self.target)  # (a coupled row's loop picks there; else the batch path does)
        # every check of a request, in the caller's thread (request.py): the server's too
        self.requests = RequestBuilder(self.tokenizer, vocab_size=self.target.vocab_size, bos_id=self.bos_id,
                                       eos_ids=self.eos_ids, capacity=self.capacity, sampling=sampling,
                                       drafting=drafting, default_k=self.num_draft_tokens, allowed_k=self.allowed_k)

    @property
    def round_log(self):
        """(round number, k chosen, rows) of the recent rounds."""
        return self.statistics.round_log

    def _check_options(self, drafter, draft, k_policy, sampling, prefill_chunk, min_prefix_tokens, prefix_cache_mb,
                       aging_s):
        """The drafter checked against what it needs (drafters.check_drafter) and the options."""
        check_drafter(drafter, draft, self.target)
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

    def _check_batch(self, max_batch) -> int:
        engine_batch = min(e.max_batch for e in self.engines)
        if max_batch is None:
            max_batch = engine_batch
        if not isinstance(max_batch, int) or not 1 <= max_batch <= engine_batch:
            raise ValueError(f"max_batch must be an integer in [1, {engine_batch}] (the engines' rows), got {max_batch!r}")
        for engine in self.engines:  # (an exact int8 build picks its one graph for the session from it: engines/onnxruntime.py)
            plan = getattr(engine, "plan_rows", None)
            if plan is not None:
                plan(max_batch)
        return max_batch

    # -- the loop: plan, execute, update ----------------------------------------------------------------------

    def _loop(self):
        locks = self.worker.locks()
        for lock in locks:
            lock.acquire()  # another scheduler on the same engines finishes its work first
        try:
            while True:
                with self._cv:
                    if not self._rows and not self._waiting and not self._retired:
                        self._thread = None
                        return
                try:
                    plan = self.schedule()
                    self.update(plan, self.worker.execute(plan))
                except Exception as exc:  # an engine failure fails the requests in flight, not the scheduler
                    self._fail_running(exc)
        finally:
            for lock in reversed(locks):
                lock.release()

    def _fail_running(self, exc):
        with self._cv:
            self.failure = exc
            rows, self._rows = self._rows, []
            retired, self._retired = self._retired, []
            self._decoding = 0
            self._appended, self._cache_ops = None, []  # the worker forgets the last result's rows
            self.statistics.counters.requests_failed += len(rows)
        for r in retired:  # finished before the failure: only their cache moves are lost
            self._finish(r, r.output)
        for r in rows:
            r.finish_reason = "error"
            error = RequestFailedError(f"request {r.id} failed: the engine raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._deliver(r, ("error", error))

    # -- schedule ----------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan: the cache moves of rows that retired (a step of its own, so their results go out
        as soon as their slots are saved), else admission, the prompt chunks and the decoding rows' round."""
        with self._cv:
            for r in self._rows:
                if r.cancelled and r.finish_reason is None:
                    r.finish_reason = "cancelled"
        self._retire()
        appended, self._appended = self._appended, {}
        if self._retired:
            plan = StepPlan(appended, self._cache_ops)
            self._cache_ops = []
            return plan
        plan = StepPlan(appended, self._admit())
        if len(self._rows) > self._decoding:
            plan.prompts = self._plan_prompts()
        if self._decoding:
            self._plan_decode(plan)
        return plan

    def _admit(self) -> list:
        """Waiting requests take free rows, by priority: their Load moves."""
        now = time.perf_counter()
        if not self._waiting:
            return []
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
        loads = []
        for r in admitted:
            row = len(self._rows)  # newcomers join the prompt-reading rows at the end
            r.admitted = now
            r.stats.queue_s = now - r.submitted
            self._open_output(r)
            if r.leader is not None and r.leader.shared_prefix:
                hit = r.leader.shared_prefix
            elif self.prefix_cache and r.prompt_logprobs is None:  # prompt logprobs need every position computed
                hit = self.prefix_cache.lookup(r.prompt_ids)
            else:
                hit = None
            reused, blocks = reusable_slots(hit, self.drafter.reusable)
            r.computed = reused
            loads.append(Load(row, r.prompt_ids, reused, blocks))
            self.statistics.admitted(r, reused, self.prefix_cache is not None)
            with self._cv:
                self._rows.append(r)
        return loads

    def _open_output(self, r):
        plen = r.prompt_ids.size
        r.output = RequestOutput(self.tokenizer, eos_ids=self.eos_ids, limit=min(r.max_new_tokens, self.capacity - plen),
                                 stop=r.stop, include_stop=r.include_stop, streaming=r.streaming)
        if r.sampler.params.logprobs is not None:
            r.output.logprobs = []
        if r.prompt_logprobs is not None:
            r.prompt_entries = [None]  # the first token has no log-probability
            r.output.prompt_logprobs = (r.leader or r).prompt_entries  # complete when the first piece goes out

    def _plan_prompts(self) -> PromptChunks:
        """Rows [D, B) read their prompts: up to prefill_chunk tokens this step, first come first served, in one call
        over the rows that get tokens (a contiguous run from D, since earlier rows are served first)."""
        first, rows = self._decoding, self._rows[self._decoding :]
        # every row of the call writes T slots: pads stay inside the cache
        budget = min(self.prefill_chunk, min(self.capacity - r.computed for r in rows))
        chunks = []
        for r in rows:
            rest = int(r.prompt_ids.size - r.computed)
            if chunks and rest > budget:
                break  # after the first row, only whole prompts: a part would delay the first's token for nothing
            chunks.append(min(rest, budget))
            budget -= chunks[-1]
            if budget == 0 or chunks[-1] < rest:
                break  # a row served only in part ends the run: completions stay rows first, first + 1, ...
        choosers, logprobs, share = [], [], []
        for r, chunk in zip(rows, chunks):
            r.computed += chunk
            done = r.computed >= r.prompt_ids.size
            choosers.append(r.sampler if done and not r.prefix_only else None)
            logprobs.append((r.prompt_ids, r.prompt_logprobs) if r.prompt_entries is not None else None)
            # the other samples of this prompt start from its slots
            share.append(r.prompt_ids.size - 1 if done and r.shared_prefix is not None else 0)
        lazy = self._lazy_prompts and self.policy.plain_at(len(self._rows))
        return PromptChunks(first, chunks, choosers, logprobs, share, draft=not lazy)

    def _plan_decode(self, plan: StepPlan) -> None:
        """Rows [0, D) decode: each row's drafts at most, the round's k and width (the load-aware policy's), the
        tokens a grammar forces; or a lone plain row without drafts in the engine's own loop."""
        rows = self._rows[: self._decoding]
        room = self._room(rows)
        caps = np.minimum(room, [r.k for r in rows])
        lone = len(self._rows) == 1 and on_device(s := rows[0].sampler) and (s.mode == "greedy" or self._host_logits)
        self._plain_left = self._plain_left if lone else 0
        if lone and self.lone_row_loops and not caps.any():
            plan.alone = self._plan_alone(rows[0])
            return
        samplers = [r.sampler for r in rows]
        sampled = any(s.mode != "greedy" for s in samplers)  # such rounds are measured apart
        policy, width, expected = self.policy, self.tree_width, None
        if self._plain_left > 0 and caps.any():  # a plain stretch, one round a step (lone_row_loops off)
            self._plain_left, caps, k = self._plain_left - 1, np.zeros_like(caps), 0
        elif policy is not None and caps.any() and not self._self_shaping:
            k, width = policy.choose_shape(len(rows), caps, [(r.stats.accepted, r.stats.accepted + r.stats.rejected,
                                                              r.sampler.mode != "greedy") for r in rows], sampled)
            expected = policy.last_expected
            if k == 0 and lone and self._plain_stretches:
                steps = policy.plain_stretch(1, sampled)
                if self.lone_row_loops:
                    plan.alone = self._plan_alone(rows[0], steps)
                    return
                self._plain_left = steps - 1
            caps = np.minimum(caps, k)
        else:
            k = int(caps.max())
        # rows whose grammar forces the next tokens: drafts after them, if any
        forced = forced_tokens(samplers, caps, room, self._drafts_after_forced and width == 1,
                               min(self.max_forced, self.max_drafts), self.max_drafts)
        plan.decode = DraftShape(samplers, caps, room, k, width, forced, expected, sampled)

    max_forced = 16  # forced tokens verified per round at most (the verify call's width)

    def _room(self, rows) -> np.ndarray:
        """The most tokens past the last one each row may verify this round: room in the cache and its output."""
        outputs = [len(r.output.token_ids) for r in rows]
        # every row writes [n - 1, n - 1 + T): no row may pass the cache's capacity
        t_cap = self.capacity + 1 - max(r.prompt_ids.size + m for r, m in zip(rows, outputs))
        return np.array([max(0, min(t_cap - 1, r.output.limit - m - 1)) for r, m in zip(rows, outputs)], np.int64)

    def _plan_alone(self, r, steps: int | None = None) -> LoneDecode:
        """A lone plain row with no drafts: one-token target calls in the engine's own loop, each token through the
        stop rule as it comes, while the row runs alone; at most ``steps`` (None: to its output's limit)."""

        def take(token):
            taken = self._emit(r, [token])
            return taken, self._keeps_going(r)

        left = max(1, r.output.limit - len(r.output.token_ids))  # (the limit keeps it in the cache)
        return LoneDecode(left if steps is None else min(steps, left), take, r.sampler)

    def _keeps_going(self, r) -> bool:
        """A lone row's loop goes on: it runs, it is still alone, and nobody arrived whom a free row could take."""
        return (r.finish_reason is None and not r.cancelled and len(self._rows) == 1
                and not (self._waiting and len(self._rows) < self.max_batch))

    # -- update ------------------------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """What the step gave: saved slots to the prefix cache and retired requests' results out, first tokens and
        verdicts through the stop rule, the statistics told; then finished rows retire."""
        self._after_moves(plan, result)
        if result.prompts is not None:
            self._update_prompts(plan.prompts, result.prompts)
        if result.decode is not None:
            self._update_round(plan.decode, result.decode)
        elif result.alone is not None:
            self.statistics.alone(self._rows[0], result.alone)
        self._retire()

    def _after_moves(self, plan: StepPlan, result: StepResult) -> None:
        saves = iter(result.saved)
        for op in plan.cache:
            if isinstance(op, Save):
                saved = next(saves)
                if saved is not None:
                    self.prefix_cache.add(*saved, pinned=op.pinned)
        retired, self._retired = self._retired, []
        for r in retired:
            self._finish(r, r.output)

    def _update_prompts(self, plan: PromptChunks, result: PromptResult) -> None:
        rows = self._rows[plan.first : plan.first + len(plan.chunks)]
        self.statistics.prompts(rows, result)
        completed = 0
        for i, r in enumerate(rows):
            if result.entries[i] is not None:
                r.prompt_entries.extend(result.entries[i])
            if r.computed < r.prompt_ids.size:
                continue
            completed += 1  # served first come first served: completions are rows first, first + 1, ...
            r.prompt_read = True
            if plan.share[i]:
                r.shared_prefix = result.shared[i]
            elif r.shared_prefix is not None:
                r.shared_prefix = None  # (a one-token prompt: nothing to share)
            if r.prefix_only:
                r.finish_reason = "stop"
                continue
            token = result.first[i]
            try:
                if isinstance(token, Exception):
                    raise token
                taken = self._emit(r, [token])
            except Exception as exc:  # noqa: BLE001 - this request's own failure: it alone ends
                self._fault(r, exc)
                continue
            self._appended[plan.first + i] = [token][:taken]
            r.stats.time_to_first_token_s = r.last_emit - r.submitted
        self._decoding += completed

    def _update_round(self, plan: DraftShape, result: DecodeResult) -> None:
        rows = self._rows[: len(plan.samplers)]
        for s, fault in result.faults:  # the drafter's batched step failed in this row's sampler
            self._fault(rows[s], fault)
        emitted = 0
        for s, (r, verdict) in enumerate(zip(rows, result.verdicts)):
            if isinstance(verdict, Exception):  # this request's own failure: it alone ends
                self._fault(r, verdict)
            elif verdict is not None:
                try:
                    taken = self._emit(r, verdict.tokens)
                except Exception as exc:  # noqa: BLE001 - this request's own failure: it alone ends
                    self._fault(r, exc)
                    continue
                self._appended[s] = verdict.tokens[:taken]
                emitted += taken
        self.statistics.round(rows, plan, result, emitted)

    def _emit(self, r, new) -> int:
        """Accepted tokens join request r: THE place every path hands tokens over. The output's stop rule
        (stop_rule.RequestOutput) takes them up to where the request ends; returns how many it took (the row's
        buffer takes those at the next step)."""
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
        r.stats.new_tokens += taken
        self.statistics.counters.generated_tokens += taken
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
        return taken

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

    def _fault(self, r, exc):
        """Request r's own processing failed with ``exc`` during a step: r alone ends (retired with the step's
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

    def _deliver(self, r, event):
        """Hand ``event`` to r's sink. A sink that raises (its caller's event loop is gone) must not take the step
        down with it: nobody can read r any more, so r is cancelled."""
        try:
            r.sink(event)
        except Exception:  # noqa: BLE001 - the caller's failure, not the step's
            log.warning("request %s: its sink raised; cancelling it", r.id, exc_info=True)
            r.cancelled = True

    def _finish(self, r, output):
        r.stats.elapsed_s = time.perf_counter() - r.submitted
        counters = self.statistics.counters
        if r.finish_reason == "error":  # its own failure (_fault): only the error goes out
            counters.requests_failed += 1
            self._deliver(r, ("error", r.error))
            return
        if r.finish_reason == "cancelled":
            counters.requests_cancelled += 1
        else:
            counters.requests_finished += 1
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

    # -- retirement: decided here, its cache moves made by the next step ---------------------------------------

    def _retire(self):
        """Finished rows leave: their slots to the prefix cache and their output to the drafter (Save, LearnOutput),
        the rows after them close the gap (Move); their results go out once the next step made those moves."""
        s = 0
        while s < len(self._rows):
            r = self._rows[s]
            if r.finish_reason is None:
                s += 1
                continue
            if r.finish_reason not in ("cancelled", "error"):
                if self.prefix_cache is not None:
                    self._cache_ops.append(Save(s, self.prefix_cache.min_tokens, r.prefix_only))
                self._cache_ops.append(LearnOutput(s, int(r.prompt_ids.size)))
            self._retired.append(r)
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
        self._cache_ops.append(Move(src, dst))
        self._rows[dst] = self._rows[src]
