"""The server's guard: the API key, the drain, the body limit and the queue limit, before a request reaches its
route; and what the app knows beside the scheduler (ServerState: loading, draining, the requests in flight)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import contextmanager

from fastapi.responses import JSONResponse

from ..runtime.prompts import PromptEncoder
from ..runtime.request import RequestFailedError
from .limits import MAX_BODY_BYTES, MAX_QUEUE
from .protocol import APIError, queue_full, too_large, unauthorized, unavailable

log = logging.getLogger("trtspec.server")

# an oversized body is read this far more, and dropped, before the 413 goes out: an HTTP client reads the answer
# only once it has sent its body, and would see a reset connection instead
_DISCARD_BYTES = 64 << 20


class ShuttingDownError(RequestFailedError):
    """The server stopped this request before it finished (a drain that timed out): a 503, retry elsewhere."""

    status = 503


class ServerState:
    """What the app knows beside the scheduler: loading/draining, and the requests in flight (for the drain)."""

    def __init__(self):
        self.ready = False
        self.draining = False
        self.arriving_now = 0  # requests tokenized and validated right now: counted as waiting (max_queue)
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

    @contextmanager
    def arriving(self, scheduler, max_queue: int):
        """A request on its way to the queue (being tokenized and validated): refused with 429 if it would wait
        beyond max_queue (those the free rows take next do not count), and counted as waiting until queued."""
        backlog = scheduler.backlog(self.arriving_now)
        if backlog >= max_queue:
            raise queue_full(backlog)
        self.arriving_now += 1
        try:
            yield
        finally:
            self.arriving_now -= 1


def bearer_tokens(api_key) -> list[bytes]:
    """``api_key`` (a key, several, or None) as the Authorization header values that are let in."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not isinstance(k, str) or not k.strip() for k in keys):
        raise ValueError("an API key must be a non-empty string")
    return [f"Bearer {k}".encode() for k in keys]


class Guard:
    """401 without the API key (on every route but /health, and /metrics when public), 503 for a generation while
    loading or draining, 413 for a body over ``max_body_bytes``, as a plain ASGI middleware: a stream's chunks pass
    straight through (starlette's ``@app.middleware("http")`` relays every chunk through a task and a memory stream
    of its own)."""

    def __init__(self, app, *, state: ServerState, bearers: list[bytes], metrics_public: bool, max_body_bytes: int):
        self.app, self.state, self.bearers = app, state, bearers
        self.metrics_public, self.max_body_bytes = metrics_public, max_body_bytes

    def refusal(self, scope) -> APIError | None:
        """Why a request may not come in, or None."""
        path, state = scope["path"], self.state
        if self.bearers and path != "/health" and not (self.metrics_public and path == "/metrics"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not any([hmac.compare_digest(given, b) for b in self.bearers]):  # (constant time, every key compared)
                return unauthorized()
        if path.startswith("/v1/") and scope["method"] == "POST" and (state.draining or not state.ready):
            return unavailable("the server is shutting down" if state.draining else
                               "the server is still loading its engines")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.refusal(scope)
        if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive, error = await _bounded_body(scope, receive, self.max_body_bytes)
            if receive is None:  # the client left while sending it
                return
        if error is not None:
            return await JSONResponse(error.body, status_code=error.status, headers=error.headers)(scope, receive,
                                                                                                     send)
        await self.app(scope, receive, send)


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
