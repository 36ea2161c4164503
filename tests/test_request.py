"""A request's checks (runtime/request.py, RequestBuilder: the one validation source): invalid sampling parameters
are refused with the user's error."""

from __future__ import annotations

import pytest

from trtspec import Generator, load_engine

PROMPTS = ["def add(a, b):"]
ARCH = "llama-gqa-rope3"


@pytest.fixture(scope="module")
def target(exported):
    return load_engine(exported(ARCH))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p must be in \\(0, 1\\]"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be an integer >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"stop": [""]}, "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_parameters_are_refused(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Generator(target).generate(PROMPTS[0], **kwargs)
