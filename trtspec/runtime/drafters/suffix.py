"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): a drafter with no model, proposing token trees from text
already written.

Two stores of earlier text answer one question, "where did the row's last tokens occur before, and what came
next?":
- each row's own tokens (its prompt and output so far), indexed as they become known;
- a SuffixCache of earlier requests' outputs, bounded in tokens (the least recently added go first), shared by
  every row of a Scheduler and kept across requests (`trtspec serve` keeps one for its lifetime); thread-safe.

Both are a ``_Text`` (drafters/suffix_text.py): the tokens, and the occurrences of every 2-gram and 4-gram chained
latest first, keyed by the n-gram's ids side by side in one int. A lookup walks the chain of the row's last 4 tokens (else its last 2),
extends each occurrence's match backwards up to MAX_MATCH tokens, and keeps the longest matches (the latest
MAX_OCCURRENCES occurrences looked at, the row's own text first). Their continuations make a trie; a node's
score is the share of continuations through it, an empirical probability of its whole path. Under a grammar,
each continuation is cut at the first token the grammar forbids: only allowed tokens are proposed.

The round's shape is the drafter's own (``costs`` set: the scheduler's load-aware policy gives the measured call
costs). A node's gain is its score calibrated by the acceptance measured at its depth after matches of its
length (the running ratio of accepted to predicted, 1-token, short, longer and full matches apart), and each row
proposes the best-gain nodes that maximise (1 + their gains) / (the verify call's cost at 1 + their count): deep
where the text repeats and the call is cheap, nothing where a match says too little for its cost. A target without
tree verification gets the trie's likeliest path as a chain. No match of MIN_MATCH tokens: what followed the row's
last token where it last occurred in its own text, where its own calibration says it pays (``one_token_matches``);
no occurrence at all: no drafts, and the round costs the target call alone.

``SuffixThenDraft`` puts a draft model under it: rows the suffix drafter has nothing for draft with the model,
when its measured acceptance and call costs say a draft pays (TensorRT-LLM's suffix automaton on top of a
drafter).
"""

from __future__ import annotations

from array import array

import numpy as np

from ..verify import expected_tokens_per_call
from .trees import pack_trees
from .base import Drafter, Proposal
from .datastore import Datastore, open_datastore
from .draft_model import DraftModelDrafter
from .suffix_text import _BITS, _MASK1, MAX_MATCH, MAX_OCCURRENCES, SuffixCache, _Text

_CALIBRATION_PRIOR = 4.0  # predicted tokens' worth of "the scores are right" before a depth is measured
_CALIBRATION_MEMORY = 256.0  # a depth's counts are halved beyond this: acceptance drifts with the text
_PROBE_EVERY = 32  # rounds with a match but nothing worth proposing, before one node is proposed anyway
# the calibration is kept apart for 1-token (the row's own text only, see SuffixDrafter), short (2-3 tokens), longer
# (4-7) and full (MAX_MATCH) matches: how far back the text agrees says how often what followed it follows again (a
# regenerated answer matches in full and repeats whole; a 2-token match in prose rarely), which a continuation's
# count alone does not say. A datastore's matches (drafters/datastore.py: a corpus, not this conversation) have
# classes of their own: 2-3, 4-5, 6-8 and 9 or more tokens
_CLASSES = 8


def _match_class(m: int, indexed: bool = False) -> int:
    if indexed:
        return 4 if m < 4 else 5 if m < 6 else 6 if m < 9 else 7
    return 0 if m < 2 else 1 if m < 4 else 2 if m < MAX_MATCH else 3


def _calibrated(reached: float, predicted: float) -> float:
    return (reached + _CALIBRATION_PRIOR) / (predicted + _CALIBRATION_PRIOR)


class SuffixDrafter(Drafter):
    """The Drafter protocol (drafters/base.py) over suffix matches; see the module docstring.

    ``costs``: None (every node scoring at least ``min_score`` is proposed, up to the caps and ``tree_nodes``), or
    a function (rows, tokens per row, tree) -> the verify call's seconds or None (not known yet), which makes
    each round's shape the one with the most tokens expected per second (the Scheduler sets it under its
    load-aware policy).

    ``one_token_matches``: with call costs known, a row with no match of MIN_MATCH tokens anywhere takes what
    followed its last token where it last occurred in its own text (prompt lookup's last resort), calibrated apart
    and proposed only where that calibration and the call costs say it pays (on a one-row decode graph a second
    token in the call is nearly free). Off under a draft model (SuffixThenDraft): the model drafts those rows."""

    name = "suffix"
    proposes_drafts = True
    combines_with_draft = True  # (SuffixThenDraft)
    reads_datastore = True
    proposes_trees = True
    shapes_own_rounds = True
    drafts_after_forced = False  # (its trees start at the row's last token, as a draft model's do)

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes, datastore=None):
        # trees where the target verifies them; its cache of earlier outputs lives as long as the drafter
        suffix = cls(max_batch, tree=bool(getattr(target, "tree_verify", False)), tree_nodes=tree_nodes,
                     one_token_matches=draft is None, datastore=datastore)
        return suffix if draft is None else SuffixThenDraft(suffix, DraftModelDrafter(draft, pad_id))

    def __init__(self, max_batch: int, *, cache: SuffixCache | None = None, tree: bool = False,
                 tree_nodes: int | None = None, min_score: float = 0.1, costs=None, one_token_matches: bool = True,
                 datastore: Datastore | str | None = None):
        if not 0.0 <= min_score <= 1.0:
            raise ValueError(f"min_score must be in [0, 1], got {min_score!r}")
        self.cache = cache if cache is not None else SuffixCache()
        self.datastore = open_datastore(datastore)  # a corpus drafted from after the row's text and the cache
        self.tree = tree
        self.tree_nodes = tree_nodes or 16
        self.min_score = min_score
        self.costs = costs
        self.one_token_matches = one_token_matches
        self.rows: list[_Text] = [_Text() for _ in range(max_batch)]
        # per match class (_match_class) and depth (1..): the proposed nodes' scores, and the rounds whose accepted
        # path reached that depth (Python lists: a round touches a few entries, each a numpy scalar op otherwise)
        self.predicted: list[list[float]] = [[0.0] for _ in range(_CLASSES)]
        self.reached: list[list[float]] = [[0.0] for _ in range(_CLASSES)]
        self._gain: list[list[float]] = [[1.0] for _ in range(_CLASSES)]  # calibration(depth, class): accepted()
        self._round: list | None = None  # this round's proposals: (row, n, depths, scores, match class)
        self._idle = 0  # rounds since a row last proposed while it had a match
        self._b = 0  # this round's rows (for the call costs _shape asks for)
        self._chain, self._depths = [-1], [1]  # a chain's parents and depths (-1 0 1 .., 1 2 3 ..), as deep as asked

    # -- the Drafter protocol ---------------------------------------------------------------

    def admit(self, row, prefix, n):
        self.rows[row] = _Text()

    def move_row(self, src, dst):
        self.rows[dst] = self.rows[src]
        self.rows[src] = _Text()

    def finish(self, row: int, tokens, prompt_len: int) -> None:
        """A request leaves ``row``: its output, after its prompt's last MAX_MATCH tokens (what it followed is
        matchable too), joins the shared cache."""
        self.cache.add(tokens[max(0, prompt_len - MAX_MATCH) :])

    def propose(self, tokens, n, caps, samplers, capacity):
        # tokens [B, cap] int64, n [B], caps [B] -> Proposal (a tree per row, or chains); no engine calls: the
        # round's own clock counts this host work, so the per-row work below keeps to plain Python lists and ints
        b = n.size
        lengths, limits = n.tolist(), caps.tolist()
        deepest = max(limits, default=0)
        if deepest >= len(self.predicted[0]):  # a deeper round than any before: room for its depths
            grow = [0.0] * (deepest + 1 - len(self.predicted[0]))
            for c in range(_CLASSES):
                self.predicted[c] += grow
                self.reached[c] += grow
                self._gain[c] += [1.0] * len(grow)  # (_calibrated(0, 0))
            self._chain, self._depths = list(range(-1, deepest)), list(range(1, deepest + 2))
        # the verify call's seconds at 1 token a row; _shape asks for more tokens as it needs them, once a round
        call_costs = self._call_costs(b) if b else None
        rows, tree, cache, store = self.rows, self.tree, self.cache, self.datastore
        ones = self.one_token_matches and call_costs is not None
        shaped: dict[tuple, list[int]] = {}  # this round's chain shapes by (match class, score): _chain_shape
        trees = []
        self._round = []
        for r in range(b):
            depth = limits[r]
            if depth <= 0:
                trees.append(([], []))
                continue
            text, length = rows[r], lengths[r]
            held = len(text.seq)
            if held < length:
                text.extend(tokens[r, held:length].tolist())
            match, found = text.find(text.seq, text._key)  # (its own tail: the end of its tokens)
            indexed = False
            if found or cache.tokens:
                match, found = self._continuations(text, depth, match, found)
            if store is not None and match < MAX_MATCH:  # the index, where it matches longer than what was written
                m_index, from_index = store.find(text.seq[-store.depth :], depth)
                if m_index > match and (not found or self._first_odds(from_index, _match_class(m_index, True))
                                        > self._first_odds(found, _match_class(match))):
                    match, found, indexed = m_index, from_index, True
            if not found and ones:  # what followed the row's last token where it last occurred in its own text
                p = text.last1.get(text._key & _MASK1, -1)
                if p >= 0:
                    match, found = 1, [tuple(text.seq[p : p + depth])]
            if not found:
                trees.append(([], []))
                continue
            c = _match_class(match, indexed)
            processor = samplers[r].processor if samplers is not None else None
            if processor is None or processor.constraint is None:
                cont = found[0]
                if found.count(cont) == len(found):  # one continuation: a chain, each node as likely as the next
                    if not cont:
                        trees.append(([], []))
                        continue
                    # rows with the same (match class, score) share their shapes a round (most rows at 8: the
                    # lone occurrences of 1- and 2-token matches)
                    score = len(found) / (len(found) + 1)
                    keep = self._probed(self._chain_shape(shaped, call_costs, score, c, deepest, len(cont)))
                    if keep:
                        depths = self._depths[:keep]
                        self._round.append((r, length, depths, [score] * keep, c))
                        trees.append((list(cont[:keep]), self._chain[:keep]))
                    else:
                        trees.append(([], []))
                    continue
                grammar = None
            else:
                grammar = processor
            nodes, parents, scores, depths = self._candidates(found, depth, grammar)
            if not nodes:
                trees.append(([], []))
                continue
            if scores[0] == scores[-1] and depths[-1] == len(depths):  # a chain of alike nodes, as above
                keep = self._probed(self._chain_shape(shaped, call_costs, scores[0], c, deepest, len(scores)))
            else:
                keep = self._probed(self._shape(call_costs, scores, depths, c))
            if keep < len(nodes):
                nodes, parents, scores, depths = nodes[:keep], parents[:keep], scores[:keep], depths[:keep]
            if nodes:
                if tree and depths[-1] != len(depths):  # by depth (a path 1..L is in order already)
                    order = sorted(range(len(nodes)), key=depths.__getitem__)
                    at = {j: i for i, j in enumerate(order)}
                    nodes = [nodes[j] for j in order]
                    parents = [at[parents[j]] if parents[j] >= 0 else -1 for j in order]
                    scores, depths = [scores[j] for j in order], [depths[j] for j in order]
                self._round.append((r, length, depths, scores, c))
            trees.append((nodes, parents))
        if not tree:  # chains: the tokens alone, in one conversion of a padded flat list
            counts = [len(t) for t, _ in trees]
            k = max(counts, default=0)
            flat: list[int] = []
            if k:
                for t, _ in trees:
                    flat += t
                    flat += [0] * (k - len(t))
            return Proposal(np.frombuffer(array("q", flat), np.int64).reshape(b, k),
                            np.frombuffer(array("q", counts), np.int64))
        drafts, parents, counts = pack_trees(trees, max([len(t) for t, _ in trees] + [0]))
        return Proposal(drafts, counts, None, [], parents, f"suffix{self.tree_nodes}")

    def accepted(self, valid):
        """The verdicts calibrate the scores: per match class and depth, how often the accepted path reached it
        against the summed scores of the nodes proposed there."""
        if not self._round:
            return
        valid = valid.tolist() if isinstance(valid, np.ndarray) else list(valid)
        top = [0] * _CLASSES  # per match class, the deepest node proposed (depths 1..it were all proposed at)
        for r, length, depths, scores, c in self._round:
            predicted = self.predicted[c]
            for d, score in zip(depths, scores):
                predicted[d] += score
            deepest = depths[-1]
            got = valid[r] - length if r < len(valid) else 0
            if got > 0:
                reached = self.reached[c]
                for d in range(1, (got if got < deepest else deepest) + 1):
                    reached[d] += 1
            if deepest > top[c]:
                top[c] = deepest
        for c, deepest in enumerate(top):  # (only a depth proposed at changed, or grew past the memory)
            if deepest:
                predicted, reached, gain = self.predicted[c], self.reached[c], self._gain[c]
                for d in range(1, deepest + 1):
                    if predicted[d] > _CALIBRATION_MEMORY:
                        predicted[d] *= 0.5
                        reached[d] *= 0.5
                    gain[d] = _calibrated(reached[d], predicted[d])
        self._round = None

    # -- proposals ------------------------------------------------------------------------------

    def _continuations(self, text: _Text, depth: int, m: int, found: list[int]) -> tuple[int, list[tuple[int, ...]]]:
        """(the longest match's length, the continuations after its occurrences: the row's own first), from the
        row's own match (``m``, its occurrences ``found``) and the shared cache's."""
        seq, base = text.seq, text.base
        if not self.cache.tokens:
            return m, [tuple(seq[p - base : p - base + depth]) for p in found] if found else found
        own = [tuple(seq[p - base : p - base + depth]) for p in found]
        if m == MAX_MATCH:  # (the cache could only tie)
            return m, own
        m_cache, shared = self.cache.find(seq[-MAX_MATCH:], depth)
        if m_cache > m:
            return m_cache, shared[:MAX_OCCURRENCES]
        if m_cache == m:
            own += shared
        return m, own[:MAX_OCCURRENCES]

    def _candidates(self, found: list[tuple[int, ...]], depth: int, grammar) -> tuple[list, list, list, list]:
        """(tokens, parents, scores, depths) of a row's candidate nodes from the continuations ``found`` (one or more),
        best first (a parent before its children): the trie of continuations, or its likeliest path (chains), nodes
        through fewer than min_score of the continuations out. A score is the share of continuations through the
        node, counting one more that goes elsewhere (a lone occurrence is a guess, not a certainty: 1/2; 16
        agreeing: 16/17)."""
        total = len(found)
        floor = self.min_score * total
        # repetitive text repeats its continuations: count each distinct one once (latest first, for ties)
        distinct: dict[tuple, int] = {}
        for cont in found:
            distinct[cont] = distinct.get(cont, 0) + 1
        if grammar is not None:  # cut each at the first token the request's grammar forbids
            cut: dict[tuple, int] = {}
            for cont, w in distinct.items():
                key = cont[: grammar.allowed_prefix(list(cont))] if cont else cont
                cut[key] = cut.get(key, 0) + w
            distinct = cut
        if len(distinct) == 1:  # one continuation (repeated text): a chain, each node as likely as the next
            (cont, w), = distinct.items()
            if w < floor or not cont:
                return [], [], [], []
            score = w / (total + 1)
            return list(cont), self._chain[: len(cont)], [score] * len(cont), self._depths[: len(cont)]
        if not self.tree:  # a chain: the likeliest next token at each step, among the continuations still agreeing
            chain: list[int] = []
            scores: list[float] = []
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
                if votes[token] < floor:
                    break
                chain.append(token)
                scores.append(votes[token] / (total + 1))
                live = [(cont, w) for cont, w in live if len(cont) > j and cont[j] == token]
                if len(live) == 1:  # one continuation left: the rest of it, each node as likely as this one
                    rest = live[0][0][j + 1 : depth]
                    chain += rest
                    scores += [scores[-1]] * len(rest)
                    break
            return chain, self._chain[: len(chain)], scores, self._depths[: len(chain)]
        # the trie: node i is tokens[i] after node parent[i] (-1: the row's last token), at depth[i], with count[i]
        # continuations through it
        tokens: list[int] = []
        parent: list[int] = []
        depth_of: list[int] = []
        count: list[int] = []
        child: dict[int, int] = {}  # (parent + 1) << _BITS | token -> node
        for cont, w in distinct.items():
            at = -1
            for d, t in enumerate(cont, 1):
                key = (at + 1) << _BITS | t
                i = child.get(key)
                if i is None:
                    i = child[key] = len(tokens)
                    tokens.append(t)
                    parent.append(at)
                    depth_of.append(d)
                    count.append(w)
                else:
                    count[i] += w
                at = i
        # the best nodes by count, ties to the shallower (so a parent always comes before its children), then to the
        # first made; nodes under the floor out
        rank = [d - c * 4096 for c, d in zip(count, depth_of)]  # (depths are below 4096)
        ranked = [i for i in sorted(range(len(tokens)), key=rank.__getitem__) if count[i] >= floor][: self.tree_nodes]
        index = {i: j for j, i in enumerate(ranked)}
        index[-1] = -1
        return ([tokens[i] for i in ranked], [index[parent[i]] for i in ranked],
                [count[i] / (total + 1) for i in ranked], [depth_of[i] for i in ranked])

    def _first_odds(self, found: list[tuple[int, ...]], c: int) -> float:
        """How likely the first drafted token of ``found`` is accepted: the share of continuations that agree on it
        (one more counted elsewhere, as _candidates scores), times its match class's calibration at depth 1. Which
        store drafts a row (its own text and the cache, or the datastore) is the one with the better odds: a
        corpus' longer match often says less about this answer than the answer's own shorter one."""
        votes: dict[int, int] = {}
        for cont in found:
            if cont:
                votes[cont[0]] = votes.get(cont[0], 0) + 1
        if not votes:
            return 0.0
        gain = self._gain[c]
        return max(votes.values()) / (len(found) + 1) * (gain[1] if len(gain) > 1 else 1.0)

    def calibration(self, depth: int, match: int) -> float:
        """Accepted per predicted at ``depth`` after a ``match``-token match (1: the scores are taken as they are,
        before anything is measured)."""
        c = _match_class(match)
        if depth >= len(self.predicted[c]):
            return 1.0
        return _calibrated(self.reached[c][depth], self.predicted[c][depth])

    def _call_costs(self, b: int) -> list[float] | None:
        """[the verify call's seconds at b rows of 1 token] (a tree target verifies even an empty tree in its tree
        call), which _shape lengthens to more tokens as it needs them; None before anything was measured (or no
        costs)."""
        if self.costs is None:
            return None
        self._b = b
        one = self.costs(b, 1, self.tree)
        return None if one is None else [one]

    def _shape(self, call_costs: list[float] | None, scores: list[float], depths: list[int], c: int) -> int:
        """How many of the best-first candidates to propose: all (no call costs known), or the count with the most
        tokens expected per second of the verify call (``call_costs[t - 1]``: its seconds at t tokens a row)."""
        if not scores or call_costs is None:
            return len(scores)
        return self._best_counts(call_costs, scores, depths, c)[-1]

    def _chain_shape(self, shaped: dict, call_costs: list[float] | None, score: float, c: int, deepest: int,
                     size: int) -> int:
        """_shape of a chain of ``size`` nodes all scoring ``score``; ``shaped`` keeps, for the round, each
        (match class, score)'s shapes at every length up to ``deepest`` (one pass serves them all)."""
        sizes = shaped.get((c, score))
        if sizes is None:
            sizes = shaped[c, score] = (list(range(deepest + 1)) if call_costs is None else
                                        self._best_counts(call_costs, [score] * deepest, self._depths[:deepest], c))
        return sizes[size]

    def _best_counts(self, call_costs: list[float], scores: list[float], depths: list[int], c: int) -> list[int]:
        """[0, _shape of the first candidate alone, of the first two, .., of them all]: one pass serves every
        prefix, since the rate of the first i candidates does not depend on the ones after them."""
        # gains: calibrated scores, never above a shallower candidate's (the candidates come best first)
        best_rate, best, expected, ceiling = 1.0 / call_costs[0], 0, 1.0, 1.0
        gain = self._gain[c]  # calibration at depth d for match class c (propose grew it to every depth asked for)
        counts = [0]
        for i, (score, d) in enumerate(zip(scores, depths), 1):
            score *= gain[d]
            if score < ceiling:
                ceiling = score
            expected += ceiling
            if i == len(call_costs):  # (the costs' estimates are known at every size once one is)
                call_costs.append(self.costs(self._b, i + 1, self.tree))
            rate = expected / call_costs[i]
            if rate > best_rate:
                best_rate, best = rate, i
            counts.append(best)
        return counts

    def _probed(self, best: int) -> int:
        """A row's count of nodes, or 1 where nothing has paid for _PROBE_EVERY rows with candidates."""
        if best == 0:
            self._idle += 1
            if self._idle >= _PROBE_EVERY:  # keep measuring: the calibration learns only from proposed nodes
                self._idle, best = 0, 1
        else:
            self._idle = 0
        return best


