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


# The tiny GGUF model's layers' types: every type the export keeps, packed groups of equal and of different kinds
# (q/k of layer 1 packed, v apart; gate/up packed with their minimums), and one it does not keep (IQ4_NL).
_GGUF_LAYER_TYPES = (
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_K", "attn_output": "Q8_0",
     "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q4_K"},
    {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q5_0", "attn_output": "Q6_K",
     "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "IQ4_NL"},
)


def gguf_blocks(type_name: str, n: int, k: int, rng) -> "np.ndarray":
    """Random but well-formed GGUF blocks of ``type_name`` for an [n, k] tensor: codes (and the K-quants' packed
    sub-block scales) uniform, fp16 scales of a trained model's size, minimums negative, as bytes [n, row bytes]."""
    import numpy as np

    # type -> (weights per block, bytes per block, where its fp16 scale sits, its fp16 minimum / dmin or None,
    #          the scale's range)
    layouts = {"Q4_0": (32, 18, 0, None, (0.002, 0.02)), "Q4_1": (32, 20, 0, 2, (0.002, 0.02)),
               "Q5_0": (32, 22, 0, None, (0.001, 0.01)), "Q5_1": (32, 24, 0, 2, (0.001, 0.01)),
               "Q8_0": (32, 34, 0, None, (0.0002, 0.002)), "Q4_K": (256, 144, 0, 2, (0.0005, 0.002)),
               "Q5_K": (256, 176, 0, 2, (0.0002, 0.001)), "Q6_K": (256, 210, 208, None, (0.00001, 0.00005)),
               "IQ4_NL": (32, 18, 0, None, (0.0002, 0.002))}
    if type_name not in layouts:
        raise ValueError(type_name)
    per, size, at, minimum, (low, high) = layouts[type_name]
    b = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, (b.shape[0], 1)).astype(np.float16).view(np.uint8)

    b[:, at:at + 2] = f16(low, high)
    if minimum is not None:  # Q4_1/Q5_1's m is negative, about -7.5 d; the K-quants' dmin is positive
        b[:, minimum:minimum + 2] = f16(-8 * high, -4 * low) if per == 32 else f16(low, high)
    return b.reshape(n, -1)


def make_tiny_gguf(path: str | os.PathLike, *, seed: int = 0, tied: bool = True, arch: str = "llama") -> Path:
    """A 2-layer model as a GGUF file, as llama.cpp writes one: blocks of several types (_GGUF_LAYER_TYPES), a
    Q8_0 embedding (the head too when ``tied``), a byte-level BPE tokenizer with a chat template. ``arch``
    "llama": transformers undoes a rotary permutation of the query/key rows (llama.cpp's layout), which the export
    must find; "qwen2": rows as stored, and float32 biases on q/k/v."""
    import json

    import gguf
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokenizer = make_tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if not isinstance(m, str) else m
              for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    hidden, ffn, heads, kv_heads, layers = 256, 512, 4, 2, 2
    vocab_size = 32 * ((len(tokens) + 32) // 32)
    # transformers' GGUF tokenizer adds <|endoftext|> where the list lacks it
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens) - 1)] + ["<|endoftext|>"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be llama or qwen2, got {arch!r}")
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in ("<pad>", "<s>", "</s>", "<|endoftext|>") else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_pad_token_id(vocab["<pad>"])
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                        "{% if add_generation_prompt %}<s>assistant\n{% endif %}")

    def add(name, type_name, n, k):
        w.add_tensor(name, gguf_blocks(type_name, n, k, rng), raw_dtype=gguf.GGMLQuantizationType[type_name])

    add("token_embd.weight", "Q8_0", vocab_size, hidden)
    if not tied:
        add("output.weight", "Q8_0", vocab_size, hidden)
    w.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden // heads * kv_heads, hidden),
              "attn_v": (hidden // heads * kv_heads, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i, types in enumerate(_GGUF_LAYER_TYPES[:layers]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        for part, (n, k) in shapes.items():
            add(f"blk.{i}.{part}.weight", types[part], n, k)
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{part}.bias", rng.normal(0, 0.1, n).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Save a tiny random-init HF model directory (offline).")
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_model(args.arch, args.out_dir, seed=args.seed))
