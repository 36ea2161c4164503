"""Which Hugging Face architectures the step graph supports, read from config.json."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError

# model_type -> family. Everything in the "llama" family shares one layer layout
# (RMSNorm, RoPE, gated MLP); the differences are read from the config below.
SUPPORTED = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",  # fused qkv_proj / gate_up_proj, partial rotary, LongRoPE within its original length
    "gemma2": "llama",  # norms after attention and MLP too, soft-capped attention and logits, scaled embeddings
    "gemma3_text": "llama",  # Gemma 2's layout with q/k norms and local/global RoPE tables
    "gpt2": "gpt2",
}
# Other model_types users try, and what to do instead.
HINTS = {
    "gemma3": "the multimodal Gemma 3 checkpoint: export its text model (Gemma3ForCausalLM, model_type gemma3_text)",
}
# RoPE variants whose cos/sin depend only on the position, so a table over
# [0, S_max) is exact. "dynamic" changes with the sequence length; "longrope" too, past the model's original
# length only (its short factors hold below it): allowed where max_seq_len <= original_max_position_embeddings.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    # per layer: None for full attention, else the sliding window length
    sliding_windows: tuple[int | None, ...]
    rope_type: str | None
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    longrope_max_len: int | None = None  # LongRoPE: the length its short factors hold to


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED))


def arch_spec(config) -> ArchSpec:
    """Read the architecture from a transformers config, refusing what the step graph cannot express."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        hint = f" ({HINTS[model_type]})" if model_type in HINTS else ""
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r} (model_type in config.json){hint}; "
            f"trtspec export supports: {supported_list()}"
        )
    family = SUPPORTED[model_type]
    if family == "gpt2":
        return ArchSpec(
            model_type=model_type,
            family=family,
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=config.n_embd // config.n_head,
            hidden_size=config.n_embd,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            sliding_windows=(None,) * config.n_layer,
            rope_type=None,
        )

    rope = getattr(config, "rope_parameters", None) or {}
    # Gemma 3: one set of parameters per layer type (local and global layers rotate at different bases)
    ropes = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for params in ropes:
        if params.get("rope_type", "default") not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {params['rope_type']!r} depends on the sequence length and cannot be tabulated over a "
                f"fixed cache; supported RoPE types: {', '.join(STATIC_ROPE_TYPES)}"
            )
    rope_type = ropes[0].get("rope_type", "default")
    longrope = getattr(config, "original_max_position_embeddings", None) or rope.get(
        "original_max_position_embeddings") if rope_type == "longrope" else None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if model_type in ("mistral", "phi3"):  # one window for every layer, where the config sets one
        windows = (window,) * num_layers
    elif layer_types is not None:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        windows = (None,) * num_layers
    return ArchSpec(
        model_type=model_type,
        family=family,
        num_layers=num_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_windows=windows,
        rope_type=rope_type,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        longrope_max_len=longrope,
    )
