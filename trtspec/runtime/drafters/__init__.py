"""Drafters: what proposes a round's drafts, one module each, all speaking drafters/base.Drafter.

    none            base.Drafter itself: no drafts
    draft           draft_model.DraftModelDrafter: a small model over its own engine (chains, or trees with siblings)
    prompt_lookup   prompt_lookup.PromptLookupDrafter: the latest earlier occurrence of the row's last n-gram
    suffix          suffix.SuffixDrafter: trees from the request's own text and earlier outputs, shaped each round
                    from the measured call costs; with a draft model, suffix.SuffixThenDraft (the model drafts the
                    rows suffix matching has nothing for)
    eagle3          eagle3.Eagle3Drafter: an EAGLE-3 head on the target's features
    medusa          medusa.MedusaDrafter: Medusa heads on the target's last hidden state (product trees)
and self_draft.self_draft: the target's own INT4 build as a draft model (draft="self").

``make_drafter(name, ...)`` builds one from its name (the Scheduler's ``drafter``); the Scheduler checks the
combination (a head needs its engine and a target that outputs features, trees a --tree target) before.
"""

from __future__ import annotations

from .base import ANY, Drafter, Proposal
from .draft_model import DraftModelDrafter
from .eagle3 import Eagle3Drafter
from .medusa import MedusaDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixCache, SuffixDrafter, SuffixThenDraft


def _suffix(target, draft, max_batch, pad_id, tree_width, tree_nodes):
    # trees where the target verifies them; its cache of earlier outputs lives as long as the drafter
    suffix = SuffixDrafter(max_batch, tree=bool(getattr(target, "tree_verify", False)), tree_nodes=tree_nodes,
                           one_token_matches=draft is None)
    return suffix if draft is None else SuffixThenDraft(suffix, DraftModelDrafter(draft, pad_id))


# name -> (target, draft, max_batch, pad_id, tree_width, tree_nodes) -> Drafter
REGISTRY = {
    "draft": lambda target, draft, max_batch, pad_id, width, nodes: DraftModelDrafter(
        draft, pad_id, tree_width=width, tree_nodes=nodes),
    "eagle3": lambda target, draft, max_batch, pad_id, width, nodes: Eagle3Drafter(
        draft, target, pad_id, tree_width=width, tree_nodes=nodes),
    "medusa": lambda target, draft, max_batch, pad_id, width, nodes: MedusaDrafter(
        draft, target, tree_nodes=nodes),  # the heads run in a small graph of their own: no draft engine
    "prompt_lookup": lambda target, draft, max_batch, pad_id, width, nodes: PromptLookupDrafter(max_batch),
    "suffix": _suffix,
    "none": lambda target, draft, max_batch, pad_id, width, nodes: Drafter(),
}
DRAFTERS = tuple(REGISTRY)
HEADS = ("eagle3", "medusa")  # drafters whose draft is a head on the target's features (draft=PATH of the head)


def make_drafter(name: str, *, target, draft=None, max_batch: int, pad_id: int, tree_width: int = 1,
                 tree_nodes: int | None = None) -> Drafter:
    """The drafter ``name`` (one of DRAFTERS) over a loaded target (and draft engine, or a head's path)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    return REGISTRY[name](target, draft, max_batch, pad_id, tree_width, tree_nodes)


__all__ = ["ANY", "DRAFTERS", "HEADS", "REGISTRY", "DraftModelDrafter", "Drafter", "Eagle3Drafter", "MedusaDrafter",
           "PromptLookupDrafter", "Proposal", "SuffixCache", "SuffixDrafter", "SuffixThenDraft", "make_drafter"]
