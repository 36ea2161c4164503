"""Structured output: a grammar masks every token a request draws — the target's and the draft's alike.

A request's ``response_format`` (OpenAI's: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
{"schema": ...}}``; trtspec's extensions ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar",
"grammar": LARK}``) becomes an llguidance matcher. Why llguidance (benchmarks/results/grammar.md): its mask costs
~9 us a token here (xgrammar ~1 us; both well under 1 % of a decode step), it compiles a schema in under 1 ms,
and it gives what speculation needs directly: the tokens the grammar forces next (taken without asking the draft,
"jump-forward"), how many of a proposal's tokens are allowed (prompt-lookup drafts are cut there), and rollback of
drafted tokens — with numpy masks, no torch.

JSON is generated compact with ``json.dumps``' separators (", " and ": ") and no free whitespace between tokens
(a schema's own ``"x-guidance"`` options override that), so a model cannot spend its tokens on whitespace.
"""

from __future__ import annotations

import json
import threading

import numpy as np

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def grammar_of(response_format) -> str | None:
    """llguidance's grammar for an OpenAI ``response_format`` (None for plain text); ValueError saying what is wrong."""
    import llguidance

    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError('response_format must be an object with a "type": one of ' + ", ".join(FORMATS))
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {})
        if schema is True or schema == {}:
            schema = {}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"response_format json_schema: {exc}") from None
    if kind == "regex":
        if not isinstance(response_format.get("regex"), str):
            raise ValueError('response_format regex needs "regex": a regular expression string')
        return llguidance.LLMatcher.grammar_from_regex(response_format["regex"])
    if kind == "grammar":
        if not isinstance(response_format.get("grammar"), str):
            raise ValueError('response_format grammar needs "grammar": a Lark grammar string')
        return llguidance.LLMatcher.grammar_from_lark(response_format["grammar"])
    raise ValueError(f"unknown response_format type {kind!r}; choose one of {', '.join(FORMATS)}")


