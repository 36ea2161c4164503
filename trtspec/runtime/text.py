"""Incremental detokenization and stop strings, without decoding the whole text each round."""

from __future__ import annotations

import numpy as np


class IncrementalText:
    """Text of one sequence's output, grown token block by token block.

    Only a short window is decoded per step: the tokens since the last emitted
    text plus the ones before them (so byte-level merges and leading spaces come
    out right). A delta ending in U+FFFD (half a UTF-8 character) waits for more.
    """

    def __init__(self, tokenizer, start: int, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.prefix_offset = start
        self.read_offset = start
        self.text = ""
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def advance(self, tokens: np.ndarray, end: int, final: bool = False) -> str:
        """Take tokens[: end] as the sequence so far; return the new text (may be empty).

        ``final``: the sequence ends here, so a trailing partial character is emitted as is.
        """
        # tokens [cap] int64
        prefix = self._decode(tokens[self.prefix_offset : self.read_offset])
        full = self._decode(tokens[self.prefix_offset : end])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.text += delta
        return delta

    def stop_hit(self, delta: str) -> int | None:
        """If a stop string is now complete, the text length just past it (it may straddle deltas)."""
        if not self.stop or not delta:
            return None
        window_start = max(0, len(self.text) - len(delta) - self.longest_stop + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i >= 0 and (best is None or i + len(s) < best):
                best = i + len(s)
        return best
