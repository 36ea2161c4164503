"""An EAGLE-3 draft head: one decoder layer over the target's fused low/mid/high features and its own outputs.

Layout (the EAGLE authors' released checkpoints, so a published head loads as is): ``config.json`` (Llama-style
sizes plus ``draft_vocab_size``, optional ``target_hidden_size``) and ``model.safetensors`` or
``pytorch_model.bin`` with

    fc.weight [H, 3 H_target]                      the fused features' projection (no bias)
    midlayer.hidden_norm / input_layernorm / post_attention_layernorm .weight [H]
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]  attention over [norm(embedding), norm(hidden)]
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight [H], lm_head.weight [V_draft, H]
    d2t [V_draft] int64 (target id = draft id + d2t[draft id]), t2d [V] bool
    embed_tokens.weight [V, H]                      optional: otherwise the target's embedding

At position p the head reads the pair (feature of p, embedding of token p + 1) and predicts token p + 2: the
feature is fc(target's hidden states at p) for positions the target has verified, and the head's own output
hidden state at p - 1 for the positions it drafts itself (``hidden_in``; fc has no bias, so one graph takes
both: x = fc(features) + hidden_in with the other input zero).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArtifactError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_layers: list[int] | None = None  # HF hidden_states indices fused (None: EAGLE-3's 2, L // 2, L - 3)
    architectures: list[str] = field(default_factory=lambda: [ARCHITECTURE])

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_hidden_size = self.target_hidden_size or self.hidden_size

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in known and rope.get("rope_theta"):
            known["rope_theta"] = rope["rope_theta"]
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                               "vocab_size", "draft_vocab_size") if k not in known]
        if missing:
            raise ArtifactError(f"not an EAGLE-3 head config: {', '.join(missing)} missing")
        return cls(**known)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's fused target layers as HF hidden_states indices (exporter/contract.parse_hidden_states)."""
    from ..exporter.contract import parse_hidden_states

    return parse_hidden_states("low,mid,high", num_layers)


