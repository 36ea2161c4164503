"""An EAGLE-3 head compiled with the engine that carries it (`trtspec build ... --backend torch --head DIR`): the
head's step as an AOTInductor package, its matrices in 8-bit blocks on trtspec's GGUF kernels (Q8_0's form:
symmetric int8 codes, one scale per 32 weights), attention over the live slots of its one-layer cache only.

Its signature is the torch engine's (engines/torch_aot.py) plus the head's two float inputs:

    (input_ids [B, T], position_ids [B, T], live [L], features [B, T, 3 H_t], hidden_in [B, T, H], key, value)
        -> logits [B, T, V_draft], hidden_states [B, T, H]

and the manifest's model section is the exported head's (heads/export.py), so the runtime's EAGLE-3 drafter runs
either. A head call reads its weights (about 10 MB for SmolLM2's 10,240-token head) and its live cache slots; the
onnxruntime graph of the same head attended all of its capacity and paid onnxruntime's per-call work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("trtspec.build")
GROUP = 32


def q8_blocks(weight: np.ndarray):
    """A float matrix [n, k] -> its Q8_0 blocks: codes round(w / d) in -127..127, d = max|w| / 127 per group of 32
    along k, stored in float16 as Q8_0's are."""
    from ..kernels.blocks import Blocks

    w = np.asarray(weight, np.float32)
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"8-bit blocks need a multiple of {GROUP} inputs, got {k}")
    groups = w.reshape(n, k // GROUP, GROUP)
    d = (np.abs(groups).max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)
    codes = np.clip(np.rint(groups / safe[..., None]), -127, 127).astype(np.int8).reshape(n, k)
    return Blocks(codes, d, None, 0, 8, GROUP, "Q8_0")


def not_compilable(config) -> str | None:
    """Why a head of this config cannot run on the kernels' 8-bit blocks (None: it can): each matrix's inputs
    must fill whole groups of 32."""
    inputs = {"fc": 3 * config.target_hidden_size, "q/k/v_proj": 2 * config.hidden_size,
              "o_proj": config.num_attention_heads * config.head_dim, "gate/up_proj, lm_head": config.hidden_size,
              "down_proj": config.intermediate_size}
    odd = [f"{name} ({k})" for name, k in inputs.items() if k % GROUP]
    return f"inputs not a multiple of {GROUP}: {', '.join(odd)}" if odd else None


def _linear(linear, int8_activations: bool):
    from ..kernels.layout import pack
    from ..torch_backend.gguf import GGUFLinear

    w = linear.weight.detach().float().numpy()
    return GGUFLinear(pack(q8_blocks(w), half_scales=True), None, int8_activations)


def step_module(head, int8_activations: bool = True):
    """The head's step for the package, its linear layers in 8-bit blocks (q/k/v and gate/up each one kernel call)."""
    import torch
    from torch import nn

    from .. import kernels
    from ..torch_backend.gguf import fuse_gguf
    from .eagle3 import rotate_half

    c = head.config
    layer = head.midlayer
    for module, names in ((head, ("fc", "lm_head")), (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                          (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            setattr(module, name, _linear(getattr(module, name), int8_activations))
    qkv = fuse_gguf(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
    gate_up = fuse_gguf(layer.mlp, ("gate_proj", "up_proj"))
    scale = c.head_dim ** -0.5

    class HeadStep(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.qkv, self.gate_up = head, qkv, gate_up

        def forward(self, input_ids, position_ids, live, features, hidden_in, key, value):
            h = self.head
            emb = h.embed_tokens(input_ids)
            hidden = h.fc(features) + hidden_in
            x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
            q, k, v = self.qkv(x)
            q = q.unflatten(-1, (c.num_attention_heads, c.head_dim)).transpose(1, 2)
            k = k.unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(1, 2)
            v = v.unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(1, 2)
            cos, sin = h.rope(position_ids)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None]
            key[rows, :, position_ids] = k.transpose(1, 2)
            value[rows, :, position_ids] = v.transpose(1, 2)
            n = live.shape[0]
            mask = live <= position_ids[:, None, :, None]
            y = kernels.attention(q, key[:, :, :n], value[:, :, :n], mask, scale)
            out = hidden + layer.self_attn.o_proj(y.transpose(1, 2).flatten(2))
            g, u = self.gate_up(layer.post_attention_layernorm(out))
            out = out + layer.mlp.down_proj(torch.nn.functional.silu(g) * u)
            return h.lm_head(h.norm(out)), out

    return HeadStep().eval()


def compile_head(head, config, package: Path, *, max_seq_len: int, max_batch: int, max_call: int,
                 int8_activations: bool = True) -> float:
    """AOT-compile the head's step into ``package`` (a .pt2 file); returns the seconds it took."""
    import torch
    from torch.export import Dim

    from ..engines.torch_aot import CACHE_PAD, LIVE_STEP
    from ..torch_backend.aot import compiling

    from .. import kernels
    from ..engines.torch_aot import require_native_kernels

    t0 = time.perf_counter()
    require_native_kernels("a compiled EAGLE-3 head")
    step = step_module(head, int8_activations)
    b, t = min(2, max_batch), min(8, max_call)
    slots = max_seq_len + CACHE_PAD
    cache = torch.zeros((b, config.num_key_value_heads, slots, config.head_dim))
    args = (torch.ones((b, t), dtype=torch.long), torch.arange(t).repeat(b, 1), torch.arange(min(4 * LIVE_STEP, max_seq_len)),
            torch.zeros(b, t, 3 * config.target_hidden_size), torch.zeros(b, t, config.hidden_size), cache, cache.clone())
    row = Dim("rows", min=1, max=max_batch) if max_batch > 1 else None
    tok = Dim("tokens", min=1, max=max_call) if max_call > 1 else None
    dims = ({0: row, 1: tok}, {0: row, 1: tok}, {0: Dim("live", min=1, max=max_seq_len)}, {0: row, 1: tok},
            {0: row, 1: tok}, {0: row}, {0: row})
    with torch.no_grad():
        program = torch.export.export(step, args, dynamic_shapes=dims, strict=False)
        with compiling(kernels.c_shims()):
            torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    return time.perf_counter() - t0


def compile_head_for(head_dir, out_dir, *, target, target_manifest: dict, target_model=None,
                     embedding=None) -> Path:
    """The head in ``head_dir`` compiled for the target (an engine being written: its manifest given) into the
    engine artifact ``out_dir`` (backend torch), which the runtime loads as it loads any torch engine."""
    import torch

    from ..engines.torch_aot import PACKAGE, cpu_isa, kernel_schema
    from ..manifest import ENGINE_FORMAT, atomic_artifact, versions
    from .export import carry_head_files, checked_head, head_section

    t0 = time.perf_counter()
    target, out_dir = Path(target), Path(out_dir)
    head, config, layers = checked_head(head_dir, target, target_manifest, target_model, embedding)
    head = head.float().eval()
    model = target_manifest["model"]
    section = head_section(head, config, model, layers, model["max_seq_len"], model["max_batch"])
    build = {"weights": "q8_0", "int8_activations": True, "device": "cpu", "torch": torch.__version__}
    manifest = {"format": ENGINE_FORMAT, "backend": "torch", "graph": PACKAGE, "model": section,
                "config": config.to_dict(), "build": build,
                "source": {"head_dir": str(Path(head_dir).resolve()), "target": str(target.resolve())},
                "versions": versions("torch")}
    with atomic_artifact(out_dir, manifest) as tmp:
        carry_head_files(tmp, head, target, target_manifest, manifest)
        log.info("AOTInductor: compiling the EAGLE-3 head's step into %s/%s", out_dir.name, PACKAGE)
        build["compile_s"] = round(compile_head(head, config, tmp / PACKAGE, max_seq_len=section["max_seq_len"],
                                                max_batch=section["max_batch"],
                                                max_call=section["max_call_tokens"]), 1)
        build["cpu_isa"], build["kernel_schema"] = cpu_isa(), kernel_schema()
    log.info("compiled the EAGLE-3 head %s in %.1f s", head_dir, time.perf_counter() - t0)
    return out_dir
