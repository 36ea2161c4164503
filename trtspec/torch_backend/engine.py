"""The torch engine: StepModel over fixed in-place cache buffers, compiled with torch.compile.

Each layer's K and V live in one buffer [max_batch, Hkv, S_max, D], allocated
once; a call with B rows passes the first B rows (views) to StepModel, whose
``trtspec::kv_cache_write_`` writes them in place. Positions are tensor inputs
and the batch and token dimensions are compiled dynamic, so decoding at a new
position never recompiles; torch specialises sizes 0 and 1, so the graphs are
at most: (B = 1 | B > 1) x (T = 1 | T > 1).

An engine compiled with ``tree`` verifies token trees (a ``tree_mask`` call, ``keep_path``) and with
``hidden_states`` keeps the call's features in ``features``, as onnxruntime engines of a --tree /
--hidden-states export do: tree speculation and EAGLE-3 / Medusa drafting run over a torch target.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..engines.base import CallGuard, SavedPrefix, chain_mask, check_call, path_moves, ring_rows
from ..exporter.contract import max_call_tokens
from ..errors import BackendUnavailableError
from .cached_step import split_outputs, tree_args
from .source import load_source

BACKENDS = ("inductor", "eager", "torch_tensorrt")
DEVICES = ("cpu", "cuda")
# On CUDA, calls of at most this many tokens per row (decode, verify k+1) run as CUDA graphs.
MAX_GRAPHED_TOKENS = 16

log = logging.getLogger("trtspec.torch")


class TorchEngine:
    """The engine protocol (engines/base.py) over a compiled torch module; see trtspec.compile().

    Not thread-safe (engines/base.py); rows other than [0, B) (``first_row``) run eagerly."""

    backend = "torch"

    def __init__(self, source, *, compile_backend: str, device: str, functional_cache: bool = False):
        import torch

        from ..exporter.step_model import StepModel
        from .cached_step import CachedStep

        self.path = source.path
        self.manifest = source.manifest
        model = self.manifest["model"]
        self.max_seq_len = model["max_seq_len"]
        self.max_batch = model["max_batch"]
        self.vocab_size = model["vocab_size"]
        self.max_call_tokens = max_call_tokens(model)
        self._rings = ring_rows(model, self.max_batch)
        self.compile_backend = compile_backend
        self.device = torch.device(device)
        self._guard = CallGuard(f"{self.path} (torch)")
        # a tree_mask input and a hidden_states output where the source asks for them (as an export with --tree /
        # --hidden-states: contract.py); a chain call of a tree engine passes the causal mask
        self.tree_verify = bool(model.get("tree_verify"))
        features = model.get("hidden_states") or {}
        self.features_size = features.get("size")
        self.features = None  # the last call's hidden_states [B, T, features_size] (numpy), engines with features
        # built on the CPU (its RoPE table comes from the HF rotary module there), then moved
        hf = source.hf_model.requires_grad_(False)
        step = StepModel(hf, source.spec, self.max_seq_len, in_place_cache=not functional_cache,
                         cache_slots=model["cache_slots"], tree=self.tree_verify,
                         hidden_layers=features.get("layers")).eval().to(self.device)
        self.module = CachedStep(step, self.max_batch, getattr(torch, model["dtype"]), self.device)
        if functional_cache:
            # TensorRT: the compiled graph takes the caches and returns them (the converter makes the
            # write in place inside TensorRT); whatever comes back not aliased is copied into our buffers.
            compiled = torch.compile(step, backend=compile_backend, fullgraph=True, dynamic=True)
            self._general = self._graphed = _functional_call(compiled, self.module)
        else:
            self._general, self._graphed = _compile(self.module, compile_backend, self.device.type)

    @property
    def caches(self):
        """The KV cache buffers, [max_batch, Hkv, S_max, D] each: key_0, value_0, key_1, ..."""
        return self.module.caches()

    def forward(self, input_ids, position_ids, first_row: int = 0, tree_mask=None, inputs=None):
        # input_ids [B, T] int64, position_ids [B, T] int64 -> logits [B, T, V] float32 numpy (a fresh array)
        # tree_mask [B, T, T] bool: a tree call (engines with tree_verify; exporter/contract.py)
        import torch

        if inputs:
            raise ValueError(f"torch engines take no extra inputs ({', '.join(inputs)}): draft heads run as their "
                             "own onnxruntime step graph (trtspec export-head)")
        input_ids, position_ids, tree_mask = check_call(self, input_ids, position_ids, first_row, tree_mask)
        if self._rings is not None:
            self._rings.wrote(first_row, position_ids)
        fn = self._graphed if input_ids.shape[1] <= MAX_GRAPHED_TOKENS else self._general
        ids = torch.from_numpy(input_ids).to(self.device)
        pos = torch.from_numpy(position_ids).to(self.device)
        if tree_mask is None and self.tree_verify:  # a chain call: the causal mask (one graph per shape class)
            tree_mask = chain_mask(*input_ids.shape).copy()
        tree = None if tree_mask is None else torch.from_numpy(tree_mask).to(self.device)
        with self._guard, torch.no_grad():
            if first_row:
                # The compiled graphs take rows [0, B); other rows run eagerly (the scheduler's prefill calls).
                logits, hidden = _functional_call(self.module.step, self.module, first_row)(ids, pos, tree)
            else:
                logits, hidden = fn(ids, pos, tree)
            if hidden is not None:
                self.features = hidden.float().cpu().numpy()
            return logits.float().cpu().numpy()

    def keep_path(self, row: int, start: int, nodes):
        """Move an accepted tree path's K/V (its nodes' call indices, root first) to the consecutive slots from
        ``start``, within the row (engines/base.py)."""
        import torch

        moves = path_moves(start, nodes)
        if moves is None:
            return
        src, dst = (torch.from_numpy(m).to(self.device) for m in moves)
        with self._guard:
            for cache in self.caches:
                cache[row, :, dst] = cache[row, :, src]  # (the gather reads every source before the write)

    def move_row(self, src: int, dst: int, n: int | None = None):
        with self._guard:
            for cache in self.caches:
                cache[dst, :, :n].copy_(cache[src, :, :n])
            if self._rings is not None:
                self._rings.moved(src, dst)

    def save_prefix(self, row: int, n: int):
        with self._guard:
            parts = [cache[row, :, :n].clone() for cache in self.caches]
            return self._rings.saved(parts, row, n) if self._rings is not None else SavedPrefix(parts)

    def load_prefix(self, saved, row: int):
        with self._guard:
            for cache, part in zip(self.caches, saved.parts):
                cache[row, :, : part.shape[1]].copy_(part)
            if self._rings is not None:
                self._rings.loaded(saved, row)

    def reset(self):
        with self._guard:
            for cache in self.caches:
                cache.zero_()
            if self._rings is not None:
                self._rings.reset()


def _functional_call(compiled_step, module, first_row: int = 0):
    """(input_ids, position_ids, tree_mask) -> (logits, hidden_states or None) over a step that returns its caches
    (or writes them in place); keeps module's buffers current."""

    def call(input_ids, position_ids, tree_mask=None):
        b = input_ids.shape[0]
        rows = [c[first_row : first_row + b] for c in module.caches()]
        out = compiled_step(input_ids, position_ids, *tree_args(module.step, tree_mask), *rows)
        logits, hidden, presents = split_outputs(module.step, out)
        for row, present in zip(rows, presents):
            if present.data_ptr() != row.data_ptr():
                row.copy_(present)
        return logits, hidden

    return call


