"""The torch engine: StepModel over fixed in-place cache buffers, compiled with torch.compile.

Each layer's K and V live in one buffer [max_batch, Hkv, S_max, D], allocated
once; a call with B rows passes the first B rows (views) to StepModel, whose
indexed store writes them in place (inductor fuses it with RoPE). Positions are tensor inputs
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

from ..engines.base import (CallGuard, TorchCacheRows, chain_mask, check_call, check_greedy_steps, device_greedy_steps,
                            forward_greedy_steps, ring_rows)
from ..engines.torch_aot import live_length
from ..exporter.contract import max_call_tokens
from ..errors import BackendUnavailableError
from .cached_step import split_outputs, tree_args
from .source import load_source

BACKENDS = ("inductor", "eager", "torch_tensorrt")
DEVICES = ("cpu", "cuda")
# On CUDA, calls of at most this many tokens per row (decode, verify k+1) run as CUDA graphs.
MAX_GRAPHED_TOKENS = 16

log = logging.getLogger("trtspec.torch")


class TorchEngine(TorchCacheRows):
    """The engine protocol (engines/base.py) over a compiled torch module; see trtspec.compile().

    Not thread-safe (engines/base.py); rows other than [0, B) (``first_row``) run eagerly."""

    backend = "torch"
    tensor_logits = True  # forward(..., as_tensor=True) leaves the logits on the device

    def __init__(self, source, *, compile_backend: str, device: str, functional_cache: bool = False,
                 weights: str = "float", int8_activations: bool = False):
        import torch

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
        step, self.gguf = step_module(source, device=device, functional_cache=functional_cache, weights=weights,
                                      int8_activations=int8_activations)
        self.module = CachedStep(step, self.max_batch, getattr(torch, model["dtype"]), self.device)
        if functional_cache:
            # TensorRT: the compiled graph takes the caches and returns them (the converter makes the
            # write in place inside TensorRT); whatever comes back not aliased is copied into our buffers.
            compiled = torch.compile(step, backend=compile_backend, fullgraph=True, dynamic=True)
            self._general = self._graphed = _functional_call(compiled, self.module)
        else:
            self._general, self._graphed = _compile(self.module, compile_backend, self.device.type)
        # On the CPU a chain call attends the caches' live slots only (engines/torch_aot.py; attention over the
        # whole capacity was the largest cost of a decode call); CUDA graphs keep one shape, the whole cache.
        self._live = (torch.arange(self.max_seq_len, device=self.device)
                      if self.device.type == "cpu" and not (self.tree_verify or functional_cache) else None)
        # CUDA graphs (inductor's cudagraph trees) keep their manager per thread; the scheduler's thread needs one
        self._cudagraph_state = cudagraph_tree_state() if self.device.type == "cuda" else None

    @property
    def caches(self):
        """The KV cache buffers, [max_batch, Hkv, S_max, D] each: key_0, value_0, key_1, ..."""
        return self.module.caches()

    def forward(self, input_ids, position_ids, first_row: int = 0, tree_mask=None, inputs=None, as_tensor=False):
        # input_ids [B, T] int64, position_ids [B, T] int64 -> logits [B, T, V] float32 numpy (a fresh array), or with
        # ``as_tensor`` the step's own output tensor on the engine's device (runtime/picks.py reads it there)
        # tree_mask [B, T, T] bool: a tree call (engines with tree_verify; exporter/contract.py)
        import torch

        if inputs:
            raise ValueError(f"torch engines take no extra inputs ({', '.join(inputs)}): draft heads run as their "
                             "own onnxruntime step graph (trtspec export-head)")
        input_ids, position_ids, tree_mask = check_call(self, input_ids, position_ids, first_row, tree_mask)
        if self._rings is not None:
            self._rings.wrote(first_row, position_ids)
        fn = self._graphed if input_ids.shape[1] <= MAX_GRAPHED_TOKENS else self._general
        if self._cudagraph_state is not None:
            adopt_cudagraph_tree_state(self._cudagraph_state)
        ids = torch.from_numpy(input_ids).to(self.device)
        pos = torch.from_numpy(position_ids).to(self.device)
        if tree_mask is None and self.tree_verify:  # a chain call: the causal mask (one graph per shape class)
            tree_mask = chain_mask(*input_ids.shape).copy()
        tree = None if tree_mask is None else torch.from_numpy(tree_mask).to(self.device)
        with self._guard, torch.no_grad():
            if first_row:
                # The compiled graphs take rows [0, B); other rows run eagerly (the scheduler's prefill calls).
                logits, hidden = _functional_call(self.module.step, self.module, first_row)(ids, pos, tree)
            elif self._live is not None:
                logits, hidden = fn(ids, pos, tree, self._live[: live_length(position_ids, self.max_seq_len)])
            else:
                logits, hidden = fn(ids, pos, tree)
            if hidden is not None:
                self.features = hidden.float().cpu().numpy()
            if as_tensor:  # (a CUDA graph's output is overwritten by its next replay: the caller's own copy)
                return logits.clone() if self._cudagraph_state is not None else logits
            return logits.float().cpu().numpy()

    def greedy_steps(self, row: int, token: int, position: int, steps: int, on_token, pick=None
                     ) -> tuple[int, float]:
        """engines.base.greedy_steps with the tokens kept on the device (engines.base.device_greedy_steps): each
        call's argmax feeds the next call there, and the host reads them once per GREEDY_CHUNK calls instead of a
        sync and a logits copy per call. Row 0 of a full-cache engine without features (the draft chain, the
        scheduler's lone row); else forward's loop."""
        import torch

        if row or self._rings is not None or self.features_size or steps < 1:
            return forward_greedy_steps(self, row, token, position, steps, on_token, pick)
        check_greedy_steps(self, row, token, position, steps)
        dev = self.device
        positions = torch.arange(position, position + steps, device=dev).view(-1, 1, 1)
        tree = torch.ones((1, 1, 1), dtype=torch.bool, device=dev) if self.tree_verify else None
        if self._cudagraph_state is not None:
            adopt_cudagraph_tree_state(self._cudagraph_state)

        def call(i, tok):
            return self._graphed(tok, positions[i], tree)[0]

        with self._guard, torch.no_grad():
            return device_greedy_steps(call, token, steps, on_token, dev, pick=pick)

    # the cache-row operations: engines/base.TorchCacheRows over this engine's caches
    def _cache_buffers(self):
        return self.caches


# torch's cudagraph trees keep their managers in two thread-local attributes of this module
_TREE_STATE = ("tree_manager_containers", "tree_manager_locks")


def cudagraph_tree_state() -> dict | None:
    """This thread's cudagraph-tree state (the managers of CUDA-graphed calls), to share with the threads that call
    the engine; None where this torch keeps none that we can read."""
    from torch._inductor import cudagraph_trees

    try:
        return {name: cudagraph_trees.get_obj(cudagraph_trees.local, name) for name in _TREE_STATE}
    except (AssertionError, AttributeError):
        return None


def adopt_cudagraph_tree_state(state: dict) -> None:
    """Give the calling thread the engine's cudagraph-tree state where it has none of its own.

    Before torch 2.13 (pytorch/pytorch#123177) the state lives only in the thread that imported the cudagraph
    trees, and any CUDA-graphed call from another thread (the scheduler's, the server's) fails an assertion.
    One engine's calls never overlap (CallGuard), so threads can share one manager."""
    from torch._inductor import cudagraph_trees

    for name, value in state.items():
        if not hasattr(cudagraph_trees.local, name):
            setattr(cudagraph_trees.local, name, value)


def step_module(source, *, device: str, functional_cache: bool = False, weights: str = "float",
                int8_activations: bool = False, rowwise: bool = False):
    """The StepModel of ``source`` on ``device`` -> (step, the GGUF kernels' report or None).

    weights "gguf": the linear layers run our kernels on the file's own blocks (torch_backend/gguf.py).
    ``rowwise`` (compiled engines only): each row's result the same bits whatever the call's size, for builds that
    round activations: exporter.step_model.rowwise_attention instead of SDPA, and RowwiseLinear for the layers
    left in float beside the kernels. GGUF weights also run the step's small ops of trtspec's library (RMSNorm,
    q/k/v RoPE: exporter.step_model's step_ops), which cut what a build traces and compiles."""
    from ..exporter.step_model import StepModel

    model = source.manifest["model"]
    features = model.get("hidden_states") or {}
    # built on the CPU (its RoPE table comes from the HF rotary module there), then moved
    hf = source.hf_model.requires_grad_(False)
    gguf = None
    if weights == "gguf":
        if source.gguf_file is None:
            raise ValueError(f"weights='gguf' needs an export of a GGUF file; {source.path} was not made from one")
        if device != "cpu":
            raise BackendUnavailableError("the GGUF kernels run on the CPU; use device='cpu' or weights='float'")
        from .gguf import fuse_gguf, use_gguf_kernels

        gguf = use_gguf_kernels(hf, source.gguf_file, source.spec, int8_activations, rowwise)
    step = StepModel(hf, source.spec, model["max_seq_len"], in_place_cache=not functional_cache,
                     cache_slots=model["cache_slots"], tree=bool(model.get("tree_verify")),
                     hidden_layers=features.get("layers"),
                     fuse_projections=not functional_cache and (True if gguf is None else fuse_gguf),
                     rowwise_attention=rowwise, step_ops=gguf is not None)
    return step.eval().to(device), gguf


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
    weights: str = "float",
    int8_activations: bool = False,
) -> TorchEngine:
    """Compile an HF model (or the model behind an export/ artifact) into a torch engine.

    The engine has the same protocol as load_engine()'s, so Generator can mix it with
    onnxruntime or TensorRT engines. ``backend`` is the torch.compile backend:
    "inductor", "eager" (captured by dynamo, run by eager PyTorch) or "torch_tensorrt".
    ``max_seq_len``/``max_batch``/``dtype`` default to the export's own values for an
    export dir, else to 512 / 4 / "float32". ``tree`` (one call verifies a token tree) and ``hidden_states``
    ("low,mid,high", "last" or layer indices: features for draft heads) are export()'s options; they default to
    the export's own, and to neither for an HF dir. ``weights`` "gguf" (an export of a GGUF file, CPU): the linear
    layers run trtspec's GGUF kernels on the file's own blocks (``int8_activations``: their int8 variant), not
    dequantized float32 weights.
    """
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"unknown torch backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if weights not in ("float", "gguf"):
        raise ValueError(f"unknown weights {weights!r}; choose float or gguf")
    if int8_activations and weights != "gguf":
        raise ValueError("int8_activations goes with weights='gguf'")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    if backend == "torch_tensorrt":
        from .dynamo_backend import require_torch_tensorrt

        require_torch_tensorrt()
    source = load_source(Path(model_dir_or_export_dir), max_seq_len=max_seq_len, max_batch=max_batch, dtype=dtype,
                         tree=tree, hidden_states=hidden_states)
    engine = TorchEngine(source, compile_backend=backend, device=device, functional_cache=backend == "torch_tensorrt",
                         weights=weights, int8_activations=int8_activations)
    log.info("torch engine for %s: backend %s on %s (compiled lazily, per shape class, on first calls)",
             model_dir_or_export_dir, backend, device)
    return engine
