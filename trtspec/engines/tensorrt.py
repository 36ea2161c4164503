"""The TensorRT engine: one plan, one execution context per profile, the KV cache updated in place on the GPU.

Device memory comes from torch CUDA tensors, allocated once: one
[max_batch, Hkv, S_max, D] buffer per layer's K and V, the token and logits
buffers, and one scratch block that all contexts share (they run one at a
time on one stream). Each present_* output is bound to the address of the
past_* input the engine reports it aliases, so TensorRT's KVCacheUpdate
writes the new K/V straight into the cache. Decode and verify profiles have a
static T: after a first eager call, each (profile, batch size) is captured
as a CUDA graph and replayed. Logits come back to the host for the [B, T]
rows of the call only.

The pure functions at the top (aliasing map, bindings of a call) hold our own
logic and are tested on CPU; the class is a thin layer over TensorRT and torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..errors import ArtifactError, BackendUnavailableError
import numpy as np

from .base import CacheRows, CallGuard, chain_mask, check_call
from ..engine_contract import is_static, select_profile
from .tensorrt_compat import check_plan_compatible, compute_capability, import_tensorrt


def engine_aliases(output_names, aliased_input_of, expected: dict) -> dict:
    """present_* -> past_* as the engine reports it (``aliased_input_of`` is engine.get_aliased_input_tensor).

    Raises ArtifactError unless it is exactly the step graph's ``kv_aliases``:
    without the aliasing the cache would not be updated in place.
    """
    found = {name: aliased_input_of(name) for name in output_names}
    found = {out: src for out, src in found.items() if src}
    if found != expected:
        wrong = [f"{p} -> {found.get(p)} (expected {q})" for p, q in expected.items() if found.get(p) != q]
        extra = [f"{p} -> {q}" for p, q in found.items() if p not in expected]
        raise ArtifactError(
            "the TensorRT engine does not alias its KV cache outputs to their inputs as the step graph requires: "
            f"{'; '.join(wrong + extra)}. TensorScatter was not imported as an in-place KV cache update; "
            "run `trtspec check` on the export and rebuild"
        )
    return found


def call_bindings(model: dict, aliases: dict, batch: int, tokens: int, pointers: dict, first_row: int = 0,
                  row_bytes: int = 0) -> tuple[dict, dict]:
    """Input shapes and tensor addresses for one [batch, tokens] call over cache rows [first_row, first_row + batch).

    ``pointers`` holds the device address of input_ids, position_ids, logits
    and each past_* buffer; ``row_bytes`` is one cache row's size. The rows of
    a call are contiguous, so a call's cache address is the buffer's plus
    first_row rows; each present_* output gets its past_* input's address.
    """
    cache_shape = [batch, model["num_kv_heads"], model["max_seq_len"], model["head_dim"]]
    shapes = {"input_ids": [batch, tokens], "position_ids": [batch, tokens]}
    if model.get("tree_verify"):  # a tree export: its mask input [B, T, T] (the causal one for other calls)
        shapes["tree_mask"] = [batch, tokens, tokens]
    shapes.update({past: cache_shape for past in aliases.values()})
    addresses = {name: pointers[name] for name in ("input_ids", "position_ids", "logits", "tree_mask", "hidden_states")
                 if name in pointers}
    for present, past in aliases.items():
        addresses[past] = pointers[past] + first_row * row_bytes
        addresses[present] = addresses[past]
    return shapes, addresses


def _cuda_torch():
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "the TensorRT engine keeps its buffers in torch CUDA tensors, but torch has no CUDA device here; "
            "install a CUDA build of torch and run on a machine with an NVIDIA GPU"
        )
    return torch


class TensorRTEngine(CacheRows):
    """A TensorRT plan with in-place KV cache bindings. Not thread-safe: see engines/base.py (Engine)."""

    backend = "tensorrt"
    tensor_logits = True  # forward(..., as_tensor=True) leaves the logits on the GPU

    def __init__(self, path: Path, manifest: dict):
        trt = import_tensorrt()
        torch = self._torch = _cuda_torch()
        self.path = Path(path)
        check_plan_compatible(manifest, trt.__version__, compute_capability(), self.path)
        self.manifest = manifest
        self.plan = manifest["profile_plan"]
        model = manifest["model"]
        self.max_seq_len = model["max_seq_len"]
        self.max_call_tokens = self.max_seq_len  # profile_plan refuses ring caches
        self.max_batch = self.plan["max_batch"]
        self.vocab_size = model["vocab_size"]
        self.verify_tokens = list(self.plan["verify_tokens"])  # T values with their own static profile
        self.tree_verify = bool(model.get("tree_verify"))
        self.features_size = (model.get("hidden_states") or {}).get("size")
        self.features = None  # the last call's hidden_states [B, T, F] on the host (exports with them)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine((self.path / manifest["plan_file"]).read_bytes())
        if self._engine is None:
            raise ArtifactError(f"TensorRT could not deserialize {self.path / manifest['plan_file']}; rebuild the engine")
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self._aliases = engine_aliases(names, self._engine.get_aliased_input_tensor, model["kv_aliases"])
        self._allocate(torch, self.plan["buffers"])
        self._stream = torch.cuda.Stream()
        self._contexts = [self._make_context(trt, i) for i in range(len(self.plan["profiles"]))]
        self._graphs = {}  # (profile index, batch) -> torch.cuda.CUDAGraph
        self._guard = CallGuard(str(self.path))

    def _allocate(self, torch, buffers: dict):
        dtype = getattr(torch, buffers["cache_dtype"])
        self.cache = {past: torch.zeros(buffers["cache_shape"], dtype=dtype, device="cuda") for past in self._aliases.values()}
        _, max_tokens, vocab = buffers["logits_shape"]
        self._logits = torch.empty(self.max_batch * max_tokens * vocab, dtype=getattr(torch, buffers["logits_dtype"]), device="cuda")
        # numpy has no bfloat16: bf16 logits arrive on the host as float32.
        host_dtype = torch.float32 if self._logits.dtype == torch.bfloat16 else self._logits.dtype
        self._host_logits = torch.empty(self._logits.numel(), dtype=host_dtype, pin_memory=True)
        self._ids = torch.zeros(buffers["token_buffer_elements"], dtype=torch.int64, device="cuda")
        self._positions = torch.zeros_like(self._ids)
        self._scratch = torch.empty(max(self._engine.device_memory_size_v2, 1), dtype=torch.uint8, device="cuda")
        self._pointers = {"input_ids": self._ids.data_ptr(), "position_ids": self._positions.data_ptr(),
                          "logits": self._logits.data_ptr(), **{p: buf.data_ptr() for p, buf in self.cache.items()}}
        tokens = buffers["token_buffer_elements"] // self.max_batch
        if self.tree_verify:
            self._tree = torch.zeros(self.max_batch * tokens * tokens, dtype=torch.bool, device="cuda")
            self._pointers["tree_mask"] = self._tree.data_ptr()
        if self.features_size:
            self._hidden = torch.empty(buffers["token_buffer_elements"] * self.features_size,
                                       dtype=self._logits.dtype, device="cuda")
            self._pointers["hidden_states"] = self._hidden.data_ptr()

    def _make_context(self, trt, index: int):
        context = self._engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        context.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
        context.set_optimization_profile_async(index, self._stream.cuda_stream)
        return context

    def forward(self, input_ids, position_ids, first_row: int = 0, tree_mask=None, as_tensor=False):
        # input_ids [B, T] int64, position_ids [B, T] int64 -> logits [B, T, V] on the host
        # tree_mask [B, T, T] bool: a tree call (a --tree export). The returned array is a view of a reused pinned
        # buffer: valid until the next call. ``as_tensor``: a view of the GPU's own logits buffer instead (no copy
        # to the host; runtime/picks.py reads it there), valid until the next call too.
        input_ids, position_ids, tree_mask = check_call(self, input_ids, position_ids, first_row, tree_mask)
        b, t = input_ids.shape
        if tree_mask is None and self.tree_verify:
            tree_mask = chain_mask(b, t)
        index = select_profile(self.plan, b, t)
        torch = self._torch
        n, m = b * t, b * t * self.vocab_size
        with self._guard, torch.cuda.stream(self._stream):
            self._ids[:n].copy_(torch.from_numpy(input_ids.reshape(-1)))
            self._positions[:n].copy_(torch.from_numpy(position_ids.reshape(-1)))
            if self.tree_verify:
                self._tree[: n * t].copy_(torch.from_numpy(np.ascontiguousarray(tree_mask).reshape(-1)))
            self._run(index, b, t, first_row)
            if not as_tensor:
                self._host_logits[:m].copy_(self._logits[:m], non_blocking=True)
            if self.features_size:
                f = self._hidden[: n * self.features_size].float().cpu()
            self._stream.synchronize()
        if self.features_size:
            self.features = f.numpy().reshape(b, t, self.features_size)
        if as_tensor:
            return self._logits[:m].view(b, t, self.vocab_size)
        return self._host_logits[:m].numpy().reshape(b, t, self.vocab_size)

    def _run(self, index: int, b: int, t: int, first_row: int):
        graph = self._graphs.get((index, b, first_row))
        if graph is not None:
            graph.replay()
            return
        context = self._contexts[index]
        row_bytes = next(iter(self.cache.values()))[0].nbytes
        shapes, addresses = call_bindings(self.manifest["model"], self._aliases, b, t, self._pointers, first_row, row_bytes)
        for name, shape in shapes.items():
            context.set_input_shape(name, shape)
        for name, address in addresses.items():
            context.set_tensor_address(name, address)
        if not context.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run profile {self.plan['profiles'][index]['name']} at batch {b}")
        if is_static(self.plan["profiles"][index]):
            # Captured after an eager call (TensorRT's advice: shape-dependent setup happens outside capture).
            # Capture records without running, so the cache is written once, by the eager call above.
            graph = self._torch.cuda.CUDAGraph()
            with self._torch.cuda.graph(graph, stream=self._stream):
                context.execute_async_v3(self._stream.cuda_stream)
            self._graphs[(index, b, first_row)] = graph

    # the cache-row operations (engines/base.CacheRows) on this engine's stream; a prefix never leaves the GPU
    @contextmanager
    def _cache_work(self):
        with self._guard, self._torch.cuda.stream(self._stream):
            yield
            self._stream.synchronize()

    @staticmethod
    def _copied(view):
        return view.clone()

    def _moves(self, indices):
        return self._torch.from_numpy(indices).cuda()
