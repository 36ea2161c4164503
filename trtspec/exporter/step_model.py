"""The step contract (DESIGN.md §2) as a torch module over a Hugging Face model's own layers.

Projections, norms and MLPs are the HF modules themselves, so their numerics are
the reference's; only the cache handling and attention are ours: the new K/V
are written into a fixed-capacity cache at each sequence's position, and
attention runs over the whole cache with an explicit boolean mask
``slot <= position`` (rejected draft tokens beyond a sequence's length are
hidden by the mask and overwritten by the next write; no copies).

A sliding-window layer may keep a ring buffer instead (``cache_slots`` below S_max): position p lives in
slot p mod slots, written by a circular TensorScatter, and its mask is computed from the position each slot
holds after the call's write (contract.cache_slots says why that is exact, rollback included).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .architectures import ArchSpec
from .attention_op import softcapped_attention
from .kv_cache_op import kv_cache_write, kv_cache_write_ring


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin):
    """RoPE on the first cos.shape[-1] dims of x's head dim (all of them unless the rotary factor is partial)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


class FusedLinear(nn.Module):
    """Linear layers of one module that read the same input, as one matmul; forward returns their outputs in
    order. Their weights move here: the module keeps none of them (no second copy of a model's projections)."""

    def __init__(self, module: nn.Module, names: tuple[str, ...]):
        super().__init__()
        linears = [getattr(module, n) for n in names]
        self.sizes = [lin.out_features for lin in linears]
        self.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
        biases = [lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears]
        has_bias = any(lin.bias is not None for lin in linears)
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if has_bias else None
        for n in names:
            delattr(module, n)

    def whole(self, x):
        """The outputs side by side, unsplit."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):
        return self.whole(x).split(self.sizes, dim=-1)


# HF's RMSNorms of the plain form weight * (x * rsqrt(mean(x^2) + eps)), which kernels.rms_norm computes
PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")


class NativeRMSNorm(nn.Module):
    """An HF RMSNorm of the plain form (PLAIN_RMS_NORMS, float32) as trtspec's rms_norm op."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)

    def forward(self, x):
        from .. import kernels

        return kernels.rms_norm(x, self.weight, self.eps)


def rowwise_attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """Attention whose query rows are each computed in an order fixed per row, so a row's result is the same bits
    in a decode call and in a verify call (SDPA's matmuls order their sums by the call's size): trtspec's
    attention_rows op (kernels.attention), traced by torch.export and called by the compiled package.

    q [B, H, T, D], k/v [B, Hkv, S', D] (S' >= S: the op reads the first S slots), mask bool [B, 1, T, S]
    -> [B, T, H * D] (the output projection's input: attention_rows_tokens)"""
    from .. import kernels

    return kernels.attention_rows_tokens(q, k, v, mask, scale, softcap)


