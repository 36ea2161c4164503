"""The OpenAI-compatible HTTP front: a thin FastAPI app over a Scheduler (runtime/scheduler.py).

Handlers translate a request into scheduler parameters and scheduler output into OpenAI's objects and stream
chunks; they hold no generation logic. ``create_app`` is the factory that ``trtspec serve``, the tests and any
other ASGI server (Ray Serve) use.

Hostile clients (issue 43): every route but /health (and /metrics with ``metrics_public``) needs the API key
when one is set; a body is read at most ``max_body_bytes`` (413 beyond); tokenizing, rendering a chat template
and compiling a grammar run in worker threads, after a length check (server/prompts.py), so the event loop
keeps answering; at most ``max_queue`` requests wait beyond the free rows (429); a request that fails alone
(its grammar, say) gets its own status while the others run on; a client that leaves is a 499.

A stream ends with ``data: [DONE]`` exactly when it completed. One that fails, or that a drain stops at its
timeout, ends with an error event (``data: {"error": {...}}``, OpenAI's schema) and closes without
``[DONE]``; the official client raises ``openai.APIError`` on it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import CapacityError
from ..runtime.request import RequestFailedError
from ..runtime.tokenizer import token_bytes
from .metrics import Metrics
from .prompts import PromptEncoder
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    failed,
    queue_full,
    response_format_of,
    too_large,
    unauthorized,
    unavailable,
    unsupported,
)

log = logging.getLogger("trtspec.server")

MAX_QUEUE = 256  # requests waiting beyond the free rows before new ones get 429 (trtspec serve --max-queue)
MAX_BODY_BYTES = 4 << 20  # the largest request body read (trtspec serve --max-body-bytes): 413 beyond
# an oversized body is read this far more, and dropped, before the 413 goes out: an HTTP client reads the answer
# only once it has sent its body, and would see a reset connection instead
_DISCARD_BYTES = 64 << 20


class ShuttingDownError(RequestFailedError):
    """The server stopped this request before it finished (a drain that timed out): a 503, retry elsewhere."""

    status = 503


class _State:
    """What the app knows beside the scheduler: loading/draining, and the requests in flight (for the drain)."""

    def __init__(self):
        self.ready = False
        self.draining = False
        self.arriving = 0  # requests tokenized and validated right now: counted as waiting (max_queue)
        self.prompts: PromptEncoder | None = None  # made at startup: a remote scheduler's tokenizer comes with connect
        self.active: dict[str, list] = {}  # response id -> its handles, while it runs

    async def drain(self, timeout: float) -> None:
        """Refuse new generations (503 with Retry-After; the listener stays open) and give those in flight up to
        ``timeout`` seconds; then end the rest: a stream gets an error event and closes without ``[DONE]``, a
        client waiting for a whole response gets a 503. Returns once nothing is in flight (run.serve then stops)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.active:
            return
        log.warning("drain: %d requests still running after %.1f s; ending them", len(self.active), timeout)
        error = ShuttingDownError("the server is shutting down and stopped this request before it finished; retry it")
        for handles in list(self.active.values()):
            for handle in handles:
                handle.fail(error)
        deadline = loop.time() + 5.0  # their responses go out (error events, 503s) before the server stops
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)


