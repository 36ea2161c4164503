"""The runtime's time per token around the engine calls, this tree against a baseline revision, in the same rounds.

    python benchmarks/bench_runtime_token.py [--engine engines/smollm2-torch-int8x] [--baseline REV] [--rounds 3]
        [--configs NAME ...]

Each round runs each source (this tree; --baseline REV checked out into a temporary git worktree) in a fresh process
on the same engine, 2 threads: Generator over 4 held-out prompts x --new tokens per configuration (greedy and
sampled at temperature 0.8, with and without top-p 0.9 or top-k 50, target alone and with suffix decoding, and the
head the engine carries; --configs: some of them). Per token: the whole time, the target's
calls (verify_s), the drafting (draft_s) and the rest ("other": picks, acceptance, the stop rule, streaming, the
scheduler). Medians over rounds; ratios are this tree's over the baseline's in the same run. Writes
benchmarks/results/<--out>.{json,md} with the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_oracle import cpu_info
from common import ROOT, sources

RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = {  # name -> (Generator options, request options)
    "greedy, target alone": ({"drafter": "none"}, {}),
    "sampled, target alone": ({"drafter": "none"}, {"temperature": 0.8, "seed": 1}),
    "greedy, suffix": ({"drafter": "suffix"}, {}),
    "sampled, suffix": ({"drafter": "suffix"}, {"temperature": 0.8, "seed": 1}),
    "sampled top-p 0.9, target alone": ({"drafter": "none"}, {"temperature": 0.8, "top_p": 0.9, "seed": 1}),
    "sampled top-p 0.9, suffix": ({"drafter": "suffix"}, {"temperature": 0.8, "top_p": 0.9, "seed": 1}),
    "sampled top-k 50, target alone": ({"drafter": "none"}, {"temperature": 0.8, "top_k": 50, "seed": 1}),
    "sampled top-k 50, suffix": ({"drafter": "suffix"}, {"temperature": 0.8, "top_k": 50, "seed": 1}),
    "greedy, auto (the carried head)": ({"drafter": "auto"}, {}),
}
CHILD = r"""
import json, sys, time
from trtspec import Generator, load_engine
from trtspec.bench import load_prompts
engine_path, new, configs, prompts_file = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
engine = load_engine(engine_path, num_threads=2)
prompts = load_prompts(prompts_file)[:4]
out = {}
for name, (options, request) in configs.items():
    gen = Generator(engine, **options)
    gen.generate(prompts[0], max_new_tokens=16, **request)  # (first calls of each shape)
    t0 = time.perf_counter()
    outputs = [gen.generate([p], max_new_tokens=new, **request) for p in prompts]  # (one at a time: batch 1)
    elapsed = time.perf_counter() - t0
    gen.close()
    results = [o[0] for o in outputs]
    tokens = sum(len(r.token_ids) for r in results)
    s = lambda f: sum(getattr(o.stats, f) for o in outputs)
    out[name] = {"tokens": tokens, "ms_per_token": 1e3 * elapsed / tokens, "verify_ms": 1e3 * s("verify_s") / tokens,
                 "draft_ms": 1e3 * s("draft_s") / tokens, "prefill_ms": 1e3 * s("prefill_s") / tokens,
                 "other_ms": 1e3 * s("other_s") / tokens, "calls_per_token": s("target_calls") / tokens,
                 "ids": [r.token_ids for r in results]}
print(json.dumps(out))
"""


def _run(src: Path, engine: Path, new: int, configs: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(engine.resolve()), str(new), json.dumps(configs),
                           str(ROOT / "models" / "heldout.json")], env=env, capture_output=True, text=True, cwd=src)
    if done.returncode:
        raise RuntimeError(f"{src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-torch-int8x")
    ap.add_argument("--baseline", help="a git revision run in the same rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", default="runtime-token")
    ap.add_argument("--configs", nargs="+", metavar="NAME", help=f"only these of {list(CONFIGS)}")
    args = ap.parse_args()
    unknown = set(args.configs or ()) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown --configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    configs = {name: CONFIGS[name] for name in args.configs or CONFIGS}
    runs: dict[tuple, list] = {}
    with sources(args.baseline) as checkouts:
        for r in range(args.rounds):
            for label, src in checkouts.items():
                for name, row in _run(src, args.engine, args.new, configs).items():
                    runs.setdefault((label, name), []).append(row)
                    print(f"round {r + 1}, {label}, {name}: {row['ms_per_token']:.3f} ms a token "
                          f"(other {row['other_ms']:.3f})", flush=True)
    rows = []
    for (label, name), outs in runs.items():
        med = {k: statistics.median(o[k] for o in outs) for k in
               ("ms_per_token", "verify_ms", "draft_ms", "prefill_ms", "other_ms", "calls_per_token")}
        rows.append({"source": label, "config": name, **med, "tokens": outs[0]["tokens"], "ids": outs[0]["ids"]})
    labels = list(dict.fromkeys(r["source"] for r in rows))
    for row in rows:
        base = next((b for b in rows if b["source"] == labels[-1] and b["config"] == row["config"]), None)
        compared = len(labels) > 1 and row is not base
        row["x_baseline_ms"] = row["ms_per_token"] / base["ms_per_token"] if compared else None
        row["same_tokens_as_baseline"] = row["ids"] == base["ids"] if compared else None
    cpu = cpu_info(2)
    result = {"cpu": cpu, "engine": str(args.engine), "rounds": args.rounds, "new_tokens": args.new,
              "rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [f"Generator on {args.engine.name}, 4 held-out prompts x {args.new} tokens, 2 threads, medians of "
             f"{args.rounds} alternating rounds (each source in a fresh process). CPU: {cpu['cpu']}; ISA: "
             f"{' '.join(cpu['isa'])}.", "",
             "| config | source | ms/token | target calls ms | drafting ms | prompt ms | other ms | calls/token | "
             "x baseline | same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (list(CONFIGS).index(r["config"]), r["source"])):
        x = "-" if row["x_baseline_ms"] is None else f"{row['x_baseline_ms']:.3f}"
        same = "-" if row["same_tokens_as_baseline"] is None else row["same_tokens_as_baseline"]
        lines.append(f"| {row['config']} | {row['source']} | {row['ms_per_token']:.3f} | {row['verify_ms']:.3f} | "
                     f"{row['draft_ms']:.3f} | {row['prefill_ms']:.3f} | {row['other_ms']:.3f} | "
                     f"{row['calls_per_token']:.3f} | {x} | {same} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
