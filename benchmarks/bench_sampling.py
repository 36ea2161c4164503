"""Coupled vs rejection sampling for speculative decoding on the bundled pair (temperature 0.8).

Coupled (the default): a seed's output equals target-only sampling whatever k, drafter or batch.
Rejection: modified rejection sampling, the higher acceptance. Both are exact in distribution (tests).
Measured: acceptance (accepted / proposed) and tok/s, one request at a time, 24 held-out prompts x 96
tokens, k = 2 and 3, medians of 3 repeats visiting every configuration in turn.

    python benchmarks/bench_sampling.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import engines  # noqa: E402
from common import RESULTS  # noqa: E402

from trtspec import Generator  # noqa: E402
from trtspec.bench import load_prompts  # noqa: E402


def main():
    target, draft = engines()
    prompts = load_prompts(Path(__file__).resolve().parent.parent / "models" / "heldout.json")
    configs = [(mode, k) for k in (2, 3) for mode in ("coupled", "rejection")]
    runs = {c: [] for c in configs}
    for rep in range(3):
        for mode, k in configs:
            gen = Generator(target, draft, num_draft_tokens=k, k_policy="fixed", sampling=mode)
            t0, tokens, accepted, proposed = time.perf_counter(), 0, 0, 0
            for i, p in enumerate(prompts):
                r = gen.generate(p, max_new_tokens=96, temperature=0.8, seed=1000 * rep + i)
                tokens += len(r.token_ids)
                accepted += r.stats.accepted
                proposed += r.stats.proposed
            runs[(mode, k)].append({"tok_s": tokens / (time.perf_counter() - t0), "acceptance": accepted / proposed})
            gen.close()
            print(f"[rep {rep + 1}/3] {mode:9s} k={k}: {runs[(mode, k)][-1]}", flush=True)
    table = {f"{mode} k={k}": {key: statistics.median(r[key] for r in rs) for key in rs[0]}
             for (mode, k), rs in runs.items()}
    lines = ["| sampling | k | acceptance | tok/s |", "|---|---|---|---|"]
    for (mode, k) in configs:
        row = table[f"{mode} k={k}"]
        lines.append(f"| {mode} | {k} | {row['acceptance']:.3f} | {row['tok_s']:.1f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sampling.json").write_text(json.dumps(table, indent=1))
    (RESULTS / "sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
