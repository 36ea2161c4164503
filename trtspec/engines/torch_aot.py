"""A torch engine built ahead of time (`trtspec build --backend torch`): an AOTInductor package of the step module.

The package (torch_backend/aot.py builds it) is one shared library with the weights inside; loading it compiles
nothing and a call runs no Python per op. Its signature:

    (input_ids [B, T], position_ids [B, T], tree_mask [B, T, T] | live [L] | -, *caches) -> logits[, hidden_states]

The caches are this engine's buffers, rows [first_row, first_row + B), written in place. A full-length cache has
CACHE_PAD slot more than max_seq_len, never read nor written: a call attends its first L slots (live, a multiple
of LIVE_STEP that holds every slot the call reads or writes), and a cut that can never equal the buffer keeps
torch.export from specialising L. An engine of a tree export takes a tree_mask instead (a chain call's: the
causal mask) and attends the whole capacity, as a CUDA build's calls do (no live input: torch_backend/aot.py).

An engine whose linear layers run trtspec's GGUF kernels needs them compiled here (trtspec/kernels); without a
compiler it is refused with the fix, not run on a slower path.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError
from ..exporter.contract import max_call_tokens
from ..kernels import release_openmp_workers
from .base import (CallGuard, TorchCacheRows, chain_mask, check_call, check_greedy_steps, device_greedy_steps,
                   forward_greedy_steps, ring_rows)

PACKAGE = "step.pt2"
CACHE_PAD = 1
# a chain call attends the first multiple of this many slots that holds every position it reads or writes
LIVE_STEP = 64

log = logging.getLogger("trtspec.torch")


def live_length(position_ids: np.ndarray, max_seq_len: int) -> int:
    """The cache slots a chain call attends: every slot it reads (a position) or writes (first slot + j, pad tokens
    included), rounded up to LIVE_STEP, at most max_seq_len."""
    return live_slots(max(int(position_ids.max()) + 1, int(position_ids[:, 0].max()) + position_ids.shape[1]),
                      max_seq_len)


def live_slots(last: int, max_seq_len: int) -> int:
    """``last`` slots rounded up to LIVE_STEP, at most max_seq_len."""
    return min(max_seq_len, -(-last // LIVE_STEP) * LIVE_STEP)


def kernel_schema() -> str:
    """The GGUF kernels' op schema, which a package calls by name: recorded at build, checked at load."""
    import torch

    return str(torch.ops.trtspec.gguf_linear.default._schema)


def cpu_isa(supported: bool = False):
    """The vector instruction set inductor compiles for on this CPU (e.g. "avx512 avx512_vnni"); ``supported``:
    every one this CPU runs."""
    from torch._inductor import cpu_vec_isa

    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] if supported else str(cpu_vec_isa.pick_vec_isa())


def flat_runner(package):
    """The loaded package as a function of its tensors, in the package's order. Its own __call__ parses both of the
    package's call specs and flattens the arguments on every call (15-60 us of a 3 ms decode call, measured); here
    the outputs' spec is parsed once and the tensors go straight to the loader. The package itself where torch has
    no loader."""
    from torch.utils import _pytree as pytree

    loader = getattr(package, "loader", None)
    if not (hasattr(loader, "boxed_run") and hasattr(loader, "get_call_spec")):
        return package
    out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def run(*tensors):
        return pytree.tree_unflatten(loader.boxed_run(list(tensors)), out_spec)

    return run


def require_native_kernels(what: str) -> None:
    """Load trtspec's compiled GGUF kernels, or refuse ``what`` with the reason and the fix."""
    from .. import kernels

    if kernels.load() != "native":
        raise BackendUnavailableError(
            f"{what} runs trtspec's compiled GGUF kernels, which could not be built on this machine "
            f"({kernels.status().get('reason')}). Install a C++ compiler (Debian: apt install g++) or point "
            "TRTSPEC_CXX at one, then load it again; or use an onnxruntime engine of the same export")


