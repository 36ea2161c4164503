"""Jump-forward: the tokens a request's grammar forces next, verified without asking the drafter.

Each round, a grammar row's forced tokens (``forced_tokens``) go in front of its drafts. A chain drafter that
drafts after them (``drafts_after_forced``) sees them in the row's buffer and its logits processor
(``ahead_of_forced``); a tree drafter drafts nothing for the row. ``constrain`` cuts a grammar row's chain at
its first forbidden draft and lays the forced tokens in front of it (marked, so they count apart from the
drafter's: ``forced_counts``). The scheduler plans a round's forced tokens (``forced_tokens``); the worker lays
them into the round (the others). Rows are given by their RowSamplers.
"""

from __future__ import annotations

import numpy as np


def forced_tokens(samplers, caps, room: np.ndarray, drafts_after: bool, most: int, max_drafts: int):
    """{row: the tokens its grammar forces next}, or None when no row has a grammar. A row's cap (caps, changed in
    place) shrinks by its forced tokens where the drafter drafts after them, else becomes 0. ``room``: each
    row's room for tokens this round (the cache's and its output's); ``most``: the
    forced tokens a round verifies at most; ``max_drafts``: the tokens a verify call carries past a row's last one."""
    forced = None
    for s, sampler in enumerate(samplers):
        proc = sampler.processor
        if proc is None or proc.constraint is None:
            continue
        forced = {} if forced is None else forced
        tokens = proc.forced()
        if tokens:
            tokens = tokens[: min(int(room[s]), most)]  # (rings: calls are short)
        if tokens:
            forced[s] = tokens
            caps[s] = max(0, min(int(caps[s]), int(room[s]) - len(tokens), max_drafts - len(tokens))
                          if drafts_after else 0)
    return forced


def ahead_of_forced(samplers, forced, caps, tokens, n):
    """Each row's length as the drafter sees it: a row that drafts after forced tokens has them in its buffer
    (``tokens``, where they will be emitted: the grammar allows nothing else) and in its logits processor's state."""
    if not forced or not any(caps[s] for s in forced):
        return n
    ahead = n.copy()
    for s, forced_row in forced.items():
        if caps[s]:
            tokens[s, n[s] : n[s] + len(forced_row)] = forced_row
            for t in forced_row:
                samplers[s].processor.push(t)
            ahead[s] += len(forced_row)
    return ahead


def constrain(samplers, proposal, forced, room, max_drafts: int) -> None:
    """Grammar rows: drafts are cut at the first token the grammar forbids (a draft model proposes under the
    grammar already; prompt lookup does not); a forced row verifies its forced tokens, then its drafts (in place:
    ``proposal``'s drafts, counts, probs, forced marks and parents). ``room``: each row's room this round."""
    tree = proposal.parents is not None
    for s, sampler in enumerate(samplers):
        proc = sampler.processor
        m = int(proposal.counts[s])
        if proc is None or proc.constraint is None or not m or tree:
            continue  # (a tree's forbidden nodes are never accepted: the walk sees the processed logits)
        proc.rollback()  # the drafter's pushed proposals: check from the committed state
        ahead = forced.get(s, [])
        # a chain's forced tokens beyond k: cut to the room the verify call has (the cache, the output, a call)
        m = max(0, min(m, int(room[s]) - len(ahead), max_drafts - len(ahead)))
        proposal.counts[s] = max(0, proc.allowed_prefix([*ahead, *proposal.drafts[s, :m].tolist()]) - len(ahead))
    if not forced:
        return
    b, counts = len(samplers), proposal.counts
    width = max([proposal.drafts.shape[1]] + [len(t) + int(counts[s]) for s, t in forced.items()])

    def widened(a, fill):  # [B, K, ...] -> [B, width, ...]
        out = np.full((b, width, *a.shape[2:]), fill, a.dtype)
        out[:, : a.shape[1]] = a
        return out

    drafts = widened(proposal.drafts, 0)
    probs = None if proposal.probs is None else widened(proposal.probs, 0.0)  # rejection rows
    marks = np.zeros((b, width), bool) if proposal.forced is None else widened(proposal.forced, False)
    if tree:
        proposal.parents = widened(proposal.parents, -1)
    for s, tokens in forced.items():  # the forced tokens first, then the row's drafts
        f, m = len(tokens), int(counts[s])
        drafts[s, f : f + m] = proposal.drafts[s, :m]
        drafts[s, :f] = tokens
        marks[s, f : f + m] = False if proposal.forced is None else proposal.forced[s, :m]
        marks[s, :f] = True
        if probs is not None:  # a forced token's proposal is certain
            probs[s, f : f + m] = proposal.probs[s, :m]
            probs[s, :f] = 0.0
            probs[s, np.arange(f), tokens] = 1.0
        counts[s] = f + m
        if tree:  # a forced row's tokens verify as a chain (tree drafters draft nothing after them)
            proposal.parents[s, :f] = np.arange(f) - 1
    proposal.drafts, proposal.probs, proposal.forced = drafts, probs, marks


def forced_counts(proposal, s, m, accepted_nodes) -> tuple[int, int]:
    """Row s's grammar-forced drafts: (how many were accepted, how many of its m were forced)."""
    if proposal.forced is None:
        return 0, 0
    mask = proposal.forced[s, :m]
    return int(mask[list(accepted_nodes)].sum()), int(mask.sum())
