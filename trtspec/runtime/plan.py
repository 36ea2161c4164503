"""One step of the runtime: what the scheduler plans (StepPlan) and what came of it (StepResult).

    Scheduler.schedule() -> StepPlan -> Worker.execute(plan) -> StepResult -> Scheduler.update(plan, result)

A plan names engine rows only by index; the worker's rows follow the plan's cache moves. Nothing in a plan is an
engine object, and nothing in a result is a request: the scheduler keeps the requests, the worker the engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np


# -- the cache moves, in the order the worker makes them -------------------------------------------------------


class Save(NamedTuple):
    """A finished row's slots for the prefix cache: what the target's cache holds of it, if at least ``least``
    (``pinned``: a registered prefix, never evicted)."""

    row: int
    least: int
    pinned: bool = False


class LearnOutput(NamedTuple):
    """A finished row's tokens (``prompt_len`` of them its prompt's), to the drafter, which may learn from them."""

    row: int
    prompt_len: int


class Move(NamedTuple):
    """Row ``src`` moves to ``dst`` (rows close the gap a retired row left)."""

    src: int
    dst: int


class Load(NamedTuple):
    """A request takes ``row``: its prompt into the row's buffer, ``reused`` slots of ``blocks`` (the prefix
    cache's (target block, drafter block)) loaded instead of computed."""

    row: int
    prompt_ids: np.ndarray
    reused: int
    blocks: tuple | None


# -- the plan ---------------------------------------------------------------------------------------------------


@dataclass
class PromptChunks:
    """Rows first, first + 1, ... read their next ``chunks[i]`` prompt tokens in one target call."""

    first: int
    chunks: list[int]
    choosers: list  # per row: the RowSampler that chooses its first token (its prompt ends here), or None
    logprobs: list  # per row: (prompt ids, N) where the request asked for prompt logprobs, else None
    share: list[int]  # per row: the slots to save for the other samples of its prompt (0: none)
    draft: bool = True  # the drafter reads the chunks too (False: it catches up when it drafts; Drafter.catches_up)


@dataclass
class DraftShape:
    """Rows [0, D) decode: each drafts up to ``caps[s]`` tokens after the tokens its grammar forces, and ONE target
    call verifies [last token, forced..., drafts...] of every row."""

    samplers: list  # [D] each row's RowSampler
    caps: np.ndarray  # [D] int64: the most drafts each row may have (what its forced tokens left)
    room: np.ndarray  # [D] int64: the most tokens past its last one each row may verify (its cache, its output)
    k: int  # the round's k: the load-aware policy's, else the largest cap
    width: int  # the round's tree width (1: chains)
    forced: dict | None = None  # row -> the tokens its grammar forces next; None: no row has a grammar
    expected: float | None = None  # the tokens the load-aware policy expects of this shape (stats.py)
    sampled: bool = False  # whether a row samples (the policy measures such rounds apart)


@dataclass
class LoneDecode:
    """Row 0 alone, greedy or coupled sampling with no logits processing, no drafts: up to ``steps`` one-token calls
    in the engine's own loop; ``take(token)`` -> (tokens its output took, whether to go on), the stop rule applied as
    each token comes; ``sampler``: the row's (a coupled one picks each token; greedy takes the argmax)."""

    steps: int
    take: Callable[[int], tuple[int, bool]]
    sampler: Any  # (verify.RowSampler)


@dataclass
class StepPlan:
    """What one step does, in this order: the rows' buffers take what their outputs took of the last result
    (``appended``), the cache moves, the prompt chunks, then the decoding rows' round (or a lone row's loop)."""

    # row -> tokens its output took of the last result (None: that result is void, its rows failed)
    appended: dict[int, list[int]] | None = field(default_factory=dict)
    cache: list = field(default_factory=list)  # Save, LearnOutput, Move and Load, in order
    prompts: PromptChunks | None = None
    decode: DraftShape | None = None
    alone: LoneDecode | None = None


# -- the result -------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """One decoding row's verdict: the tokens it emits and how its drafts fared."""

    tokens: list[int]  # the accepted drafts (forced tokens included), then the target's own token
    accepted: int  # drafts accepted (a tree: the nodes of the accepted path)
    proposed: int  # drafts that could have been accepted (a tree: its deepest path)
    forced: int = 0  # of ``proposed``, tokens a grammar forced (counted apart from the drafter's)
    forced_accepted: int = 0
    source: str = "none"  # the drafter that proposed them


@dataclass
class PromptResult:
    first: list  # per prompt row: its first token, the exception its sampler raised, or None (prompt not read yet)
    entries: list  # per prompt row: the prompt logprob entries of its chunk, or None
    shared: list  # per prompt row: (slots, target block, drafter block) for the other samples, or None
    draft_calls: int  # draft-engine calls that read the same chunks
    seconds: float


@dataclass
class DecodeResult:
    verdicts: list  # per row: Verdict, the exception its own sampler raised (it alone fails), or None
    faults: list  # (row, RowFault): a row's sampler failed in the drafter's batched step (the others go on)
    calls: list  # the draft engine's calls as (rows, tokens per row, seconds), a catch-up call first
    drafted: int  # the widest row's drafts
    width: int  # the verify call's tokens per row
    tree: bool
    shape: str | None  # a tree's shape, e.g. "4x3"
    forced_in_chains: bool  # a chain held tokens a grammar forced after a proposal
    started: float  # perf_counter() when the round began
    draft_s: float
    verify_s: float


@dataclass
class LoneResult:
    calls: int
    seconds: float  # in the engine
    started: float
    sampled: bool = False  # (a coupled row's: the policy measures sampled rounds apart)


@dataclass
class StepResult:
    saved: list = field(default_factory=list)  # per Save: (tokens, target block, drafter block), or None
    prompts: PromptResult | None = None
    decode: DecodeResult | None = None
    alone: LoneResult | None = None
