"""A request's life outside the engines: how it is made and checked (RequestBuilder: every check, in the caller's
thread), its state, the handles a caller holds, its results and statistics. Where a request ends (EOS, stop strings,
its token limit) is stop_rule.py's one stop rule."""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from .grammar import GrammarCompiler
from .logits import LogitsProcessor
from .stop_rule import Piece
from .sampling import SamplingParams
from .verify import RowSampler
from .tokenizer import encode_prompt


class RequestFailedError(RuntimeError):
    """This request failed while it ran: an engine call failed (then the round's other requests fail too), or its
    own processing did (then it fails alone). A server answers 500: the fault is the server's."""

    status = 500


class InvalidRequestError(RequestFailedError):
    """This request cannot be honoured, which showed only while it ran (its grammar failed or reached a dead end);
    it fails alone, and a server answers 400 with the message, which names the problem."""

    status = 400


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
    forced_tokens: int = 0  # tokens a grammar forced, verified without drafting (jump-forward)

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
    """One request's output.

    ``text`` ends before the first stop string (or after it, with ``include_stop_str_in_output``); ``token_ids``
    end where the text ends: an EOS is not included, the token that completed a stop string is (its text may
    run past the stop string). ``finish_reason``: "stop" (an EOS or a stop string), "length" (max_new_tokens or
    the engines' capacity), "cancelled". ``stats.new_tokens == len(token_ids)``.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    replica: str | None = None  # the server replica that produced it (set by the Ray Serve front)
    # with logprobs: per token (token id, log-probability, [(token id, log-probability), ...] most likely first)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # with prompt_logprobs: per prompt token (None for the first)


@dataclass
class EngineWork:
    """Engine calls and where their time went: a scheduler's since it was made, or while a batch ran."""

    draft_calls: int = 0
    prefill_s: float = 0.0  # rounds that carried prompt chunks (their target call)
    draft_s: float = 0.0
    verify_s: float = 0.0  # target calls of rounds without prompt chunks


@dataclass
class SchedulerStats(EngineWork):
    """Counters of one scheduler since it was made (a snapshot)."""

    running: int = 0
    waiting: int = 0
    rounds: int = 0
    target_calls: int = 0
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
    tree_shapes: dict[str, int] = field(default_factory=dict)  # rounds that verified a tree, by shape ("4x3")
    by_drafter: dict[str, list[int]] = field(default_factory=dict)  # drafter -> [tokens proposed, accepted]


@dataclass
class BatchStats(EngineWork, RequestStats):
    """A generate() call's totals: its requests' counts, and the scheduler's work while it ran
    (which includes other callers' requests sharing the rounds)."""

    requests: int = 0
    other_s: float = 0.0
    k_chosen: list[int] = field(default_factory=list)  # k per round

    @classmethod
    def of(cls, results, before: SchedulerStats, after: SchedulerStats, elapsed_s: float, k_chosen: list[int]):
        """Sum the requests' counts; the engine work is the scheduler's between ``before`` and ``after``."""
        stats = cls(requests=len(results), elapsed_s=elapsed_s, k_chosen=k_chosen)
        for r in results:
            for name in ("new_tokens", "prompt_tokens", "proposed", "accepted", "rejected"):
                setattr(stats, name, getattr(stats, name) + getattr(r.stats, name))
            for i, count in enumerate(r.stats.accepted_histogram):
                if len(stats.accepted_histogram) <= i:
                    stats.accepted_histogram.append(0)
                stats.accepted_histogram[i] += count
        stats.time_to_first_token_s = min(r.stats.time_to_first_token_s for r in results)
        for name in ("target_calls", "rounds", "draft_calls", "prefill_s", "draft_s", "verify_s"):
            setattr(stats, name, getattr(after, name) - getattr(before, name))
        stats.other_s = max(0.0, elapsed_s - stats.prefill_s - stats.draft_s - stats.verify_s)
        return stats


