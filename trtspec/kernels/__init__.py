"""Our own GGUF kernels: a linear layer on a GGUF file's own blocks, as a torch op.

    from trtspec import kernels
    b = kernels.decode("Q4_1", raw_bytes, n, k)     # the file's blocks, exactly (blocks.py)
    layer = kernels.pack(b)                          # the kernels' layout, once (layout.py)
    y = kernels.linear(x, layer, int8_activations=True)   # torch.ops.trtspec.gguf_linear

Every type of common GGUF mixes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with its scales and minimums
exact; float activations (closest to float32) or int8 activations rounded per block of 32 (llama.cpp's q8_1 idea,
faster). One kernel for any number of rows reads each block once for all rows of a call, and a row's result does
not depend on how many rows share the call, nor on the thread count, nor on the instruction set path
(csrc/gguf_linear.h). The C++ is compiled with the machine's compiler at first use and cached (build.py); where
that fails, the op is defined in plain torch instead (torch_path.py), with a warning saying why.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

import numpy as np
import torch

from . import build, torch_path
from .blocks import TYPES, Blocks, decode, dequantize
from .layout import Packed, pack, unpack

__all__ = ["TYPES", "Blocks", "Packed", "decode", "dequantize", "pack", "unpack", "load", "linear", "attention",
           "attention_rows_live", "attention_rows_tokens", "rms_norm", "rope_qkv", "silu_mul", "loaded", "status",
           "paths", "use_path", "c_shims"]

_status: dict = {}


def load(progress=sys.stderr) -> str:
    """Make torch.ops.trtspec.gguf_linear available; returns "native" (the compiled kernels) or "torch" (the
    pure-torch path, where they could not be built). The fastest ISA path this CPU runs is used, or the one named by
    $TRTSPEC_KERNEL_PATH (e.g. avx2, to compare paths on one machine)."""
    if _status:
        return _status["backend"]
    try:
        lib = build.library(progress)
        # global: an AOTInductor package built with c_shims() calls the library's C functions by name
        ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
        torch.ops.load_library(str(lib))
        _status.update(backend="native", library=str(lib))
    except (build.CompilerMissing, RuntimeError, OSError) as e:
        warnings.warn(f"trtspec's GGUF kernels could not be built ({e}); GGUF layers run on the pure-torch path, "
                      "several times slower. Install a C++ compiler (Debian: apt install g++) or point TRTSPEC_CXX "
                      "at one, then run again.", RuntimeWarning, stacklevel=2)
        torch_path.register()
        _status.update(backend="torch", reason=str(e))
    torch.library.register_fake("trtspec::gguf_linear")(_fake)
    torch.library.register_fake("trtspec::attention_rows")(_attention_fake)
    torch.library.register_fake("trtspec::attention_rows_tokens")(_attention_tokens_fake)
    torch.library.register_fake("trtspec::rms_norm")(_rms_norm_fake)
    torch.library.register_fake("trtspec::rope_qkv")(_rope_qkv_fake)
    torch.library.register_fake("trtspec::silu_mul")(_silu_mul_fake)
    forced = os.environ.get("TRTSPEC_KERNEL_PATH")
    if forced and _status["backend"] == "native":
        runs = list(torch.ops.trtspec.gguf_kernel_paths())
        if forced not in runs:
            raise RuntimeError(f"TRTSPEC_KERNEL_PATH={forced!r}: this CPU runs the kernel paths {runs} (fastest "
                               "first); set one of them, or unset TRTSPEC_KERNEL_PATH to use the fastest")
        torch.ops.trtspec.gguf_kernel_path(forced)
    return _status["backend"]


def c_shims() -> dict:
    """{op: [its C function's declaration]} for torch._inductor.config.aot_inductor.custom_ops_to_c_shims: a package
    compiled with it calls the native kernels directly (csrc/ops.cpp, "C shims"), not through the dispatcher's
    boxed call, a few microseconds less per call. Empty where the kernels run on the pure-torch path."""
    if load() != "native":
        return {}
    return {
        torch.ops.trtspec.gguf_linear.default: [
            "AOTITorchError aoti_torch_cpu_gguf_linear(AtenTensorHandle x, AtenTensorHandle packed, int64_t n, "
            "int64_t k, int64_t bits, int64_t group, int64_t zero, int32_t has_min, int32_t half_scales, "
            "int32_t int8_activations, AtenTensorHandle* ret0)"],
        torch.ops.trtspec.attention_rows.default: [
            "AOTITorchError aoti_torch_cpu_attention_rows(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, "
            "AtenTensorHandle mask, double scale, double softcap, AtenTensorHandle* ret0)"],
        torch.ops.trtspec.attention_rows_tokens.default: [
            "AOTITorchError aoti_torch_cpu_attention_rows_tokens(AtenTensorHandle q, AtenTensorHandle k, "
            "AtenTensorHandle v, AtenTensorHandle mask, double scale, double softcap, AtenTensorHandle* ret0)"],
        torch.ops.trtspec.rms_norm.default: [
            "AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps, "
            "AtenTensorHandle* ret0)"],
        torch.ops.trtspec.rope_qkv.default: [
            "AOTITorchError aoti_torch_cpu_rope_qkv(AtenTensorHandle qkv, AtenTensorHandle cos, AtenTensorHandle sin, "
            "int64_t heads, int64_t kv_heads, AtenTensorHandle* ret0, AtenTensorHandle* ret1, AtenTensorHandle* ret2)"],
        torch.ops.trtspec.silu_mul.default: [
            "AOTITorchError aoti_torch_cpu_silu_mul(AtenTensorHandle x, AtenTensorHandle* ret0)"],
    }


def _fake(x, packed, n, k, bits, group, zero, has_min, half_scales, int8_activations):
    # torch.export / AOTInductor trace with this: the output's shape and dtype only
    return x.new_empty((*x.shape[:-1], n))


def _attention_fake(q, k, v, mask, scale, softcap):
    return q.new_empty(q.shape)


def _attention_tokens_fake(q, k, v, mask, scale, softcap):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1] * q.shape[3]))


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape)


def _rope_qkv_fake(qkv, cos, sin, heads, kv_heads):
    b, t, d = qkv.shape[0], qkv.shape[1], cos.shape[-1]
    return qkv.new_empty((b, heads, t, d)), qkv.new_empty((b, t, kv_heads, d)), qkv.new_empty((b, t, kv_heads, d))


def _silu_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's fused gate/up output [..., 2N] -> silu(gate) * up [..., N] in float32, each element alone, the
    same bits on every instruction set (csrc/step_ops.cpp): one traced op where HF's split, SiLU and product are
    five."""
    load()
    return torch.ops.trtspec.silu_mul(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) in float32 (HF's LlamaRMSNorm), one row at a time in a fixed
    order (csrc/step_ops.cpp): one traced op where HF's module is ten."""
    load()
    return torch.ops.trtspec.rms_norm(x, weight, eps)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """A layer's fused projection [B, T, (H + 2 Hkv) D] and its rows' RoPE tables [B, T, D] -> q [B, H, T, D] and
    k [B, T, Hkv, D] rotated (HF's rotate_half form), v [B, T, Hkv, D] (csrc/step_ops.cpp)."""
    load()
    return torch.ops.trtspec.rope_qkv(qkv, cos, sin, heads, kv_heads)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], where mask) v, one query row at a time in an order fixed per row: a
    row's result is the same bits whatever the call's number of rows (csrc/attention_rows.h).

    q [B, H, T, D] float32; k, v [B, Hkv, S, D] (a KV cache cut to its live slots), H a multiple of Hkv; mask
    bool, broadcastable to [B, 1, T, S] -> [B, H, T, D]. The op itself also takes a whole cache and a mask
    [B, 1, T, S] over its first S slots (attention_rows_live)."""
    return attention_rows_live(q, k, v, mask.expand(q.shape[0], 1, q.shape[2], k.shape[2]), scale, softcap)


def attention_rows_live(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                        softcap: float | None = None) -> torch.Tensor:
    """attention() over the first S slots of whole caches k, v [B, Hkv, S_max, D], mask bool [B, 1, T, S] in full
    (not broadcast): the op alone, no cut views or expand to trace (the compiled step's attention)."""
    load()
    return torch.ops.trtspec.attention_rows(q, k, v, mask, scale, softcap or 0.0)


def attention_rows_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float | None = None) -> torch.Tensor:
    """attention_rows_live's rows, the same bits, as [B, T, H * D] (the output projection's input): one traced op
    where the op and a transpose and a flatten were three."""
    load()
    return torch.ops.trtspec.attention_rows_tokens(q, k, v, mask, scale, softcap or 0.0)


def release_openmp_workers() -> None:
    """Let the calling thread's idle OpenMP workers exit (OpenMP 5's omp_pause_resource_all, in the libgomp torch
    loaded). libgomp keeps a pool of workers per thread that ran parallel work; while the process holds more of them
    than it has CPUs, every pool spins only briefly before sleeping, and each of a call's ~500 parallel regions then
    pays a wake-up: a decode call from the scheduler's thread took 15.5 ms against 10.3 from the thread that loaded
    the engine, and Generators made after an index was built in the same process decoded 5x slower. Loading an
    engine and building an index (datastore.build_index) release theirs; the engine's calls come from the scheduler's
    thread."""
    try:
        ctypes.CDLL("libgomp.so.1").omp_pause_resource_all(1)  # omp_pause_soft
    except (OSError, AttributeError):  # another OpenMP runtime, or none: nothing to release
        pass


def loaded() -> str | None:
    """What ``load`` made available ("native" or "torch"), or None before it ran: never compiles anything."""
    return _status.get("backend")


def status() -> dict:
    """{"backend": "native" | "torch", "library" or "reason", "path": the ISA path in use}."""
    load()
    return {**_status, "path": torch.ops.trtspec.gguf_kernel_path("")}


def paths() -> list[str]:
    """The kernel paths this CPU runs, fastest first (e.g. ["avx512vnni", "avx512", "avxvnni", "avx2", "reference"])."""
    load()
    return list(torch.ops.trtspec.gguf_kernel_paths())


def use_path(name: str) -> str:
    """Run every later call on path ``name`` (benchmarks and tests; the fastest is chosen at load)."""
    load()
    return torch.ops.trtspec.gguf_kernel_path(name)


def as_tensor(layer: Packed) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(layer.data))


def linear(x: torch.Tensor, layer: Packed, int8_activations: bool = False, data: torch.Tensor | None = None):
    """x [..., k] float32 -> x @ W^T [..., n] for the GGUF layer ``layer`` (``data``: its bytes as a tensor,
    to skip the conversion on every call)."""
    if not _status:
        load()
    # the overload itself: the packet's call resolves it again on every call
    return torch.ops.trtspec.gguf_linear.default(x, as_tensor(layer) if data is None else data, layer.n, layer.k,
                                                 layer.bits, layer.group, layer.zero, layer.has_min,
                                                 layer.half_scales, int8_activations)
