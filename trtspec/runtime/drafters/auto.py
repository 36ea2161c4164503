"""``auto``: suffix decoding where the text repeats, an EAGLE-3 head elsewhere (the default drafter of an engine
that carries a head: heads/carried.py).

Each round, every row first asks the suffix drafter (drafters/suffix.py: matches in the request's own text, in
earlier outputs and in a datastore, each round's tree or chain shaped from the measured verify costs). The rows
it proposes nothing for go to the head. The head reads the target's features of every verified position whichever
drafter drafted, so it is always ready (one catch-up call feeds the pairs of rounds it sat out). This is
SuffixThenDraft with the head in the draft model's place, and two things of its own for greedy rows
(ConfidenceStop):
- each row's chain stops where the next draft no longer pays, judged from the head's own probability of the
  chain so far (EAGLE-2's observation: it predicts how much of the chain the target accepts), calibrated online
  against what was accepted, and the measured verify and head call costs; the chain is then cut to the length with
  the most tokens expected per second (0: the row verifies alone);
- the head is asked at all only while the rounds that asked it made more tokens a second than decoding alone
  would (their accepted drafts, verify calls and head calls, measured), with a probe every few rounds otherwise.
(Giving the head the rows where its chain expected more accepted tokens than the suffix proposal, without weighing
its calls' cost, was measured slower: benchmarks/results/real-eagle3-own.md; sampled rows draft at the k the
head's measured acceptance and call costs give, as SuffixThenDraft does.)
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ...errors import ArtifactError
from ...manifest import MANIFEST, read_manifest
from .eagle3 import Eagle3Drafter
from .suffix import SuffixDrafter, SuffixThenDraft


HEAD_DIR = "head"  # where an engine keeps the head it carries (heads/carried.py writes it)
_BINS = 10  # the calibration's bins of the head's chain probability
_PRIOR = 4.0  # chains' worth of "the head's probability is right" in each bin before any is measured
_MEMORY = 512.0  # the calibration's counts are halved beyond this many drafts: acceptance drifts with the text
_EMA = 0.1  # the weight of a round in the asked rounds' running means
_PROBE_EVERY = 8  # rounds without asking the head before it is asked anyway (its rate is measured again)


def carried_head(engine) -> Path | None:
    """The directory of the head an engine (loaded, or its path) carries, or None."""
    if hasattr(engine, "manifest"):
        path, manifest = Path(engine.path), engine.manifest
    else:
        path = Path(engine)
        if not (path / MANIFEST).is_file():
            return None
        manifest = read_manifest(path)
    head = manifest.get("head")
    if not head:
        return None
    where = path / head["path"]
    if not (where / MANIFEST).is_file():
        raise ArtifactError(f"{path} says it carries a head in {head['path']}/ but it is not there: rebuild the "
                            "engine with --head")
    return where


class ConfidenceStop:
    """Where a greedy row's head chain ends (drafters/eagle3.py calls ``extend`` after each draft and ``trim`` at
    the end; the module docstring says why). ``costs``: (rows, tokens a row, tree) -> a verify call's seconds, or
    None before it is measured (then chains are not cut)."""

    def __init__(self, costs):
        self.costs = costs
        self.hits, self.trials = np.zeros(_BINS), np.zeros(_BINS)
        self.call_s: float | None = None  # a one-token head call's seconds, measured
        self.pending: dict[int, np.ndarray] = {}  # row -> its proposed chain's probabilities, until the verdict

    def calibrated(self, chain):
        """The head's chain probabilities [rows, j] -> how likely the target accepts the chain up to each draft,
        from how often it did at such probabilities (never rising along a chain)."""
        i = np.minimum((chain * _BINS).astype(np.int64), _BINS - 1)
        c = (self.hits[i] + _PRIOR * chain) / (self.trials[i] + _PRIOR)
        return np.minimum.accumulate(c, axis=1)

    def _verify(self, b: int, t: int) -> float | None:
        return self.costs(b, t, False) if self.costs is not None else None

    def _rates(self, c, sunk: float):
        """Tokens expected per second of the round [rows, j + 1] with 0..j of each row's drafts (``c``: their
        calibrated chain probabilities [rows, j]; ``sunk``: the head's seconds so far), or None (costs unknown)."""
        b, j = c.shape
        verify = [self._verify(b, t) for t in range(1, j + 2)]
        if any(v is None for v in verify):
            return None
        tokens = np.concatenate([np.ones((b, 1)), 1.0 + np.cumsum(c, axis=1)], axis=1)
        return tokens / (np.asarray(verify) + sunk)

    def extend(self, chain, calls) -> np.ndarray:
        """[rows] bool: whether each row's next draft is worth one more head call: the tokens it adds, expected
        (the chain's last step's odds again), over the call and the longer verify, beat the row's best rate."""
        b, j = chain.shape
        sunk = sum(s for _, _, s in calls)
        c = self.calibrated(chain)
        rates = self._rates(c, sunk)
        longer = self._verify(b, j + 2)
        if rates is None or longer is None:
            return np.ones(b, bool)
        step = c[:, -1] / np.maximum(c[:, -2], 1e-9) if j > 1 else c[:, -1]
        more = (1.0 + c.sum(1) + c[:, -1] * step) / (longer + sunk + (self.call_s or (calls[-1][2] if calls else 0.0)))
        return more > rates.max(1)

    def trim(self, chain, counts, calls) -> np.ndarray:
        """Each row's count of drafts cut to the one with the most tokens expected per second (0 included)."""
        single = [s for _, t, s in calls[1:] if t == 1]
        if single:
            call = sum(single) / len(single)
            self.call_s = call if self.call_s is None else 0.8 * self.call_s + 0.2 * call
        c = self.calibrated(chain)
        rates = self._rates(c, sum(s for _, _, s in calls))
        if rates is not None:
            j = np.arange(rates.shape[1])
            rates = np.where(j[None, :] <= counts[:, None], rates, -np.inf)
            counts = np.minimum(counts, rates.argmax(1))
        self.pending = {r: chain[r, : counts[r]].copy() for r in np.flatnonzero(counts)}
        return counts

    def record(self, row: int, got: int) -> None:
        """Row ``row``'s proposed chain had its first ``got`` drafts accepted."""
        chain = self.pending.pop(row, None)
        if chain is None:
            return
        i = np.minimum((chain * _BINS).astype(np.int64), _BINS - 1)
        np.add.at(self.trials, i, 1.0)
        np.add.at(self.hits, i[:got], 1.0)
        if self.trials.sum() > _MEMORY:
            self.hits *= 0.5
            self.trials *= 0.5


