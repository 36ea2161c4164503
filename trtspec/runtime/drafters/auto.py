"""``auto``: suffix decoding where the text repeats, an EAGLE-3 head elsewhere (the default drafter of an engine
that carries a head: heads/carried.py).

Each round, every row first asks the suffix drafter (drafters/suffix.py: matches in the request's own text, in
earlier outputs and in a datastore, each round's tree or chain shaped from the measured verify costs). A row
goes to the head where the suffix drafter proposes nothing, or where the head's chain expects more accepted
tokens (its acceptance measured so far, alpha + alpha^2 + ... up to the row's k) than the suffix proposal does
(its nodes' calibrated scores summed). The head drafts its rows at the k with the most tokens expected per second
from that acceptance and its measured call time (0: those rows verify alone). The head reads the
target's features of every verified position whichever drafter drafted, so it is always ready (one catch-up call
feeds the pairs of rounds it sat out). This is SuffixThenDraft with the head in the draft model's place.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ArtifactError
from ...manifest import MANIFEST, read_manifest
from .eagle3 import Eagle3Drafter
from .suffix import SuffixDrafter, SuffixThenDraft


HEAD_DIR = "head"  # where an engine keeps the head it carries (heads/carried.py writes it)


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


class AutoDrafter(SuffixThenDraft):
    name = "auto"
    proposes_drafts = True
    needs_draft_model = True  # its head, on an engine of its own (carried by the target's engine, or draft=)
    reads_features = True
    reads_datastore = True
    proposes_trees = True
    shapes_own_rounds = True

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes, datastore=None):
        suffix = SuffixDrafter(max_batch, tree=bool(getattr(target, "tree_verify", False)), tree_nodes=tree_nodes,
                               one_token_matches=False, datastore=datastore)
        return cls(suffix, Eagle3Drafter(draft, target, pad_id))

    def observe(self, first_row, starts, features):
        self.fallback.observe(first_row, starts, features)

    def head_alpha(self) -> float:
        """The head's acceptance per drafted token on the rows it drafted (prior 0.5, worth 8 drafts)."""
        return (self.draft_accepted + 0.5 * 8) / (self.draft_checked + 8)

    def propose(self, tokens, n, caps, samplers, capacity):
        suffix = self.suffix
        proposal = suffix.propose(tokens, n, caps, samplers, capacity)
        need = (proposal.counts == 0) & (caps > 0)
        if suffix._round:
            # a row the suffix drafter matched goes to the head where the head expects more tokens: the suffix
            # nodes' calibrated scores summed (its expected accepted tokens) against the head's chain at this k
            alpha = self.head_alpha()
            proposal.counts = proposal.counts.copy()
            for r, _, depths, scores, c in suffix._round:
                gain = suffix._gain[c]
                head = sum(alpha**j for j in range(1, int(caps[r]) + 1))
                if head > sum(sc * (gain[d] if d < len(gain) else 1.0) for d, sc in zip(depths, scores)):
                    need[r] = True
                    proposal.counts[r] = 0
            # (the suffix drafter calibrates only on the rows it still drafts)
            suffix._round = [entry for entry in suffix._round if not need[entry[0]]]
        proposal = self._with_model(proposal, need, tokens, n, caps, samplers, capacity)
        # in the stats, each row's drafts are the suffix drafter's or the head's (eagle3)
        sources = proposal.sources or ["suffix"] * n.size
        proposal.sources = ["eagle3" if s == "draft" else s for s in sources]
        return proposal
