"""The engine protocol the runtime drives, and the input checks every backend shares."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import CapacityError, EngineBusyError


class Engine(Protocol):
    """One model's step graph with its own fixed-capacity KV cache (DESIGN.md §3).

    Not thread-safe: an engine's cache rows belong to whoever drives it. A call made while
    another thread's call is running raises EngineBusyError; share engines between threads
    through one trtspec.Generator or Scheduler, whose single loop thread makes every call.
    """

    path: Path
    manifest: dict  # the artifact's manifest; manifest["model"] describes the step graph
    max_seq_len: int
    max_batch: int
    vocab_size: int
    max_call_tokens: int  # the most tokens one call may carry: S_max, or less where sliding-window layers keep rings

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, first_row: int = 0) -> np.ndarray:
        """Run T new tokens per row for cache rows [first_row, first_row + B), writing their K/V into the
        cache; returns logits [B, T, V]."""

    def move_row(self, src: int, dst: int, n: int | None = None) -> None:
        """Copy cache row src (its first n slots, or all) into row dst (the runtime compacts its batch)."""

    def keep_path(self, row: int, start: int, nodes) -> None:
        """After a tree call wrote nodes at slots start, start + 1, ...: move node nodes[j]'s K/V to slot
        start + j (an accepted path; nodes increasing, nodes[j] >= j), within the row, no other slot touched."""

    def reset(self) -> None:
        """Zero the KV cache."""

    def save_prefix(self, row: int, n: int):
        """A copy of the first n cache slots of ``row`` (an opaque block with ``nbytes``)."""

    def load_prefix(self, saved, row: int) -> None:
        """Write a block from save_prefix into the first slots of ``row``."""


class SavedPrefix:
    """Cache slots copied out of one row: host arrays (onnxruntime) or device tensors (GPU backends).

    A part holds the first ``tokens`` slots of a full cache, or a whole ring where a sliding-window layer's ring
    has wrapped (fewer slots than tokens). A ring forgets, so a head shorter than ``min_head`` is not exact.
    """

    def __init__(self, parts, tokens: int | None = None, *, min_head: int = 0, written_end: int = -1):
        self.parts = parts  # one [Hkv, n, D] block per cache buffer
        self.nbytes = sum(int(p.nbytes) for p in parts)
        self.tokens = int(parts[0].shape[1]) if tokens is None else tokens
        self.min_head = min_head
        self.written_end = written_end  # the last position the source row's rings were written at (RingRows)

    def head(self, n: int) -> SavedPrefix:
        """The first n slots (views, no copy); a wrapped ring stays whole."""
        assert self.min_head <= n <= self.tokens, (n, self.min_head, self.tokens)
        return SavedPrefix([p if p.shape[1] < self.tokens else p[:, :n] for p in self.parts], n,
                           min_head=n, written_end=self.written_end)


class RingRows:
    """Per cache row, the last position a sliding-window layer's ring was written at (engines with rings only).

    A ring of n slots keeps position p until p + n is written, so after writes up to E the positions above
    E - n are intact. A head m of the row is exact when its next query's window, [m - window + 1, m), lies
    there: m >= E - max_call_tokens + 1 (n = window + max_call_tokens - 1, exporter/contract.py).
    """

    def __init__(self, max_batch: int, max_call_tokens: int):
        self.end = np.full(max_batch, -1, np.int64)
        self.max_call_tokens = max_call_tokens

    def wrote(self, first_row: int, position_ids) -> None:
        # position_ids [B, T]: rows [first_row, first_row + B) wrote up to their last position
        rows = self.end[first_row : first_row + position_ids.shape[0]]
        np.maximum(rows, position_ids[:, -1], out=rows)

    def saved(self, parts, row: int, n: int) -> SavedPrefix:
        end = int(self.end[row])
        return SavedPrefix(parts, n, min_head=min(n, max(0, end - self.max_call_tokens + 1)), written_end=end)

    def loaded(self, saved: SavedPrefix, row: int) -> None:
        self.end[row] = max(saved.written_end, saved.tokens - 1)

    def moved(self, src: int, dst: int) -> None:
        self.end[dst] = self.end[src]

    def reset(self) -> None:
        self.end.fill(-1)


def ring_rows(model: dict, max_batch: int) -> RingRows | None:
    from ..exporter.contract import max_call_tokens, slots_by_input

    rings = min(slots_by_input(model).values()) < model["max_seq_len"]
    return RingRows(max_batch, max_call_tokens(model)) if rings else None


class CallGuard:
    """Refuses a second simultaneous call on one engine instead of letting two callers mix its cache."""

    def __init__(self, engine_name: str):
        self._lock = threading.Lock()
        self._name = engine_name

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError(
                f"engine {self._name} is already running a call from another thread; engines are not thread-safe. "
                "Share one trtspec.Generator (or Scheduler) between threads: it makes every engine call from its "
                "own loop thread and batches the callers' requests together"
            )
        return self

    def __exit__(self, *exc):
        self._lock.release()


def lease(engine) -> threading.Lock:
    """The lock a scheduler holds while it has work on ``engine``, so two schedulers never interleave rounds."""
    lock = engine.__dict__.get("_trtspec_lease")
    if lock is None:
        lock = engine.__dict__.setdefault("_trtspec_lease", threading.Lock())
    return lock


def tree_positions(parents) -> tuple[np.ndarray, np.ndarray]:
    """parents [B, T] (each node's parent index, -1 for the root at 0; parents before children) ->
    (tree_mask [B, T, T] bool: ancestors and self, depth [B, T]) for a tree call (exporter/contract.py)."""
    parents = np.asarray(parents, np.int64)
    b, t = parents.shape
    mask = np.zeros((b, t, t), bool)
    depth = np.zeros((b, t), np.int64)
    rows = np.arange(b)
    for i in range(t):
        p = parents[:, i]
        has = p >= 0
        if i:
            mask[has, i, :i] = mask[rows[has], p[has], :i]
            depth[has, i] = depth[rows[has], p[has]] + 1
        mask[:, i, i] = True
    return mask, depth


def check_tree(tree_mask, position_ids) -> np.ndarray:
    """A tree call's mask and positions keep the contract: every node sees itself and only earlier nodes (a
    parent comes before its children), what it sees is closed under ancestry, and its position is the root's
    plus its depth. Returns the mask as a C-contiguous bool array."""
    tree_mask = np.ascontiguousarray(tree_mask, dtype=bool)
    b, t = position_ids.shape
    if tree_mask.shape != (b, t, t):
        raise ValueError(f"tree_mask must be [batch, tokens, tokens] = {(b, t, t)}, got {tree_mask.shape}")
    if not tree_mask[:, np.arange(t), np.arange(t)].all() or np.triu(tree_mask, 1).any():
        raise ValueError("tree_mask: each node must see itself and only nodes before it (a parent before its children)")
    depth = tree_mask.sum(-1) - 1
    if np.any(position_ids != position_ids[:, :1] + depth) or np.any(tree_mask[:, :, 0] == 0):
        raise ValueError("tree_mask: every node descends from node 0 (the root) and sits at the root's position "
                         "plus its depth (the number of nodes above it)")
    return tree_mask


def check_call(engine, input_ids, position_ids, first_row: int, tree_mask):
    """An engine's call checked before anything touches its cache -> (input_ids, position_ids, tree_mask or None):
    check_step_inputs, and a tree call (check_tree) only on an engine exported with tree verification."""
    tree = tree_mask is not None
    if tree and not getattr(engine, "tree_verify", False):
        raise ValueError(f"{engine.path} was exported without tree verification; re-export the target with "
                         "--tree (trtspec export), or compile it with tree=True (torch backend), to verify token trees")
    input_ids, position_ids = check_step_inputs(
        input_ids, position_ids, max_batch=engine.max_batch, max_seq_len=engine.max_seq_len,
        vocab_size=engine.vocab_size, first_row=first_row, max_call=getattr(engine, "max_call_tokens", None), tree=tree,
    )
    return input_ids, position_ids, (check_tree(tree_mask, position_ids) if tree else None)


def chain_mask(b: int, t: int) -> np.ndarray:
    """The tree_mask of a chain call ([B, T, T], lower triangle: each token sees those before it), which an engine
    with a tree input passes for calls that verify no tree (a read-only broadcast view)."""
    return np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))


def path_moves(start: int, nodes) -> tuple[np.ndarray, np.ndarray] | None:
    """keep_path's slot moves: (source slots, destination slots) that bring an accepted tree path's nodes (call
    indices, root first) to the consecutive slots from ``start``; None when the path already lies there."""
    nodes = np.asarray(nodes, np.int64)
    moved = np.flatnonzero(nodes != np.arange(nodes.size))
    if not moved.size:
        return None
    return start + nodes[moved], start + moved


class CacheRows:
    """The cache-row operations of the Engine protocol (move_row, keep_path, save_prefix, load_prefix, reset), written
    once for every backend over its cache buffers [B, Hkv, slots, D]: numpy arrays (onnxruntime) or torch tensors
    (TensorRT, the torch backend), which index and assign alike. A backend gives ``_cache_buffers()``, its
    ``_guard`` (CallGuard) and ``_rings`` (RingRows or None), and where it differs: ``_cache_work()`` (the context
    of a cache edit: the guard, and a GPU stream), ``_copied(view)`` (a copy that owns its memory) and
    ``_moves(indices)`` (slot indices where its buffers live). A ring's slots [0, n) clip to the ring: a row past
    its length moves (and saves) whole."""

    _rings = None

    def _cache_buffers(self):
        return self.cache.values()

    def _cache_work(self):
        return self._guard

    @staticmethod
    def _copied(view):
        return view.copy()

    def _moves(self, indices):
        return indices

    def move_row(self, src: int, dst: int, n: int | None = None):
        with self._cache_work():
            for buf in self._cache_buffers():
                buf[dst, :, :n] = buf[src, :, :n]
            if self._rings is not None:
                self._rings.moved(src, dst)

    def keep_path(self, row: int, start: int, nodes):
        moves = path_moves(start, nodes)
        if moves is None:
            return
        src, dst = (self._moves(m) for m in moves)
        with self._cache_work():
            for buf in self._cache_buffers():
                buf[row, :, dst] = buf[row, :, src]  # (fancy indexing reads every source before it writes)

    def save_prefix(self, row: int, n: int):
        # -> [Hkv, n, D] copies (a wrapped ring: [Hkv, slots, D]), one per cache buffer
        with self._cache_work():
            parts = [self._copied(buf[row, :, :n]) for buf in self._cache_buffers()]
        return self._rings.saved(parts, row, n) if self._rings is not None else SavedPrefix(parts)

    def load_prefix(self, saved, row: int):
        with self._cache_work():
            for buf, part in zip(self._cache_buffers(), saved.parts):
                buf[row, :, : part.shape[1]] = part
            if self._rings is not None:
                self._rings.loaded(saved, row)

    def reset(self):
        with self._cache_work():
            for buf in self._cache_buffers():
                buf[...] = 0
            if self._rings is not None:
                self._rings.reset()



class TorchCacheRows(CacheRows):
    """CacheRows over torch tensors on ``self.device`` (the torch engines: compiled, or built ahead of time)."""

    @staticmethod
    def _copied(view):
        return view.clone()

    def _moves(self, indices):
        import torch

        return torch.from_numpy(indices).to(self.device)

def check_step_inputs(input_ids, position_ids, *, max_batch: int, max_seq_len: int, vocab_size: int,
                      first_row: int = 0, max_call: int | None = None, tree: bool = False):
    """Validate one step call before anything touches the cache; returns C-contiguous int64 arrays.
    ``tree``: the call carries a tree_mask (checked by check_tree): positions follow the tree, not the slots."""
    # input_ids [B, T] int, position_ids [B, T] int, consecutive per row
    input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    position_ids = np.ascontiguousarray(position_ids, dtype=np.int64)
    if input_ids.ndim != 2 or input_ids.shape != position_ids.shape or input_ids.size == 0:
        raise ValueError(
            f"input_ids and position_ids must both be non-empty [batch, tokens] arrays of the same shape, "
            f"got {input_ids.shape} and {position_ids.shape}"
        )
    b, t = input_ids.shape
    if max_call is not None and t > max_call:
        raise CapacityError(
            f"this call carries {t} tokens per row but the engine takes at most {max_call} (its sliding-window "
            f"layers keep rings of window + {max_call} - 1 slots); split the call, or re-export with "
            f"--max-call-tokens {t} (or --no-ring-cache)"
        )
    if first_row < 0 or first_row + b > max_batch:
        raise CapacityError(
            f"rows {first_row}..{first_row + b - 1} asked for but the engine holds {max_batch}; "
            f"build it with more rows (`trtspec export --max-batch {first_row + b}` then build; a torch build from "
            f"the model itself or a TensorRT build: `trtspec build --max-batch {first_row + b}`)"
        )
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {input_ids.min()}..{input_ids.max()}")
    start = position_ids[:, 0]
    if start.min() < 0:
        raise ValueError("position_ids must be non-negative")
    if t > 1 and not tree and np.any(position_ids != start[:, None] + np.arange(t)):
        raise ValueError("position_ids must be consecutive within each row (the new tokens fill consecutive cache slots)")
    end = int(start.max()) + t
    if end > max_seq_len:
        raise CapacityError(
            f"this call writes up to position {end - 1} but the engine's KV cache holds {max_seq_len} positions; "
            f"re-export with --max-seq-len {max(end, 2 * max_seq_len)}"
        )
    return input_ids, position_ids


def greedy_steps(engine, row: int, token: int, position: int, steps: int, on_token, pick=None) -> tuple[int, float]:
    """Greedy decoding of one cache row, one token per call, for up to ``steps`` calls.

    Call i feeds ``token`` at ``position + i`` and takes the argmax of its logits as the next token, or ``pick(x,
    i)`` of its logits x (float32 [V] on the host: a coupled sampler's pick), handing it to ``on_token(token)``;
    decoding stops early when that returns False. Returns (calls made, seconds spent inside the engine's calls).
    Engines with a faster loop of their own provide ``greedy_steps`` (onnxruntime: buffers bound once, no per-call
    checks); this generic loop over ``forward`` gives the same tokens.
    """
    # the class's own method only: a wrapper that forwards attributes but overrides forward sees every call
    if getattr(type(engine), "greedy_steps", None) is not None:
        return engine.greedy_steps(row, token, position, steps, on_token, **({"pick": pick} if pick else {}))
    return forward_greedy_steps(engine, row, token, position, steps, on_token, pick)


def check_greedy_steps(engine, row: int, token: int, position: int, steps: int) -> None:
    """An engine's own greedy_steps loop checks its calls once, up front, as forward checks each."""
    check_step_inputs(np.array([[token]]), np.array([[position + steps - 1]]), max_batch=engine.max_batch,
                      max_seq_len=engine.max_seq_len, vocab_size=engine.vocab_size, first_row=row)
    if position < 0:
        raise ValueError("position_ids must be non-negative")


# a torch engine's greedy loop reads its tokens back once per this many calls: a stop costs at most as many calls more
GREEDY_CHUNK = 8


def device_greedy_steps(call, token: int, steps: int, on_token, device, *, host_argmax: bool = False, pick=None
                        ) -> tuple[int, float]:
    """greedy_steps' loop over a torch engine's own call: ``call(i, tok)`` runs call i fed ``tok`` (a [1, 1] tensor on
    ``device``) and returns its logits [1, T, V]. Each call's argmax feeds the next one on the device and the host
    reads the ids once per GREEDY_CHUNK calls; calls past a refused token (at most a chunk's) wrote slots the mask
    hides and later writes overwrite. ``host_argmax`` (a CPU engine): each token read with numpy's argmax instead
    (4 us over a 49,152-token row against torch's 45); ``pick`` (greedy_steps'): each token read by it on the host.
    Returns (the calls whose tokens were taken, seconds)."""
    import torch

    t0, done = time.perf_counter(), 0
    if host_argmax or pick is not None:
        seconds = 0.0  # (the calls and their logits' reads: a pick's own time is the caller's, as in forward's loop)
        for i in range(steps):
            t1 = time.perf_counter()
            x = call(i, torch.tensor([[token]], device=device))[0, -1].float().cpu().numpy()
            seconds += time.perf_counter() - t1
            token = int(x.argmax()) if pick is None else pick(x, i)
            if not on_token(token):
                return i + 1, seconds
        return steps, seconds
    tok = torch.tensor([[token]], device=device)
    while done < steps:
        picked = []
        for i in range(done, min(steps, done + GREEDY_CHUNK)):
            tok = call(i, tok)[:, -1].argmax(-1, keepdim=True)  # [1, 1]: the first maximum, as numpy's argmax
            picked.append(tok)
        for t in torch.cat(picked).view(-1).tolist():  # (one sync)
            done += 1
            if not on_token(t):
                return done, time.perf_counter() - t0
    return steps, time.perf_counter() - t0


def forward_greedy_steps(engine, row: int, token: int, position: int, steps: int, on_token, pick=None
                         ) -> tuple[int, float]:
    """greedy_steps as a loop over ``engine.forward``: what an engine's own loop must equal."""
    seconds = 0.0
    for i in range(steps):
        t0 = time.perf_counter()
        logits = engine.forward(np.array([[token]]), np.array([[position + i]]), first_row=row)
        seconds += time.perf_counter() - t0
        token = int(logits[0, 0].argmax()) if pick is None else pick(logits[0, 0], i)
        if not on_token(token):
            return i + 1, seconds
    return steps, seconds