class Request:
    """One request's state; lives in an engine row while it runs."""

    __slots__ = ("id", "seq", "prompt_ids", "max_new_tokens", "stop", "include_stop", "k", "priority", "sampler",
                 "sink", "submitted", "admitted", "last_emit", "cancelled", "prefix_only", "stats", "output",
                 "finish_reason", "streaming", "prompt_logprobs", "prompt_entries", "leader", "shared_prefix",
                 "prompt_read", "error", "computed")

    def __init__(self, seq, prompt_ids, max_new_tokens, stop, include_stop, k, priority, sampler, sink,
                 prefix_only=False):
        self.id = f"req-{uuid.uuid4().hex[:16]}"
        self.seq = seq
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.include_stop = include_stop
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
        self.output = None  # stop_rule.RequestOutput, made when the request takes an engine row
        self.finish_reason = None
        self.streaming = True  # False: nobody reads text deltas, the text is decoded once when it finishes
        self.prompt_logprobs = None  # N: log-probabilities of the prompt's tokens (and N alternatives) too
        self.prompt_entries = None
        # n samples of one prompt: the others wait for the first ("leader") to read the prompt, then start from
        # a copy of its cache slots (shared_prefix: (tokens, target block, draft block))
        self.leader = None
        self.shared_prefix = None
        self.prompt_read = False
        self.error = None  # what failed it alone (finish_reason "error"; the scheduler's _fault)
        self.computed = 0  # its tokens in the target's cache while it reads its prompt


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
                error = next((v for k, v in events if k == "error"), None)
                if error is not None:  # (fail() may put one in front of the scheduler's own last events)
                    raise error
                text = Piece.join([v for k, v in events if k == "delta"])
                kind, value = events[-1]
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

    def fail(self, error: BaseException):
        """End this handle with ``error`` (its consumer raises it at once) and cancel the request: a server that
        stops waiting for it (its drain timed out) says why to whoever reads the handle."""
        self._queue.put_nowait(("error", error))
        self.cancel()


_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key as JSON carries a token id: canonical decimal, ASCII


