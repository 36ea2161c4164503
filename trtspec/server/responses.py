"""OpenAI's response objects and stream events from the scheduler's results: whole responses, server-sent
events, log-probabilities in OpenAI's two shapes, usage, and trtspec's own speculation statistics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse

from ..runtime.request import RequestFailedError
from ..runtime.tokenizer import token_bytes
from .guard import ServerState
from .metrics import Metrics
from .protocol import APIError, failed

log = logging.getLogger("trtspec.server")


@dataclass
class Served:
    """What a response needs of its server."""

    scheduler: object
    model_name: str
    state: ServerState
    metrics: Metrics


async def respond(served: Served, request, kind, body, ids, params, handles, logged_prompt, echo=None):
    """The response of a queued request: a whole JSON object, or a stream of events (``body.stream``)."""
    scheduler, state, metrics, model_name = served.scheduler, served.state, served.metrics, served.model_name
    t0 = time.perf_counter()
    rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
    endpoint = "chat" if kind == "chat.completion" else "completions"
    state.active[rid] = handles

    def finished(status, results=()):  # counted and logged once, however the request ended
        if state.active.pop(rid, None) is None:
            return
        result = results[0] if results else None
        for r in results or (None,):
            metrics.request_done(endpoint, status, r)
        tokens = sum(len(r.token_ids) for r in results)
        log.info("%s %s status=%s prompt_tokens=%d completion_tokens=%d latency_ms=%.1f finish=%s%s", rid,
                 endpoint, status, len(ids), tokens, (time.perf_counter() - t0) * 1e3,
                 result.finish_reason if result is not None else "-",
                 f" prompt={json.dumps(logged_prompt)}" if logged_prompt is not None else "")

    try:
        for handle in handles:
            await handle.start()  # a remote scheduler routes the request here (and may refuse it)
    except (ValueError, TypeError) as exc:
        _cancel_all(handles)
        finished(400)
        raise APIError(400, str(exc)) from None
    except RequestFailedError as exc:
        _cancel_all(handles)
        error = failed(exc)
        finished(error.status)
        raise error from None
    except BaseException:
        _cancel_all(handles)
        finished(499)
        raise
    logprobs = LogprobsFormat(scheduler.tokenizer, kind, ids, echo) if params.get("logprobs") is not None else None
    created = int(time.time())

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def settle():  # a client that left before the first chunk: its request never started streaming
            if rid in state.active:
                _cancel_all(handles)
                finished(499)

        return _EventStream(stream(served, handles, rid, created, kind, include_usage, finished, logprobs, echo),
                            settle)
    consume = asyncio.ensure_future(asyncio.gather(*(_consume(h) for h in handles)))
    gone = False
    while not consume.done():  # a client that hangs up cancels its request
        await asyncio.wait({consume}, timeout=0.25)
        if not consume.done() and await request.is_disconnected():
            gone = True
            _cancel_all(handles)
    try:
        await consume
    except RequestFailedError as exc:
        _cancel_all(handles)
        error = failed(exc)
        finished(499 if gone else error.status)
        raise error from None
    results = [h.result for h in handles]
    if gone:  # nobody reads an answer: counted and logged as the client's leaving, never as a 200
        finished(499, results)
        return Response(status_code=499)
    finished(200, results)
    choices = []
    for i, result in enumerate(results):
        text = result.text if echo is None else echo + result.text
        lp = logprobs.whole(result) if logprobs is not None else None
        if kind == "chat.completion":
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": _finish(result), "logprobs": lp})
        else:
            choices.append({"index": i, "text": text, "finish_reason": _finish(result), "logprobs": lp})
    return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
            "usage": _usage(results), "trtspec": _speculation(results)}

async def stream(served: Served, handles, rid, created, kind, include_usage, finished, logprobs, echo):
    """The events of a streamed response, ``data: [DONE]`` last when it completed."""
    model_name = served.model_name
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"

    def chunk(index, delta=None, finish=None, lp=None, **extra):
        if kind == "chat.completion":
            choice = {"index": index, "delta": delta if delta is not None else {}, "finish_reason": finish,
                      "logprobs": lp}
        else:
            choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": lp}
        payload = {"id": rid, "object": chunk_kind, "created": created, "model": model_name, "choices": [choice],
                   **extra}
        return f"data: {json.dumps(payload)}\n\n"

    status = 499  # the client went away before the end
    results = []
    try:
        if kind == "chat.completion":
            for i in range(len(handles)):
                yield chunk(i, {"role": "assistant", "content": ""})
        echoed = set()  # choices whose text began with the prompt's (echo)
        async for i, delta in _merged(handles):
            if i is None:  # choice ``delta`` ended
                result = handles[delta].result
                results.append(result)
                if echo is not None and delta not in echoed:
                    yield chunk(delta, echo, lp=logprobs.whole(result) if logprobs is not None else None)
                yield chunk(delta, finish=_finish(result), trtspec=_speculation([result]))
                continue
            lp = logprobs.piece(i, delta, first=echo is not None and i not in echoed) if logprobs else None
            if echo is not None and i not in echoed:
                echoed.add(i)
                delta = echo + delta
            yield chunk(i, {"content": delta} if kind == "chat.completion" else delta, lp=lp)
        if include_usage:
            payload = {"id": rid, "object": chunk_kind, "created": created, "model": model_name, "choices": [],
                       "usage": _usage(results)}
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
        status = 200
    except RequestFailedError as exc:  # an error event, and no [DONE]: the client can tell it did not finish
        error = failed(exc)
        status = error.status
        yield f"data: {json.dumps(error.body)}\n\n"
    finally:
        if status != 200:  # failed, or the client went away: the other choices stop too
            _cancel_all(handles)
        finished(status, results)


class _EventStream(StreamingResponse):
    """Server-sent events that always settle their request: ``settle()`` runs once the response is over, however
    it ended. (A client that leaves before the first chunk cancels the response before its generator starts, and
    an unstarted generator's own cleanup never runs: its request would go on, uncounted.)"""

    def __init__(self, events, settle):
        super().__init__(events, media_type="text/event-stream")
        self._settle = settle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._settle()


def _cancel_all(handles):
    for handle in handles:
        handle.cancel()


async def _consume(handle):
    async for _ in handle:
        pass


async def _merged(handles):
    """(choice index, text delta) from several handles as they come, and (None, index) when choice index ends."""
    if len(handles) == 1:
        async for delta in handles[0]:
            yield 0, delta
        yield None, 0
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, handle):
        try:
            async for delta in handle:
                await queue.put((i, delta))
            await queue.put((None, i))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((exc, i))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        ended = 0
        while ended < len(handles):
            i, value = await queue.get()
            if isinstance(i, BaseException):
                raise i
            if i is None:
                ended += 1
            yield i, value
    finally:
        for t in tasks:
            t.cancel()


