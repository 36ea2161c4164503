"""Where a request's output ends — the one stop rule — and its text, decoded incrementally.

Every token any path produces (the prompt's first token, plain decoding, a block of accepted drafts, the
lone-row loop, batched rounds) joins its request through ``RequestOutput.extend``, and nothing else decides
where a request ends. So every path — alone or batched, streamed or not, served over HTTP or Ray — returns
the same text for the same tokens.

The rule, token by token in order: the output ends
- at the first EOS id ("stop"; the EOS is not part of the output),
- at the token that completes a stop string in the *generated* text ("stop"; that token is part of the
  output; the text ends before the stop string, or after it with ``include_stop_str_in_output``),
- at ``limit`` tokens, the smaller of max_new_tokens and the room left in the engines ("length").
When several stop strings appear at that token, the text is cut at the earliest-starting one (the shortest
of those starting there). Tokens after the end are neither returned nor counted.
"""

from __future__ import annotations


class Piece(str):
    """A streamed text delta that carries the log-probability entries of the tokens it completes (logprobs)."""

    logprobs: list = []
    prompt_logprobs: list | None = None  # the first piece of a request with prompt_logprobs: the prompt's entries

    @classmethod
    def of(cls, text: str, logprobs: list, prompt_logprobs: list | None = None) -> Piece:
        piece = cls(text)
        piece.logprobs = logprobs
        piece.prompt_logprobs = prompt_logprobs
        return piece

    @staticmethod
    def join(pieces) -> str:
        """Several deltas as one (their entries concatenated, when they carry any)."""
        text = "".join(pieces)
        if not any(isinstance(p, Piece) for p in pieces):
            return text
        entries = [e for p in pieces for e in getattr(p, "logprobs", ())]
        return Piece.of(text, entries, next((p.prompt_logprobs for p in pieces if getattr(p, "prompt_logprobs", None)),
                                            None))


class RequestOutput:
    """One request's generated tokens and text; ``finish_reason`` is set once the output has ended."""

    def __init__(self, tokenizer, *, eos_ids, limit: int, stop: tuple[str, ...] = (), include_stop: bool = False,
                 streaming: bool = True):
        # a fast tokenizer's own decoder directly: the transformers wrapper costs more than the decode itself for
        # a few tokens, every round (same text: the wrapper only adds optional space clean-up, off here)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=True)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True,
                                                        clean_up_tokenization_spaces=False)
        self.eos_ids = eos_ids
        self.limit = limit
        self.stop = stop
        self.include_stop = include_stop
        self.streaming = streaming  # False: nobody reads deltas; decode only where stop strings need it
        self.token_ids: list[int] = []
        self.logprobs: list | None = None  # one entry per token when the request asked for logprobs
        self.prompt_logprobs: list | None = None  # the prompt's entries (prompt_logprobs), sent with the first piece
        self._lp_sent = 0
        self._pieces = 0
        self.finish_reason: str | None = None
        self._text = ""  # the text of token_ids[: _read]
        self._prefix = 0  # decoding window [_prefix, end): its first tokens only give the context of the rest
        self._read = 0
        self._searched = 0  # stop strings were looked for in _text[: _searched]
        self._overlap = max((len(s) for s in stop), default=1) - 1  # a stop string ending later starts no earlier
        self._cut: int | None = None  # where the text ends, once a stop string matched
        self._sent = 0  # characters handed out by delta()

    def extend(self, tokens) -> int:
        """Add accepted tokens in order until the output ends; returns how many joined it."""
        assert self.finish_reason is None, "the output has already ended"
        block = [int(t) for t in tokens[: self.limit - len(self.token_ids)]]
        eos = next((i for i, t in enumerate(block) if t in self.eos_ids), None)
        if eos is not None:
            block = block[:eos]
        start = len(self.token_ids)
        self.token_ids.extend(block)
        if self.stop:
            kept = self._stop_in(start)
            if kept is not None:
                del self.token_ids[start + kept :]
                self.finish_reason = "stop"
                return kept
        elif self.streaming:
            self._advance(len(self.token_ids))
        if eos is not None:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.limit:
            self.finish_reason = "length"
        return len(block)

    @property
    def text(self) -> str:
        """The text so far (all of it once the output has ended)."""
        if self._cut is not None:
            return self._text[: self._cut]
        self._advance(len(self.token_ids), final=self.finish_reason is not None)
        return self._text

    def delta(self) -> str:
        """Text not handed out yet that no stop string can take back: while the output runs, the longest end of
        the text that could still begin a stop string is held back (as llama.cpp's and vLLM's servers do)."""
        text = self.text
        end = len(text)
        if self.finish_reason is None and self.stop and not self.include_stop:
            end -= self._partial_stop(text)
        piece = text[self._sent : end]
        self._sent = max(self._sent, end)
        return piece

    def piece(self, text: str) -> str:
        """A delta for the stream: with logprobs, it carries the entries of the tokens not streamed before."""
        if self.logprobs is None:
            return text
        entries = self.logprobs[self._lp_sent :]
        self._lp_sent = len(self.logprobs)
        self._pieces += 1
        return Piece.of(text, entries, self.prompt_logprobs if self._pieces == 1 else None)

    @property
    def cut_by_stop_string(self) -> bool:
        """The output ended at a stop string (not at an EOS or the limit)."""
        return self._cut is not None

    def unsent_logprobs(self) -> bool:
        return self.logprobs is not None and self._lp_sent < len(self.logprobs)

    def finish(self, reason: str):
        """End the output from outside (cancelled): what was generated so far stays."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def _advance(self, end: int, final: bool = False):
        # decode a window: the tokens since the last decoded text, after the ones before them (so byte-level
        # merges and leading spaces come out right); a piece ending in U+FFFD (half a UTF-8 character) waits
        ids = self.token_ids
        prefix = self._decode(ids[self._prefix : self._read])
        full = self._decode(ids[self._prefix : end])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return
        self._text += full[len(prefix) :]
        self._prefix, self._read = self._read, end

    def _stop_in(self, start: int) -> int | None:
        """Tokens of token_ids[start:] up to the one that completes a stop string (the text cut there), or None."""
        end = len(self.token_ids)
        before = (self._text, self._prefix, self._read, self._searched)
        self._advance(end)
        cut = self._find_stop()
        if cut is None or end - start == 1:
            return None if cut is None else self._stopped_at(cut, end - start)
        # the block completes a stop string: find the token that does, one at a time
        after = (self._text, self._prefix, self._read, self._searched)
        self._text, self._prefix, self._read, self._searched = before
        for i in range(start + 1, end):
            self._advance(i)
            found = self._find_stop()
            if found is not None:
                return self._stopped_at(found, i - start)
        self._text, self._prefix, self._read, self._searched = after
        return self._stopped_at(cut, end - start)

    def _stopped_at(self, cut: int, kept: int) -> int:
        self._cut = cut
        return kept

    def _find_stop(self) -> int | None:
        # where the text ends if a stop string occurs in text not searched before (or across its border)
        text, lo = self._text, max(0, self._searched - self._overlap)
        self._searched = len(text)
        best = None
        for s in self.stop:
            i = text.find(s, lo)
            if i >= 0 and (best is None or (i, len(s)) < best):
                best = (i, len(s))
        if best is None:
            return None
        return best[0] + best[1] if self.include_stop else best[0]

    def _partial_stop(self, text: str) -> int:
        # the longest end of ``text`` that is the beginning of a stop string
        held = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:length]):
                    held = length
                    break
        return held