def check_k(k, allowed_k: list[int], allow_any: bool = False) -> None:
    """A draft length the engines can verify in one call (k + 1 tokens; TensorRT engines have fixed profiles);
    ``allow_any``: any k up to the largest (the load-aware policy picks a verifiable one each round)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
    if k not in allowed_k and not (allow_any and k <= (allowed_k[-1] if allowed_k else 0)):
        shown = f"{allowed_k[:8]}{'...' if len(allowed_k) > 8 else ''}"
        raise ValueError(f"num_draft_tokens={k} is not supported by the engines (verify sizes k+1 allowed for k in {shown})")


class RequestBuilder:
    """Every check of one request, made in the caller's thread before anything is queued: THE validation source of
    the runtime. Scheduler.make_request is this; the server's parameters (server/params.py) come here too, and
    a ValueError raised here is its 400.

    ``tokenizer``/``vocab_size``/``bos_id``/``eos_ids``/``capacity``: the target's; ``sampling``: how sampled
    requests verify drafts; ``drafting``: whether the scheduler has a drafter; ``default_k``: a request's k
    unless it asks for its own; ``allowed_k``: the k values the engines verify in one call."""

    def __init__(self, tokenizer, *, vocab_size: int, bos_id, eos_ids, capacity: int, sampling: str, drafting: bool,
                 default_k: int, allowed_k: list[int]):
        self.tokenizer, self.vocab_size, self.bos_id, self.eos_ids = tokenizer, vocab_size, bos_id, eos_ids
        self.capacity, self.sampling, self.drafting = capacity, sampling, drafting
        self.default_k, self.allowed_k = default_k, allowed_k
        self._seq = itertools.count()
        self._grammars = None

    def encode(self, prompt) -> np.ndarray:
        """Token ids of a prompt (a string, or a list of token ids), checked against the engines' capacity."""
        return encode_prompt(self.tokenizer, prompt, vocab_size=self.vocab_size, bos_id=self.bos_id,
                             capacity=self.capacity)

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars

    def make(self, prompt, *, max_new_tokens=128, temperature=0.0, top_k=None, top_p=None, seed=None, stop=None,
             include_stop_str_in_output=False, num_draft_tokens=None, priority=0, sink=None, prefix_only=False,
             presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, min_tokens=0,
             logprobs=None, prompt_logprobs=None, response_format=None) -> Request:
        """Validate everything about one request (raising the user's error) without queuing it.

        Logits processing (runtime/logits.py, applied alike to the target and the draft, so speculation stays
        lossless): ``presence_penalty``/``frequency_penalty`` (OpenAI's), ``repetition_penalty`` (vLLM's),
        ``logit_bias`` ({token id: bias in [-100, 100]}), ``min_tokens`` (no EOS before), ``response_format``
        (structured output, runtime/grammar.py). ``logprobs`` N: each token's log-probability and the N most
        likely (sampling.log_probs says which distribution); ``prompt_logprobs`` N: the prompt's tokens' too.
        """
        if not prefix_only and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                                or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        if not isinstance(include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be true or false, got {include_stop_str_in_output!r}")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        bias = self.logit_bias(logit_bias)
        params = SamplingParams(temperature, top_k, top_p, seed, presence_penalty, frequency_penalty,
                                repetition_penalty, bias, min_tokens, logprobs)
        if not prefix_only and min_tokens > max_new_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) must not exceed max_new_tokens ({max_new_tokens})")
        if prompt_logprobs is not None and (not isinstance(prompt_logprobs, int) or isinstance(prompt_logprobs, bool)
                                            or not 0 <= prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20] or None, got {prompt_logprobs!r}")
        if num_draft_tokens is None:
            k = self.default_k
        elif not self.drafting:
            if num_draft_tokens != 0:
                raise ValueError("num_draft_tokens needs a drafter; this scheduler has none (it decodes one token a call)")
            k = 0
        else:
            if num_draft_tokens != 0:
                check_k(num_draft_tokens, self.allowed_k)
            elif not isinstance(num_draft_tokens, int):
                raise ValueError(f"num_draft_tokens must be an integer >= 0, got {num_draft_tokens!r}")
            k = num_draft_tokens
        ids = self.encode(prompt)
        constraint = self.grammar_compiler().constraint(response_format) if response_format is not None else None
        processor = None
        if params.processed or constraint is not None:
            processor = LogitsProcessor(params, ids, self.eos_ids, constraint)
        request = Request(next(self._seq), ids, max_new_tokens if not prefix_only else 0, stop,
                          include_stop_str_in_output, k, priority, RowSampler(params, self.sampling, processor), sink,
                          prefix_only)
        request.prompt_logprobs = prompt_logprobs
        return request

    def logit_bias(self, logit_bias) -> tuple:
        # {token id (an int, or its decimal string as JSON sends it): bias} -> ((id, bias), ...), ids checked.
        # A string key must be the id's canonical decimal (as OpenAI requires): " 5", "05", "+5" or "٥" (an
        # Arabic-Indic five, which int() takes) must not quietly name token 5
        if logit_bias is None:
            return ()
        if not isinstance(logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {type(logit_bias).__name__}")
        pairs = []
        for key, bias in logit_bias.items():
            token = int(key) if isinstance(key, str) and _TOKEN_ID.fullmatch(key) else key
            if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise ValueError(f"logit_bias key {key!r} is not a token id of this model (0..{self.vocab_size - 1})")
            pairs.append((int(token), bias))
        return tuple(pairs)

    def group(self, prompt, n, params) -> list[Request]:
        """n requests sampling one prompt, sample i with seed + i; all but the first start from a copy of the
        first's cache slots once it has read the prompt (each then reads only the prompt's last token)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        seed = params.pop("seed", None)
        requests = [self.make(prompt, seed=None if seed is None else seed + i, **params) for i in range(n)]
        if n > 1:
            requests[0].shared_prefix = ()  # asked for: made when it has read its prompt
            for r in requests[1:]:
                r.leader = requests[0]
        return requests
