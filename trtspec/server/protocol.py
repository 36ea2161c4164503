"""OpenAI's wire protocol, the part trtspec serves: request bodies as pydantic models, errors in one place.

Fields a client may send but trtspec cannot honour are accepted only at their no-op values, and
refused with a 400 that names them otherwise (an OpenAI client sends many of them as null). The checks of a
body's own shape and of the ranges OpenAI documents are made here; those that depend on the server (its model's
name, context and vocabulary) in params.py; those that depend on the runtime (token ids, schemas, sampling) by
Scheduler.make_request, whose ValueError params.submit turns into a 400. Every error the server answers is an
APIError made here, most by the named constructors below.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown option is refused, as OpenAI does

    include_usage: bool = False


class _Sampling(BaseModel):
    # an unknown parameter is refused (400, named), as OpenAI's API does: a typo never passes silently
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range; its default is 1.0
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # 64 bits: no two seeds name one stream
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(default=None, ge=1, le=16)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    # extensions (vLLM's names)
    top_k: int | None = None
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int = Field(default=0, ge=0)
    guided_json: Union[dict, str, None] = None  # a JSON schema: as response_format json_schema
    guided_regex: str | None = None
    guided_grammar: str | None = None  # a Lark grammar (llguidance's syntax)
    # trtspec extensions
    priority: int = 0
    num_draft_tokens: int | None = Field(default=None, ge=0)
    include_stop_str_in_output: bool = False  # vLLM's name: keep the matched stop string at the end of the text


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the N most likely alternatives per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # default: up to the engine's capacity
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class APIError(Exception):
    """An error in OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}
        self.headers = headers or {}


RETRY_AFTER = {"Retry-After": "1"}


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", type="authentication_error",
                    code="invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def unavailable(why: str) -> APIError:
    return APIError(503, f"{why}; retry on another replica or later", type="service_unavailable",
                    headers=RETRY_AFTER)


def queue_full(waiting: int) -> APIError:
    return APIError(429, f"the queue is full ({waiting} requests waiting for a free row); retry shortly",
                    type="rate_limit_error", headers=RETRY_AFTER)


def failed(exc) -> APIError:
    """A request that failed after it was queued (runtime.request.RequestFailedError): its ``status`` says whose
    fault it was — 400 the request's (its grammar failed), 503 the server stopped it (a drain), 500 the server's."""
    status = getattr(exc, "status", 500)
    if status == 400:
        return APIError(400, str(exc), param="response_format" if "response_format" in str(exc) else None)
    if status == 503:
        return APIError(503, str(exc), type="service_unavailable", headers=RETRY_AFTER)
    return APIError(500, str(exc), type="server_error")


def unsupported(req: _Sampling) -> None:
    """Refuse what trtspec does not do, naming the parameter (400)."""
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1) and req.best_of != (req.n or 1):
            raise APIError(400, "best_of is not supported by trtspec (it returns every sample: use n)", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported by trtspec", param="suffix")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def response_format_of(req: _Sampling) -> dict | None:
    """The one structured-output format a request asks for (response_format or a guided_* extension)."""
    given = {name: getattr(req, name) for name in ("response_format", "guided_json", "guided_regex", "guided_grammar")
             if getattr(req, name) is not None}
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} both ask for structured output; send one", param=next(iter(given)))
    if not given:
        return None
    name, value = next(iter(given.items()))
    if name == "guided_json":
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, "guided_json is not a valid JSON schema string", param=name) from None
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": value}}
    if name == "guided_regex":
        return {"type": "regex", "regex": value}
    if name == "guided_grammar":
        return {"type": "grammar", "grammar": value}
    return value