class AutoDrafter(SuffixThenDraft):
    name = "auto"
    proposes_drafts = True
    needs_draft_model = True  # its head, on an engine of its own (carried by the target's engine, or draft=)
    reads_features = True
    reads_datastore = True
    proposes_trees = True
    shapes_own_rounds = True
    # the head's cost per drafted token counts its catch-up call too (after a prompt or suffix rounds it feeds many
    # pairs at once): with one-token calls alone the head was chosen where it made decode slower
    whole_rounds = True

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes, datastore=None):
        suffix = SuffixDrafter(max_batch, tree=bool(getattr(target, "tree_verify", False)), tree_nodes=tree_nodes,
                               one_token_matches=False, datastore=datastore)
        return cls(suffix, Eagle3Drafter(draft, target, pad_id))

    def __init__(self, suffix, fallback):
        super().__init__(suffix, fallback)
        self.stop = fallback.stop = ConfidenceStop(None)
        # the rounds that asked the head (greedy): running means of their accepted drafts, drafts and head seconds
        self.asked: tuple[float, float, float] | None = None
        self.unasked = 0  # rounds since the head was last asked
        self._greedy = False  # this round's rows all decode greedily without constraints (ConfidenceStop's rounds)
        self._round_s = 0.0  # this round's seconds in the head's drafting

    @property
    def costs(self):
        return self.suffix.costs

    @costs.setter
    def costs(self, value):
        self.suffix.costs = self.stop.costs = value

    def observe(self, first_row, starts, features):
        self.fallback.observe(first_row, starts, features)

    def _draft_k(self, b: int, cap: int) -> int:
        """Sampled rows: SuffixThenDraft's k. Greedy rows: every draft (the head's chains end where they stop
        paying), or none while the rounds that asked the head were slower than decoding alone (the module
        docstring)."""
        if not self._greedy:
            return super()._draft_k(b, cap)
        one, asked = self.costs(b, 1, self.suffix.tree) if self.costs is not None else None, self.asked
        if one is None or asked is None or self.unasked >= _PROBE_EVERY:
            self.unasked = 0
            return cap
        accepted, drafts, seconds = asked
        longer = self.costs(b, 1 + max(1, round(drafts)), self.suffix.tree)
        if longer is None or (1.0 + accepted) / (longer + seconds) >= 1.0 / one:
            self.unasked = 0
            return cap
        self.unasked += 1
        return 0

    def propose(self, tokens, n, caps, samplers, capacity):
        proposal = self.suffix.propose(tokens, n, caps, samplers, capacity)
        need = (proposal.counts == 0) & (caps > 0)
        self._greedy = all(s.plain and s.mode == "greedy" for s in samplers)
        self.stop.pending = {}
        t0 = time.perf_counter()
        proposal = self._with_model(proposal, need, tokens, n, caps, samplers, capacity)
        self._round_s = time.perf_counter() - t0  # the head's calls and the work around them
        if self._greedy and self._drafted is None and need.any() and proposal.calls:  # asked, nothing proposed
            self._asked(0.0, 0.0, self._round_s)
        # in the stats, each row's drafts are the suffix drafter's or the head's (eagle3)
        sources = proposal.sources or ["suffix"] * n.size
        proposal.sources = ["eagle3" if s == "draft" else s for s in sources]
        return proposal

    def accepted(self, valid):
        drafted = self._drafted
        if self._greedy and drafted:
            got = self._drafts_accepted(valid)
            for (r, _, _), g in zip(drafted, got):
                self.stop.record(r, g)
            self._asked(sum(got) / len(got), sum(m for _, _, m in drafted) / len(drafted), self._round_s)
        super().accepted(valid)

    def _asked(self, accepted: float, drafts: float, seconds: float) -> None:
        now = (accepted, drafts, seconds)
        self.asked = now if self.asked is None else tuple((1 - _EMA) * a + _EMA * x for a, x in zip(self.asked, now))
