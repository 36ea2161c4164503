"""Load-aware k: each round, the draft length that gives the most tokens per second at the current batch size.

A shape (k, and a tree's width) is worth the tokens its rows are expected to emit over the seconds its round takes.
- Tokens come from the acceptance: sum over rows of E(alpha_r, k) (DESIGN.md §4), each row's alpha its request's
  accepted / checked drafts, starting from the policy's alpha for rows of its kind (greedy or sampled: sampling
  accepts less than greedy decoding from the same draft) as a prior. Every round with drafts measures acceptance, so
  it is known closely; the tokens of one shape's own rounds are not used, since they vary by ~40 % a round and the few
  tries a neighbour gets could not tell neighbouring k apart. So rounds of requests that accept little (sampling,
  another language) do not turn drafting off for requests that accept much (greedy code, JSON under a grammar).
- Seconds are measured: the statistics (runtime/stats.py) record whole decode rounds (draft calls, the verify call,
  bookkeeping) per (batch size, k, width), each shape's time relative to the others from consecutive rounds of two
  shapes, at the machine's current speed (ShapeTimes): these machines' speed drifts by a third within minutes, more
  than neighbouring k differ, and rates measured minutes apart chose the wrong k.
- A shape not measured yet (or seen fewer than _TRUSTED times) is costed from the engine calls measured so far: one
  draft catch-up call plus k - 1 one-token draft calls and one target call over k + 1 tokens per row, each costed per
  (rows, tokens) with a linear fit for sizes not seen. Such estimates leave out the host's work, so they are
  optimistic: an unmeasured k gets tried, and is then judged on what it really did.

k = 0 (plain decoding) competes on the same terms, so when the batch is full enough that verify calls grow faster
than acceptance pays, drafting stops. Every _PROBE_EVERY rounds at a batch size one neighbour of the best k is tried
again, so a change in acceptance or cost is noticed; while the best stays the same the gap between tries doubles, up
to _PROBE_MAX rounds (a try is not free: after plain rounds the draft catches up on every token). Rounds with sampled
rows are measured apart from greedy ones (keyed by whether any row samples): a sampled position costs more host work
than a greedy one (noise, the rejection rule), and drafting that pays for greedy rows may not for sampled rows at the
same acceptance.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from .verify import expected_tokens_per_call

# Before anything is measured: alpha 0.5 worth a few rounds; a draft call a tenth of a target call; a
# target call costing 5 % more per extra token (DESIGN.md §6 measured 15-35 % for 5-9 tokens).
_PRIOR_ALPHA, _PRIOR_WEIGHT = 0.5, 8.0
_PRIOR_DRAFT_RATIO = 0.1
_PRIOR_SLOPE = 0.05
_PROBE_EVERY = 16  # rounds at one batch size between tries of a neighbour of the best k, at first
_PROBE_MAX = 256  # ... and at most, the gap doubling while the best stays the same
_MEMORY = 32  # a mean covers at most this many recent observations (machines are shared and noisy)
_TRUSTED = 3  # rounds of a (batch, k) before its measured rate replaces the estimate
_RECENT = 4  # rounds the machine's current speed is a mean of (ShapeTimes)
_REFIT = 8  # pairs of rounds between two fits of the shapes' relative times (a fit costs ~50 us)
_PRIOR_RESCUE = 0.3  # before a tree is measured: the share of the chain's rejections its siblings would catch


def _tokens(k: int, alphas, caps) -> float:
    """E(alpha_r, min(k, cap_r)) summed over the rows."""
    return sum(expected_tokens_per_call(a, int(min(k, c))) for a, c in zip(alphas, caps))


class CallCosts:
    """Seconds per call by (batch, tokens per row): measured means, else a linear fit in batch * tokens."""

    def __init__(self):
        self.means: dict[tuple[int, int], list[float]] = {}  # (b, t) -> [mean seconds, calls counted]
        self._fit = None  # (slope, intercept) or False; refitted after new sizes or _MEMORY records
        self._records = 0

    def record(self, b: int, t: int, seconds: float):
        if (b, t) not in self.means or self._records % _MEMORY == 0:
            self._fit = None
        self._records += 1
        entry = self.means.setdefault((b, t), [0.0, 0])
        entry[1] = min(entry[1] + 1, _MEMORY)
        entry[0] += (seconds - entry[0]) / entry[1]

    def estimate(self, b: int, t: int) -> float | None:
        # (asked for every size of every round by self-shaping drafters: the fit is kept between refits, and only the
        # fallback below builds arrays)
        entry = self.means.get((b, t))
        if entry is not None:
            return entry[0]
        if not self.means:
            return None
        if self._fit is None:
            self._fit = False
            sizes = np.array([bb * tt for bb, tt in self.means], dtype=float)
            if np.unique(sizes).size >= 2:
                slope, intercept = np.polyfit(sizes, [m for m, _ in self.means.values()], 1)
                if slope > 0 and intercept > 0:
                    self._fit = (float(slope), float(intercept))
        if self._fit:
            slope, intercept = self._fit
            return intercept + slope * b * t
        # one size measured (or a fit that makes no sense yet): scale the nearest by the prior slope
        size, mean = min(((bb * tt, m) for (bb, tt), (m, _) in self.means.items()), key=lambda sm: abs(sm[0] - b * t))
        return float(mean * (1 + _PRIOR_SLOPE * (b * t - 1)) / (1 + _PRIOR_SLOPE * (size - 1)))


class ShapeTimes:
    """The seconds a round of each shape takes, relative to the others, at one batch size (greedy or sampled rounds).

    Two consecutive rounds of different shapes ran within milliseconds of each other, so the ratio of their seconds
    holds whatever the machine's speed: each pair of shapes keeps the mean log ratio of its neighbouring rounds, and
    a least-squares fit over the pairs gives every connected shape's log time. The current speed is the recent
    rounds' seconds over their shape's relative time (a short mean), so a shape's time now is that speed times its
    relative time. These machines' speed drifts by a third within minutes, more than neighbouring k differ, and the
    means of each shape's own rounds, measured minutes apart, chose the wrong k.
    """

    def __init__(self):
        self.pairs: dict[tuple, list[float]] = {}  # (a, b), a < b -> [mean log(seconds of b / seconds of a), count]
        self.counts: dict[tuple, int] = {}  # shape -> the counts of its pairs, summed
        self.last: tuple | None = None  # (shape, seconds) of the last round
        self.speed: float | None = None  # recent seconds / relative time
        self._logs: dict | None = None  # shape -> log relative time: refitted for a new shape, or after _REFIT pairs
        self._stale = 0  # pairs recorded since the last fit

    def record(self, shape, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.last is not None and self.last[0] != shape:
            a, b = sorted((self.last[0], shape))
            ratio = math.log(seconds / self.last[1]) * (1 if shape == b else -1)
            entry = self.pairs.setdefault((a, b), [0.0, 0])
            if entry[1] < _MEMORY:
                entry[1] += 1
                self.counts[a] = self.counts.get(a, 0) + 1
                self.counts[b] = self.counts.get(b, 0) + 1
            entry[0] += (ratio - entry[0]) / entry[1]
            if self._logs is None or a not in self._logs or b not in self._logs:
                self._logs = None  # a shape new to the fit: refit now
            else:
                self._stale += 1
        self.last = (shape, seconds)
        log = self.logs().get(shape)
        if log is not None:
            sample = seconds / math.exp(log)
            self.speed = sample if self.speed is None else self.speed + (sample - self.speed) / _RECENT

    def now(self, shape) -> float | None:
        """Seconds a round of ``shape`` takes at the current speed; None until it was timed against others
        _TRUSTED times."""
        log = self.logs().get(shape)
        if log is None or self.speed is None or self.counts.get(shape, 0) < _TRUSTED:
            return None
        return self.speed * math.exp(log)

    def logs(self) -> dict:
        """Log relative time of each shape connected (through pairs) to the first one paired, that one at 0."""
        if self._logs is None or self._stale >= _REFIT:
            self._logs, self._stale = {}, 0
            if self.pairs:
                anchor = next(iter(self.pairs))[0]
                linked, grew = {anchor}, True
                while grew:
                    grew = False
                    for a, b in self.pairs:
                        if (a in linked) != (b in linked):
                            linked |= {a, b}
                            grew = True
                shapes = sorted(linked)
                index = {shape: i for i, shape in enumerate(shapes)}
                rows, targets = [], []
                for (a, b), (mean, n) in self.pairs.items():
                    if a in index:
                        row = np.zeros(len(shapes))
                        row[index[b]], row[index[a]] = math.sqrt(n), -math.sqrt(n)
                        rows.append(row)
                        targets.append(mean * math.sqrt(n))
                anchor_row = np.zeros(len(shapes))
                anchor_row[index[anchor]] = 1e3
                solution = np.linalg.lstsq(np.array(rows + [anchor_row]), np.array(targets + [0.0]), rcond=None)[0]
                self._logs = {shape: float(solution[i]) for shape, i in index.items()}
        return self._logs


class LoadAwareK:
    """The k (and, with a tree drafter, the tree width) of each round.

    ``widths``: the tree widths a round may use (1: a chain; with a tree drafter also its width, so every round
    weighs the wider verify call it costs against the acceptance it buys, measured per width, and falls back to
    chains, or to no drafts, where the wider call does not pay). ``nodes``: the most nodes a tree may have.
    Shapes are (k, width); a round's rate is keyed by (batch, k, width).
    """

    def __init__(self, k_max: int, allowed: list[int], widths=(1,), nodes: int | None = None):
        self.k_max = k_max
        self.allowed = allowed  # the k values the engines can verify, ascending
        self.widths = tuple(sorted(set(widths) | {1}))
        self.nodes = nodes
        self.checked: dict[int, int] = {w: 0 for w in self.widths}
        self.accepted: dict[int, int] = {w: 0 for w in self.widths}
        self.by_kind: dict[bool, list[int]] = {False: [0, 0], True: [0, 0]}  # sampled? -> chains' [accepted, checked]
        self.target = CallCosts()
        self.tree_target = CallCosts()  # tree calls apart: on onnxruntime they run another graph than chains do
        self.draft = CallCosts()
        # (b, k, width, sampled) -> [mean tokens, mean seconds, rounds, mean tokens expected from the rows' acceptance]:
        # the choice reads the seconds; the tokens against those expected show how the acceptance model fares
        self.rounds: dict[tuple, list[float]] = {}
        self.since_probe: dict[tuple, int] = {}  # (b, sampled) -> rounds since the last try of a neighbour
        self.probe_gap: dict[tuple, int] = {}  # (b, sampled) -> rounds between tries of a neighbour
        self.best: dict[tuple, tuple[int, int]] = {}  # (b, sampled) -> the best shape when last chosen
        self.times: dict[tuple, ShapeTimes] = {}  # (b, sampled) -> the shapes' seconds relative to each other
        self.last_expected: float | None = None  # the chosen shape's expected tokens (record_round's ``expected``)

    def record_acceptance(self, proposed: int, accepted: int, width: int = 1, sampled: bool = False):
        # alpha is per checked draft (per checked depth of a tree): drafts after the first rejection were never checked
        checked = accepted + (accepted < proposed)
        self.checked[width] += checked
        self.accepted[width] += accepted
        if width == 1:
            kind = self.by_kind[bool(sampled)]
            kind[0] += accepted
            kind[1] += checked

    def record_round(self, b: int, k: int, tokens: int, seconds: float, width: int = 1,
                     expected: float | None = None, sampled: bool = False):
        """A whole decode round at batch b with k drafts: the tokens it emitted and the seconds it took, and the
        tokens its rows were expected to emit when it was chosen (``expected_tokens``; None: rows with the policy's
        alpha); ``sampled``: whether any of its rows sampled."""
        if expected is None:
            expected = self.expected_tokens(k, np.full(b, k), width)
        self.times.setdefault((b, bool(sampled)), ShapeTimes()).record((k, width), seconds)
        entry = self.rounds.setdefault((b, k, width, bool(sampled)), [0.0, 0.0, 0, 0.0])
        entry[2] = min(entry[2] + 1, _MEMORY)
        entry[0] += (tokens - entry[0]) / entry[2]
        entry[1] += (seconds - entry[1]) / entry[2]
        entry[3] += (expected - entry[3]) / entry[2]

    def alpha_of(self, width: int = 1, sampled: bool | None = None) -> float:
        """Acceptance per checked draft of chains (width 1) or trees of ``width``; ``sampled``: of chains drafted
        for greedy (False) or sampled (True) rows, with all rows' as the prior (None: all rows')."""
        chain = (self.accepted[1] + _PRIOR_ALPHA * _PRIOR_WEIGHT) / (self.checked[1] + _PRIOR_WEIGHT)
        if width == 1:
            if sampled is None:
                return chain
            accepted, checked = self.by_kind[bool(sampled)]
            return (accepted + chain * _PRIOR_WEIGHT) / (checked + _PRIOR_WEIGHT)
        # before a tree is measured: its siblings catch a share of the chain's misses
        prior = chain + (1 - chain) * _PRIOR_RESCUE
        return (self.accepted[width] + prior * _PRIOR_WEIGHT) / (self.checked[width] + _PRIOR_WEIGHT)

    @property
    def alpha(self) -> float:
        return self.alpha_of(1)

    def row_alphas(self, seen) -> list[float]:
        """Each row's alpha from its request's (accepted, checked) drafts, or (accepted, checked, sampled), the
        policy's alpha (for rows of its kind, where given) as the prior."""
        priors = {kind: self.alpha_of(1, kind) for kind in (None, False, True)}
        return [(row[0] + priors[row[2] if len(row) > 2 else None] * _PRIOR_WEIGHT) / (row[1] + _PRIOR_WEIGHT)
                for row in seen]

    def expected_tokens(self, k: int, caps: np.ndarray, width: int = 1, alphas=None) -> float:
        """Tokens a round of k drafts per row (at most ``caps``) is expected to emit: E(alpha, k) summed over rows.
        ``alphas``: the rows' own (row_alphas), else the policy's; a tree's rows scale its alpha by theirs."""
        return _tokens(k, self._width_alphas(width, len(caps), alphas), caps)

    def _width_alphas(self, width: int, rows: int, alphas) -> list[float]:
        base = self.alpha_of(width)
        if alphas is None:
            return [base] * rows
        if width > 1:
            chain = self.alpha_of(1)
            return [min(0.99, base * a / chain) for a in alphas]
        return alphas

    def tree_size(self, k: int, width: int) -> int:
        """Nodes of a (k, width) tree: the tokens its verify call carries besides the last token."""
        nodes = k * width
        return min(nodes, self.nodes) if self.nodes and width > 1 else nodes

    def _estimated_cost(self, b: int, k: int, width: int = 1) -> float:
        size = self.tree_size(k, width)
        costs = self.tree_target if width > 1 and self.tree_target.means else self.target
        target = costs.estimate(b, size + 1)
        if target is None:  # nothing measured: relative units, decode call = 1
            target = 1 + _PRIOR_SLOPE * (b * (size + 1) - 1)
        if k == 0:
            return target
        draft = self.draft.estimate(b, 1)
        if draft is None:
            decode = self.target.estimate(b, 1)
            draft = _PRIOR_DRAFT_RATIO * (decode if decode is not None else 1.0)
        return target + k * draft

    def tokens_per_second(self, b: int, k: int, caps: np.ndarray, width: int = 1, alphas=None,
                          sampled: bool = False) -> float:
        """Measured tokens per second of rounds at (b, k, width) (with sampled rows or not), scaled to these rows'
        acceptance, or the estimate while they are too few."""
        return self._rate(b, k, width, self.expected_tokens(k, caps, width, alphas), sampled)

    def _rate(self, b: int, k: int, width: int, expected: float, sampled: bool = False) -> float:
        """``expected`` tokens over the seconds a round at this shape takes now: measured, once trusted (a shape
        other than the best timed against the best, _timed), else estimated from its calls."""
        seconds = self._timed(b, k, width, sampled)
        return expected / (seconds if seconds is not None else self._estimated_cost(b, k, width))

    def _timed(self, b: int, k: int, width: int, sampled: bool) -> float | None:
        """Seconds a round at (b, k, width) takes now, as measured (None while untrusted): its time relative to the
        other shapes' at the machine's current speed (ShapeTimes), else the mean of its own rounds. The tokens a
        shape emits come from the acceptance, which every round measures, and not from its own rounds' tokens: those
        vary by ~40 % a round, so the few tries a neighbour gets could not tell neighbouring k apart."""
        seen = self.rounds.get((b, k, width, bool(sampled)))
        if seen is None or seen[2] < _TRUSTED or seen[1] <= 0:
            return None
        times = self.times.get((b, bool(sampled)))
        now = times.now((k, width)) if times is not None else None
        return now if now is not None else seen[1]

    def call_cost(self, b: int, t: int, tree: bool = False) -> float | None:
        """Seconds of a target call over b rows of t tokens (tree calls apart), as measured or fitted so far; None
        before any was measured. A drafter that shapes its own rounds (suffix) reads its costs here."""
        return (self.tree_target if tree else self.target).estimate(b, t)

    def choose(self, b: int, caps: np.ndarray, seen=None, sampled: bool = False) -> int:
        """The best k for this round (0: plain decoding); ``caps`` [rows] bounds each row's k."""
        return self.choose_shape(b, caps, seen, sampled)[0]

    def choose_shape(self, b: int, caps: np.ndarray, seen=None, sampled: bool = False) -> tuple[int, int]:
        """The best (k, width) for this round ((0, 1): plain decoding); ``caps`` [rows] bounds each row's k;
        ``seen``: each row's (accepted, checked) or (accepted, checked, sampled) drafts so far (None: every row has
        the policy's alpha); ``sampled``: whether any row samples (such rounds are measured apart)."""
        alphas = None if seen is None else self.row_alphas(seen)
        top = min(int(caps.max()) if caps.size else 0, self.k_max)
        candidates = [(0, 1)] + [(k, w) for k in self.allowed[:bisect.bisect_right(self.allowed, top)]
                                 for w in self.widths]
        self.last_expected = None
        if len(candidates) == 1:
            return 0, 1
        caps_list = caps.tolist()
        by_width = {w: self._width_alphas(w, len(caps_list), alphas) for w in self.widths}
        expected = {c: _tokens(c[0], by_width[c[1]], caps_list) for c in candidates}
        rates = {c: self._rate(b, *c, expected[c], sampled) for c in candidates}
        best = max(candidates, key=rates.get)
        choice = self._probe((b, bool(sampled)), best, candidates, rates)
        self.last_expected = expected[choice]
        return choice

    def plain_at(self, b: int) -> bool:
        """Whether its last choice at batch size b was plain decoding (for greedy and sampled rounds both)."""
        shapes = [shape for (size, _), shape in self.best.items() if size == b]
        return bool(shapes) and all(k == 0 for k, _ in shapes)

    def plain_stretch(self, b: int, sampled: bool = False) -> int:
        """Rounds of plain decoding to run at once after choose_shape gave k = 0, before the policy looks again:
        those until its next try of a neighbour, counted as chosen (at least 1). A lone row runs them in the
        engine's own loop, without a step of the scheduler per token."""
        key = (b, bool(sampled))
        left = max(1, self.probe_gap.get(key, _PROBE_EVERY) - self.since_probe.get(key, 0))
        self.since_probe[key] = self.since_probe.get(key, 0) + left - 1
        return left

    def _probe(self, key, best, candidates, rates):
        """``key``: (batch size, sampled), the rounds among which the best shape is probed."""
        if self.best.get(key) != best:  # something changed: look around soon
            self.best[key] = best
            self.probe_gap[key] = _PROBE_EVERY
        waited = self.since_probe.get(key, 0) + 1
        self.since_probe[key] = waited
        gap = self.probe_gap.get(key, _PROBE_EVERY)
        if waited >= gap:
            self.since_probe[key] = 0
            self.probe_gap[key] = min(2 * gap, _PROBE_MAX)
            # a neighbour of the best: one k up or down at its width, or the other widths at its k; the one
            # measured least often (the fewest rounds on record)
            k, w = best
            ks = [c[0] for c in candidates if c[1] == w]
            i = ks.index(k)
            near = [(ks[j], w) for j in (i - 1, i + 1) if 0 <= j < len(ks)]
            near += [(k, other) for other in self.widths if other != w and (k, other) in rates]
            if near:
                return min(near, key=lambda c: self.rounds.get((key[0], *c, key[1]), [0, 0, 0])[2])
        return best
