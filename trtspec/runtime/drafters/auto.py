"""``auto``: suffix decoding where the text repeats, an EAGLE-3 head elsewhere (the default drafter of an engine
that carries a head: heads/carried.py).

Each round, every row first asks the suffix drafter (drafters/suffix.py: matches in the request's own text, in
earlier outputs and in a datastore, each round's tree or chain shaped from the measured verify costs). The rows
it proposes nothing for go to the head, at the k with the most tokens expected per second from the head's
acceptance measured on such rows and its measured call time (0: those rows verify alone). (Giving the head the
rows where its chain expected more accepted tokens than the suffix proposal, without weighing its calls' cost,
was measured slower: benchmarks/results/real-eagle3-own.md.) The head reads the
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
    # the head's cost per drafted token counts its catch-up call too (after a prompt or suffix rounds it feeds many
    # pairs at once): with one-token calls alone the head was chosen where it made decode slower
    whole_rounds = True

    @classmethod
    def make(cls, *, target, draft, max_batch, pad_id, tree_width, tree_nodes, datastore=None):
        suffix = SuffixDrafter(max_batch, tree=bool(getattr(target, "tree_verify", False)), tree_nodes=tree_nodes,
                               one_token_matches=False, datastore=datastore)
        return cls(suffix, Eagle3Drafter(draft, target, pad_id))

    def observe(self, first_row, starts, features):
        self.fallback.observe(first_row, starts, features)

    def propose(self, tokens, n, caps, samplers, capacity):
        proposal = self.suffix.propose(tokens, n, caps, samplers, capacity)
        need = (proposal.counts == 0) & (caps > 0)
        proposal = self._with_model(proposal, need, tokens, n, caps, samplers, capacity)
        # in the stats, each row's drafts are the suffix drafter's or the head's (eagle3)
        sources = proposal.sources or ["suffix"] * n.size
        proposal.sources = ["eagle3" if s == "draft" else s for s in sources]
        return proposal
