"""How much faster 8 rows can speculate than 1 on this CPU: the engines' own ceiling on "c = 8 / c = 1" with a draft.

    python benchmarks/bench_batch_ceiling.py [--repeats 15] [--max-k 6]   # writes benchmarks/results/batch-ceiling.*

Serving throughput at 8 clients over 1 client (issue 31 asks for >= 2.5x with the draft) cannot exceed what the
engine calls of a decode round allow, whatever the host does. This measures both halves of that bound on the
bundled pair (the max-batch-8 engines `trtspec serve` runs in benchmarks/bench_serve.py):

- tau(k): tokens a row emits per verify call when it drafts k tokens, measured by greedy generation over the
  held-out prompts (one row at a time, k fixed; a row's acceptance does not depend on its batch, greedy);
- round(b, k): the median seconds of one round's engine calls at b rows, k drafts: the draft's catch-up call
  (2 tokens per row), k - 1 one-token draft calls, and the target's verify call over k + 1 tokens per row (k = 0:
  one decode call), at a mid-generation position. The configurations take turns within every repeat, so a shared
  machine's drift falls on all of them alike.

rate(b, k) = b * tau(k) / round(b, k), tokens per second with no host work or queueing at all. The ceiling is
max_k rate(8, k) / max_k rate(1, k): each load level at its best k, as load-aware k picks. Also with the draft's
calls free (the verify call alone) and with a perfect, free draft (tau = k + 1): no drafter can do better. Then
the same with each request's prompt read (one call of the target and one of the draft over the held-out prompts'
median length, which stops every row's rounds while it runs), as bench_serve.py's requests must be (its prefix
cache is off). Last, a Scheduler set up as `trtspec serve --draft` is, under closed-loop clients in this process,
measures what the served ratio is next to that ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import engines, run_clients  # noqa: E402
from common import RESULTS, ROOT  # noqa: E402

from trtspec.bench import load_prompts  # noqa: E402
from trtspec.runtime.scheduler import Scheduler  # noqa: E402
from trtspec.runtime.tokenizer import load_tokenizer  # noqa: E402


def tokens_per_call(target, draft, prompts, ks, max_tokens) -> tuple[dict[int, float], float]:
    """tau(k): new tokens per verify round of greedy rows drafting exactly k (the first token comes from the prompt's
    call); and the mean new tokens of a request (greedy rows end at EOS or max_tokens, whatever drafts them)."""
    out, new = {0: 1.0}, []
    for k in ks:
        if k == 0:
            continue
        s = Scheduler(target, draft, num_draft_tokens=k, k_policy="fixed", prefix_cache_mb=0)
        try:
            results = [s.submit(p, max_new_tokens=max_tokens, temperature=0.0).result() for p in prompts]
        finally:
            s.close()
        tokens = sum(r.stats.new_tokens - 1 for r in results)
        rounds = sum(r.stats.rounds for r in results)
        out[k] = tokens / rounds
        new = [r.stats.new_tokens for r in results]
    return out, float(np.mean(new))


def served(target, draft, prompts, levels, max_tokens) -> list[tuple[int, float]]:
    """Closed-loop clients on a Scheduler set up as `trtspec serve --draft` is (load-aware k <= 4, no prefix cache),
    in this process (no HTTP): (clients, tokens per second) per level."""
    out = []
    s = Scheduler(target, draft, prefix_cache_mb=0)
    try:
        s.warm_up()
        for c in levels:
            requests = [(prompts[i % len(prompts)], max_tokens) for i in range(16 if c == 1 else 32)]
            results, wall = run_clients(s, requests, c, closed=False)
            out.append((c, sum(r.stats.new_tokens for r, _ in results) / wall))
            print(f"  {c} client(s): {out[-1][1]:.0f} tok/s", flush=True)
    finally:
        s.close()
    return out


def round_costs(target, draft, batches, ks, position, repeats) -> dict[tuple[int, int], dict[str, float]]:
    """(b, k) -> median seconds of the round's draft calls and of its verify call (random ids: costs do not
    depend on them). Every repeat runs each configuration once, in turn."""
    rng = np.random.default_rng(0)
    vocab = target.vocab_size

    def call(engine, b, t, pos):
        ids = rng.integers(3, vocab, (b, t), dtype=np.int64)
        t0 = time.perf_counter()
        engine.forward(ids, np.tile(np.arange(pos, pos + t), (b, 1)))
        return time.perf_counter() - t0

    configs = [(b, k) for b in batches for k in ks]
    times = {c: {"draft": [], "verify": []} for c in configs}
    for rep in range(repeats + 1):  # the first pass warms every shape up and is not counted
        for b, k in configs:
            drafting = 0.0
            if k:
                drafting += call(draft, b, 2, position - 1)  # catch-up: the last draft and the bonus token
                for j in range(k - 1):
                    drafting += call(draft, b, 1, position + 1 + j)
            verify = call(target, b, k + 1, position)
            if rep:
                times[(b, k)]["draft"].append(drafting)
                times[(b, k)]["verify"].append(verify)
    return {c: {part: statistics.median(v) for part, v in parts.items()} for c, parts in times.items()}


def prefill_cost(target, draft, prompt_len, repeats) -> float:
    """Median seconds of reading one prompt: the target's and the draft's call over its tokens (one row)."""
    ids = np.full((1, prompt_len), 5, np.int64)
    pos = np.arange(prompt_len)[None]
    times = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        target.forward(ids, pos)
        draft.forward(ids, pos)
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceiling(tau, costs, batches, ks, perfect: bool = False, free_draft: bool = False, prefill: float = 0.0,
            new_tokens: float = 128):
    """Per batch size the best k and its rate (tokens/s), and the ratio of the largest batch's to one row's.
    ``prefill``: seconds of reading a request's prompt, which stops every row's rounds while it runs; each row
    reads one prompt per ``new_tokens`` it generates."""
    best = {}
    for b in batches:  # (batches: one row first, the most rows last)
        rates = {}
        for k in ks:
            t = (k + 1) if perfect else tau[k]
            seconds = costs[(b, k)]["verify"] + (0.0 if free_draft or perfect else costs[(b, k)]["draft"])
            # b rows generating new_tokens each: new_tokens / t rounds, and b prompts read
            rates[k] = b * new_tokens / (new_tokens / t * seconds + b * prefill)
        k_best = max(rates, key=rates.get)
        best[b] = (k_best, rates[k_best])
    return best, best[batches[-1]][1] / best[batches[0]][1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts generated per k for tau(k)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--levels", type=int, nargs="*", default=[1, 8, 1, 8, 1, 8],
                    help="closed-loop client counts of the in-process serving run (1 and the engines' rows)")
    ap.add_argument("--out", type=Path, default=RESULTS / "batch-ceiling")
    args = ap.parse_args(argv)
    target, draft = engines()
    batches, ks = [1, target.max_batch], list(range(args.max_k + 1))
    everything = load_prompts(ROOT / "models" / "heldout.json")  # the prompts bench_serve.py sends
    prompts = everything[: args.prompts]
    print(f"tau(k) over {len(prompts)} held-out prompts x {args.max_tokens} tokens ...", flush=True)
    tau, new_tokens = tokens_per_call(target, draft, prompts, ks, args.max_tokens)
    tok = load_tokenizer(target)
    prompt_len = int(np.median([len(tok(p)["input_ids"]) for p in everything]))
    position = prompt_len + int(new_tokens) // 2  # mid-generation
    print(f"round costs at position {position}, {args.repeats} repeats ...", flush=True)
    costs = round_costs(target, draft, batches, ks, position, args.repeats)
    prefill = prefill_cost(target, draft, prompt_len, args.repeats)
    print("in-process serving, closed loop ...", flush=True)
    levels = served(target, draft, everything, args.levels, args.max_tokens)
    res = {"tau": tau, "new_tokens": new_tokens, "position": position, "repeats": args.repeats, "prefill_s": prefill,
           "prompt_len": prompt_len, "costs": {f"{b},{k}": v for (b, k), v in costs.items()}, "ceilings": {},
           "served": levels}
    lines = [f"`python benchmarks/bench_batch_ceiling.py --repeats {args.repeats}`: engines "
             f"`engines/stdlib-{{target,draft}}-b{target.max_batch}-s{target.max_seq_len}`, 2 threads. Round costs at "
             f"position {position} (the held-out prompts' median length, {prompt_len} tokens, + half a request's "
             f"{new_tokens:.0f} new tokens); tau(k) from greedy generation of {len(prompts)} held-out prompts x "
             f"{args.max_tokens} tokens; tok/s = b * tau(k) / (draft + verify).", "",
             "| k | tau(k) | " + " | ".join(f"b={b}: draft ms | b={b}: verify ms | b={b}: tok/s" for b in batches) + " |",
             "|---|---|" + "---|---|---|" * len(batches)]
    for k in ks:
        cells = []
        for b in batches:
            c = costs[(b, k)]
            cells += [f"{c['draft'] * 1e3:.2f}", f"{c['verify'] * 1e3:.2f}",
                      f"{b * tau[k] / (c['draft'] + c['verify']):.0f}"]
        lines.append(f"| {k} | {tau[k]:.2f} | " + " | ".join(cells) + " |")
    read = {"prefill": prefill, "new_tokens": new_tokens}
    lines += ["", f"Reading a prompt ({prompt_len} tokens, target and draft, one row): {prefill * 1e3:.1f} ms. "
              f"Each row reads one per {new_tokens:.0f} tokens it generates.", "",
              f"| ceiling of c = {batches[-1]} / c = 1 (each at its best k) | 1 row | {batches[-1]} rows | ratio |",
              "|---|---|---|---|"]
    for name, kw in (("decode rounds alone: the pair's calls", {}),
                     ("decode rounds alone: draft calls free", {"free_draft": True}),
                     ("decode rounds alone: a perfect free draft (tau = k + 1)", {"perfect": True}),
                     ("with the prompts read: the pair's calls", read),
                     ("with the prompts read: draft calls free", {"free_draft": True, **read}),
                     ("with the prompts read: a perfect free draft", {"perfect": True, **read}),
                     ("with the prompts read: plain decoding", {"ks": [0], **read})):
        best, ratio = ceiling(tau, costs, batches, kw.pop("ks", ks), **kw)
        res["ceilings"][name] = {"best": {str(b): {"k": k, "tok_s": r} for b, (k, r) in best.items()}, "ratio": ratio}
        lines.append(f"| {name} | k = {best[1][0]}, {best[1][1]:.0f} tok/s | k = {best[batches[-1]][0]}, "
                     f"{best[batches[-1]][1]:.0f} tok/s | **{ratio:.2f}x** |")
    one = statistics.median(r for c, r in levels if c == 1)
    many = statistics.median(r for c, r in levels if c == batches[-1])
    lines.append(f"| measured: a Scheduler as `trtspec serve --draft` (load-aware k <= 4), closed loop, in process, "
                 f"medians of levels {' '.join(str(c) for c, _ in levels)} | {one:.0f} tok/s | {many:.0f} tok/s | "
                 f"**{many / one:.2f}x** |")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