class GrammarCompiler:
    """Makes one Constraint per request for one tokenizer (the llguidance tokenizer is built once, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_ids)
            return self._lltok

    def constraint(self, response_format) -> Constraint | None:
        """A fresh Constraint for ``response_format`` (None: unconstrained); ValueError naming the problem, also
        for a grammar that compiles but fails or dead-ends at its first tokens (Constraint.probe)."""
        import llguidance

        grammar = grammar_of(response_format)
        if grammar is None:
            return None
        lltok = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"response_format ({response_format['type']}) cannot be used: {error}")
        matcher = llguidance.LLMatcher(lltok, grammar)
        if matcher.is_error():
            raise ValueError(f"response_format ({response_format['type']}) cannot be used: {matcher.get_error()}")
        constraint = Constraint(matcher, self.vocab_size, self.eos_ids)
        problem = constraint.probe()
        if problem is not None:
            raise ValueError(f"response_format ({response_format['type']}) cannot be used: {problem}")
        return constraint


def _reason(detail: str) -> str:
    # llguidance follows its reason with a dump of its parser state: the first line says what went wrong
    lines = str(detail).strip().splitlines()
    return lines[0] if lines else "no reason given"


class Constraint:
    """One request's grammar state: the tokens consumed so far (its output, then a round's drafts on top).

    A round asks for the mask of the same state twice, when the draft proposes a position and when the target's
    verdict reaches it: ``mask(x, key)`` keeps each state's bitmask under ``key`` (the round's tokens since the
    last ``forget``), so the second asking costs only the application.

    ``allows(token, key)`` answers for one token, without the mask where no bytes are forced next (~1 us against
    ~20-50 us for a fresh mask and ~6 us to apply it): a greedy or Gumbel-max choice that the grammar allows is
    the choice under the mask too, so most positions of a constrained request never compute one (RowSampler's
    lazy masking).

    Nothing here raises: a grammar that fails while decoding (llguidance refuses a token its own mask allowed,
    e.g. at one of its limits) or reaches a dead end (nothing but EOS allowed before the document is complete)
    keeps the reason in ``error`` and from then on allows only EOS. The scheduler reads ``error`` after each
    step and fails that request alone (a 400: the grammar cannot be honoured); the other rows never notice.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids=()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(int(t) for t in eos_ids)
        self._words = (vocab_size + 31) // 32
        self._masks: dict = {}
        self.error: str | None = None
        eos_only = np.zeros(self._words, np.uint32)
        for t in self._eos:
            if t < vocab_size:
                eos_only[t >> 5] |= np.uint32(1 << (t & 31))
        self._eos_only = eos_only.view(np.int32)  # the mask of a grammar that failed: only EOS may come

    def _fail(self, what: str, detail=None) -> None:
        if self.error is None:
            detail = str(detail) if detail is not None else self.matcher.get_error()
            self.error = f"{what}: {_reason(detail)}"

    def _raw_mask(self) -> tuple[np.ndarray, str | None]:
        """llguidance's bitmask of the next tokens, and its error if it failed (its mask then allows EOS alone)."""
        bits = np.empty(self._words, np.int32)
        try:
            self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        except Exception as exc:  # noqa: BLE001 - the grammar's failure, handed to the caller
            return self._eos_only, str(exc)
        return bits, self.matcher.get_error() if self.matcher.is_error() else None

    def _dead_end(self, bits) -> bool:
        # llguidance's mask allows EOS alone where nothing can follow, complete document or not
        return np.array_equal(bits, self._eos_only) and not self.matcher.is_accepting()

    def _bitmask(self) -> np.ndarray:
        if self.error is not None:
            return self._eos_only
        bits, error = self._raw_mask()
        if self._dead_end(bits):
            self.error = "the grammar reached a dead end: nothing may follow the text so far, yet it is not complete"
        elif error is not None:
            self._fail("the grammar failed computing its next tokens", error)
        return bits

    def probe(self) -> str | None:
        """What makes this grammar unusable from its start, or None: it allows no first token, only EOS before any
        document (a $ref cycle that never reaches a value), or it fails consuming the tokens it forces first (one
        of llguidance's limits, e.g. an object that must nest forever, a regex of a million repeats). Checked when
        the request is made, so such a request gets its 400 before it is queued. Leaves the state at the start."""
        bits, error = self._raw_mask()
        if not bits.any():
            return "it allows no token at all"
        if self._dead_end(bits):
            return "it allows no document to be generated (e.g. a $ref cycle that never reaches a value)"
        if error is not None:
            return f"the grammar failed computing its first tokens: {_reason(error)}"
        consumed = 0
        for token in self.forced():
            self.consume(token)
            if self.error is not None:
                return self.error
            consumed += 1
        self.rollback(consumed)
        self.forget()
        return self.error

    def mask(self, x: np.ndarray, key=None) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf (x [V] float32, in place)."""
        bits = self._masks.get(key) if key is not None else None
        if bits is None:
            bits = self._bitmask()
            if key is not None:
                self._masks[key] = bits
        allowed = np.unpackbits(bits.view(np.uint8), count=x.size, bitorder="little")
        x[allowed == 0] = -np.inf

    def allows(self, token: int, key=None) -> bool:
        """Whether the grammar allows ``token`` next, exactly as ``mask`` would leave it: from the kept mask if
        any; else, where the grammar forces bytes next, from the mask (computed and kept under ``key``: there the
        mask allows only the forced bytes' canonical tokens, while llguidance's validate_tokens also takes other
        tokens spelling a prefix of them, e.g. '"' where '":' is one token); else from validate_tokens (EOS:
        whether the grammar may end here, which validate_tokens does not answer)."""
        if self.error is not None:
            return token in self._eos
        bits = self._masks.get(key) if key is not None else None
        if bits is None:
            try:
                ff = self.matcher.compute_ff_bytes()
                if not ff:
                    if token in self._eos:
                        return self.matcher.is_accepting()
                    return self.matcher.validate_tokens([int(token)]) == 1
            except Exception as exc:  # noqa: BLE001 - the grammar's failure, kept for the scheduler
                self._fail("the grammar failed checking a token", exc)
                return token in self._eos
            bits = self._bitmask()
            if key is not None:
                self._masks[key] = bits
        return bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def forget(self) -> None:
        """The committed state moved on: the kept masks belong to states gone."""
        self._masks.clear()

    def consume(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed). A refusal means the grammar itself failed: kept in
        ``error`` (the matcher cannot go on from there)."""
        if self.error is not None:
            return
        try:
            ok = self.matcher.consume_token(int(token))
        except Exception as exc:  # noqa: BLE001 - the grammar's failure, kept for the scheduler
            return self._fail(f"the grammar failed at token {int(token)}", exc)
        if not ok:
            self._fail(f"the grammar failed at token {int(token)}")

    def rollback(self, n: int) -> None:
        if n and self.error is None:
            try:
                self.matcher.rollback(n)
            except Exception as exc:  # noqa: BLE001 - the grammar's failure, kept for the scheduler
                self._fail("the grammar failed rolling back drafted tokens", exc)

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (jump-forward)."""
        if self.error is not None or self.matcher.is_stopped():
            return []
        try:
            return list(self.matcher.compute_ff_tokens())
        except Exception as exc:  # noqa: BLE001 - the grammar's failure, kept for the scheduler
            self._fail("the grammar failed computing its forced tokens", exc)
            return []

    def allowed_prefix(self, tokens) -> int:
        """How many leading ``tokens`` the grammar allows from here."""
        if self.error is not None or not len(tokens):
            return 0
        try:
            return int(self.matcher.validate_tokens([int(t) for t in tokens]))
        except Exception as exc:  # noqa: BLE001 - the grammar's failure, kept for the scheduler
            self._fail("the grammar failed checking drafted tokens", exc)
            return 0

    @property
    def accepting(self) -> bool:
        """The text so far is a complete document (EOS may end it here)."""
        return self.error is None and self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but EOS may follow."""
        return self.error is not None or self.matcher.is_stopped()
