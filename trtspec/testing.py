"""Tiny random-init models made offline from configs, for tests, mechanics benchmarks and the quick start."""

from __future__ import annotations

import os
from pathlib import Path

# A small text to train a byte-level BPE on: deterministic, offline, no downloads.
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
]

ARCHITECTURES = ("llama", "llama-gqa-rope3", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2",
                 "gpt2-untied")


def make_tokenizer(vocab_size: int = 320, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer with <s>, </s> and <pad>, trained on a built-in snippet (or ``corpus``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(arch: str, vocab_size: int = 336, **overrides):
    """A transformers config for a tiny model of the given architecture (see ARCHITECTURES)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama_like = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **common,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**{**llama_like, "num_key_value_heads": 4, "tie_word_embeddings": True})
    elif arch == "llama-gqa-rope3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg = tf.LlamaConfig(**llama_like, rope_parameters=rope, mlp_bias=True, tie_word_embeddings=False)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**llama_like, sliding_window=16, tie_word_embeddings=False)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**llama_like, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**llama_like, head_dim=32, tie_word_embeddings=False)
    elif arch == "phi3":  # Phi-4-mini's kind: LongRoPE, a partial rotary factor, fused qkv/gate_up, a window
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [2.0 + 0.5 * i for i in range(4)]}
        cfg = tf.Phi3Config(**llama_like, rope_parameters=rope, original_max_position_embeddings=64,
                            sliding_window=16, tie_word_embeddings=False)
    elif arch == "gemma2":  # soft-capped attention scores and logits, alternating windowed/global layers
        cfg = tf.Gemma2Config(**llama_like, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                              attn_logit_softcapping=5.0, final_logit_softcapping=30.0, tie_word_embeddings=True)
    elif arch == "gemma3":  # text: local/global layers with their own RoPE bases, four norms a layer, q/k norms
        cfg = tf.Gemma3TextConfig(
            **llama_like, head_dim=32, query_pre_attn_scalar=24, sliding_window=16, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    elif arch in ("gpt2", "gpt2-untied"):
        cfg = tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=arch == "gpt2", **common
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_tiny_model(arch: str, out_dir: str | os.PathLike, *, seed: int = 0, **overrides) -> Path:
    """Save a random-init model with a tokenizer as an ordinary HF model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = make_tokenizer()
    # Some model types make AutoTokenizer add a token of their own; leave room for it.
    config = tiny_config(arch, vocab_size=len(tokenizer) + 16, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; a larger embedding scale makes greedy choices clear-cut,
    # so fp32 rounding cannot flip an argmax between two implementations.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Save a tiny random-init HF model directory (offline).")
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_model(args.arch, args.out_dir, seed=args.seed))
