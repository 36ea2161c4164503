"""Serving under load, in one run: `trtspec serve` plain, `trtspec serve` with speculation (load-aware k),
and HF transformers generate() behind a minimal FastAPI endpoint (benchmarks/hf_server.py), each in its own
process on 127.0.0.1, driven by `trtspec bench-serve`'s load generator (streaming, asyncio + httpx):
closed-loop concurrency 1, 2, 4, 8, 16 and open-loop Poisson arrivals, on the bundled pair.

    python benchmarks/bench_serve.py [--requests 24] [--max-tokens 128] [--rates 1 2 4]

Writes benchmarks/results/serve.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def servers():
    engines()  # builds the max-batch-8 engines if missing
    target = ROOT / "engines" / "stdlib-target-b8-s512"
    draft = ROOT / "engines" / "stdlib-draft-b8-s512"
    # prefix cache off: the load levels send the same prompts again, and reusing them would flatter trtspec
    trtspec = [sys.executable, "-m", "trtspec", "serve", "--target", str(target), "--threads", "2",
               "--served-model-name", "stdlib", "--prefix-cache-mb", "0"]
    return {
        "trtspec serve (plain)": trtspec + ["--drafter", "none"],
        "trtspec serve (draft, load-aware k)": trtspec + ["--draft", str(draft), "-k", "4"],
        "HF generate() + FastAPI": [sys.executable, str(ROOT / "benchmarks" / "hf_server.py"), "--model",
                                    str(ROOT / "models" / "stdlib-target"), "--name", "stdlib", "--threads", "2"],
    }


def start(cmd, port):
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
        axes[1].plot(cs, [r["ttft_p50_ms"] for r in rows], "o-", label=name)
        axes[2].plot(cs, [r["itl_p50_ms"] for r in rows], "o-", label=name)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "inter-token latency p50 (ms)")):
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
             "| server | load | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in res["servers"].items():
        for r in rows:
            load = f"{r['concurrency']} clients" if "concurrency" in r else f"{r['rate']} req/s Poisson"
            f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
            lines.append(f"| {name} | {load} | {f(r['output_tok_s'], 1)} | {f(r['requests_s'], 2)} | "
                         f"{f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'], 1)} | "
                         f"{f(r['itl_p99_ms'], 1)} | {r['errors']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0])
    ap.add_argument("--out", type=Path, default=RESULTS / "serve")
    args = ap.parse_args(argv)
    prompts = load_prompts(ROOT / "models" / "heldout.json")
    res = {"requests": args.requests, "max_tokens": args.max_tokens, "servers": {}, "texts": {}}
    for name, cmd in servers().items():
        port = free_port()
        proc = start(cmd, port)
        url = f"http://127.0.0.1:{port}/v1"
        rows = []
        try:
            for kind, value in [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]:
                records, wall = asyncio.run(run_load(url, "stdlib", prompts, max_tokens=args.max_tokens,
                                                     num_requests=args.requests,
                                                     **({kind: int(value)} if kind == "concurrency" else {kind: value})))
                rows.append({kind: value, **summarize(records, wall)})
                res["texts"].setdefault(name, [r.text for r in records])
                print(f"{name:38s} {kind} {value:>4}: {rows[-1]['output_tok_s']:7.1f} tok/s TTFT p50 "
                      f"{rows[-1]['ttft_p50_ms'] or 0:.0f} ms errors {rows[-1]['errors']}", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
        res["servers"][name] = rows
    names = list(res["texts"])
    res["trtspec_outputs_identical"] = res["texts"][names[0]] == res["texts"][names[1]]
    res["hf_outputs_identical_to_trtspec"] = res["texts"][names[0]] == res["texts"][names[2]]
    del res["texts"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(markdown(res))
    plot(res, args.out.with_suffix(".png"))
    print(markdown(res))
    print(f"identical greedy text, plain vs speculative server: {res['trtspec_outputs_identical']}; "
          f"HF server vs trtspec: {res['hf_outputs_identical_to_trtspec']}")


if __name__ == "__main__":
    main()
