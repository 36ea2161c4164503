"""Drafters: what proposes a round's drafts, one module each, all speaking drafters/base.Drafter.

    none            base.Drafter itself: no drafts
    draft           draft_model.DraftModelDrafter: a small model over its own engine (chains, or trees with siblings)
    prompt_lookup   prompt_lookup.PromptLookupDrafter: the latest earlier occurrence of the row's last n-gram
    suffix          suffix.SuffixDrafter: trees from the request's own text and earlier outputs, shaped each round
                    from the measured call costs; with a draft model, suffix.SuffixThenDraft (the model drafts the
                    rows suffix matching has nothing for)
    eagle3          eagle3.Eagle3Drafter: an EAGLE-3 head on the target's features
    medusa          medusa.MedusaDrafter: Medusa heads on the target's last hidden state (product trees)
    auto            auto.AutoDrafter: suffix decoding where the text repeats, the EAGLE-3 head elsewhere (the
                    default for an engine that carries a head)
and self_draft.self_draft: the target's own INT4 build as a draft model (draft="self").

``make_drafter(name, ...)`` builds one from its name (the Scheduler's ``drafter``). What each needs is declared on
its class (base.Drafter: needs_draft_model, reads_features, combines_with_draft, proposes_trees, ...), read from
REGISTRY: the Scheduler checks the combination (a head needs a target that outputs features, trees a --tree
target) against them before, and knows no drafter by name.
"""

from __future__ import annotations

from .auto import AutoDrafter, carried_head
from .base import ANY, Drafter, Proposal
from .draft_model import DraftModelDrafter
from .eagle3 import Eagle3Drafter
from .medusa import MedusaDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter, SuffixThenDraft
from .datastore import Datastore, build_index, open_datastore
from .suffix_text import SuffixCache

# name -> the drafter's class: what it needs (base.Drafter's class attributes) and how one is made (``make``)
REGISTRY: dict[str, type[Drafter]] = {cls.name: cls for cls in (
    DraftModelDrafter, Eagle3Drafter, MedusaDrafter, PromptLookupDrafter, SuffixDrafter, AutoDrafter, Drafter)}
DRAFTERS = tuple(REGISTRY)


def make_drafter(name: str, *, target, draft=None, max_batch: int, pad_id: int, tree_width: int = 1,
                 tree_nodes: int | None = None, datastore=None) -> Drafter:
    """The drafter ``name`` (one of DRAFTERS) over a loaded target (and draft engine, or a head's path); a
    ``datastore`` (drafters/datastore.py, loaded) goes to the drafters that read one (suffix)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    extra = {} if datastore is None else {"datastore": datastore}
    return REGISTRY[name].make(target=target, draft=draft, max_batch=max_batch, pad_id=pad_id, tree_width=tree_width,
                               tree_nodes=tree_nodes, **extra)


def default_drafter(name: str | None, draft, datastore, target) -> tuple[str, object]:
    """(drafter, draft): the drafter when none is named (auto for an engine that carries a head, no draft given;
    suffix decoding with a datastore; the draft model's when a draft is given; else none), and for a head's drafter
    without a draft the head the target's engine carries (trtspec build --head)."""
    head = carried_head(target) if draft is None else None
    if name is None:
        if head is not None:
            name = AutoDrafter.name
        elif datastore is not None:
            name = SuffixDrafter.name
        else:
            name = DraftModelDrafter.name if draft is not None else Drafter.name
    if head is not None and name in REGISTRY and REGISTRY[name].reads_features:
        draft = str(head)
    return name, draft


def check_datastore(name: str, datastore, tokenizer, what: str) -> Datastore | None:
    """The datastore (a path, loaded here, or a loaded one) for drafter ``name``, checked: only a drafter that reads
    one takes it, and it must be of ``tokenizer``'s vocabulary (``what``'s, for the message). None: none given."""
    if datastore is None:
        return None
    if not REGISTRY[name].reads_datastore:
        raise ValueError(f"a datastore was given but drafter is {name!r}; a datastore extends suffix decoding: use "
                         "drafter='suffix' (--drafter suffix), or drop the datastore")
    store = open_datastore(datastore)
    store.check_tokenizer(tokenizer, what)
    return store


def check_drafter(name: str, draft, target) -> None:
    """The drafter ``name`` checked against what its class says it needs (a draft model, a head, a target's
    features) and the ``draft`` given; raises the user's error."""
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    kind = REGISTRY[name]
    if kind.reads_features and draft is None:
        raise ValueError(f"drafter {name!r} needs its head: pass draft=PATH of the exported head (trtspec export-head)")
    if kind.needs_draft_model and draft is None:
        raise ValueError(f"drafter {name!r} needs a draft model: pass draft=PATH (or choose prompt_lookup/none)")
    if kind.reads_features and not hasattr(target, "features"):
        raise ValueError(f"drafter {name!r} reads the target's hidden states, which the {target.backend} "
                         "engine does not return; use the onnxruntime engine of a --hidden-states export")
    if not (kind.needs_draft_model or kind.reads_features or kind.combines_with_draft) and draft is not None:
        raise ValueError(f"a draft model was given but drafter is {name!r}; drop one of them")


def check_tree(name: str, width, nodes, target) -> tuple[int, int | None]:
    """tree_width / tree_nodes checked against the drafter and the target (a tree needs a --tree export)."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"tree_width must be an integer >= 1 (1: chains), got {width!r}")
    if nodes is not None and (not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1):
        raise ValueError(f"tree_nodes must be an integer >= 1 (or None: depth x width), got {nodes!r}")
    if width > 1 or nodes is not None:
        kind = REGISTRY[name]
        if width > 1 and not (kind.branches or kind.reads_features):
            raise ValueError(f"tree_width applies to the draft-model and head drafters, not {name!r}")
        if not kind.proposes_trees:
            raise ValueError(f"tree_nodes applies to the draft-model, head and suffix drafters, not {name!r}")
        if not getattr(target, "tree_verify", False):
            raise ValueError(f"the target {target.path} cannot verify token trees: re-export it with "
                             "--tree (trtspec export) or compile it with tree=True (torch backend), or use "
                             "tree_width=1 (chains)")
    return width, nodes


__all__ = ["ANY", "AutoDrafter", "DRAFTERS", "REGISTRY", "Datastore", "DraftModelDrafter", "Drafter", "Eagle3Drafter",
           "MedusaDrafter", "PromptLookupDrafter", "Proposal", "SuffixCache", "SuffixDrafter", "SuffixThenDraft",
           "build_index", "check_datastore", "check_drafter", "check_tree", "default_drafter", "make_drafter"]
