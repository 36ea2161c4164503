"""torch.compile (inductor, CPU) engine vs the onnxruntime engine on the bundled pair, in one run.

    python benchmarks/bench_torch.py     # ~5 min on 2 cores; writes benchmarks/results/torch.{json,md}

Decode call cost (median, batch 1, at position 128), and greedy generation tok/s (target-only and
speculative k = 2, 128 new tokens, the first 8 held-out prompts, median of 3 runs) for each backend.
"""

from __future__ import annotations

import json
import statistics
import time

from common import RESULTS, ROOT


def main():
    import torch

    from trtspec import Generator, load_engine
    from trtspec.bench import load_prompts, measure_call_costs
    from trtspec.torch_backend import compile

    torch.set_num_threads(2)
    prompts = load_prompts(ROOT / "models" / "heldout.json")[:8]
    engines = {
        "onnxruntime": (load_engine(ROOT / "engines" / "stdlib-target", num_threads=2),
                        load_engine(ROOT / "engines" / "stdlib-draft", num_threads=2)),
        "torch-inductor": (compile(ROOT / "models" / "stdlib-target", max_seq_len=512, max_batch=1),
                           compile(ROOT / "models" / "stdlib-draft", max_seq_len=512, max_batch=1)),
    }
    result = {}
    for name, (target, draft) in engines.items():
        row = {"target_decode_ms": measure_call_costs(target, [1])[1] * 1e3,
               "draft_decode_ms": measure_call_costs(draft, [1])[1] * 1e3}
        outputs = {}
        for config, gen in (("target_only", Generator(target)), ("speculative_k2", Generator(target, draft, num_draft_tokens=2, k_policy="fixed"))):
            gen.generate(prompts[0], max_new_tokens=8)  # compile/warm every shape first
            rates = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = [gen.generate(p, max_new_tokens=128).token_ids for p in prompts]
                rates.append(sum(map(len, out)) / (time.perf_counter() - t0))
            row[f"{config}_tok_s"] = statistics.median(rates)
            outputs[config] = out
        row["speculative_equals_target_only"] = outputs["target_only"] == outputs["speculative_k2"]
        result[name] = row
        print(name, row, flush=True)
    (RESULTS / "torch.json").write_text(json.dumps(result, indent=2))
    lines = ["| backend | target decode ms | draft decode ms | target-only tok/s | speculative k=2 tok/s | lossless |",
             "|---|---|---|---|---|---|"]
    for name in engines:
        r = result[name]
        lines.append(f"| {name} | {r['target_decode_ms']:.2f} | {r['draft_decode_ms']:.2f} | {r['target_only_tok_s']:.1f} | "
                     f"{r['speculative_k2_tok_s']:.1f} | {r['speculative_equals_target_only']} |")
    (RESULTS / "torch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
