"""The target's tokenizer: loading it from an engine artifact, and turning a prompt into checked token ids.

One module that the scheduler, the vocabulary check and the servers import (none of them owns it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CapacityError


def load_tokenizer(engine):
    """The tokenizer an engine (or export) artifact ships, as its manifest names it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(engine.path) / engine.manifest["tokenizer"])


def is_token_ids(prompt) -> bool:
    """Whether ``prompt`` is a prompt's token ids: a list or tuple of ints (bools are not), or a 1-D integer array."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1 and (prompt.size == 0 or np.issubdtype(prompt.dtype, np.integer))
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
    )


def encode_prompt(tokenizer, prompt, *, vocab_size: int, bos_id: int | None, capacity: int) -> np.ndarray:
    """Token ids of a prompt (a string, or a list of token ids), checked against an engine's capacity."""
    # -> ids [P] int64, 1 <= P < capacity
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif is_token_ids(prompt):
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    else:
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        if bos_id is None:
            raise ValueError("empty prompt and the tokenizer has no BOS token to start from")
        ids = [bos_id]
    if len(ids) >= capacity:
        raise CapacityError(
            f"prompt has {len(ids)} tokens but the engine holds {capacity} positions (prompt and "
            f"output together); shorten the prompt or re-export with --max-seq-len {2 * len(ids)}"
        )
    return np.asarray(ids, dtype=np.int64)


def token_bytes(tokenizer):
    """A function: token id -> the token's own bytes (what OpenAI's logprobs call ``bytes``). Byte-level BPE
    tokens map back through GPT-2's byte alphabet and byte-fallback tokens ("<0x0A>") are their byte, so a token
    that holds part of a UTF-8 character gives exactly that part; other tokens give their decoded text's UTF-8."""
    import re

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    if byte_level:  # GPT-2's bytes_to_unicode, inverted
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars, extra = {}, 0
        for b in range(256):
            if b in printable:
                chars[chr(b)] = b
            else:
                chars[chr(256 + extra)] = b
                extra += 1
    fallback = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def of(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(int(token))
        if piece is not None and byte_level and all(c in chars for c in piece):
            return bytes(chars[c] for c in piece)
        if piece is not None and (m := fallback.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        return tokenizer.decode([int(token)], skip_special_tokens=False).encode("utf-8")

    return of
