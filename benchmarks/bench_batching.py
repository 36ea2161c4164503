"""Continuous batching on the bundled pair: throughput and latency under concurrent load, and the prefix cache.

Workload: the held-out code prompts, each request asking for 32..256 new tokens (greedy), sent by C
closed-loop clients (each sends its next request as soon as its last one finished) for C = 1, 2, 4, 8.
The same requests in the same order for every configuration:
  closed     closed chunks, as trtspec ran lists before the scheduler: C requests start together and
             the next C start only when the whole chunk has finished (plain decoding)
  plain      continuous batching, plain decoding (k = 0)
  k<N>       continuous batching, every row drafts N tokens with the draft model
  load-aware continuous batching, k chosen each round from measured costs at the batch size (up to 4)
Reported: generated tokens/s (all clients), time to first token and inter-token latency p50/p99 (from
when the client was ready to send; ITL = each block's gap / its tokens). Medians over --repeats runs
that visit every configuration in turn. Then: time to first token of requests sharing a ~400-token
prefix, with and without the prefix registered.

    python benchmarks/bench_batching.py [--repeats 3] [--concurrency 1 2 4 8] [--ks 2 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, save_results  # noqa: E402

from trtspec import Scheduler, build, export, load_engine  # noqa: E402


def engines(max_batch: int = 8, max_seq_len: int = 512):
    out = {}
    for name in ("target", "draft"):
        engine_dir = ROOT / "engines" / f"stdlib-{name}-b{max_batch}-s{max_seq_len}"
        if not (engine_dir / "manifest.json").is_file():
            export_dir = ROOT / "export" / f"stdlib-{name}-b{max_batch}-s{max_seq_len}"
            if not (export_dir / "manifest.json").is_file():
                export(ROOT / "models" / f"stdlib-{name}", export_dir, max_seq_len=max_seq_len, max_batch=max_batch)
            build(export_dir, engine_dir)
        out[name] = load_engine(engine_dir, num_threads=2)
    return out["target"], out["draft"]


def workload(n: int, seed: int = 0):
    prompts = [p["prompt"] for p in json.loads((ROOT / "models" / "heldout.json").read_text())["prompts"]]
    rng = np.random.default_rng(seed)
    return [(prompts[i % len(prompts)], int(rng.integers(32, 257))) for i in range(n)]


def run_clients(scheduler, requests, concurrency: int, closed: bool):
    """Send the requests from `concurrency` clients; returns per-request (result, ttft from ready) and wall time."""
    out = [None] * len(requests)
    t_start = time.perf_counter()
    if closed:
        ready = [t_start] * concurrency  # when each client was ready to send its next request
        for start in range(0, len(requests), concurrency):
            chunk = list(range(start, min(start + concurrency, len(requests))))
            t0 = time.perf_counter()
            handles = [scheduler.submit(requests[i][0], max_new_tokens=requests[i][1]) for i in chunk]
            for j, (i, h) in enumerate(zip(chunk, handles)):
                r = h.result()
                out[i] = (r, t0 - ready[j] + r.stats.time_to_first_token_s)
                ready[j] = t0 + r.stats.elapsed_s
        return out, time.perf_counter() - t_start
    nxt = iter(range(len(requests)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            r = scheduler.submit(requests[i][0], max_new_tokens=requests[i][1]).result()
            out[i] = (r, r.stats.time_to_first_token_s)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t_start


def summarize(out, wall):
    tokens = sum(r.stats.new_tokens for r, _ in out)
    ttft = [t for _, t in out]
    itl = [x for r, _ in out for x in r.stats.inter_token_s]
    proposed = sum(r.stats.proposed for r, _ in out)
    return {
        "tok_s": tokens / wall,
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "itl_p50_ms": float(np.percentile(itl, 50) * 1e3), "itl_p99_ms": float(np.percentile(itl, 99) * 1e3),
        "acceptance": sum(r.stats.accepted for r, _ in out) / proposed if proposed else None,
        "tokens": tokens,
    }


def bench_load(target, draft, concurrency_levels, ks, repeats, n_requests):
    requests = workload(n_requests)
    configs = {"closed": dict(), "plain": dict()}
    for k in ks:
        configs[f"k{k}"] = dict(draft=draft, num_draft_tokens=k, k_policy="fixed")
    configs["load-aware"] = dict(draft=draft, num_draft_tokens=max(ks), k_policy="load-aware")
    runs = {c: {name: [] for name in configs} for c in concurrency_levels}
    outputs = {}
    k_seen = {c: {} for c in concurrency_levels}
    for rep in range(repeats):
        for c in concurrency_levels:
            for name, opts in configs.items():
                opts = dict(opts)
                d = opts.pop("draft", None)
                # a fresh scheduler per run, prefix cache off: every run computes every prompt
                scheduler = Scheduler(target, d, max_batch=8, prefix_cache_mb=0, **opts)
                out, wall = run_clients(scheduler, requests, c, closed=name == "closed")
                scheduler.close()
                runs[c][name].append(summarize(out, wall))
                outputs.setdefault(name, [r.token_ids for r, _ in out])
                if name == "load-aware":
                    for k, n in scheduler.stats().k_histogram.items():
                        k_seen[c][k] = k_seen[c].get(k, 0) + n
                print(f"[rep {rep + 1}/{repeats}] concurrency {c:2d} {name:10s} "
                      f"{runs[c][name][-1]['tok_s']:7.1f} tok/s", flush=True)
    identical = all(outputs[name] == outputs["plain"] for name in outputs)
    table = {}
    for c in concurrency_levels:
        table[c] = {}
        for name in configs:
            rs = runs[c][name]
            table[c][name] = {key: statistics.median(r[key] for r in rs) if rs[0][key] is not None else None
                              for key in rs[0]}
    return {"requests": n_requests, "table": table, "identical_outputs": identical,
            "load_aware_k_rounds": {c: dict(sorted(v.items())) for c, v in k_seen.items()}}


def bench_prefix(target, draft, repeats):
    prompts = [p["prompt"] for p in json.loads((ROOT / "models" / "heldout.json").read_text())["prompts"]]
    probe = Scheduler(target, prefix_cache_mb=0)
    prefix = ""
    for p in prompts:
        prefix += p
        if len(probe.tokenizer(prefix)["input_ids"]) >= 400:
            break
    ids = probe.tokenizer(prefix)["input_ids"][:400]
    prefix = probe.tokenizer.decode(ids)
    questions = [prefix + "\n" + p.splitlines()[0] for p in prompts[:8]]
    n_prefix = len(probe.tokenizer(prefix)["input_ids"])
    result = {}
    for name in ("no prefix cache", "registered prefix"):
        ttfts, outs = [], []
        for _ in range(repeats):
            s = Scheduler(target, draft, num_draft_tokens=2, prefix_cache_mb=0 if name == "no prefix cache" else 256)
            if name == "registered prefix":
                s.register_prefix(prefix)
            for q in questions:
                r = s.submit(q, max_new_tokens=16).result()
                ttfts.append(r.stats.time_to_first_token_s)
                outs.append(r.token_ids)
            s.close()
        result[name] = {"ttft_p50_ms": statistics.median(ttfts) * 1e3, "outputs": outs}
    same = result["no prefix cache"].pop("outputs") == result["registered prefix"].pop("outputs")
    return {"prefix_tokens": n_prefix, "requests": len(questions), **result,
            "speedup": result["no prefix cache"]["ttft_p50_ms"] / result["registered prefix"]["ttft_p50_ms"],
            "identical_outputs": same}


def markdown(res) -> str:
    lines = [f"Requests: {res['load']['requests']} (held-out prompts, 32..256 new tokens, greedy); "
             f"identical outputs in every configuration: {res['load']['identical_outputs']}", ""]
    lines.append("| concurrency | config | tok/s | vs closed | vs plain | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
                 "ITL p99 ms | acceptance |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for c, rows in res["load"]["table"].items():
        for name, r in rows.items():
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            lines.append(f"| {c} | {name} | {r['tok_s']:.1f} | {r['tok_s'] / rows['closed']['tok_s']:.2f}x | "
                         f"{r['tok_s'] / rows['plain']['tok_s']:.2f}x | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                         f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {acc} |")
    lines += ["", "Load-aware k: rounds per k chosen (all repeats): " + "; ".join(
        f"concurrency {c}: {v}" for c, v in res["load"]["load_aware_k_rounds"].items())]
    p = res["prefix"]
    lines += ["", f"Shared prefix of {p['prefix_tokens']} tokens, {p['requests']} requests one at a time: time to "
              f"first token p50 {p['no prefix cache']['ttft_p50_ms']:.1f} ms without the prefix cache, "
              f"{p['registered prefix']['ttft_p50_ms']:.1f} ms with the prefix registered ({p['speedup']:.1f}x); "
              f"identical outputs: {p['identical_outputs']}"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "batching")
    args = ap.parse_args(argv)
    target, draft = engines()
    res = {"settings": vars(args) | {"out": str(args.out)}}
    res["prefix"] = bench_prefix(target, draft, args.repeats)
    print(json.dumps(res["prefix"], indent=1), flush=True)
    res["load"] = bench_load(target, draft, args.concurrency, args.ks, args.repeats, args.requests)
    save_results(args.out, res, markdown(res))


if __name__ == "__main__":
    main()