class StepModel(nn.Module):
    """forward(input_ids, position_ids, *past) -> (logits, *present); past/present per layer: key, value.

    With ``in_place_cache`` the past tensors are written in place (the torch backend's
    persistent cache buffers) and each present is its past; the default keeps the
    functional write the ONNX export needs.
    """

    def __init__(self, hf_model: nn.Module, spec: ArchSpec, max_seq_len: int, *, in_place_cache: bool = False,
                 cache_slots: list[int] | None = None, tree: bool = False, hidden_layers: list[int] | None = None,
                 fuse_projections: bool | Callable = False, rowwise_attention: bool = False,
                 step_ops: bool = False):
        super().__init__()
        self.spec = spec
        # rowwise_attention: attention one query row at a time (rowwise_attention(): trtspec's attention_rows op),
        # not SDPA: each row's result is the same whatever the call's size (the torch backend's int8-activation
        # builds, which round it)
        self.rowwise = rowwise_attention
        # tree: a tree_mask input [B, T, T] (contract.py); hidden_layers: HF hidden_states indices output, concatenated
        self.tree = tree
        self.hidden_layers = list(hidden_layers or [])
        self.in_place_cache = in_place_cache
        self.max_seq_len = max_seq_len
        # per layer: S_max, or a sliding-window layer's ring length (contract.cache_slots)
        self.cache_slots = list(cache_slots) if cache_slots is not None else [max_seq_len] * spec.num_layers
        self.mask_keys = [("ring", w, n) if n < max_seq_len else w
                          for w, n in zip(spec.sliding_windows, self.cache_slots)]
        if tree and min(self.cache_slots) < max_seq_len:
            raise ValueError("tree verification needs full caches on sliding-window layers (a tree's nodes do not "
                             "hold consecutive positions, which a ring's slot arithmetic assumes): export with "
                             "--no-ring-cache")
        self.lm_head = hf_model.lm_head
        dtype = hf_model.get_input_embeddings().weight.dtype  # (a GGUF head in the kernels holds no float weight)
        if spec.family == "gpt2":
            base = hf_model.transformer
            self.embed, self.pos_embed, self.final_norm = base.wte, base.wpe, base.ln_f
            self.layers = base.h
            self.scalings = [
                (spec.head_dim**-0.5 if base.config.scale_attn_weights else 1.0)
                / (i + 1 if base.config.scale_attn_by_inverse_layer_idx else 1)
                for i in range(spec.num_layers)
            ]
        else:
            base = hf_model.model
            self.embed, self.pos_embed, self.final_norm = base.embed_tokens, None, base.norm
            self.layers = base.layers
            self.scalings = [layer.self_attn.scaling for layer in self.layers]
            # cos/sin for every slot, computed by the model's own rotary module (all static RoPE types); one
            # table per layer type where the layer types rotate differently (Gemma 3's local and global layers).
            positions = torch.arange(max_seq_len).unsqueeze(0)
            zero = torch.zeros((), dtype=torch.float32)
            layer_types = getattr(base.config, "layer_types", None)
            if layer_types and "layer_type" in inspect.signature(base.rotary_emb.forward).parameters:
                kinds = sorted(set(layer_types))
                tables = [base.rotary_emb(zero, positions, kind) for kind in kinds]
                self.rope_table = [kinds.index(kind) for kind in layer_types]
            else:
                tables = [base.rotary_emb(zero, positions)]
                self.rope_table = [0] * spec.num_layers
            # [S_max, rotary dim] each (below head_dim with a partial rotary factor: Phi-4-mini); rope_cos/rope_sin,
            # then rope_cos_1, ...: each a constant table of its own, which the fused build turns into RoPE caches
            self.rope_names = [("rope_cos", "rope_sin") if j == 0 else (f"rope_cos_{j}", f"rope_sin_{j}")
                               for j in range(len(tables))]
            for (cos_name, sin_name), (cos, sin) in zip(self.rope_names, tables):
                self.register_buffer(cos_name, cos[0].to(dtype), persistent=False)
                self.register_buffer(sin_name, sin[0].to(dtype), persistent=False)
        self.fused = nn.ModuleDict()  # "qkv_{i}", "gate_up_{i}": layer i's projections as one matmul
        if fuse_projections:
            self._fuse_projections(FusedLinear if fuse_projections is True else fuse_projections)
        self.register_buffer("slots", torch.arange(max_seq_len), persistent=False)
        # step_ops (the torch backend's GGUF builds, which have trtspec's native library): each plain RMSNorm, a
        # layer's q/k/v split, RoPE and layout, and a gated MLP's SiLU product, as one op each (kernels.rms_norm,
        # rope_qkv, silu_mul) where the traced step had about 10, 25 and 5: the build traces, lowers and compiles that
        # many fewer (csrc/step_ops.cpp)
        self.native_rope = [False] * spec.num_layers
        self.native_silu = [False] * spec.num_layers  # the gated MLP's silu(gate) * up as kernels.silu_mul
        if step_ops and spec.family != "gpt2" and dtype == torch.float32:
            self._use_step_ops()
        for n in set(self.cache_slots) - {max_seq_len}:
            self.register_buffer(f"ring_slots_{n}", torch.arange(n), persistent=False)

    def _fuse_projections(self, fuse):
        """The torch backend's: q/k/v, and an MLP's gate/up, as one matmul each (their weights move into it).

        On a GPU a narrow model's decode step is bound by its kernel count more than by its bytes; one matmul
        instead of three, and of two, saves three launches a layer. The ONNX export keeps HF's own projections.
        ``fuse(module, names)`` makes the fused module, or returns None to leave those projections as they are
        (FusedLinear; the GGUF kernels' layers fuse only where they share a block type)."""
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
                if (fused := fuse(attn, ("q_proj", "k_proj", "v_proj"))) is not None:
                    self.fused[f"qkv_{i}"] = fused
            mlp = getattr(layer, "mlp", None)
            # the gated MLP of the llama family (Qwen, Mistral, Gemma): down(act(gate(x)) * up(x))
            if mlp is not None and {n for n, _ in mlp.named_children()} == {"gate_proj", "up_proj", "down_proj",
                                                                              "act_fn"}:
                if (fused := fuse(mlp, ("gate_proj", "up_proj"))) is not None:
                    self.fused[f"gate_up_{i}"] = fused

    def _use_step_ops(self):
        def native(norm):
            return NativeRMSNorm(norm) if type(norm).__name__ in PLAIN_RMS_NORMS else norm

        for layer in self.layers:
            layer.input_layernorm = native(layer.input_layernorm)
            layer.post_attention_layernorm = native(layer.post_attention_layernorm)
        self.final_norm = native(self.final_norm)
        full_rotary = self.rope_cos.shape[-1] == self.spec.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            separate = all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
            self.native_rope[i] = (self.in_place_cache and full_rotary and not hasattr(attn, "q_norm")
                                   and (f"qkv_{i}" in self.fused or separate))
            gate_up = self.fused[f"gate_up_{i}"] if f"gate_up_{i}" in self.fused else None
            self.native_silu[i] = (hasattr(gate_up, "whole") and len(set(getattr(gate_up, "sizes", ()))) == 1
                                   and type(layer.mlp.act_fn).__name__ in ("SiLUActivation", "SiLU"))

    def _qkv(self, i, attn, x):
        """Layer i's q, k and v projections side by side [B, T, (H + 2 Hkv) D]."""
        fused = self.fused[f"qkv_{i}"] if f"qkv_{i}" in self.fused else None
        if fused is not None and hasattr(fused, "whole"):
            return fused.whole(x)
        parts = fused(x) if fused is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
        return torch.cat(parts, dim=-1)

    def mlp(self, i, layer, x):
        if f"gate_up_{i}" not in self.fused:
            return layer.mlp(x)
        if self.native_silu[i]:
            from .. import kernels

            return layer.mlp.down_proj(kernels.silu_mul(self.fused[f"gate_up_{i}"].whole(x)))
        gate, up = self.fused[f"gate_up_{i}"](x)
        return layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def tree_masks(self, position_ids, tree_mask):
        # A tree call: node i (position position_ids[:, i]) sees every slot before the call's first write and, of
        # the call's own slots write + j, those tree_mask[:, i, j] marks (its ancestors and itself).
        # -> {mask key: bool [B, 1, T, S_max]}
        write = position_ids[:, :1]  # [B, 1]: the root's position is the call's first slot
        rel = self.slots - write  # [B, S]
        t = tree_mask.shape[-1]
        idx = torch.clamp(rel, min=0)
        idx = torch.minimum(idx, torch.full_like(idx, t - 1))
        in_call = tree_mask.gather(2, idx[:, None, :].expand(-1, t, -1)) & (rel >= 0)[:, None, :] & (rel < t)[:, None, :]
        visible = (rel < 0)[:, None, :] | in_call  # [B, T, S]
        key_pos = torch.where(rel < 0, self.slots, position_ids.gather(1, idx))  # the position each slot holds
        pos = position_ids[:, :, None]
        out = {}
        for key in set(self.mask_keys):
            mask = visible if key is None else visible & (key_pos[:, None, :] > pos - key)
            out[key] = mask[:, None]
        return out

    def masks(self, position_ids, live=None):
        # position_ids [B, T] -> {mask key: bool [B, 1, T, slots]}; True where the slot may be attended.
        # live: how many leading slots of the full caches the call attends (the torch engine's live length), or all
        pos = position_ids[:, None, :, None]
        slots = self.slots if live is None else self.slots[:live]
        causal = slots <= pos
        out = {}
        for key in set(self.mask_keys):
            if key is None:
                out[key] = causal
            elif isinstance(key, int):
                out[key] = causal & (slots > pos - key)
            else:  # a ring: slot s holds the last position written there, e - ((e - s) mod n), e the call's last
                _, window, n = key
                last = position_ids[:, -1:]
                held = (last - torch.remainder(last - getattr(self, f"ring_slots_{n}"), n))[:, None, None, :]
                out[key] = (held <= pos) & (held > pos - window) & (held >= 0)
        return out

    def attention(self, i, layer, x, rope, mask, past_key, past_value, writes, live=None):
        # x [B, T, hidden] -> [B, T, hidden], present key/value [B, Hkv, S_max, D]
        # writes: write_indices [B] (the functional write), or {cache length: (rows, slots)} (in place)
        # live: attend the first `live` slots of a full-length cache, cut after the write (forward)
        spec = self.spec
        # unflatten/flatten, not view(b, t, ...): symbolic sizes would make the exporter read them
        # off a cache input with a Shape node, and the cache input must feed only its TensorScatter.
        if spec.family == "gpt2":
            attn = layer.attn
            q, k, v = attn.c_attn(x).split(spec.hidden_size, dim=2)
            q = q.unflatten(-1, (spec.num_heads, spec.head_dim)).transpose(1, 2)
            k = k.unflatten(-1, (spec.num_kv_heads, spec.head_dim)).transpose(1, 2)
            v = v.unflatten(-1, (spec.num_kv_heads, spec.head_dim)).transpose(1, 2)
            out_proj = attn.c_proj
        elif self.native_rope[i]:  # rope: the rows' cos, sin [B, T, D]; k_rows, v_rows [B, T, Hkv, D]
            from .. import kernels

            attn, out_proj = layer.self_attn, layer.self_attn.o_proj
            q, k_rows, v_rows = kernels.rope_qkv(self._qkv(i, attn, x), *rope, spec.num_heads, spec.num_kv_heads)
        else:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, split in q, k, v order
                nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
                q, k, v = attn.qkv_proj(x).split([nq, nkv, nkv], dim=-1)
            elif f"qkv_{i}" in self.fused:
                q, k, v = self.fused[f"qkv_{i}"](x)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.unflatten(-1, (spec.num_heads, spec.head_dim))
            k = k.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
            if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: RMSNorm over the head dim, before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.unflatten(-1, (spec.num_kv_heads, spec.head_dim)).transpose(1, 2)
            q, k = _rope(q, *rope), _rope(k, *rope)
            out_proj = attn.o_proj
        if self.in_place_cache:
            # an indexed store that inductor sees (and fuses with RoPE), not an opaque op: an opaque write cost
            # 4 kernels per cache per layer, a large share of a decode step on a GPU
            rows, slots = writes[self.cache_slots[i]]
            if not self.native_rope[i]:
                k_rows, v_rows = k.transpose(1, 2), v.transpose(1, 2)
            past_key[rows, :, slots] = k_rows  # [B, T, Hkv, D] at each row's slots
            past_value[rows, :, slots] = v_rows
            present_key, present_value = past_key, past_value
            # (the rowwise op reads the mask's first `live` slots of the whole caches itself: nothing to trace)
            if live is not None and self.cache_slots[i] == self.max_seq_len and not self.rowwise:
                past_key, past_value = past_key[:, :, :live], past_value[:, :, :live]
        elif self.cache_slots[i] < self.max_seq_len:
            present_key = kv_cache_write_ring(past_key, k, writes)
            present_value = kv_cache_write_ring(past_value, v, writes)
        else:
            present_key = kv_cache_write(past_key, k, writes)
            present_value = kv_cache_write(past_value, v, writes)
        # what attention reads: the written cache (in place: the past buffers, cut to the live slots)
        keys, values = (past_key, past_value) if self.in_place_cache else (present_key, present_value)
        if self.rowwise:  # (the op writes [B, T, H * D], the output projection's input)
            y = rowwise_attention(q, keys, values, mask, self.scalings[i], spec.attn_softcap)
        elif spec.attn_softcap:  # Gemma 2: SDPA has no soft-capping; one op exported as Attention(softcap=...)
            y = softcapped_attention(q, keys, values, mask, self.scalings[i], spec.attn_softcap)
            y = y.transpose(1, 2).flatten(2)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scalings[i],
                                               enable_gqa=spec.num_heads != spec.num_kv_heads)
            y = y.transpose(1, 2).flatten(2)
        return out_proj(y), present_key, present_value

    def forward(self, input_ids, position_ids, *past, live=None):
        # input_ids [B, T] int64, position_ids [B, T] int64, [tree_mask [B, T, T] bool,]
        # past 2L x [B, Hkv, slots_i, D] (slots_i: S_max or a ring)
        # live (in place only): attention reads the first `live` slots of the full-length caches, cut after the
        # call's write. Writing through a cut view instead made compiled graphs copy the live slots out and back,
        # every cache of every layer, a cost that grows with the context.
        # -> logits [B, T, V], [hidden_states [B, T, len(hidden_layers) * H],] present 2L x [B, Hkv, slots_i, D]
        writes = position_ids[:, 0]  # each row's first slot
        if self.in_place_cache:
            # per cache length: (rows [B, 1], slots [B, T]) of the call's writes, slot = position mod length (a ring
            # wraps; a full cache never does); tree nodes take consecutive slots from the root's, as chains do
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None]
            step = torch.arange(input_ids.shape[1], device=input_ids.device)
            writes = {n: (rows, (writes[:, None] + step) % n) for n in set(self.cache_slots)}
        if self.tree:
            masks = self.tree_masks(position_ids, past[0])
            past = past[1:]
        else:
            # the torch engines pass `live` (CachedStep, AOTStep): attention then reads only those slots. Never in the
            # export, whose cache inputs must feed nothing but their write.
            masks = self.masks(position_ids, live)
        h = self.embed(input_ids)
        rope = None
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)
        else:  # [B, 1, T, D] per table
            # [B, T, D] per table (rope_qkv's), and [B, 1, T, D] for the heads' [B, H, T, D]
            rows_rope = [(F.embedding(position_ids, getattr(self, cos)), F.embedding(position_ids, getattr(self, sin)))
                         for cos, sin in self.rope_names]
            ropes = [(cos[:, None], sin[:, None]) for cos, sin in rows_rope]
        present, hidden = [], {}
        for i, layer in enumerate(self.layers):
            if i in self.hidden_layers:  # HF's hidden_states[i]: the input of layer i
                hidden[i] = h
            if self.spec.family == "gpt2":
                norm1, norm2 = layer.ln_1, layer.ln_2
            else:
                norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
                rope = (rows_rope if self.native_rope[i] else ropes)[self.rope_table[i]]
            a, key, value = self.attention(
                i, layer, norm1(h), rope, masks[self.mask_keys[i]], past[2 * i], past[2 * i + 1], writes, live
            )
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: a norm after attention and after the MLP too
                h = h + norm2(a)
                h = h + layer.post_feedforward_layernorm(self.mlp(i, layer, layer.pre_feedforward_layernorm(h)))
            else:
                h = h + a
                h = h + self.mlp(i, layer, norm2(h))
            present += [key, value]
        h = self.final_norm(h)
        hidden[len(self.layers)] = h  # HF's last hidden state: after the final norm
        logits = self.lm_head(h)
        if self.spec.final_softcap:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        if self.hidden_layers:
            return (logits, torch.cat([hidden[i] for i in self.hidden_layers], dim=-1), *present)
        return (logits, *present)
