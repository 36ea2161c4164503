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
    "gpt2": "gpt2",
}
# RoPE variants whose cos/sin depend only on the position, so a table over
# [0, S_max) is exact. "dynamic" and "longrope" change with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED))


def arch_spec(config) -> ArchSpec:
    """Read the architecture from a transformers config, refusing what the step graph cannot express."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r} (model_type in config.json); "
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
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} depends on the sequence length and cannot be tabulated over a fixed cache; "
            f"supported RoPE types: {', '.join(STATIC_ROPE_TYPES)}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if model_type == "mistral":
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
    )
