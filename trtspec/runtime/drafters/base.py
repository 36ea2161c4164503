"""The protocol every drafter speaks, and what a round's drafts are (Proposal).

A drafter proposes up to k next tokens per sequence. It sees the scheduler's token buffer ``tokens [B, cap]`` and
each row's known token count ``n [B]`` (prompt + output so far; the last one is not in the target's cache yet).
Rows are engine rows: a request enters one with ``admit`` (taking back reused prefix slots), reads its prompt
alongside the target with ``prefill``, and the batch is compacted with ``move_row``. ``propose`` returns a
Proposal; after the target's verdict, ``accepted`` says which tokens of each row are now known to be right. The
scheduler knows only this class; ``Drafter`` itself is the drafter that proposes nothing ("none"), and its
methods are the no-op defaults of a drafter without a cache of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...engines.base import SavedPrefix

ANY = 1 << 62  # a drafter without a cache reuses any prefix


@dataclass
class Proposal:
    """One round's drafts. ``calls``: the draft-engine calls made for it as (rows, tokens per row, seconds),
    a catch-up call first; the load-aware k policy learns the draft's costs from them."""

    drafts: np.ndarray  # [B, K] int64
    counts: np.ndarray  # [B] int64: how many of each row's drafts are real proposals (<= its cap)
    probs: np.ndarray | None = None  # [B, K, V]: the draft distributions of rows that sample by rejection
    calls: list[tuple[int, int, float]] = field(default_factory=list)
    # a token tree instead of chains: parents[r, j] is the index of drafts[r, j]'s parent among the row's drafts,
    # -1 for the row's last token (parents before children); verified in one tree call (the walk: verify.RowSampler.accept)
    parents: np.ndarray | None = None
    shape: str | None = None  # the tree's shape as reported in the stats, e.g. "4x3"
    # [B, K] bool: drafts a grammar forced (jump-forward), not proposed: they count apart from the drafter's own
    forced: np.ndarray | None = None
    # each row's drafter by name, where one drafter speaks for another (suffix over a draft model); None: its own
    sources: list[str] | None = None

    @classmethod
    def empty(cls, b: int) -> Proposal:
        return cls(np.zeros((b, 0), np.int64), np.zeros(b, np.int64))


class Drafter:
    name = "none"
    # What a drafter needs, read from its class through the registry (drafters.REGISTRY) before one is made: the
    # Scheduler checks the combination against these and knows no drafter by name.
    proposes_drafts = False  # "none" proposes nothing; every other drafter drafts
    needs_draft_model = False  # draft=PATH is required: a draft model's engine (eagle3: its head's)
    reads_features = False  # a head on the target's hidden states (draft=PATH: the exported head)
    combines_with_draft = False  # draft=PATH is optional: a draft model drafts the rows it has nothing for
    reads_datastore = False  # datastore=INDEX: drafts from a corpus the user indexed (drafters/datastore.py)
    proposes_trees = False  # token trees of up to tree_nodes nodes, where the target verifies trees (a --tree export)
    branches = False  # tree_width > 1: siblings beside its chains, each round's width the load-aware policy's choice
    shapes_own_rounds = False  # it shapes each round itself from the verify call's measured costs (``costs``)
    costs = None  # (rows, tokens per row, tree) -> the verify call's seconds or None, for a drafter shaping its rounds
    # whether propose() may get, for a row whose grammar forces its next tokens, an n past them (they are in
    # ``tokens`` and the row's logits processor, not yet in the target's cache): chains only, never trees
    drafts_after_forced = False
    # whether its cache reads what it lacks in propose() (the tokens of rounds it did not draft, a prompt it did not
    # read): the scheduler then spares it the prompts while the load-aware policy is not drafting
    catches_up = False

    @classmethod
    def make(cls, *, target, draft, max_batch: int, pad_id: int, tree_width: int, tree_nodes: int | None) -> Drafter:
        """One over a loaded target (and ``draft``: a loaded draft engine, a head's path, or None)."""
        return cls()

    def admit(self, row: int, prefix: SavedPrefix | None, n: int) -> None:
        """A request takes ``row``; the first n slots of ``prefix`` (from save_prefix) are reused (n may be 0)."""

    def reusable(self, prefix: SavedPrefix | None) -> int:
        """How many leading tokens of a saved prefix this drafter can take back (no cache of its own: any)."""
        return ANY

    def save_prefix(self, row: int, n: int) -> SavedPrefix | None:
        """What this drafter keeps of the first n tokens of ``row`` for reuse, or None."""
        return None

    def prefill(self, input_ids: np.ndarray, position_ids: np.ndarray, first_row: int, fed: np.ndarray) -> int:
        """Rows [first_row, first_row + P) read the same prompt chunk as the target: ids [P, T], fed [P]. Returns
        the draft-engine calls it made."""
        return 0

    def propose(self, tokens: np.ndarray, n: np.ndarray, caps: np.ndarray, samplers, capacity: int) -> Proposal:
        """Up to caps[r] drafts for each row r (tokens [B, cap], n [B], caps [B], one RowSampler per row)."""
        return Proposal.empty(n.size)

    def accepted(self, valid: np.ndarray) -> None:
        """valid [B]: the tokens of each row now known to be right."""

    def move_row(self, src: int, dst: int) -> None:
        """Row src moves to dst (the batch is compacted)."""

    def finish(self, row: int, tokens: np.ndarray, prompt_len: int) -> None:
        """The request in ``row`` finished with ``tokens`` (its prompt's ``prompt_len``, then its output)."""
