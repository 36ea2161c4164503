"""The caller's side of a Scheduler: requests validated in the caller's thread, queued, and their handles; warm-up,
statistics and closing.

Everything a caller can get wrong is checked here, before the request is queued (request.RequestBuilder, the one
validation source); the loop thread (scheduler.py) takes requests from the queue between steps.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
import weakref

import numpy as np

from .request import AsyncRequestHandle, GenerationResult, Request, RequestHandle, SchedulerStats


class Submission:
    """The Scheduler's methods for its callers (the Scheduler holds the queue: ``_waiting``, ``_rows``, ``_cv``)."""

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
                self._last_thread = self._thread
                _STARTED.add(self)
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
            if self._rows or self._waiting or self._retired or self._closed:
                return False
            locks = self.worker.locks()
            for lock in locks:
                lock.acquire()
            try:  # (the one worker call outside a step: no step runs while idle)
                self.worker.warm_up(self.max_batch, max(1, min(self.warm_up_tokens, self.max_call, self.capacity)))
            finally:
                for lock in reversed(locks):
                    lock.release()
        return True

    def close(self, timeout: float | None = None):
        """Cancel everything queued or running and stop the loop thread."""
        _join(self._stop(), timeout)

    def _stop(self) -> threading.Thread | None:
        """Refuse new requests and cancel the others; the loop thread to join: the last one started, even one that
        has already given up its work (it may still be freeing its step's tensors, which must not happen during the
        interpreter's exit: _close_at_exit)."""
        with self._cv:
            self._closed = True
            for r in self._waiting + self._rows:
                r.cancelled = True
            self._cv.notify()
            return self._last_thread

    def stats(self) -> SchedulerStats:
        with self._cv:
            counters = self.statistics.counters
            s = SchedulerStats(**{k: v for k, v in vars(counters).items()})
            s.k_histogram = dict(counters.k_histogram)
            s.tree_shapes = dict(counters.tree_shapes)
            s.by_drafter = {name: list(counts) for name, counts in counters.by_drafter.items()}
            s.running = len(self._rows)
            s.waiting = len(self._waiting)
            s.prefix_cache_bytes = self.prefix_cache.nbytes if self.prefix_cache else 0
        return s


# Every scheduler that started a loop thread. The loop thread is a daemon, so a program may end without closing its
# Generator; but a daemon thread still freeing tensors when the interpreter finalizes is stopped inside torch's C++
# code, which aborts the process ("terminate called without an active exception"): 2 of 24 exits of a script
# whose last lines are generate() calls (benchmarks/exit_check.py). So at exit each one is closed (its requests
# cancelled) and its thread joined.
_STARTED: weakref.WeakSet = weakref.WeakSet()

EXIT_JOIN_S = 30.0  # the longest the loop threads' steps in flight may keep the exit waiting


def _join(thread: threading.Thread | None, timeout: float | None):
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


@atexit.register
def _close_at_exit():
    # every scheduler's requests cancelled before any thread is joined: a loop thread may be waiting for engines
    # that another scheduler's loop holds (schedulers on the same engines take turns), which would otherwise run its
    # requests to their end first
    threads = [scheduler._stop() for scheduler in list(_STARTED)]
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in threads:
        _join(thread, max(0.0, deadline - time.monotonic()))
