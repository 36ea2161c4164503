"""What `trtspec index` runs natively (csrc/text_index.cpp): a byte-level BPE tokenizer's encoding and the suffix
array's sort, each giving exactly what the pure path gives (the HF fast tokenizer's ids; datastore.suffix_array's
numpy order), several times faster.

    enc = byte_level_bpe(hf_tokenizer)     # None: not a tokenizer of that form, or no compiled kernels
    ids = enc.encode(texts)                # an int64 array a text: hf_tokenizer(text, add_special_tokens=False)

The native encoder reads GPT-2's pre-tokenizer pattern and the BPE merges. It knows no Unicode tables: each non-ASCII
character a text holds is classed first (letter, number, whitespace, other) by asking the HF tokenizer's own
pre-tokenizer how it splits a few probes around it. A text holding one of the tokenizer's added tokens (``<|im_end|>``
written out in a corpus), or a character no probe classes, is encoded by the HF tokenizer instead.
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import torch


log = logging.getLogger("trtspec.kernels")

_LETTER, _NUMBER, _SPACE, _OTHER = 1, 2, 3, 4
# a character c is of a class when the pre-tokenizer keeps c and its neighbours in one piece
_PROBES = ((_LETTER, "a", "a"), (_NUMBER, "1", "1"), (_OTHER, ".", "."), (_SPACE, "\t", "\t"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes for 256, 257, ..."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _supported(spec: dict) -> str | None:
    """Why the tokenizer.json ``spec`` is not of the form the native encoder runs, or None if it is."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return "its pre-tokenizer is not GPT-2's byte-level one"
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback") or model.get("ignore_merges"):
        return "its model is not plain BPE"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its BPE marks subwords"
    return None


class ByteLevelBPE:
    """The native encoder of one HF fast tokenizer (see the module's docstring)."""

    def __init__(self, tok, spec: dict):
        vocab = spec["model"]["vocab"]
        alphabet = _bytes_to_unicode()
        # (a byte without a token is dropped, as HF's BPE without an unknown token drops it)
        byte_ids = torch.tensor([vocab.get(alphabet[b], -1) for b in range(256)], dtype=torch.int64)
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in spec["model"]["merges"]]
        table = torch.tensor([(vocab[a], vocab[b], vocab[a + b]) for a, b in merges], dtype=torch.int64)
        self._native = torch.classes.trtspec.ByteLevelBPE(byte_ids, table.reshape(-1, 3))
        self._tok = tok
        self._pre = tok.backend_tokenizer.pre_tokenizer
        added = [t["content"] for t in spec.get("added_tokens", []) if t.get("content")]
        self._added = re.compile("|".join(map(re.escape, added))) if added else None  # (one pass over a text)
        self._classes: dict[str, int] = {}  # non-ASCII characters classed so far (0: no probe agrees)

    def _class(self, c: str) -> int:
        found = [cls for cls, left, right in _PROBES if len(self._pre.pre_tokenize_str(left + c + right)) == 1]
        return found[0] if len(found) == 1 else 0

    def _native_ok(self, text: str) -> bool:
        """Whether the native encoder gives ``text``'s ids (its non-ASCII characters classed on the way)."""
        if self._added is not None and self._added.search(text):
            return False
        if text.isascii():
            return True
        wide = {c for c in set(text) if ord(c) >= 128}
        new = wide - self._classes.keys()
        if new:
            classed = {c: self._class(c) for c in new}
            self._classes.update(classed)
            known = [(ord(c), k) for c, k in classed.items() if k]
            if known:
                self._native.set_classes(torch.tensor([c for c, _ in known]), torch.tensor([k for _, k in known]))
        return all(self._classes[c] for c in wide)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (int64), as the HF tokenizer gives them without special tokens."""
        native = [i for i, t in enumerate(texts) if self._native_ok(t)]
        out: list[np.ndarray | None] = [None] * len(texts)
        if native:
            data = [texts[i].encode("utf-8") for i in native]
            starts = np.zeros(len(data) + 1, np.int64)
            np.cumsum([len(d) for d in data], out=starts[1:])
            ids, counts = self._native.encode(torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
                                              if starts[-1] else torch.zeros(0, dtype=torch.uint8),
                                              torch.from_numpy(starts))
            parts = np.split(ids.numpy().astype(np.int64), np.cumsum(counts.numpy())[:-1])
            for i, part in zip(native, parts):
                out[i] = part
        rest = [i for i, o in enumerate(out) if o is None]
        if rest:
            backend = self._tok.backend_tokenizer
            for i, e in zip(rest, backend.encode_batch([texts[i] for i in rest], add_special_tokens=False)):
                out[i] = np.asarray(e.ids, np.int64)
        return out


def byte_level_bpe(tok) -> ByteLevelBPE | None:
    """The native encoder of the HF fast tokenizer ``tok``, or None where it has none (another tokenizer form, or
    the kernels could not be compiled): then ``tok`` encodes."""
    from . import load

    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    why = _supported(spec)
    if why is not None:
        log.info("tokenizing with the HF tokenizer: %s", why)
        return None
    if load() != "native":
        return None
    return ByteLevelBPE(tok, spec)


def suffix_array(values: np.ndarray, bits: int, depth: int) -> np.ndarray | None:
    """csrc/text_index.cpp's sort of ``values`` ([N] ranks >= 1, ``bits`` wide) as datastore.suffix_array sorts
    them (uint32 starts), or None where the kernels could not be compiled."""
    from . import load

    if load() != "native":
        return None
    order = torch.ops.trtspec.suffix_array(torch.from_numpy(values.astype(np.int32)), bits, depth)
    return order.numpy().view(np.uint32)
