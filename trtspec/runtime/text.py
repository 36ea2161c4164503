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
        self.pieces: list[str] = []  # joined once at the end: no per-round copy of the whole text
        self.tail = ""  # the last len(longest stop) - 1 characters, where a stop string may begin
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _decode(self, ids) -> str:
        # a fast tokenizer's own decoder directly: the transformers wrapper costs more than the decode itself
        # for a few tokens, every round (same text: the wrapper only adds optional space clean-up, off here)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids.tolist(), skip_special_tokens=True)
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
        self.pieces.append(delta)
        return delta

    def cut_at_stop(self, delta: str) -> str | None:
        """If the last delta completed a stop string (possibly begun in earlier text), drop what follows
        the stop string and return the part of delta that remains; else None."""
        if not self.stop or not delta:
            return None
        window = self.tail + delta
        end = min((i + len(s) for s in self.stop if (i := window.find(s)) >= 0), default=None)
        self.tail = window[len(window) - self.longest_stop + 1 :] if self.longest_stop > 1 else ""
        if end is None:
            return None
        kept = delta[: end - (len(window) - len(delta))]
        self.pieces[-1] = kept
        return kept
