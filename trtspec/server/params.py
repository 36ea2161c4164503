"""A request's body -> the scheduler's parameters and prompt ids, or the 400 that says what was wrong.

One source of the checks: the body's shape and ranges are protocol.py's (pydantic), what depends on this server
(the model's name, its context, the vocabulary, a chat template) is here, and what depends on the runtime (a
grammar that cannot be honoured, sampling parameters) comes from Scheduler.make_request, turned into a 400 by
``submit``. Tokenizing and rendering a chat template run in a worker thread (``completion_ids``, ``chat_ids``).
"""

from __future__ import annotations

from ..errors import CapacityError
from .protocol import APIError, ChatCompletionRequest, response_format_of, unsupported


def params_of(body, max_tokens, prompt_ids, *, scheduler, model_name: str) -> dict:
    """The Scheduler.submit parameters of a completions or chat body whose prompt is ``prompt_ids``."""
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


def completion_prompt(body):
    """The one prompt of a completions body (a string or token ids; a list of one is taken, of more refused)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"{len(prompt)} prompts in one request; trtspec takes one (send one request each)",
                           param="prompt")
        prompt = prompt[0]
    if len(prompt) == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    return prompt


def _checked(scheduler, ids, param) -> list[int]:
    """Prompt ids checked against the vocabulary and the context, or the 400 that says why not."""
    try:
        return scheduler.encode(ids).tolist()
    except CapacityError as exc:
        raise APIError(400, f"{exc} (this server's limit: {scheduler.capacity} tokens)", param=param,
                       code="context_length_exceeded") from None
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param=param) from None


def completion_ids(scheduler, prompts, prompt) -> list[int]:
    """A completions prompt's ids (``prompts``: the server's PromptEncoder; in a worker thread)."""
    try:
        ids = prompts.completion(prompt)
    except CapacityError as exc:
        raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    return _checked(scheduler, ids, "prompt")


def chat_ids(scheduler, prompts, messages) -> list[int]:
    """A chat's ids through the model's chat template (in a worker thread)."""
    try:
        ids = prompts.chat(messages)
    except CapacityError as exc:
        raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages is the request's fault
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
    return _checked(scheduler, ids, "messages")


async def submit(scheduler, ids, params, n) -> list:
    """The request queued (n samples): its handles, or the 400 for what the runtime refused."""
    try:
        return await scheduler.asubmit(ids, n, **params)
    except (ValueError, TypeError) as exc:
        param = "response_format" if "response_format" in str(exc) else None
        raise APIError(400, str(exc), param=param) from None
