"""Every generation path of the runtime, timed for this checkout and a baseline checkout in the same run.

    python benchmarks/bench_paths.py --baseline /path/to/other/checkout [--rounds 5] [--prompts 8] [--tokens 128]
        [--target ENGINE] [--only PATH ...] [--out benchmarks/results/paths]

Paths, on the bundled pair (engines/stdlib-target, engines/stdlib-draft), greedy, held-out prompts: target-only
alone (one prompt at a time) and as a list, speculative alone with load-aware and with fixed k = 4, speculative
as a list through the engines' rows, and a speculative stream. Each round runs every path once in a fresh
process per checkout (PYTHONPATH set to it), the two checkouts alternating which goes first; the figure per
path is the median over rounds of tokens per second (new tokens / wall time of the path). Each round also
reports whether the two checkouts' token ids were identical. Writes --out .json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, save_results

PATHS = ("target-only alone", "target-only list", "speculative alone, load-aware k", "speculative alone, k = 4",
         "speculative list, load-aware k", "speculative stream, load-aware k")


def _generator(target, draft, policy):
    from trtspec import Generator

    if draft is None:
        return Generator(target)
    try:
        return Generator(target, draft, num_draft_tokens=4, k_policy=policy)
    except TypeError:  # checkouts before k_policy reached the Generator
        return Generator(target, draft, num_draft_tokens=4, adaptive_k=policy == "load-aware")


def worker(args) -> dict:
    """One round of every path in this process: {path: (new tokens, seconds, token ids)}."""
    from trtspec import load_engine
    from trtspec.bench import load_prompts

    prompts = load_prompts(str(ROOT / "models" / "heldout.json"))[: args.prompts]
    target, draft = load_engine(args.target, num_threads=2), load_engine(args.draft, num_threads=2)
    gens = {"target-only": _generator(target, None, None), "load-aware": _generator(target, draft, "load-aware"),
            "fixed": _generator(target, draft, "fixed")}
    for g in gens.values():  # first calls (allocation, load-aware k's first measurements) are not timed
        g.generate(prompts[:2], max_new_tokens=16)

    def alone(gen):
        return [gen.generate(p, max_new_tokens=args.tokens).token_ids for p in prompts]

    def as_list(gen):
        return [r.token_ids for r in gen.generate(prompts, max_new_tokens=args.tokens)]

    def streamed(gen):
        out = []
        for p in prompts:
            stream = gen.stream(p, max_new_tokens=args.tokens)
            for _ in stream:
                pass
            out.append(stream.result.token_ids)
        return out

    runs = {"target-only alone": lambda: alone(gens["target-only"]),
            "target-only list": lambda: as_list(gens["target-only"]),
            "speculative alone, load-aware k": lambda: alone(gens["load-aware"]),
            "speculative alone, k = 4": lambda: alone(gens["fixed"]),
            "speculative list, load-aware k": lambda: as_list(gens["load-aware"]),
            "speculative stream, load-aware k": lambda: streamed(gens["load-aware"])}
    result = {}
    for name in args.only or PATHS:
        t0 = time.perf_counter()
        ids = runs[name]()
        result[name] = (sum(map(len, ids)), time.perf_counter() - t0, ids)
    for g in gens.values():
        g.close()
    import trtspec

    result["module"] = trtspec.__file__
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="another trtspec checkout to time against this one")
    ap.add_argument("--target", default=str(ROOT / "engines" / "stdlib-target"))
    ap.add_argument("--draft", default=str(ROOT / "engines" / "stdlib-draft"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "paths")
    ap.add_argument("--only", nargs="+", choices=PATHS, metavar="PATH", help=f"time only these paths: {PATHS}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.baseline is None or not (args.baseline / "trtspec" / "__init__.py").is_file():
        ap.error("--baseline must be a trtspec checkout (a directory with trtspec/__init__.py)")
    checkouts = {"this": ROOT, "baseline": args.baseline.resolve()}
    paths = args.only or PATHS
    times = {c: {p: [] for p in paths} for c in checkouts}
    same = {p: [] for p in paths}
    for i in range(args.rounds):
        order = list(checkouts) if i % 2 == 0 else list(checkouts)[::-1]
        got = {}
        for c in order:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--target", args.target, "--draft",
                   args.draft, "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                   *(["--only", *args.only] if args.only else [])]
            env = {**os.environ, "PYTHONPATH": str(checkouts[c])}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=checkouts[c])
            if out.returncode:
                raise RuntimeError(f"the {c} checkout's worker failed:\n{out.stderr[-3000:]}")
            got[c] = json.loads(out.stdout.strip().splitlines()[-1])
            if not Path(got[c]["module"]).is_relative_to(checkouts[c]):
                raise RuntimeError(f"the {c} worker imported {got[c]['module']}, not the checkout {checkouts[c]}")
        for p in paths:
            for c in checkouts:
                tokens, seconds, _ = got[c][p]
                times[c][p].append(tokens / seconds)
            same[p].append(got["this"][p][2] == got["baseline"][p][2])
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(
            f"{p}: {times['this'][p][-1]:.0f} vs {times['baseline'][p][-1]:.0f}" for p in paths), flush=True)
    rows = []
    for p in paths:
        new, old = statistics.median(times["this"][p]), statistics.median(times["baseline"][p])
        rows.append({"path": p, "this_tok_s": new, "baseline_tok_s": old, "ratio": new / old,
                     "identical_rounds": sum(same[p]), "rounds": args.rounds,
                     "this_runs": times["this"][p], "baseline_runs": times["baseline"][p]})
    lines = [f"Paths, this checkout vs {args.baseline}, target {args.target}: {args.prompts} held-out prompts x {args.tokens} tokens, greedy, "
             f"median tok/s of {args.rounds} alternating rounds.", "",
             "| path | this tok/s | baseline tok/s | ratio | same token ids (rounds) |", "|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['this_tok_s']:.1f} | {r['baseline_tok_s']:.1f} | {r['ratio']:.2f}x | "
              f"{r['identical_rounds']}/{r['rounds']} |" for r in rows]
    save_results(args.out, {"rounds": rows, "baseline": str(args.baseline), "target": args.target},
                 "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