class LogprobsFormat:
    """Log-probability entries (runtime: (token id, logprob, [(id, logprob), ...])) in OpenAI's two shapes:
    completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and chat's {"content": [...]}."""

    def __init__(self, tokenizer, kind, prompt_ids, echo):
        self.tokenizer = tokenizer
        self.chat = kind == "chat.completion"
        self.prompt_ids = prompt_ids
        self.echo = echo
        self._strings: dict[int, str] = {}
        self._bytes = token_bytes(tokenizer)
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token (streaming)

    def _text(self, token: int) -> str:
        s = self._strings.get(token)
        if s is None:
            s = self._strings[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return s

    def _label(self, token: int) -> str:
        """A token as logprobs name it: its text, or "bytes:\\xe2\\x80" for part of a UTF-8 character (as OpenAI's
        API writes those; distinct tokens keep distinct names)."""
        text = self._text(token)
        if "\ufffd" in text:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self._bytes(token))
        return text

    def _chat(self, entries) -> dict:
        def item(token, logprob):
            return {"token": self._label(token), "logprob": logprob, "bytes": list(self._bytes(token))}

        return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries],
                "refusal": None}

    def _completion(self, entries, offset: int) -> tuple[dict, int]:
        """Completions' shape, text offsets from ``offset``; and the offset after the last token."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, entry in enumerate(entries):
            if entry is None:  # the prompt's first token
                token, lp, top = int(self.prompt_ids[0]), None, None
            else:
                token, lp, top = entry
                top = {self._label(a): b for a, b in top}
            out["tokens"].append(self._label(token))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(self._text(token))
        return out, offset

    def whole(self, result) -> dict:
        if self.chat:
            return self._chat(result.logprobs or [])
        entries = list(result.logprobs or [])
        if self.echo is not None:
            entries = list(result.prompt_logprobs or []) + entries
        return self._completion(entries, 0)[0]

    def piece(self, index: int, delta, first: bool = False) -> dict:
        """A streamed delta's entries; the ``first`` piece of an echoed choice has the prompt's in front."""
        entries = list(getattr(delta, "logprobs", ()))
        if self.chat:
            return self._chat(entries)
        if first:
            entries = list(getattr(delta, "prompt_logprobs", None) or []) + entries
        offset = self._offsets.get(index, 0 if first or self.echo is None else len(self.echo))
        lp, self._offsets[index] = self._completion(entries, offset)
        return lp

def _finish(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _usage(results) -> dict:
    prompt = results[0].stats.prompt_tokens if results else 0
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _speculation(results) -> dict:
    """trtspec's own statistics of a response: its choice's, or per choice with n > 1."""
    if len(results) != 1:
        return {"choices": [_speculation([r]) for r in results]}
    result = results[0]
    s = result.stats
    return {"forced_tokens": s.forced_tokens, "acceptance_rate": s.acceptance_rate, "accepted": s.accepted, "proposed": s.proposed,
            "mean_tokens_per_target_call": s.mean_tokens_per_target_call, "target_calls": s.target_calls,
            "prefix_tokens_reused": s.prefix_tokens_reused, "queue_s": s.queue_s,
            "time_to_first_token_s": s.time_to_first_token_s,
            **({"replica": result.replica} if getattr(result, "replica", None) else {})}
