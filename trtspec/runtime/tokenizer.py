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


def encode_prompt(tokenizer, prompt, *, vocab_size: int, bos_id: int | None, capacity: int) -> np.ndarray:
    """Token ids of a prompt (a string, or a list of token ids), checked against an engine's capacity."""
    # -> ids [P] int64, 1 <= P < capacity
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
    ):
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