class SuffixThenDraft(Drafter):
    """Suffix drafting with a draft model (drafters/draft_model.py, chains) under it: each round, the
    rows the suffix drafter proposes nothing for draft with the model, up to the k with the most tokens expected
    per second from the model's measured acceptance on such rows and the measured call costs (0: those rows
    verify alone, and the draft catches up on their tokens when it next drafts). The draft reads every prompt
    alongside the target, as the model drafter alone does."""

    name = "suffix"  # (its rows drafted by the model say "draft": Proposal.sources)
    shapes_own_rounds = True
    whole_rounds = False  # a draft's cost per token: its one-token calls (False), or all its round's calls (True)
    drafts_after_forced = False

    def __init__(self, suffix: SuffixDrafter, fallback):
        self.suffix = suffix
        self.fallback = fallback
        self.draft_accepted, self.draft_checked = 0.0, 0.0  # the model's acceptance on the rows it drafted for
        self.draft_call_s: float | None = None  # a one-token draft call's seconds, measured
        self._drafted: list | None = None  # this round's model rows: (row, n, drafts)

    @property
    def costs(self):
        return self.suffix.costs

    @costs.setter
    def costs(self, value):
        self.suffix.costs = value

    @property
    def cache(self):
        return self.suffix.cache

    def admit(self, row, prefix, n):
        self.suffix.admit(row, prefix, n)
        self.fallback.admit(row, prefix, n)

    def reusable(self, prefix):
        return self.fallback.reusable(prefix)

    def save_prefix(self, row, n):
        return self.fallback.save_prefix(row, n)

    def prefill(self, input_ids, position_ids, first_row, fed):
        return self.fallback.prefill(input_ids, position_ids, first_row, fed)

    def move_row(self, src, dst):
        self.suffix.move_row(src, dst)
        self.fallback.move_row(src, dst)

    def finish(self, row, tokens, prompt_len):
        self.suffix.finish(row, tokens, prompt_len)

    def _draft_k(self, b: int, cap: int) -> int:
        """The model's k for rows without a suffix match: the most tokens expected per second, 0 included."""
        costs = self.suffix.costs
        if costs is None or self.draft_call_s is None:
            return cap
        alpha = (self.draft_accepted + 0.5 * 8) / (self.draft_checked + 8)  # prior: 0.5, worth 8 drafts
        best, best_rate = 0, None
        for k in range(0, cap + 1):
            verify = costs(b, k + 1, self.suffix.tree)
            if verify is None:
                return cap
            rate = expected_tokens_per_call(alpha, k) / (verify + k * self.draft_call_s)
            if best_rate is None or rate > best_rate:
                best, best_rate = k, rate
        return best

    def propose(self, tokens, n, caps, samplers, capacity):
        proposal = self.suffix.propose(tokens, n, caps, samplers, capacity)
        return self._with_model(proposal, (proposal.counts == 0) & (caps > 0), tokens, n, caps, samplers, capacity)

    def _with_model(self, proposal, need, tokens, n, caps, samplers, capacity):
        """The suffix drafter's proposal with the model's chains in the rows ``need`` marks."""
        b = n.size
        self._drafted = None
        if not need.any():
            return proposal
        k = self._draft_k(b, int(caps[need].max()))
        if k == 0:
            return proposal
        chains = self.fallback.propose(tokens, n, np.where(need, np.minimum(caps, k), 0), samplers, capacity)
        single = [s for rows, t, s in chains.calls[1:] if t == 1]
        if self.whole_rounds and chains.calls:  # every call of the round, its catch-up included, per drafted token
            single = [sum(s for _, _, s in chains.calls) / max(1, int(chains.counts.max()))]
        if single:
            call = sum(single) / len(single)
            self.draft_call_s = call if self.draft_call_s is None else 0.8 * self.draft_call_s + 0.2 * call
        drafted = need & (chains.counts > 0)
        if not drafted.any():
            proposal.calls = chains.calls
            return proposal
        self._drafted = [(r, int(n[r]), int(chains.counts[r])) for r in np.flatnonzero(drafted)]
        width = max(proposal.drafts.shape[1], chains.drafts.shape[1])
        drafts = np.zeros((b, width), np.int64)
        drafts[:, : proposal.drafts.shape[1]] = proposal.drafts
        drafts[drafted, : chains.drafts.shape[1]] = chains.drafts[drafted]
        counts = np.where(drafted, chains.counts, proposal.counts)
        sources = ["draft" if d else "suffix" for d in drafted.tolist()]
        if proposal.parents is not None:  # a tree target: the model's chains are trees whose parents are j - 1
            parents = np.full((b, width), -1, np.int64)
            parents[:, : proposal.parents.shape[1]] = proposal.parents
            parents[drafted] = np.arange(width) - 1
            return Proposal(drafts, counts, None, chains.calls, parents, proposal.shape, sources=sources)
        probs = None
        if chains.probs is not None:  # rows sampling by rejection: a suffix draft is certain (its q is one-hot)
            probs = np.zeros((b, width, chains.probs.shape[-1]), chains.probs.dtype)
            probs[drafted, : chains.probs.shape[1]] = chains.probs[drafted]
            for r in np.flatnonzero(~drafted):
                probs[r, np.arange(int(counts[r])), drafts[r, : int(counts[r])]] = 1.0
        return Proposal(drafts, counts, probs, chains.calls, sources=sources)

    def _drafts_accepted(self, valid) -> list[int]:
        """How many of this round's model drafts each model row (``_drafted``'s order) had accepted."""
        return [max(0, min(int(valid[r]) - length, m)) for r, length, m in self._drafted or ()]

    def accepted(self, valid):
        self.suffix.accepted(valid)
        self.fallback.accepted(valid)
        if self._drafted:
            for (_, _, m), got in zip(self._drafted, self._drafts_accepted(valid)):
                self.draft_accepted += got
                self.draft_checked += got + (got < m)
            if self.draft_checked > 512:
                self.draft_accepted *= 0.5
                self.draft_checked *= 0.5
        self._drafted = None
