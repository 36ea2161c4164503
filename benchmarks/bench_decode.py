"""Decode speed of the onnxruntime engine vs HF generate(), and the memory bandwidth it achieves.

    python benchmarks/bench_decode.py            # ~3 min on 2 cores; writes benchmarks/results/decode.{json,md}

Model: a random-init Llama of ~31M parameters (vocab 8000, hidden 512, 8 layers, 8 heads, 4 KV heads),
greedy, a 16-token prompt, 128 new tokens, batch 1. Decode rate = 127 tokens / (time for 128 tokens minus
time for 1 token), so prefill is excluded for both. Bandwidth achieved = weight bytes x decode tokens/s,
divided by the machine's read bandwidth measured in the same run (the larger of a 1-thread numpy and a
2-thread torch reduction over 256 MB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from common import RESULTS, WORK, memory_bandwidth_gbs, random_llama


def main():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtspec import Generator, build, export

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf_dir = random_llama(WORK / "llama31m")
    engine_dir = WORK / "llama31m-engine"
    if not (engine_dir / "manifest.json").is_file():
        export(hf_dir, WORK / "llama31m-export", max_seq_len=512, max_batch=1)
        build(WORK / "llama31m-export", engine_dir)
    gen = Generator(engine_dir, num_threads=args.threads)
    weight_bytes = gen.target.manifest["model"]["weight_bytes"]
    tok = AutoTokenizer.from_pretrained(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt_ids = np.random.default_rng(0).integers(3, 300, size=16).tolist()
    prompt = tok.decode(prompt_ids)
    ids = torch.tensor([tok(prompt)["input_ids"]])

    def hf_run(n):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()

    def ours_run(n):
        return gen.generate(prompt, max_new_tokens=n).token_ids

    def timed(fn, n):
        t = time.perf_counter()
        out = fn(n)
        return time.perf_counter() - t, out

    bw = {"numpy_1_thread": memory_bandwidth_gbs(), f"torch_{args.threads}_threads": memory_bandwidth_gbs(torch_threads=args.threads)}
    machine_bw = max(bw.values())
    rates = {"hf": [], "trtspec": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in (("hf", hf_run), ("trtspec", ours_run)):
            t1, _ = timed(fn, 1)
            t128, out = timed(fn, 128)
            rates[name].append((len(out) - 1) / (t128 - t1))  # trtspec stops early only at EOS
            outputs[name] = out
    hf_rate, our_rate = statistics.median(rates["hf"]), statistics.median(rates["trtspec"])
    achieved = weight_bytes * our_rate / 1e9
    result = {
        "model": {"parameters_bytes": weight_bytes, "config": "llama vocab 8000, hidden 512, 8 layers, 8 heads, 4 kv heads"},
        "decode_tokens_per_s": {"hf_generate": hf_rate, "trtspec_onnxruntime": our_rate},
        "runs": rates,
        "speedup": our_rate / hf_rate,
        "identical_tokens": outputs["hf"][: len(outputs["trtspec"])] == outputs["trtspec"],
        "machine_read_bandwidth_gbs": bw,
        "achieved_bandwidth_gbs": achieved,
        "bandwidth_fraction": achieved / machine_bw,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode.json").write_text(json.dumps(result, indent=2))
    table = (
        "| | decode tok/s (median of %d) |\n|---|---|\n| HF generate() | %.1f |\n| trtspec (onnxruntime) | %.1f |\n\n"
        "speedup %.2fx, identical tokens: %s; bandwidth achieved %.1f GB/s of %.1f GB/s measured = %.2f\n"
        % (args.repeats, hf_rate, our_rate, result["speedup"], result["identical_tokens"], achieved, machine_bw,
           result["bandwidth_fraction"])
    )
    (RESULTS / "decode.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
