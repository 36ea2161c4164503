"""Draft and target must tokenize identically, or speculative decoding silently corrupts the output."""

from __future__ import annotations

from ..errors import TrtspecError
from .tokenizer import load_tokenizer


class VocabularyMismatchError(TrtspecError, ValueError):
    """The draft's tokenizer or vocabulary differs from the target's."""


def check_same_vocabulary(target, draft) -> None:
    """Refuse a draft whose vocabulary, special tokens or logits width differ from the target's."""
    t, d = target.manifest["model"], draft.manifest["model"]
    problems = []
    if t["vocab_size"] != d["vocab_size"]:
        problems.append(f"logits width (vocab_size) {t['vocab_size']} vs {d['vocab_size']}")
    if t["special_tokens"] != d["special_tokens"]:
        problems.append(f"special tokens {t['special_tokens']} vs {d['special_tokens']}")
    if t["tokenizer_fingerprint"] != d["tokenizer_fingerprint"] and not problems:
        problems.append(_describe_tokenizer_difference(target, draft))
    elif t["tokenizer_fingerprint"] != d["tokenizer_fingerprint"]:
        problems.append("tokenizer vocabularies differ")
    if problems:
        raise VocabularyMismatchError(
            f"draft {draft.path} cannot draft for target {target.path}: " + "; ".join(problems)
            + ". Use a draft trained with the target's tokenizer."
        )


def _describe_tokenizer_difference(target, draft) -> str:
    tv, dv = load_tokenizer(target).get_vocab(), load_tokenizer(draft).get_vocab()
    if len(tv) != len(dv):
        return f"tokenizer vocabularies have {len(tv)} vs {len(dv)} tokens"
    differ = sorted(tok for tok in tv.keys() | dv.keys() if tv.get(tok) != dv.get(tok))
    return f"{len(differ)} tokens map to different ids (e.g. {differ[:3]})"
