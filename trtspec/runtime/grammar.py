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
        """A fresh Constraint for ``response_format`` (None: unconstrained); ValueError naming the problem."""
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
        return Constraint(matcher, self.vocab_size, self.eos_ids)


class Constraint:
    """One request's grammar state: the tokens consumed so far (its output, then a round's drafts on top).

    A round asks for the mask of the same state twice, when the draft proposes a position and when the target's
    verdict reaches it: ``mask(x, key)`` keeps each state's bitmask under ``key`` (the round's tokens since the
    last ``forget``), so the second asking costs only the application.

    ``allows(token, key)`` answers for one token, without the mask where no bytes are forced next (~1 us against
    ~20-50 us for a fresh mask and ~6 us to apply it): a greedy or Gumbel-max choice that the grammar allows is
    the choice under the mask too, so most positions of a constrained request never compute one (RowSampler's
    lazy masking).
    """

    def __init__(self, matcher, vocab_size: int, eos_ids=()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(int(t) for t in eos_ids)
        self._words = (vocab_size + 31) // 32
        self._masks: dict = {}

    def _bitmask(self) -> np.ndarray:
        bits = np.empty(self._words, np.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return bits

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
        bits = self._masks.get(key) if key is not None else None
        if bits is None:
            if not self.matcher.compute_ff_bytes():
                if token in self._eos:
                    return self.matcher.is_accepting()
                return self.matcher.validate_tokens([int(token)]) == 1
            bits = self._bitmask()
            if key is not None:
                self._masks[key] = bits
        return bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def forget(self) -> None:
        """The committed state moved on: the kept masks belong to states gone."""
        self._masks.clear()

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (jump-forward)."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    def allowed_prefix(self, tokens) -> int:
        """How many leading ``tokens`` the grammar allows from here."""
        return int(self.matcher.validate_tokens([int(t) for t in tokens])) if len(tokens) else 0

    @property
    def finished(self) -> bool:
        """Nothing but EOS may follow."""
        return self.matcher.is_stopped()
