"""How close a float32 build of the SmolLM2 GGUF is to transformers, and to the exact (float64) logits.

    python benchmarks/float_parity.py ENGINE_DIR [ENGINE_DIR ...]   (e.g. engines/smollm2-float)

Runs one chat prompt (the one tests/test_gguf.py uses, 48 tokens) through transformers' float32 (sdpa and eager
attention) and float64 models of the same GGUF, and through each engine, and prints the largest and the mean
absolute logit difference of every pair. Two float32 computations of the same model each differ from the float64
logits by their own rounding; between themselves the two add up. Writes nothing.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

from bench_real import smollm2_gguf

PROMPT = "Write a Python function that merges two sorted lists, with a docstring and tests."


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtspec.engines import load_engine

    path = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    logits = {}
    for name, dtype, attention in [("transformers float32 sdpa", torch.float32, "sdpa"),
                                   ("transformers float32 eager", torch.float32, "eager"),
                                   ("transformers float64", torch.float64, "eager")]:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                     attn_implementation=attention).eval()
        with torch.no_grad():
            logits[name] = model(torch.tensor([ids])).logits[0].double().numpy()
    for engine_dir in args.engines:
        engine = load_engine(engine_dir, num_threads=args.threads)
        engine.reset()
        logits[str(engine_dir)] = engine.forward(np.array([ids]), np.arange(len(ids))[None])[0].astype(np.float64)
    print(f"{len(ids)} positions, logits up to {np.abs(logits['transformers float64']).max():.1f}")
    print("| pair | max abs difference | mean abs difference |\n|---|---|---|")
    for a, b in itertools.combinations(logits, 2):
        d = np.abs(logits[a] - logits[b])
        print(f"| {a} vs {b} | {d.max():.3g} | {d.mean():.3g} |")


if __name__ == "__main__":
    main()
