"""`trtspec serve --ray` on this machine, in one run, on the bundled pair (draft, load-aware k):

1. Ray's added latency: a single-process `trtspec serve --threads 1` and a 1-replica x 1-thread Ray
   endpoint (through Ray's HTTP proxy, then with --direct-ingress) up side by side, sent the same short
   requests alternately, one at a time; per-request latency and TTFT medians, and the median of the
   paired differences.
2. Throughput and latency under load (`trtspec bench-serve`'s load generator, streaming, closed loop at
   concurrency 1..16): single process with 1 and 2 threads, Ray with 1 and 2 replicas of 1 thread
   (proxy and direct ingress).
   Prefix cache off here (the load levels repeat prompts; reuse would flatter whoever caches).
3. Routing: 2 replicas, prefix-aware router vs Ray's power of two choices, on a workload of a few shared
   system prompts + distinct questions; prefix-cache hits (from each response's `trtspec` field), prompt
   tokens reused, TTFT and throughput, with the default cache and with a cache that holds ~3 sequences.

    python benchmarks/bench_ray.py [--requests 24] [--max-tokens 96]

Writes benchmarks/results/ray.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, start  # noqa: E402
from common import RESULTS, ROOT, save_results  # noqa: E402

from trtspec.bench import load_prompts  # noqa: E402
from trtspec.server.loadgen import run_load, summarize  # noqa: E402

TARGET = ROOT / "engines" / "stdlib-target-b8-s512"
DRAFT = ROOT / "engines" / "stdlib-draft-b8-s512"


def command(kind: str, *, threads=1, replicas=1, router="prefix", prefix_cache_mb=0.0, direct=False) -> list[str]:
    cmd = [sys.executable, "-m", "trtspec", "serve", "--target", str(TARGET), "--draft", str(DRAFT), "-k", "4",
           "--served-model-name", "stdlib", "--threads", str(threads), "--prefix-cache-mb", str(prefix_cache_mb)]
    if kind == "ray":
        cmd += ["--ray", "--replicas", str(replicas), "--router", router] + (["--direct-ingress"] if direct else [])
    return cmd


def stop(proc):
    proc.terminate()
    try:
        proc.wait(90)
    except Exception:  # noqa: BLE001
        proc.kill()


def added_latency(urls: dict, prompts, n: int, max_tokens: int) -> dict:
    """Alternate one request at a time between the servers; per server the medians, and paired differences."""
    names = list(urls)
    lat = {k: [] for k in names}
    ttft = {k: [] for k in names}
    texts = {k: [] for k in names}

    async def one(http, url, prompt):
        body = {"model": "stdlib", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        t0, first, text = time.perf_counter(), None, ""
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    piece = json.loads(line[6:])["choices"][0]["text"]
                    if piece and first is None:
                        first = time.perf_counter() - t0
                    text += piece
        return time.perf_counter() - t0, first, text

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            for name in names:  # warm both paths
                await one(http, urls[name], prompts[0])
            for i in range(n):
                order = names if i % 2 == 0 else names[::-1]
                for name in order:
                    t, f, text = await one(http, urls[name], prompts[i % len(prompts)])
                    lat[name].append(t)
                    ttft[name].append(f)
                    texts[name].append(text)

    asyncio.run(main())
    base, other = names
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {
        "requests_each": n, "max_tokens": max_tokens,
        "latency_p50_ms": {k: ms(v) for k, v in lat.items()}, "ttft_p50_ms": {k: ms(v) for k, v in ttft.items()},
        "added_latency_p50_ms": ms(lat[other]) - ms(lat[base]),
        "added_ttft_p50_ms": ms(ttft[other]) - ms(ttft[base]),
        "paired_latency_difference_p50_ms": ms([b - a for a, b in zip(lat[base], lat[other])]),
        "paired_ttft_difference_p50_ms": ms([b - a for a, b in zip(ttft[base], ttft[other])]),
        "identical_text": texts[base] == texts[other],
    }


def routing_workload(prompts, n_systems: int, n_requests: int, seed: int = 0):
    """``n_systems`` shared system prompts (a code file's head each, ~90 tokens), each request one of them
    followed by its own question (the start of another file)."""
    systems = [f"# You review code in the style of this file:\n{p}\n# End of example.\n" for p in prompts[:n_systems]]
    questions = prompts[n_systems:]
    order = [i % n_systems for i in range(n_requests)]
    random.Random(seed).shuffle(order)
    return [systems[j] + "# Now continue this one:\n" + questions[i % len(questions)][:160] for i, j in enumerate(order)]


def routing_run(url: str, bodies, concurrency: int, max_tokens: int) -> dict:
    out = [None] * len(bodies)

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            queue = iter(range(len(bodies)))

            async def worker():
                for i in queue:
                    t0 = time.perf_counter()
                    r = await http.post(url + "/v1/completions", json={
                        "model": "stdlib", "prompt": bodies[i], "max_tokens": max_tokens, "temperature": 0})
                    r.raise_for_status()
                    body = r.json()
                    out[i] = (time.perf_counter() - t0, body["trtspec"], body["usage"])

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - t0

    wall = asyncio.run(main())
    extra = [o[1] for o in out]
    prompt_tokens = sum(o[2]["prompt_tokens"] for o in out)
    return {
        "requests": len(bodies), "hit_rate": sum(e["prefix_tokens_reused"] > 0 for e in extra) / len(extra),
        "prompt_tokens_reused": sum(e["prefix_tokens_reused"] for e in extra) / prompt_tokens,
        "ttft_p50_ms": statistics.median(e["time_to_first_token_s"] for e in extra) * 1e3,
        "latency_p50_ms": statistics.median(o[0] for o in out) * 1e3,
        "output_tok_s": sum(o[2]["completion_tokens"] for o in out) / wall,
        "requests_per_replica": sorted(_count(e["replica"] for e in extra).values()),
    }


def _count(xs):
    c = {}
    for x in xs:
        c[x] = c.get(x, 0) + 1
    return c


def markdown(res) -> str:
    lines = []
    for how, a in res["added_latency"].items():
        lines += [f"## Ray's added latency, {how} ({a['requests_each']} requests each, alternating, "
                  f"{a['max_tokens']} tokens)", "", "| server | latency p50 ms | TTFT p50 ms |", "|---|---|---|"]
        for k in a["latency_p50_ms"]:
            lines.append(f"| {k} | {a['latency_p50_ms'][k]:.1f} | {a['ttft_p50_ms'][k]:.1f} |")
        lines += ["", f"Added by Ray (p50 difference): latency {a['added_latency_p50_ms']:+.1f} ms, TTFT "
                  f"{a['added_ttft_p50_ms']:+.1f} ms; median of paired differences: latency "
                  f"{a['paired_latency_difference_p50_ms']:+.1f} ms, TTFT {a['paired_ttft_difference_p50_ms']:+.1f} ms. "
                  f"Identical text: {a['identical_text']}.", ""]
    lines += [
              f"## Under load ({res['requests']} requests per level, {res['max_tokens']} new tokens, greedy, "
              "prefix cache off)", "",
              "| server | clients | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | latency p50 ms | errors |",
              "|---|---|---|---|---|---|---|---|"]
    for name, rows in res["load"].items():
        for r in rows:
            f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
            lines.append(f"| {name} | {r['concurrency']} | {f(r['output_tok_s'], 1)} | {f(r['ttft_p50_ms'])} | "
                         f"{f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'], 1)} | {f(r['latency_p50_ms'])} | {r['errors']} |")
    w = res["routing"]["workload"]
    lines += ["", f"## Routing: {w['systems']} shared system prompts, {w['requests']} requests at concurrency "
              f"{w['concurrency']}, {w['max_tokens']} new tokens, 2 replicas", "",
              "| router | prefix cache per replica | hit rate | prompt tokens reused | TTFT p50 ms | latency p50 ms | "
              "output tok/s | requests per replica |", "|---|---|---|---|---|---|---|---|"]
    for r in res["routing"]["runs"]:
        lines.append(f"| {r['router']} | {r['cache']} | {r['hit_rate']:.2f} | {r['prompt_tokens_reused']:.2f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['latency_p50_ms']:.0f} | {r['output_tok_s']:.1f} | "
                     f"{r['requests_per_replica']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per load level")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--latency-requests", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS / "ray")
    ap.add_argument("--only-routing", action="store_true",
                    help="re-run only the routing comparison; the other sections are kept from --out's json")
    args = ap.parse_args(argv)
    from bench_batching import engines

    engines()  # the max-batch-8 engines, built if missing
    prompts = load_prompts(ROOT / "models" / "heldout.json")
    res = {"requests": args.requests, "max_tokens": args.max_tokens, "load": {}, "added_latency": {}}
    if args.only_routing:
        res = json.loads(args.out.with_suffix(".json").read_text())

    def load_levels(name, url):
        rows = []
        for c in args.concurrency:
            records, wall = asyncio.run(run_load(url + "/v1", "stdlib", prompts, max_tokens=args.max_tokens,
                                                 num_requests=args.requests, concurrency=c))
            rows.append({"concurrency": c, **summarize(records, wall)})
            print(f"{name:34s} c{c:<3d}: {rows[-1]['output_tok_s']:7.1f} tok/s, TTFT p50 "
                  f"{rows[-1]['ttft_p50_ms'] or 0:.0f} ms, errors {rows[-1]['errors']}", flush=True)
        res["load"][name] = rows

    # 1 + 2: a 1-thread single process next to a 1-replica x 1-thread Ray endpoint (one Ray at a time)
    single = "single process, 1 thread"
    for how, direct in () if args.only_routing else (("through Ray's HTTP proxy", False), ("direct ingress", True)):
        ray1 = "Ray, 1 replica x 1 thread" + (", direct ingress" if direct else "")
        ports = {single: free_port(), ray1: free_port()}
        procs = {single: start(command("single"), ports[single]), ray1: start(command("ray", direct=direct), ports[ray1])}
        try:
            urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
            res["added_latency"][how] = added_latency(urls, prompts, args.latency_requests, 16)
            print(json.dumps(res["added_latency"][how], indent=1), flush=True)
            for name in ([single] if not direct else []) + [ray1]:
                load_levels(name, urls[name])
        finally:
            for p in procs.values():
                stop(p)
    for name, cmd in () if args.only_routing else (("single process, 2 threads", command("single", threads=2)),
                      ("Ray, 2 replicas x 1 thread", command("ray", replicas=2)),
                      ("Ray, 2 replicas x 1 thread, direct ingress", command("ray", replicas=2, direct=True))):
        port = free_port()
        proc = start(cmd, port)
        try:
            load_levels(name, f"http://127.0.0.1:{port}")
        finally:
            stop(proc)

    # 3: routing
    workload = {"systems": 6, "requests": 48, "concurrency": 4, "max_tokens": 32}
    bodies = routing_workload(prompts, workload["systems"], workload["requests"])
    runs = []
    for cache in (256.0, 8.0):
        for router in ("prefix", "pow2"):
            port = free_port()
            proc = start(command("ray", replicas=2, router=router, prefix_cache_mb=cache), port)
            try:
                row = routing_run(f"http://127.0.0.1:{port}", bodies, workload["concurrency"], workload["max_tokens"])
            finally:
                stop(proc)
            runs.append({"router": router, "cache": f"{cache:g} MB", **row})
            print(runs[-1], flush=True)
    res["routing"] = {"workload": workload, "runs": runs}
    save_results(args.out, res, markdown(res))


if __name__ == "__main__":
    main()
