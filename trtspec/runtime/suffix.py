"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): a drafter with no model, proposing token trees from text
already written.

Two stores of earlier text answer one question, "where did the row's last tokens occur before, and what came
next?":
- each row's own tokens (its prompt and output so far), indexed as they become known;
- a SuffixCache of earlier requests' outputs, bounded in tokens (the least recently added go first), shared by
  every row of a Scheduler and kept across requests (`trtspec serve` keeps one for its lifetime); thread-safe.

A round finds the longest suffix of the row (MIN_MATCH..MAX_MATCH tokens) that occurred before, in the row first,
then in the cache, and lays the continuations of its latest occurrences (up to MAX_OCCURRENCES, each up to the
round's depth) into a trie. A node's score is the fraction of occurrences that pass through it: an empirical
probability of its whole path. The best nodes (a parent always scores at least its child) make the tree, up to
``tree_nodes`` and down to ``min_score``; a target without tree verification gets the trie's likeliest path as a
chain. No earlier occurrence: no drafts, and the round costs the target call alone.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque

from .drafters import Proposal
from .tree import pack_trees

MIN_MATCH = 2  # a suffix shorter than this says too little about what follows
MAX_MATCH = 8
MAX_OCCURRENCES = 16  # per n-gram: the latest ones (recent text predicts best)
CACHE_LENGTHS = (2, 3, 4, 6, 8)  # the n-grams the shared cache indexes (a row's index has every length)


def _grams_ending(seq: list[int], end: int):
    """The n-grams of seq ending at ``end``, MIN_MATCH..MAX_MATCH tokens (one tuple made, the rest sliced off it)."""
    window = tuple(seq[max(0, end - MAX_MATCH + 1) : end + 1])
    return [window[-m:] for m in range(MIN_MATCH, len(window) + 1)]


class _Index:
    """n-gram (MIN_MATCH..MAX_MATCH tokens) -> the positions right after its latest occurrences, over one list."""

    __slots__ = ("seq", "grams", "done")

    def __init__(self):
        self.seq: list[int] = []
        self.grams: dict[tuple, deque] = {}
        self.done = 0  # n-grams ending before this position are indexed

    def extend(self, tokens) -> None:
        self.seq.extend(tokens)
        # an n-gram is indexed once its follower is known: those ending at [done, len - 1)
        seq, grams = self.seq, self.grams
        for end in range(self.done, len(seq) - 1):
            for key in _grams_ending(seq, end):
                hits = grams.get(key)
                if hits is None:
                    grams[key] = hits = deque(maxlen=MAX_OCCURRENCES)
                hits.append(end + 1)
        self.done = max(self.done, len(seq) - 1)


class SuffixCache:
    """Earlier requests' outputs for suffix drafting: at most ``max_tokens`` tokens, oldest out first.

    Leaner than a row's index, since it lives as long as the server: tokens in arrays, n-grams of CACHE_LENGTHS
    tokens only, keyed by their hash (a collision only misleads a proposal, which the target's verify corrects).
    About 0.95 KB a token at worst (text that never repeats: 61 MB for the default 64 Ki tokens); less where it repeats.
    ``add`` and ``continuations`` lock; one cache serves every row of a Scheduler (and its server's lifetime)."""

    def __init__(self, max_tokens: int = 1 << 16):
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._seqs: OrderedDict[int, array] = OrderedDict()
        self._grams: dict[int, list[int]] = {}  # hash of an n-gram -> [(sequence id << 32) | follower], latest last
        self._next_id = 0
        self.tokens = 0
        self._lock = threading.Lock()

    @staticmethod
    def _keys(seq, end: int):
        window = tuple(seq[max(0, end - MAX_MATCH + 1) : end + 1])
        return [hash(window[-m:]) for m in CACHE_LENGTHS if m <= len(window)]

    def add(self, tokens) -> None:
        seq = array("q", (int(t) for t in tokens))
        if len(seq) <= MIN_MATCH or len(seq) > self.max_tokens:
            return
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._seqs[sid] = seq
            self.tokens += len(seq)
            for end in range(MIN_MATCH - 1, len(seq) - 1):
                for key in self._keys(seq, end):
                    hits = self._grams.setdefault(key, [])
                    hits.append((sid << 32) | (end + 1))
                    if len(hits) > MAX_OCCURRENCES:
                        del hits[0]
            while self.tokens > self.max_tokens:
                self._evict()

    def _evict(self):
        sid, seq = self._seqs.popitem(last=False)
        self.tokens -= len(seq)
        for end in range(MIN_MATCH - 1, len(seq) - 1):
            for key in self._keys(seq, end):
                hits = self._grams.get(key)
                if hits is not None:
                    hits[:] = [h for h in hits if h >> 32 != sid]
                    if not hits:
                        del self._grams[key]

    def continuations(self, key: tuple, depth: int) -> list[list[int]]:
        """What followed the n-gram ``key`` (CACHE_LENGTHS tokens long) in the stored outputs, latest first: up to
        ``depth`` tokens each."""
        if len(key) not in CACHE_LENGTHS:
            return []
        with self._lock:
            hits = self._grams.get(hash(key))
            if not hits:
                return []
            return [self._seqs[h >> 32][(h & 0xFFFFFFFF) : (h & 0xFFFFFFFF) + depth].tolist() for h in reversed(hits)]


class SuffixDrafter:
    """The Drafter protocol (runtime/drafters.py) over suffix matches; see the module docstring."""

    name = "suffix"
    drafts_after_forced = False  # (its trees start at the row's last token, as a draft model's do)

    def __init__(self, max_batch: int, *, cache: SuffixCache | None = None, tree: bool = False,
                 tree_nodes: int | None = None, min_score: float = 0.1):
        if not 0.0 <= min_score <= 1.0:
            raise ValueError(f"min_score must be in [0, 1], got {min_score!r}")
        self.cache = cache if cache is not None else SuffixCache()
        self.tree = tree
        self.tree_nodes = tree_nodes or 16
        self.min_score = min_score
        self.rows: list[_Index] = [_Index() for _ in range(max_batch)]

    def admit(self, row, prefix, n):
        self.rows[row] = _Index()

    def reusable(self, prefix):
        return 1 << 62  # no cache of its own: any prefix

    def save_prefix(self, row, n):
        return None

    def prefill(self, input_ids, position_ids, first_row, fed):
        pass

    def accepted(self, valid):
        pass

    def move_row(self, src, dst):
        self.rows[dst] = self.rows[src]
        self.rows[src] = _Index()

    def finish(self, row: int, tokens) -> None:
        """A request leaves ``row``: its output (after its prompt's last MAX_MATCH tokens) joins the shared cache."""
        self.cache.add(tokens)

    def propose(self, tokens, n, caps, samplers, capacity):
        # tokens [B, cap] int64, n [B], caps [B] -> Proposal (a tree per row, or chains); no engine calls: the
        # round's own clock counts this host work
        b = n.size
        trees = []
        for r in range(b):
            index, length, depth = self.rows[r], int(n[r]), int(caps[r])
            if len(index.seq) < length:
                index.extend(tokens[r, len(index.seq) : length].tolist())
            trees.append(self._tree(index, depth) if depth > 0 else ([], []))
        drafts, parents, counts = pack_trees(trees, max([len(t) for t, _ in trees] + [0]))
        if not self.tree:
            return Proposal(drafts, counts)
        return Proposal(drafts, counts, None, [], parents, f"suffix{self.tree_nodes}")

    def _continuations(self, index: _Index, depth: int) -> list[list[int]]:
        seq = index.seq
        for m in range(min(MAX_MATCH, len(seq)), MIN_MATCH - 1, -1):
            key = tuple(seq[-m:])
            found = [seq[p : p + depth] for p in reversed(index.grams.get(key, ()))]
            found += self.cache.continuations(key, depth)
            if found:
                return found[:MAX_OCCURRENCES]
        return []

    def _tree(self, index: _Index, depth: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of this row's proposal: the trie of continuations, best nodes first."""
        found = self._continuations(index, depth)
        if not found:
            return [], []
        total = len(found)
        # repetitive text repeats its continuations: count each distinct one once (latest first, for ties)
        distinct: dict[tuple, int] = {}
        for cont in found:
            key = tuple(cont)
            distinct[key] = distinct.get(key, 0) + 1
        if not self.tree:  # a chain: the likeliest next token at each step, among the continuations still agreeing
            chain: list[int] = []
            live = list(distinct.items())
            while len(chain) < depth:
                j = len(chain)
                votes: dict[int, int] = {}
                for cont, w in live:
                    if len(cont) > j:
                        votes[cont[j]] = votes.get(cont[j], 0) + w
                if not votes:
                    break
                token = max(votes, key=votes.get)  # (the first seen, the latest occurrence, wins a tie)
                if votes[token] < self.min_score * total:
                    break
                chain.append(token)
                live = [(cont, w) for cont, w in live if len(cont) > j and cont[j] == token]
            return chain, list(range(-1, len(chain) - 1))
        counts: dict[tuple, int] = {}  # trie node (its path) -> continuations through it
        for cont, w in distinct.items():
            for j in range(1, len(cont) + 1):
                path = cont[:j]
                counts[path] = counts.get(path, 0) + w
        # the best nodes by score; ties go to the shallower, so a parent always comes before its children
        ranked = sorted((p for p, c in counts.items() if c >= self.min_score * total),
                        key=lambda p: (-counts[p], len(p)))[: self.tree_nodes]
        position = {}
        tokens, parents = [], []
        for path in sorted(ranked, key=len):
            position[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(position[path[:-1]] if len(path) > 1 else -1)
        return tokens, parents
