"""The text suffix decoding drafts from (drafters/suffix.py): a ``_Text`` of tokens with the occurrences of every
2-gram and 4-gram chained latest first, keyed by the n-gram's ids side by side in one int, and the SuffixCache of
earlier requests' outputs, one ``_Text`` shared by every row of a Scheduler.

A lookup walks the chain of the tail's last 4 tokens (else its last 2), extends each occurrence's match backwards
up to MAX_MATCH tokens, and keeps the longest matches (the latest MAX_OCCURRENCES occurrences looked at).
"""

from __future__ import annotations

import threading
from array import array
from collections import deque

MIN_MATCH = 2  # a suffix shorter than this says too little about what follows
MAX_MATCH = 8
MAX_OCCURRENCES = 16  # occurrences looked at per lookup: the latest ones (recent text predicts best)
_BITS = 21  # token ids below 2**21: an n-gram's key is its ids side by side in one int
SEP = (1 << _BITS) - 1  # between the shared cache's outputs: no match or continuation crosses it
_MASK1, _MASK2, _MASK4 = (1 << _BITS) - 1, (1 << 2 * _BITS) - 1, (1 << 4 * _BITS) - 1


class _Text:
    """Tokens, with the positions after each 2-gram's and 4-gram's occurrences chained latest first:
    ``last[key]`` is the latest, ``prev[p - base]`` the one before p (-1: none); and after each token's latest
    occurrence (``last1``, no chain). Positions count from the first token ever added; the first ``base`` were
    dropped (the shared cache forgets its oldest outputs)."""

    __slots__ = ("seq", "prev2", "prev4", "last1", "last2", "last4", "base", "_key")

    def __init__(self):
        self.seq = array("q")
        self.prev2 = array("q")
        self.prev4 = array("q")
        self.last1: dict[int, int] = {}
        self.last2: dict[int, int] = {}
        self.last4: dict[int, int] = {}
        self.base = 0
        self._key = 0  # the last 4 tokens' ids side by side

    def __len__(self):
        return len(self.seq)

    def extend(self, tokens) -> None:
        """Append tokens (ints below SEP, or SEP); the n-grams ending before each get it as their follower."""
        held = len(self.seq)
        if held < 4:  # (a text's first tokens: fewer n-grams end before them)
            for i, t in enumerate(tokens):
                if held >= 4:
                    return self.extend(tokens[i:])
                if held >= 1:
                    self.last1[self._key & _MASK1] = self.base + held
                if held >= 2:
                    k = self._key & _MASK2
                    self.prev2.append(self.last2.get(k, -1))
                    self.last2[k] = self.base + held
                else:
                    self.prev2.append(-1)
                self.prev4.append(-1)
                self.seq.append(t)
                self._key = ((self._key << _BITS) | t) & _MASK4
                held += 1
            return
        prev2, prev4 = self.prev2.append, self.prev4.append
        last1, last2, last4 = self.last1, self.last2, self.last4
        key, p, mask1, mask2, mask4 = self._key, self.base + held, _MASK1, _MASK2, _MASK4
        for t in tokens:
            last1[key & mask1] = p
            k = key & mask2
            prev2(last2.get(k, -1))
            last2[k] = p
            prev4(last4.get(key, -1))
            last4[key] = p
            key = ((key << _BITS) | t) & mask4
            p += 1
        self.seq.extend(tokens)
        self._key = key

    def find(self, tail, key: int | None = None) -> tuple[int, list[int]]:
        """(the longest match, the positions after its latest occurrences, latest first) of a suffix of ``tail``
        (an array or list of the query's last tokens: only MAX_MATCH of them are read), MIN_MATCH..MAX_MATCH tokens
        long; (0, []) if none. ``key``: the tail's last 4 ids side by side, where the caller has them."""
        n = len(tail)
        if n >= 4:
            if key is None:
                key = (((((tail[-4] << _BITS) | tail[-3]) << _BITS) | tail[-2]) << _BITS) | tail[-1]
            p = self.last4.get(key, -1)
            if p >= self.base:
                return self._walk(p, tail, 4, MAX_MATCH, self.prev4)
        if n >= 2:
            p = self.last2.get(key & _MASK2 if key is not None else (tail[-2] << _BITS) | tail[-1], -1)
            if p >= self.base:
                return self._walk(p, tail, 2, 3, self.prev2)  # (a match of 4 or more has a 4-gram)
        return 0, []

    def _walk(self, p: int, tail, g: int, longest: int, prev) -> tuple[int, list[int]]:
        # the occurrences chained from p, latest first, each match extended backwards from its keyed g tokens
        seq, base, n = self.seq, self.base, len(tail)
        full = min(longest, n)
        window = tail[n - full :]  # (an occurrence matching it whole is told in one comparison)
        best, found, looked = 0, [], 0
        while p >= base and looked < MAX_OCCURRENCES:
            looked += 1
            if p - base >= full and seq[p - base - full : p - base] == window:
                m = full
            else:
                m, i, j = g, p - g - 1 - base, n - g - 1
                while m < longest and i >= 0 and j >= 0 and seq[i] == tail[j]:
                    m, i, j = m + 1, i - 1, j - 1
            if m > best:
                best, found = m, [p]
            elif m == best:
                found.append(p)
            p = prev[p - base]
        return best, found

    def continuation(self, p: int, depth: int) -> tuple[int, ...]:
        out = tuple(self.seq[p - self.base : p - self.base + depth])
        if SEP in out:
            out = out[: out.index(SEP)]
        return out


class SuffixCache:
    """Earlier requests' outputs for suffix drafting: at most ``max_tokens`` tokens, oldest out first.

    One ``_Text`` of every output, SEP between them: 24 bytes a token in arrays plus the chains' dict entries
    (204 bytes a token at worst, 12.8 MiB for the default 64 Ki tokens: `bench_suffix.py --cache-memory`), and no
    Python object per n-gram, so the garbage collector has nothing to walk. ``add`` and ``find`` lock; one cache
    serves every row of a Scheduler (and its server's lifetime)."""

    def __init__(self, max_tokens: int = 1 << 16):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._text = _Text()
        self._lengths: deque[int] = deque()  # each stored output's length, SEP included, oldest first
        self.tokens = 0  # the outputs' tokens held (SEPs not counted)
        self._lock = threading.Lock()

    def add(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        if len(tokens) <= MIN_MATCH or len(tokens) > self.max_tokens:
            return
        with self._lock:
            self._text.extend([SEP, *tokens])
            self._lengths.append(len(tokens) + 1)
            self.tokens += len(tokens)
            while self.tokens > self.max_tokens:
                self._evict()

    def _evict(self):
        text, k = self._text, self._lengths.popleft()
        self.tokens -= k - 1
        del text.seq[:k], text.prev2[:k], text.prev4[:k]
        text.base += k
        for name in ("last1", "last2", "last4"):  # entries before base are never walked; drop them once they pile up
            chains = getattr(text, name)
            if len(chains) > 2 * len(text.seq) + 1024:
                setattr(text, name, {key: p for key, p in chains.items() if p >= text.base})

    def find(self, tail: list[int], depth: int) -> tuple[int, list[tuple[int, ...]]]:
        """(match length, continuations of up to ``depth`` tokens, latest first) of ``tail``'s longest suffix
        in the stored outputs (0, [] if none)."""
        with self._lock:
            m, found = self._text.find(tail)
            return m, [self._text.continuation(p, depth) for p in found]
