"""The OpenAI-compatible HTTP front: a thin FastAPI app over a Scheduler (runtime/scheduler.py).

``create_app`` (the factory that ``trtspec serve``, the tests and any other ASGI server, Ray Serve, use) holds
the routes; they hold no generation logic. A request passes the guard (guard.py: key, drain, body and queue
limits), becomes scheduler parameters (params.py: every check that depends on this server), and its results
become OpenAI's objects and stream events (responses.py).

Hostile clients (issue 43): every route but /health (and /metrics with ``metrics_public``) needs the API key
when one is set; a body is read at most ``max_body_bytes`` (413 beyond); tokenizing, rendering a chat template
and compiling a grammar run in worker threads, after a length check (runtime/prompts.py), so the event loop
keeps answering; at most ``max_queue`` requests wait beyond the free rows (429); a request that fails alone
(its grammar, say) gets its own status while the others run on; a client that leaves is a 499.

A stream ends with ``data: [DONE]`` exactly when it completed. One that fails, or that a drain stops at its
timeout, ends with an error event (``data: {"error": {...}}``, OpenAI's schema) and closes without
``[DONE]``; the official client raises ``openai.APIError`` on it.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.prompts import PromptEncoder
from .guard import MAX_BODY_BYTES, MAX_QUEUE, Guard, ServerState, ShuttingDownError, bearer_tokens, log
from .metrics import Metrics
from .params import chat_ids, completion_ids, completion_prompt, params_of, submit
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .responses import Served, respond

__all__ = ["MAX_BODY_BYTES", "MAX_QUEUE", "ShuttingDownError", "create_app"]


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
    bearers = bearer_tokens(api_key)
    state = ServerState()
    metrics = Metrics(getattr(scheduler, "stats", None))
    served = Served(scheduler, model_name, state, metrics)

    app = FastAPI(title="trtspec", lifespan=_lifespan(scheduler, state, model_name, parse_special_tokens, warmup))
    app.state.trtspec = state
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    _error_handlers(app)
    app.add_middleware(Guard, state=state, bearers=bearers, metrics_public=metrics_public,
                       max_body_bytes=max_body_bytes)

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = completion_prompt(body)
        with state.arriving(scheduler, max_queue):
            ids = await asyncio.to_thread(completion_ids, scheduler, state.prompts, prompt)
            params = params_of(body, body.max_tokens, ids, scheduler=scheduler, model_name=model_name)
            handles = await submit(scheduler, ids, params, body.n or 1)
        echo = None
        if body.echo:  # the prompt's text leads each choice's text (and its tokens the logprobs)
            echo = prompt if isinstance(prompt, str) else scheduler.tokenizer.decode(ids, skip_special_tokens=True)
        return await respond(served, request, "text_completion", body, ids, params, handles,
                             prompt if log_prompts else None, echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if not getattr(scheduler.tokenizer, "chat_template", None):
            raise APIError(400, f"model {model_name!r} has no chat template; use /v1/completions with a plain prompt",
                           param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        with state.arriving(scheduler, max_queue):
            ids = await asyncio.to_thread(chat_ids, scheduler, state.prompts, messages)
            params = params_of(body, body.max_completion_tokens or body.max_tokens, ids, scheduler=scheduler,
                               model_name=model_name)
            handles = await submit(scheduler, ids, params, body.n or 1)
        return await respond(served, request, "chat.completion", body, ids, params, handles,
                             messages if log_prompts else None)

    return app


def _lifespan(scheduler, state: ServerState, model_name: str, parse_special_tokens: bool, warmup: bool):
    """The app's start (connect a remote scheduler, the prompt encoder, a warm-up, then ready) and end (not ready,
    the scheduler closed)."""

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

    return lifespan


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's schema: ours (APIError), starlette's (404, 405, unparsable bodies), pydantic's."""

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
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