class TorchAOTEngine(TorchCacheRows):
    """The engine protocol (engines/base.py) over an AOTInductor package. Not thread-safe (engines/base.py)."""

    backend = "torch"
    tensor_logits = True  # forward(..., as_tensor=True) leaves the logits on the device

    def __init__(self, path: Path, manifest: dict, *, num_threads: int | None = None):
        import torch

        self.path, self.manifest = Path(path), manifest
        build = manifest["build"]
        if build["torch"] != torch.__version__:
            raise ArtifactError(
                f"{path} was built with torch {build['torch']} and this is torch {torch.__version__}; an AOTInductor "
                "package runs only on the torch that built it: rebuild it with `trtspec build --backend torch`")
        self.device = torch.device(build["device"])
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(f"{path} was built for CUDA and torch sees no GPU here; build it with "
                                          "`trtspec build --backend torch --device cpu`")
        if build.get("cpu_isa") and build["cpu_isa"] not in cpu_isa(supported=True):
            raise ArtifactError(f"{path} was compiled for {build['cpu_isa']} instructions, which this CPU does not run "
                                f"({', '.join(cpu_isa(supported=True)) or 'none found'}); build it on this machine "
                                "with `trtspec build --backend torch`")
        if build.get("kernel_schema"):
            require_native_kernels(str(path))
            if kernel_schema() != build["kernel_schema"]:
                raise ArtifactError(f"{path} calls the GGUF kernels as {build['kernel_schema']}, and this trtspec's "
                                    f"are {kernel_schema()}; rebuild it with `trtspec build --backend torch`")
        if num_threads:
            torch.set_num_threads(num_threads)
        model = manifest["model"]
        self.max_seq_len, self.max_batch = model["max_seq_len"], model["max_batch"]
        self.vocab_size = model["vocab_size"]
        self.logits_size = model.get("logits_size", self.vocab_size)  # a draft head's own vocabulary
        self.extra_inputs = dict(model.get("extra_inputs") or {})  # a carried head's float inputs [B, T, n]
        self._zeros: dict[tuple[int, int, int], object] = {}
        self.max_call_tokens = max_call_tokens(model)
        self.tree_verify = bool(model.get("tree_verify"))
        self.features_size = (model.get("hidden_states") or {}).get("size")
        self.features = None  # the last call's hidden_states [B, T, features_size] (numpy), engines with features
        self._rings = ring_rows(model, self.max_batch)
        self._guard = CallGuard(f"{path} (torch)")
        dtype = getattr(torch, model["dtype"])
        self._rows_views: dict[tuple[int, int], list] = {}  # forward's views of the caches' rows
        self._caches = [torch.zeros((self.max_batch, model["num_kv_heads"], n + CACHE_PAD * (n == self.max_seq_len),
                                     model["head_dim"]), dtype=dtype, device=self.device)
                        for n in model["cache_slots"] for _ in (0, 1)]
        self._slots = torch.arange(self.max_seq_len, device=self.device)
        # a chain call's live-length input (a CUDA build has none: it attends the whole capacity)
        self._live_input = not self.tree_verify and build.get("live", True)
        self._runner = flat_runner(torch._inductor.aoti_load_package(str(self.path / manifest["graph"])))
        release_openmp_workers()

    @property
    def caches(self):
        """The KV cache buffers, [max_batch, Hkv, slots, D] each (key_0, value_0, key_1, ...)."""
        return [c[:, :, : self.max_seq_len] for c in self._caches]

    def forward(self, input_ids, position_ids, first_row: int = 0, tree_mask=None, inputs=None, as_tensor=False):
        # input_ids [B, T] int64, position_ids [B, T] int64 -> logits [B, T, V] float32 numpy (a fresh array), or with
        # ``as_tensor`` the package's own output tensor on the engine's device (runtime/picks.py reads it there)
        import torch

        unknown = sorted(set(inputs or ()) - set(self.extra_inputs))
        if unknown:
            raise ValueError(f"{self.path} takes no input {', '.join(unknown)} (its extra inputs: "
                             f"{', '.join(self.extra_inputs) or 'none'})")
        input_ids, position_ids, tree_mask = check_call(self, input_ids, position_ids, first_row, tree_mask)
        if self._rings is not None:
            self._rings.wrote(first_row, position_ids)
        dev = self.device
        args = [torch.from_numpy(input_ids).to(dev), torch.from_numpy(position_ids).to(dev)]
        if self.tree_verify:  # a chain call passes the causal mask; a tree call attends the whole capacity
            mask = chain_mask(*input_ids.shape).copy() if tree_mask is None else tree_mask
            args.append(torch.from_numpy(mask).to(dev))
        elif self._live_input:
            args.append(self._slots[: live_length(position_ids, self.max_seq_len)])
        b, t = input_ids.shape
        for name, size in self.extra_inputs.items():  # (zeros where one is not given, as onnxruntime's engine)
            value = None if inputs is None else inputs.get(name)
            if value is None:
                zeros = self._zeros.get((b, t, size))
                if zeros is None:
                    zeros = self._zeros[b, t, size] = torch.zeros((b, t, size), device=dev)
                args.append(zeros)
            elif np.shape(value) != (b, t, size):
                raise ValueError(f"{name} has shape {np.shape(value)}, the call needs {(b, t, size)}")
            else:
                args.append(torch.from_numpy(np.ascontiguousarray(value, np.float32)).to(dev))
        rows = self._rows_views.get((first_row, b))
        if rows is None:  # 60 slices cost ~80 us a call: made once per (first row, rows), the caches never move
            rows = self._rows_views[first_row, b] = [c[first_row : first_row + b] for c in self._caches]
        args += rows
        with self._guard, torch.no_grad():
            out = self._runner(*args)
            logits = out[0] if self.features_size else out
            if self.features_size:
                self.features = out[1].float().cpu().numpy()
            return logits if as_tensor else logits.float().cpu().numpy()

    def greedy_steps(self, row: int, token: int, position: int, steps: int, on_token, pick=None
                     ) -> tuple[int, float]:
        """engines.base.greedy_steps calling the package directly (no per-call checks or numpy inputs), the tokens
        kept on the device off the CPU (engines.base.device_greedy_steps). Row 0 of an engine without rings,
        features, extra inputs or a tree input; else forward's loop."""
        import torch

        if row or self._rings is not None or self.features_size or self.extra_inputs or self.tree_verify or steps < 1:
            return forward_greedy_steps(self, row, token, position, steps, on_token, pick)
        check_greedy_steps(self, row, token, position, steps)
        dev = self.device
        positions = torch.arange(position, position + steps, device=dev).view(-1, 1, 1)
        rows = self._rows_views.get((0, 1))
        if rows is None:
            rows = self._rows_views[0, 1] = [c[:1] for c in self._caches]

        def call(i, tok):  # the call at position + i, fed tok -> its logits
            live = [self._slots[: live_slots(position + i + 1, self.max_seq_len)]] if self._live_input else []
            return self._runner(tok, positions[i], *live, *rows)

        with self._guard, torch.no_grad():
            return device_greedy_steps(call, token, steps, on_token, dev, host_argmax=dev.type == "cpu", pick=pick)

    # the cache-row operations: engines/base.TorchCacheRows over this engine's buffers
    def _cache_buffers(self):
        return self._caches