def create_app(scheduler, *, model_name: str, api_key: str | list[str] | None = None, max_queue: int = MAX_QUEUE,
               max_body_bytes: int = MAX_BODY_BYTES, metrics_public: bool = False, parse_special_tokens: bool = False,
               log_prompts: bool = False, warmup: bool = True) -> FastAPI:
    """An ASGI app serving ``scheduler`` as OpenAI's /v1/completions and /v1/chat/completions.

    ``scheduler``: a runtime Scheduler, or anything with its front (``encode``, ``asubmit``, ``backlog``,
    ``capacity``, ``tokenizer``...), e.g. ray_app.RemoteScheduler, whose engines live in other processes; an async
    ``connect()`` on it is awaited at startup.

    ``api_key``: a key, or several (any one is accepted), required as a bearer token on every route but /health
    (and /metrics when ``metrics_public``). ``max_queue``: requests waiting beyond the free rows before new ones
    get 429. ``max_body_bytes``: 413 beyond. ``parse_special_tokens``: completions prompts may spell special
    tokens (chat content never does). ``app.state.trtspec.drain(timeout)`` drains (run.serve on SIGTERM).
    """
    for name, value in (("max_queue", max_queue), ("max_body_bytes", max_body_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not isinstance(k, str) or not k.strip() for k in keys):
        raise ValueError("an API key must be a non-empty string")
    bearers = [f"Bearer {k}".encode() for k in keys]
    state = _State()
    metrics = Metrics(getattr(scheduler, "stats", None))

    @asynccontextmanager
    async def lifespan(app):
        connect = getattr(scheduler, "connect", None)
        if connect is not None:
            await connect()
        state.prompts = await asyncio.to_thread(PromptEncoder, scheduler.tokenizer, scheduler.capacity,
                                                parse_special_tokens)
        if warmup:  # the widest call, then one short generation: first-call costs paid before /health says ok
            if hasattr(scheduler, "warm_up"):
                await asyncio.to_thread(scheduler.warm_up)
            bos = scheduler.bos_id if scheduler.bos_id is not None else 0
            await scheduler.agenerate([bos], max_new_tokens=2)
        state.ready = True
        log.info("serving %s: max batch %d, capacity %d tokens, drafter %s", model_name, scheduler.max_batch,
                 scheduler.capacity, scheduler.drafter_name)
        yield
        state.ready = False
        await asyncio.to_thread(scheduler.close, 10.0)

    app = FastAPI(title="trtspec", lifespan=lifespan)
    app.state.trtspec = state
    app.state.scheduler = scheduler
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):  # 404, 405, unparsable bodies: OpenAI's schema too
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        problems = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":
                return JSONResponse(APIError(400, "the request body is not valid JSON").body, status_code=400)
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "extra_forbidden":
                problems.append(f"unrecognized request argument: {where}")
            else:
                problems.append(f"{where or 'body'}: {e.get('msg')}")
        return JSONResponse(APIError(400, "; ".join(problems) or "invalid request").body, status_code=400)

    def refusal(scope) -> APIError | None:
        """401 without the API key (on every route but /health, and /metrics when public), 503 for a generation
        while loading or draining; None lets the request in."""
        path = scope["path"]
        if bearers and path != "/health" and not (metrics_public and path == "/metrics"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not any([hmac.compare_digest(given, b) for b in bearers]):  # (constant time, every key compared)
                return unauthorized()
        if path.startswith("/v1/") and scope["method"] == "POST" and (state.draining or not state.ready):
            return unavailable("the server is shutting down" if state.draining else
                               "the server is still loading its engines")
        return None

    class Guard:
        """The refusals above, and the body limit, as a plain ASGI middleware: a stream's chunks pass straight
        through (starlette's ``@app.middleware("http")`` relays every chunk through a task and a memory stream of
        its own)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            error = refusal(scope)
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                receive, error = await _bounded_body(scope, receive, max_body_bytes)
                if receive is None:  # the client left while sending it
                    return
            if error is not None:
                return await JSONResponse(error.body, status_code=error.status, headers=error.headers)(scope, receive,
                                                                                                         send)
            await self.app(scope, receive, send)

    app.add_middleware(Guard)

    @app.get("/health")
    async def health():
        if state.ready and not state.draining:
            return {"status": "ok"}
        return JSONResponse({"status": "draining" if state.draining else "loading"}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "trtspec",
                                            "max_model_len": scheduler.capacity}]}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def params_of(body, max_tokens, prompt_ids):
        if body.model != model_name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        unsupported(body)
        temperature = 1.0 if body.temperature is None else body.temperature
        sampled = temperature > 0
        room = scheduler.capacity - len(prompt_ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        elif max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} with a {len(prompt_ids)}-token prompt exceeds this model's "
                           f"{scheduler.capacity}-token context; ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        params = dict(max_new_tokens=max_tokens, temperature=temperature, seed=body.seed, stop=body.stop,
                      include_stop_str_in_output=body.include_stop_str_in_output, priority=body.priority,
                      num_draft_tokens=body.num_draft_tokens,
                      top_p=body.top_p if sampled and body.top_p not in (None, 1, 1.0) else None,
                      top_k=body.top_k if sampled and body.top_k not in (None, 0) else None,
                      presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                      repetition_penalty=body.repetition_penalty or 1.0, logit_bias=body.logit_bias or None,
                      min_tokens=body.min_tokens, response_format=response_format_of(body))
        if isinstance(body, ChatCompletionRequest):
            params["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
        else:
            params["logprobs"] = body.logprobs
            if body.echo and body.logprobs is not None:
                params["prompt_logprobs"] = body.logprobs
        if isinstance(params["stop"], list) and len(params["stop"]) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
        return params

    def checked(ids, param) -> list[int]:
        """Prompt ids checked against the vocabulary and the context, or the 400 that says why not."""
        try:
            return scheduler.encode(ids).tolist()
        except CapacityError as exc:
            raise APIError(400, f"{exc} (this server's limit: {scheduler.capacity} tokens)", param=param,
                           code="context_length_exceeded") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=param) from None

    def completion_ids(prompt) -> list[int]:  # (in a worker thread)
        try:
            ids = state.prompts.completion(prompt)
        except CapacityError as exc:
            raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        return checked(ids, "prompt")

    def chat_ids(messages) -> list[int]:  # (in a worker thread)
        try:
            ids = state.prompts.chat(messages)
        except CapacityError as exc:
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages is the request's fault
            raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
        return checked(ids, "messages")

    @contextmanager
    def arriving():
        """A request on its way to the queue (being tokenized and validated): refused with 429 if it would wait
        beyond max_queue (those the free rows take next do not count), and counted as waiting until queued."""
        backlog = scheduler.backlog(state.arriving)
        if backlog >= max_queue:
            raise queue_full(backlog)
        state.arriving += 1
        try:
            yield
        finally:
            state.arriving -= 1

    async def submit(ids, params, n) -> list:
        try:
            return await scheduler.asubmit(ids, n, **params)
        except (ValueError, TypeError) as exc:
            param = "response_format" if "response_format" in str(exc) else None
            raise APIError(400, str(exc), param=param) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request; trtspec takes one (send one request each)",
                               param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        with arriving():
            ids = await asyncio.to_thread(completion_ids, prompt)
            params = params_of(body, body.max_tokens, ids)
            handles = await submit(ids, params, body.n or 1)
        echo = None
        if body.echo:  # the prompt's text leads each choice's text (and its tokens the logprobs)
            echo = prompt if isinstance(prompt, str) else scheduler.tokenizer.decode(ids, skip_special_tokens=True)
        return await respond(request, "text_completion", body, ids, params, handles,
                             prompt if log_prompts else None, echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if not getattr(scheduler.tokenizer, "chat_template", None):
            raise APIError(400, f"model {model_name!r} has no chat template; use /v1/completions with a plain prompt",
                           param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        with arriving():
            ids = await asyncio.to_thread(chat_ids, messages)
            params = params_of(body, body.max_completion_tokens or body.max_tokens, ids)
            handles = await submit(ids, params, body.n or 1)
        return await respond(request, "chat.completion", body, ids, params, handles,
                             messages if log_prompts else None)

    async def respond(request, kind, body, ids, params, handles, logged_prompt, echo=None):
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

            return _EventStream(stream(handles, rid, created, kind, include_usage, finished, logprobs, echo), settle)
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

    async def stream(handles, rid, created, kind, include_usage, finished, logprobs, echo):
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

    return app


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


async def _bounded_body(scope, receive, limit: int):
    """Read a request's body here, at most ``limit`` bytes of it kept: (a ``receive`` that hands it to the app,
    None), or (``receive``, the 413) for a larger one — read on up to _DISCARD_BYTES more and dropped, so its
    client gets to read the answer — or (None, None) when the client left while sending."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    if declared is not None:
        try:
            declared = int(declared)
        except ValueError:
            return receive, APIError(400, "the Content-Length header is not a number")
        if declared > limit + _DISCARD_BYTES:
            return receive, too_large(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, None
        body = message.get("body", b"")
        size += len(body)
        if size <= limit:
            chunks.append(body)
        else:
            chunks.clear()
            if size > limit + _DISCARD_BYTES:
                break
        if not message.get("more_body", False):
            break
    if size > limit:
        return receive, too_large(limit)
    body, handed = b"".join(chunks), False

    async def replay():
        nonlocal handed
        if not handed:
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, as the app listens for it

    return replay, None


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
