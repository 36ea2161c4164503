"""Ring-buffer caches for sliding-window layers: KV cache bytes and call cost at long context.

A model with Gemma 3 1B's attention shape (26 layers, 5 local of every 6 with a 512-token window, 1 KV head of
256 dims; random weights, narrower MLP and a small vocabulary, which change neither the cache nor attention)
is exported at --max-seq-len 8192 twice: with rings (the default) and --no-ring-cache. Both are built for
onnxruntime (fused); the table gives the bytes each engine allocates for its KV cache, and the median cost of a
decode call and of a 4-token verify call at position 8000 (the cache zero-filled: cost does not depend on it),
in alternating rounds. The same layout for the larger Gemma 3 shapes is computed by the exporter's own
function (exporter/contract.cache_slots), not exported.

    python benchmarks/bench_ring_cache.py        # ~5 min on 2 cores; results/ring-cache.{json,md}
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from common import RESULTS, WORK, save_results

CONTEXT = 8192
POSITION = 8000
# name: (layers, kv heads, head dim, window, local layers per global one) of the published Gemma 3 text models
GEMMA3 = {"1b": (26, 1, 256, 512, 5), "4b": (34, 4, 256, 1024, 5), "12b": (48, 8, 256, 1024, 5),
          "27b": (62, 16, 128, 1024, 5)}


def layer_types(layers: int, local: int) -> list[str]:
    return ["full_attention" if (i + 1) % (local + 1) == 0 else "sliding_attention" for i in range(layers)]


def make_checkpoint(out):
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from trtspec.testing import make_tokenizer

    if (out / "config.json").is_file():
        return out
    layers, kv, head_dim, window, local = GEMMA3["1b"]
    tokenizer = make_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer) + 16, hidden_size=1152, intermediate_size=1152, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv, head_dim=head_dim, sliding_window=window,
        layer_types=layer_types(layers, local), max_position_embeddings=32768, query_pre_attn_scalar=head_dim,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def computed_layout(name: str, max_call_tokens: int) -> dict:
    from trtspec.exporter.contract import cache_slots

    layers, kv, head_dim, window, local = GEMMA3[name]
    windows = [window if t == "sliding_attention" else None for t in layer_types(layers, local)]
    ring = sum(cache_slots(windows, CONTEXT, max_call_tokens))
    per_slot = 2 * kv * head_dim * 2  # K and V, bfloat16
    return {"ring_bytes": ring * per_slot, "full_bytes": layers * CONTEXT * per_slot, "ratio": ring / (layers * CONTEXT)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from trtspec import build, export, load_engine

    work = WORK / "ring-cache"
    work.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(work / "hf")
    engines = {}
    for name, ring in (("ring", True), ("full", False)):
        built = work / f"engine-{name}"
        if not (built / "manifest.json").is_file():
            t0 = time.perf_counter()
            exported = export(hf, work / f"export-{name}", max_seq_len=CONTEXT, max_batch=1, ring_cache=ring)
            build(exported, built)
            print(f"{name}: exported and built in {time.perf_counter() - t0:.0f} s", flush=True)
        engines[name] = load_engine(built, num_threads=args.threads)
    res = {"context": CONTEXT, "position": POSITION, "threads": args.threads, "rounds": args.rounds}
    for name, engine in engines.items():
        m = engine.manifest["model"]
        res[name] = {"cache_bytes": int(sum(b.nbytes for b in engine.cache.values())),
                     "cache_slots": m["cache_slots"], "max_call_tokens": m["max_call_tokens"], "decode_ms": [],
                     "verify4_ms": []}
    for _ in range(args.rounds):  # alternating: both engines see the same machine state
        for name, engine in engines.items():
            for t, key in ((1, "decode_ms"), (4, "verify4_ms")):
                ids, pos = np.ones((1, t), np.int64), np.arange(POSITION, POSITION + t)[None]
                engine.forward(ids, pos)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    engine.forward(ids, pos)
                    times.append(time.perf_counter() - t0)
                res[name][key].append(1e3 * statistics.median(times))
    for name in engines:
        for key in ("decode_ms", "verify4_ms"):
            res[name][key + "_median"] = statistics.median(res[name][key])
    max_call = res["ring"]["max_call_tokens"]
    res["computed"] = {name: computed_layout(name, max_call) for name in GEMMA3}
    ring, full = res["ring"], res["full"]
    lines = [
        f"### Gemma 3 1B attention shape at {CONTEXT} context, batch 1, float32, onnxruntime fused, "
        f"{args.threads} threads; medians of {args.rounds} alternating rounds",
        "",
        "| cache | KV cache bytes | of full | decode call at 8000 | 4-token verify at 8000 |",
        "|---|---|---|---|---|",
        f"| full (`--no-ring-cache`) | {full['cache_bytes'] / 2**20:.1f} MiB | 1.00 | {full['decode_ms_median']:.2f} ms "
        f"| {full['verify4_ms_median']:.2f} ms |",
        f"| ring (window + {max_call} - 1 slots in local layers) | {ring['cache_bytes'] / 2**20:.1f} MiB | "
        f"{ring['cache_bytes'] / full['cache_bytes']:.3f} | {ring['decode_ms_median']:.2f} ms | "
        f"{ring['verify4_ms_median']:.2f} ms |",
        "",
        f"The same layout for the published shapes at {CONTEXT} context (bfloat16 K and V, one sequence), computed "
        "with `exporter.contract.cache_slots`, not exported:",
        "",
        "| model | full | ring | ratio |",
        "|---|---|---|---|",
        *(f"| Gemma 3 {name} | {c['full_bytes'] / 2**20:.0f} MiB | {c['ring_bytes'] / 2**20:.0f} MiB | {c['ratio']:.3f} |"
          for name, c in res["computed"].items()),
    ]
    save_results(RESULTS / "ring-cache", res, "\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
