"""torch.compile (inductor) engine vs the onnxruntime engine on the bundled pair, in one run: chains and token trees.

    python benchmarks/bench_torch.py                    # CPU, ~10 min on 2 cores; benchmarks/results/torch.{json,md}
    python benchmarks/bench_torch.py --device cuda --dtype bfloat16 --out benchmarks/results/gpu/torch  # a GPU

Both backends run the bundled target exported with --tree (bench_tree.py's artifacts: a tree_mask input, S_max 1024)
and the bundled draft. Per backend: the cost of a target call (median, batch 1, position 300) for decode, a 5-token
chain verify and 9- / 17-node tree verifies (every node with up to 3 children), as a ratio to decode; and greedy
generation tok/s (128 new tokens, the first 8 held-out prompts, median of --runs runs): the target alone, the draft's
chains at k = 2 and 5, and its trees 5x2 (8 nodes) and 6x3 (16 nodes), each checked against the target alone. On
CUDA the onnxruntime rows are left out (its CPU provider only), and the torch engine replays CUDA graphs for calls of
up to 16 tokens (a 17-node tree runs the general compiled graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench_tree import artifacts
from common import RESULTS, ROOT, WORK

CONFIGS = {  # name -> Generator options (None: the target alone)
    "target alone": None,
    "chain k=2": dict(num_draft_tokens=2),
    "chain k=5": dict(num_draft_tokens=5),
    "tree 5x2 (8 nodes)": dict(num_draft_tokens=5, tree_width=2, tree_nodes=8),
    "tree 6x3 (16 nodes)": dict(num_draft_tokens=6, tree_width=3, tree_nodes=16),
}
CALLS = {"decode": (1, False), "chain 5": (5, False), "tree 9": (9, True), "tree 17": (17, True)}


def measure(target, draft, prompts, runs: int) -> dict:
    from trtspec import Generator
    from trtspec.bench import measure_call_costs

    target.reset()
    target.forward(np.arange(300)[None] % 200 + 5, np.arange(300)[None])  # a cache to attend to, as bench_tree's
    costs = {name: measure_call_costs(target, [t], position=300, repeats=40, warmup=5, tree=tree)[t] * 1e3
             for name, (t, tree) in CALLS.items()}
    row = {"calls_ms": costs, "configs": {}}
    outputs = {}
    for name, options in CONFIGS.items():
        gen = Generator(target) if options is None else Generator(target, draft, k_policy="fixed", **options)
        gen.generate(prompts[0], max_new_tokens=8)  # compile / warm the shapes first
        rates, calls = [], 0
        for _ in range(runs):
            t0 = time.perf_counter()
            results = [gen.generate(p, max_new_tokens=128) for p in prompts]
            rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0))
            calls = sum(r.stats.target_calls for r in results)
        outputs[name] = [r.token_ids for r in results]
        row["configs"][name] = {"tok_s": statistics.median(rates),
                                "tokens_per_target_call": sum(map(len, outputs[name])) / max(calls, 1),
                                "equals_target_alone": outputs[name] == outputs["target alone"]}
        print(f"  {name}: {row['configs'][name]}", flush=True)
    return row


def markdown(result: dict, args) -> str:
    lines = [f"Device {args.device}, dtype {args.dtype}; bundled target exported with --tree, greedy, 128 new tokens, "
             f"8 held-out prompts, median of {args.runs} runs.", "",
             "| backend | " + " | ".join(f"{c} ms (x decode)" for c in CALLS) + " |",
             "|---|" + "---|" * len(CALLS)]
    for name, row in result.items():
        d = row["calls_ms"]["decode"]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f} ({v / d:.2f}x)" for v in row["calls_ms"].values()) + " |")
    lines += ["", "| backend | " + " | ".join(CONFIGS) + " |", "|---|" + "---|" * len(CONFIGS)]
    for name, row in result.items():
        cells = [f"{c['tok_s']:.1f} tok/s, {c['tokens_per_target_call']:.2f}/call{'' if c['equals_target_alone'] else ', DIFFERS'}"
                 for c in row["configs"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    import torch

    from trtspec import load_engine
    from trtspec.bench import load_prompts
    from trtspec.torch_backend import compile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="the torch engines' dtype (onnxruntime runs the float32 export)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "torch")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(2)
    prompts = load_prompts(ROOT / "models" / "heldout.json")[:8]
    paths = artifacts(WORK / "tree")
    engines = {}
    if args.device == "cpu":
        engines["onnxruntime"] = lambda: (load_engine(paths["target"], num_threads=2),
                                          load_engine(paths["draft"], num_threads=2))
    engines[f"torch-inductor ({args.device}, {args.dtype})"] = lambda: (
        compile(WORK / "tree" / "target-export", max_batch=1, device=args.device, dtype=args.dtype),
        compile(WORK / "tree" / "draft-export", max_batch=1, device=args.device, dtype=args.dtype))
    result = {}
    for name, make in engines.items():
        print(name, flush=True)
        result[name] = measure(*make(), prompts, args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    text = markdown(result, args)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
