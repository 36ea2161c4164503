"""OpenAI's wire protocol, the part trtspec serves: request bodies as pydantic models, errors in one place.

Fields a client may send but trtspec cannot honour are accepted only at their no-op values, and
refused with a 400 that names them otherwise (an OpenAI client sends many of them as null).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    # an unknown parameter is refused (400, named), as OpenAI's API does: a typo never passes silently
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = None  # OpenAI's default is 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    logprobs: Union[bool, int, None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    # trtspec extensions
    top_k: int | None = None
    priority: int = 0
    num_draft_tokens: int | None = Field(default=None, ge=0)
    include_stop_str_in_output: bool = False  # vLLM's name: keep the matched stop string at the end of the text


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
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
    top_logprobs: int | None = None


class APIError(Exception):
    """An error in OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}
        self.headers = headers or {}


def unsupported(req: _Sampling) -> None:
    """Refuse what trtspec does not do, naming the parameter (400)."""
    if req.n not in (None, 1):
        raise APIError(400, f"n={req.n} is not supported: trtspec returns one choice per request; send n requests",
                       param="n")
    if req.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported by trtspec", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported by trtspec (it would change the target's distribution)",
                           param=name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by trtspec", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError(400, "echo is not supported by trtspec", param="echo")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported by trtspec", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported by trtspec", param="suffix")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs:
        raise APIError(400, "top_logprobs is not supported by trtspec", param="top_logprobs")
