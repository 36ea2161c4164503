"""Serving under load, in one run: `trtspec serve` plain, `trtspec serve` with speculation (load-aware k),
and HF transformers generate() behind a minimal FastAPI endpoint (benchmarks/hf_server.py), each in its own
process on 127.0.0.1, driven by `trtspec bench-serve`'s load generator (streaming, asyncio + httpx):
closed-loop concurrency 1, 2, 4, 8, 16 and open-loop Poisson arrivals, on the bundled pair. Every server is
started first; then each load level runs against every server in turn (the order rotating per level), so the
ratios between servers come from the same minutes of a shared machine.

    python benchmarks/bench_serve.py [--requests 24] [--max-tokens 128] [--rates 1 2 4]
    python benchmarks/bench_serve.py --baseline /path/to/other/checkout --no-hf   # this code vs another checkout
    python benchmarks/bench_serve.py --baseline CHECKOUT --no-hf --runs 4   # fresh servers 4 times, order alternating
    python benchmarks/bench_serve.py --no-hf --llama-server BIN --llama-model TARGET.gguf --llama-draft DRAFT.gguf
    python benchmarks/bench_serve.py --no-hf --only draft --draft-k 4 8   # draft servers drafting up to 4 and 8
    python benchmarks/bench_serve.py --no-hf --int4-draft   # also a server drafting with the draft's INT4 build

``--llama-server``: llama.cpp's server (built by the user; trtspec ships none of it) on the same model converted to
GGUF float32, 8 slots, 2 threads, with and without its draft model, in the same rotation.

A server process keeps its own speed for its life: on this 2-core machine two processes of the same checkout, their
requests alternating, differed by up to 12 % in tokens/s (in every such A/B here the process started first was
the slower). So ``--runs N`` starts every server afresh N times, the baseline's servers first in every other run,
and the medians are over all runs: compare checkouts there, not within one run.

Writes benchmarks/results/serve.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import engines  # noqa: E402
from common import RESULTS, ROOT  # noqa: E402

from trtspec.bench import load_prompts  # noqa: E402
from trtspec.server.loadgen import run_load, summarize  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(baseline: Path | None = None, hf: bool = True, llama: tuple | None = None,
            only: list[str] | None = None, draft_k=(4,), int4_draft: bool = False, baseline_first: bool = False
            ) -> dict[str, tuple[list[str], dict | None]]:
    """name -> (command, environment or None), in the order they start; ``baseline``: also trtspec's servers from
    that checkout (started before this checkout's with ``baseline_first``);
    ``llama``: (llama-server binary, target GGUF, draft GGUF or None); ``draft_k``: one draft server per most
    drafts a round (-k; load-aware k below it); ``int4_draft``: also a server drafting with the draft's INT4 build."""
    engines()  # builds the max-batch-8 engines if missing
    target = ROOT / "engines" / "stdlib-target-b8-s512"
    draft = ROOT / "engines" / "stdlib-draft-b8-s512"
    # prefix cache off: the load levels send the same prompts again, and reusing them would flatter trtspec
    trtspec = [sys.executable, "-m", "trtspec", "serve", "--target", str(target), "--threads", "2",
               "--served-model-name", "stdlib", "--prefix-cache-mb", "0"]
    out = {"trtspec serve (plain)": (trtspec + ["--drafter", "none"], None)}
    for k in draft_k:  # (-k 4: the name earlier results have)
        name = "trtspec serve (draft, load-aware k)" if k == 4 else f"trtspec serve (draft, load-aware k <= {k})"
        out[name] = (trtspec + ["--draft", str(draft), "-k", str(k)], None)
    if int4_draft:
        out["trtspec serve (INT4 draft, load-aware k)"] = (trtspec + ["--draft", str(int4_engine(draft)), "-k", "4"], None)
    if baseline is not None:
        env = {**os.environ, "PYTHONPATH": str(baseline)}
        theirs = {f"{name}, baseline": (cmd, env) for name, (cmd, _) in out.items()}
        out = {**theirs, **out} if baseline_first else {**out, **theirs}
    if hf:
        out["HF generate() + FastAPI"] = ([sys.executable, str(ROOT / "benchmarks" / "hf_server.py"), "--model",
                                          str(ROOT / "models" / "stdlib-target"), "--name", "stdlib", "--threads", "2"],
                                         None)
    if llama is not None:
        binary, model, draft_gguf = llama
        # 8 slots of 512 positions (the trtspec engines' rows and capacity), 2 threads, the same greedy requests
        base = [str(binary), "-m", str(model), "--host", "127.0.0.1", "-t", "2", "-tb", "2", "-np", "8", "-c", "4096",
                "-a", "stdlib", "--no-webui", "--no-cache-prompt", "-cram", "0"]  # no prompt reuse, as trtspec here
        out["llama-server (8 slots)"] = (base, None)
        if draft_gguf is not None:
            out["llama-server (8 slots, draft)"] = (base + ["-md", str(draft_gguf), "--spec-type", "draft-simple",
                                                          "--spec-draft-n-max", "4"], None)
    if only:
        out = {name: v for name, v in out.items() if any(o in name for o in only)}
    return out


def int4_engine(draft: Path) -> Path:
    """The INT4 build of a draft engine's export (int4-awq, block 32, lm_head in INT4), made if missing."""
    from trtspec import build, quantize

    name = draft.name.replace("stdlib-draft", "stdlib-draft-int4")
    engine, exported = ROOT / "engines" / name, ROOT / "export" / draft.name
    if not (engine / "manifest.json").is_file():
        quantized = ROOT / "export" / name
        if not (quantized / "manifest.json").is_file():
            quantize(exported, quantized, mode="int4-awq", block_size=32, quantize_lm_head=True)
        build(quantized, engine)
    return engine


def start(cmd, port, env=None):
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd} did not come up")


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in res["servers"].items():
        rows = [r for r in rows if "concurrency" in r]
        cs = [r["concurrency"] for r in rows]
        axes[0].plot(cs, [r["output_tok_s"] for r in rows], "o-", label=name)
        line = axes[1].plot(cs, [r["ttft_p50_ms"] for r in rows], "o-", label=name)[0]
        axes[1].plot(cs, [r["ttft_p99_ms"] for r in rows], "--", color=line.get_color(), alpha=0.6)
        line = axes[2].plot(cs, [r["itl_p50_ms"] for r in rows], "o-", label=name)[0]
        axes[2].plot(cs, [r["itl_p99_ms"] for r in rows], "--", color=line.get_color(), alpha=0.6)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (solid), p99 (dashed), ms",
                                "inter-token latency p50 (solid), p99 (dashed), ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(res) -> str:
    lines = [f"{res['requests']} requests per load level, {res['max_tokens']} new tokens each (greedy), "
             "held-out prompts (~90 tokens)", "",
             "| server | load | output tok/s | req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | ITL p90 ms "
             "| ITL p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    runs = 1 + max((r.get("run", 0) for rows in res["servers"].values() for r in rows), default=0)
    for name, rows in res["servers"].items():
        for r in rows:
            load = f"{r['concurrency']} clients" if "concurrency" in r else f"{r['rate']} req/s Poisson"
            if runs > 1:
                load += f" (run {r['run']})"
            lines.append(f"| {name} | {load} | {f(r['output_tok_s'], 1)} | {f(r['requests_s'], 2)} | "
                         f"{f(r['ttft_p50_ms'])} | {f(r.get('ttft_p90_ms'))} | {f(r['ttft_p99_ms'])} | "
                         f"{f(r['itl_p50_ms'], 1)} | {f(r.get('itl_p90_ms'), 1)} | {f(r['itl_p99_ms'], 1)} | {r['errors']} |")
    medians = _medians(res)
    if medians:  # a load level given more than once: each server's median over its runs of it
        lines += ["", "Medians over every run of each load level:", "",
                  "| server | load | runs | output tok/s | TTFT p50 ms | ITL p50 ms |", "|---|---|---|---|---|---|"]
        for (name, load), m in medians.items():
            lines.append(f"| {name} | {load} | {m['runs']} | {f(m['output_tok_s'], 1)} | {f(m['ttft_p50_ms'])} | "
                         f"{f(m['itl_p50_ms'], 1)} |")
    ratios = _ratios(res)
    if ratios:  # this checkout's server against the baseline's, level by level within each run
        lines += ["", "This checkout / the baseline: the median of the ratios of the two servers' runs of each load "
                  "level (run in turn, within minutes of each other, in the same run):", "",
                  "| server | load | pairs | output tok/s ratio | TTFT p50 ratio | ITL p50 ratio |",
                  "|---|---|---|---|---|---|"]
        for (name, load), m in ratios.items():
            lines.append(f"| {name} | {load} | {m['pairs']} | {f(m['output_tok_s'], 3)} | {f(m['ttft_p50_ms'], 3)} | "
                         f"{f(m['itl_p50_ms'], 3)} |")
    return "\n".join(lines) + "\n"


def _by_load(rows) -> dict:
    out: dict[str, list] = {}
    for r in rows:  # (the load without its run)
        load = f"{r['concurrency']} clients" if "concurrency" in r else f"{r['rate']} req/s Poisson"
        out.setdefault(load, []).append(r)
    return out


def _ratios(res) -> dict:
    """(server, load) -> medians of this checkout's / the baseline's output tok/s, TTFT p50 and ITL p50 over the
    pairs of their runs of that load level (both servers' rows come in the same order: run by run, level by
    level), for every server the baseline also ran."""
    import statistics

    out = {}
    for name, rows in res["servers"].items():
        theirs = res["servers"].get(f"{name}, baseline")
        if theirs is None:
            continue
        mine_by, theirs_by = _by_load(rows), _by_load(theirs)
        for load, mine in mine_by.items():
            pairs = list(zip(mine, theirs_by.get(load, [])))
            out[(name, load)] = {"pairs": len(pairs), **{
                key: statistics.median(a[key] / b[key] for a, b in pairs if a[key] and b[key])
                if any(a[key] and b[key] for a, b in pairs) else None
                for key in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")}}
    return out


def _medians(res) -> dict:
    """(server, load) -> medians of output tok/s, TTFT p50 and ITL p50 over that load level's runs, for levels
    run more than once."""
    import statistics

    out = {}
    for name, rows in res["servers"].items():
        for load, runs in _by_load(rows).items():
            if len(runs) > 1:
                out[(name, load)] = {"runs": len(runs), **{
                    key: statistics.median(x[key] for x in runs if x[key] is not None)
                    if any(x[key] is not None for x in runs) else None
                    for key in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")}}
    return out


def serve_levels(chosen: dict, run: int, args, prompts, res) -> None:
    """Start ``chosen`` servers (in their order), run every load level against each in turn (the order rotating per
    level), stop them; rows go to ``res["servers"]`` tagged with ``run``."""
    procs, urls = [], {}
    try:
        for name, (cmd, env) in chosen.items():
            port = free_port()
            procs.append(start(cmd, port, env))
            urls[name] = f"http://127.0.0.1:{port}/v1"
            res["servers"].setdefault(name, [])
        levels = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]
        for i, (kind, value) in enumerate(levels):
            names = list(urls)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                records, wall = asyncio.run(run_load(urls[name], "stdlib", prompts, max_tokens=args.max_tokens,
                                                     num_requests=args.requests,
                                                     **({kind: int(value)} if kind == "concurrency" else {kind: value})))
                res["servers"][name].append({"run": run, kind: value, **summarize(records, wall)})
                res["texts"].setdefault(name, [r.text for r in records])
                row = res["servers"][name][-1]
                print(f"run {run} {name:48s} {kind} {value:>4}: {row['output_tok_s']:7.1f} tok/s TTFT p50 "
                      f"{row['ttft_p50_ms'] or 0:.0f} ms errors {row['errors']}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:  # llama-server may ignore SIGTERM with requests it never finished
                proc.kill()
                proc.wait()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0])
    ap.add_argument("--out", type=Path, default=RESULTS / "serve")
    ap.add_argument("--baseline", type=Path, help="also serve with this other trtspec checkout (same engines)")
    ap.add_argument("--runs", type=int, default=1,
                    help="start the servers afresh this many times, the baseline's first in every other run; each "
                         "run goes through every load level (default 1)")
    ap.add_argument("--no-hf", action="store_true", help="leave out the HF generate() server")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary: serve the same model with it")
    ap.add_argument("--llama-model", type=Path, help="the bundled target converted to GGUF (float32)")
    ap.add_argument("--llama-draft", type=Path, help="the bundled draft converted to GGUF (float32)")
    ap.add_argument("--only", nargs="+", help="only the servers whose names contain one of these")
    ap.add_argument("--draft-k", type=int, nargs="+", default=[4],
                    help="one draft server per value: the most drafts a round (-k; default 4)")
    ap.add_argument("--int4-draft", action="store_true", help="also serve with the draft's INT4 build (-k 4)")
    args = ap.parse_args(argv)
    if args.llama_server is not None and args.llama_model is None:
        ap.error("--llama-server needs --llama-model (the target in GGUF)")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.baseline is not None and not (args.baseline / "trtspec" / "__init__.py").is_file():
        ap.error("--baseline must be a trtspec checkout (a directory with trtspec/__init__.py)")
    prompts = load_prompts(ROOT / "models" / "heldout.json")
    res = {"requests": args.requests, "max_tokens": args.max_tokens, "servers": {}, "texts": {}}
    llama = (args.llama_server, args.llama_model, args.llama_draft) if args.llama_server else None
    for run in range(args.runs):
        chosen = servers(args.baseline, hf=not args.no_hf, llama=llama, only=args.only, draft_k=args.draft_k,
                         int4_draft=args.int4_draft, baseline_first=run % 2 == 1)
        serve_levels(chosen, run, args, prompts, res)
    texts = res["texts"]
    reference = "trtspec serve (plain)" if "trtspec serve (plain)" in texts else next(iter(texts))
    res["identical_greedy_text_to"] = reference
    res["outputs_identical"] = {name: t == texts[reference] for name, t in texts.items() if name != reference}
    del res["texts"]
    res["medians"] = [{"server": name, "load": load, **m} for (name, load), m in _medians(res).items()]
    res["ratios_to_baseline"] = [{"server": name, "load": load, **m} for (name, load), m in _ratios(res).items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(markdown(res))
    plot(res, args.out.with_suffix(".png"))
    print(markdown(res))
    print(f"identical greedy text to {reference}: {res['outputs_identical']}")


if __name__ == "__main__":
    main()