def _modules():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, size, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(size))
            self.eps = eps

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            h2, nh, nkv, d = 2 * c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
            self.q_proj = nn.Linear(h2, nh * d, bias=False)
            self.k_proj = nn.Linear(h2, nkv * d, bias=False)
            self.v_proj = nn.Linear(h2, nkv * d, bias=False)
            self.o_proj = nn.Linear(nh * d, c.hidden_size, bias=False)

    class MLP(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class MidLayer(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.self_attn = Attention(c)
            self.mlp = MLP(c)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    return RMSNorm, MidLayer


def rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def make_head(config: Eagle3Config):
    """The head as a torch module (random init); see Eagle3Head.forward_steps for training."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    RMSNorm, MidLayer = _modules()
    c = config

    class Eagle3Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = c
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
            self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
            self.midlayer = MidLayer(c)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
            inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)

        def rope(self, positions):
            # positions [B, T] -> cos, sin [B, 1, T, D]
            freqs = positions[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]
            return emb.cos(), emb.sin()

        def qkv(self, emb, hidden, positions):
            # the layer's attention inputs: [norm(embedding), norm(hidden)] -> q [B, nh, T, D], k, v [B, nkv, T, D]
            layer = self.midlayer
            x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
            a = layer.self_attn
            q = a.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim)).transpose(1, 2)
            k = a.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(1, 2)
            v = a.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(1, 2)
            cos, sin = self.rope(positions)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

        def finish(self, hidden, attn_out):
            # residual, MLP: -> the layer's output hidden state [B, T, H]
            layer = self.midlayer
            h = hidden + layer.self_attn.o_proj(attn_out.transpose(1, 2).flatten(2))
            return h + layer.mlp(layer.post_attention_layernorm(h))

        def logits(self, hidden):
            return self.lm_head(self.norm(hidden))

        def forward_steps(self, features, tokens, steps: int, hidden_only: bool = False, positions=None):
            """Training with test-time steps (EAGLE-3's "training-time test"): features [B, N, 3H_t] of positions
            0..N-1, tokens [B, N] the token after each position. Step 0 reads the target's features; step j reads
            step j-1's output at the position before, attending to step-0 keys up to q - j and to step i's key at
            q - j + i, as the head does when it drafts j tokens past what the target verified.
            ``positions`` [B, N]: each position's place in its sequence where a row packs several (0 where one
            starts; attention stays within a sequence); default 0..N-1, one sequence a row. Step j's output at a
            position is the sequence's own only from place j on (what a loss may count).
            Returns the logits [B, N, V_draft] of every step (position q predicts token q + 2), or with
            ``hidden_only`` the hidden states [B, N, H] they come from (logits(h) on the positions that count)."""
            b, n, _ = features.shape
            idx = torch.arange(n, device=features.device)
            if positions is None:
                positions = idx.expand(b, n)
            # a key is another sequence's where it lies before the query's sequence starts: [B, 1, N, N]
            other = (idx[None, None, :] < (idx - positions)[:, :, None])[:, None]
            emb = self.embed_tokens(tokens)
            hidden = self.fc(features)
            rep = c.num_attention_heads // c.num_key_value_heads
            keys, values, out = [], [], []
            scale = c.head_dim ** -0.5
            for j in range(steps):
                q, k, v = self.qkv(emb, hidden, positions)
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                keys.append(k)
                values.append(v)
                # step-0 keys at positions <= q - j
                s0 = (q @ keys[0].transpose(-1, -2)) * scale
                s0 = s0.masked_fill((idx[None, :] > idx[:, None] - j) | other, float("-inf"))
                diag_s, diag_v = [], []
                for i in range(1, j + 1):  # step i's key at q - (j - i): shifted right by j - i
                    shift = j - i
                    ki, vi = keys[i], values[i]
                    if shift:
                        ki = F.pad(ki[:, :, : n - shift], (0, 0, shift, 0))
                        vi = F.pad(vi[:, :, : n - shift], (0, 0, shift, 0))
                    si = (q * ki).sum(-1, keepdim=True) * scale
                    if shift:
                        si = si.masked_fill((positions < shift)[:, None, :, None], float("-inf"))
                    diag_s.append(si)
                    diag_v.append(vi)
                scores = torch.cat([s0, *diag_s], dim=-1)
                # the first j positions see no step-0 key; a row of -inf only where nothing at all is visible
                weights = torch.softmax(scores, -1).nan_to_num(0.0)
                attn = weights[..., :n] @ values[0]
                for i, vi in enumerate(diag_v):
                    attn = attn + weights[..., n + i : n + i + 1] * vi
                new_hidden = self.finish(hidden, attn)
                out.append(new_hidden if hidden_only else self.logits(new_hidden))
                # step j + 1 at q reads this step's output at q - 1
                hidden = F.pad(new_hidden[:, :-1], (0, 0, 1, 0))
            return out

    return Eagle3Head()


def load_head(path, target_dir=None, embedding=None):
    """A head directory (this layout, or the EAGLE authors' released one) -> (Eagle3Head, Eagle3Config).

    Without embed_tokens in the checkpoint the head takes the target's embedding: ``embedding`` (a build that has
    the target loaded already), else loaded from ``target_dir``."""
    import torch

    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ArtifactError(f"{path} has no {CONFIG}; an EAGLE-3 head directory has config.json and its weights")
    config = Eagle3Config.from_dict(json.loads((path / CONFIG).read_text()))
    state = _read_state(path)
    head = make_head(config)
    missing = [k for k in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.self_attn.q_proj.weight")
               if k not in state]
    if missing:
        raise ArtifactError(f"{path} is not an EAGLE-3 head: {', '.join(missing)} missing from its weights")
    if "embed_tokens.weight" not in state:
        if embedding is None and target_dir is None:
            raise ArtifactError(f"{path} has no embed_tokens.weight of its own, so it takes the target's embedding, "
                                "and the target's HF model directory is unknown (not recorded, moved or deleted): "
                                "pass it with --target-model DIR (trtspec export-head) or target_model=DIR "
                                "(export_head)")
        state["embed_tokens.weight"] = embedding if embedding is not None else _target_embedding(Path(target_dir))
    if "d2t" not in state:  # a head over the full vocabulary
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    expected = head.state_dict()
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ArtifactError(f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies "
                                f"{tuple(expected[name].shape)}")
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items() if k in expected},
                         strict=True)
    return head.eval(), config


def _read_state(path: Path) -> dict:
    import torch

    if (path / WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(path / WEIGHTS))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ArtifactError(f"{path} has neither {WEIGHTS} nor pytorch_model.bin")


def _target_embedding(target_dir: Path):
    """The target's input embedding, from its HF directory or its GGUF file."""
    from transformers import AutoModelForCausalLM

    import torch

    from ..exporter.gguf import hf_source

    folder, source = hf_source(target_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **source)
    return model.get_input_embeddings().weight.detach().clone()


def save_head(head, path, *, include_embedding: bool = True) -> None:
    """Write the head in the released layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()
             if include_embedding or k != "embed_tokens.weight"}
    save_file(state, str(path / WEIGHTS))
    (path / CONFIG).write_text(json.dumps(head.config.to_dict(), indent=2))


def draft_vocabulary(token_ids: np.ndarray, vocab_size: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``size`` most frequent target tokens of a text (ties by id) -> (d2t offsets [size], t2d mask [V])."""
    counts = np.bincount(token_ids.astype(np.int64), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]
    draft_to_target = np.sort(order)
    t2d = np.zeros(vocab_size, bool)
    t2d[draft_to_target] = True
    return draft_to_target - np.arange(size), t2d


def head_parameters(head) -> int:
    """Trainable parameters (the frozen embedding is the target's own)."""
    return sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens.weight")


def init_from_target(head, target) -> None:
    """Start from the target: its embedding (frozen), its last layer's MLP and norms where the shapes agree."""
    import torch

    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        last = target.model.layers[-1]
        mlp = head.midlayer.mlp
        for name in ("gate_proj", "up_proj", "down_proj"):
            src = getattr(last.mlp, name).weight
            if src.shape == getattr(mlp, name).weight.shape:
                getattr(mlp, name).weight.copy_(src.float())
        if target.lm_head.weight.shape[1] == head.lm_head.weight.shape[1]:
            ids = torch.arange(head.config.draft_vocab_size) + head.d2t
            head.lm_head.weight.copy_(target.lm_head.weight[ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