def _compile(module, backend: str, device: str):
    """(general, graphed) callables, dynamic shapes; on CUDA with inductor, short calls replay CUDA graphs."""
    import torch

    from . import dynamo_backend  # noqa: F401  (registers the "trtspec" torch.compile backend)
    from .cached_step import own_forward

    general = torch.compile(own_forward(module), backend=backend, fullgraph=True, dynamic=True)
    if device == "cuda" and backend == "inductor":
        # cudagraph trees record one graph per concrete (B, T): few for decode and verify, many for prefill
        graphed = torch.compile(own_forward(module), backend="inductor", mode="reduce-overhead", fullgraph=True, dynamic=True)
        return general, graphed
    return general, general


def compile(
    model_dir_or_export_dir: str | os.PathLike,
    *,
    max_seq_len: int | None = None,
    max_batch: int | None = None,
    backend: str = "inductor",
    device: str = "cpu",
    dtype: str | None = None,
    tree: bool | None = None,
    hidden_states=None,
) -> TorchEngine:
    """Compile an HF model (or the model behind an export/ artifact) into a torch engine.

    The engine has the same protocol as load_engine()'s, so Generator can mix it with
    onnxruntime or TensorRT engines. ``backend`` is the torch.compile backend:
    "inductor", "eager" (captured by dynamo, run by eager PyTorch) or "torch_tensorrt".
    ``max_seq_len``/``max_batch``/``dtype`` default to the export's own values for an
    export dir, else to 512 / 4 / "float32". ``tree`` (one call verifies a token tree) and ``hidden_states``
    ("low,mid,high", "last" or layer indices: features for draft heads) are export()'s options; they default to
    the export's own, and to neither for an HF dir.
    """
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"unknown torch backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    if backend == "torch_tensorrt":
        from .dynamo_backend import require_torch_tensorrt

        require_torch_tensorrt()
    source = load_source(Path(model_dir_or_export_dir), max_seq_len=max_seq_len, max_batch=max_batch, dtype=dtype,
                         tree=tree, hidden_states=hidden_states)
    engine = TorchEngine(source, compile_backend=backend, device=device, functional_cache=backend == "torch_tensorrt")
    log.info("torch engine for %s: backend %s on %s (compiled lazily, per shape class, on first calls)",
             model_dir_or_export_dir, backend, device)
    return engine
