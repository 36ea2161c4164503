"""The engine protocol the runtime drives, and the input checks every backend shares."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import CapacityError


class Engine(Protocol):
    """One model's step graph with its own fixed-capacity KV cache (DESIGN.md §3)."""

    path: Path
    manifest: dict  # the artifact's manifest; manifest["model"] describes the step graph
    max_seq_len: int
    max_batch: int
    vocab_size: int

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run T new tokens per row, writing their K/V into the cache; returns logits [B, T, V]."""

    def move_row(self, src: int, dst: int) -> None:
        """Copy cache row src into row dst (the runtime compacts its batch when a sequence finishes)."""

    def reset(self) -> None:
        """Zero the KV cache."""


def check_step_inputs(input_ids, position_ids, *, max_batch: int, max_seq_len: int, vocab_size: int):
    """Validate one step call before anything touches the cache; returns C-contiguous int64 arrays."""
    # input_ids [B, T] int, position_ids [B, T] int, consecutive per row
    input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    position_ids = np.ascontiguousarray(position_ids, dtype=np.int64)
    if input_ids.ndim != 2 or input_ids.shape != position_ids.shape or input_ids.size == 0:
        raise ValueError(
            f"input_ids and position_ids must both be non-empty [batch, tokens] arrays of the same shape, "
            f"got {input_ids.shape} and {position_ids.shape}"
        )
    b, t = input_ids.shape
    if b > max_batch:
        raise CapacityError(f"batch of {b} rows but the engine holds {max_batch}; rebuild with --max-batch {b}")
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {input_ids.min()}..{input_ids.max()}")
    start = position_ids[:, 0]
    if start.min() < 0:
        raise ValueError("position_ids must be non-negative")
    if t > 1 and np.any(position_ids != start[:, None] + np.arange(t)):
        raise ValueError("position_ids must be consecutive within each row (the new tokens fill consecutive cache slots)")
    end = int(start.max()) + t
    if end > max_seq_len:
        raise CapacityError(
            f"this call writes up to position {end - 1} but the engine's KV cache holds {max_seq_len} positions; "
            f"re-export with --max-seq-len {max(end, 2 * max_seq_len)}"
        )
    return input_ids, position_ids
