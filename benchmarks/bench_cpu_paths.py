"""Built torch engines on every ISA path this CPU runs, against the kernels of an earlier revision and llama.cpp:
engine call times at T = 1, 5, 9 and 17 tokens, a 512-token prefill, and plain decode through the Generator.

    python benchmarks/bench_cpu_paths.py --engines engines/smollm2-torch engines/smollm2-torch-int8x
        [--baseline REV] [--paths avx512vnni avx2 ...] [--llama-bench LABEL=BINARY ...] [--rounds 3]
        [--out cpu-paths]

Each (kernels, path, engine) runs in its own process (one engine alive at a time: a second engine's OpenMP pool
slows every call on 2 cores), with TRTSPEC_KERNEL_PATH naming the path; rounds alternate over all of them, and the
tables quote the median over rounds of each process' own medians. --baseline REV checks REV's trtspec/ out into a
temporary git worktree and runs the same engines on its kernels (the engines' AOTInductor packages call the kernels'
library by name, so one build serves both). The 2-thread read bandwidth is measured first, before any engine loads.
Writes benchmarks/results/<--out>.{json,md} with the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_gguf_kernels import _cpu, _read_bandwidth  # noqa: E402
from bench_real import llama_bench_rate  # noqa: E402
from common import AVX2_FAMILY, AVX2_ONLY_ENV, compiled_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
TOKENS = (1, 5, 9, 17)
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "import json\n\n\ndef load_config(path):\n"]

# one process: load the engine, then time its calls ("calls") or plain decode through the Generator ("decode"), never
# both: the Generator calls the engine from its scheduler's thread, and a second OpenMP pool (the main thread's, still
# spinning after its own calls) slows every call on 2 cores
CHILD = r"""
import json, os, statistics, sys, time
import numpy as np, torch
torch.set_num_threads(2)
from trtspec import kernels
from trtspec.engines import load_engine
from trtspec.runtime import Generator
mode, engine_dir, reps, new_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
position, calls_only = int(sys.argv[6]), sys.argv[7] == "1"
e = load_engine(engine_dir, num_threads=2)
want = os.environ["TRTSPEC_KERNEL_PATH"]
if want not in kernels.paths():  # a baseline's kernels without this path
    print(json.dumps({"skip": f"no {want} path"}))
    sys.exit()
kernels.use_path(want)  # as TRTSPEC_KERNEL_PATH does from now on; a baseline may predate the variable
out = {"path": kernels.status()["path"]}
if mode == "calls":
    p = position
    e.reset()
    e.forward(np.arange(p)[None] % 500 + 100, np.arange(p)[None])
    for n in (1, 5, 9, 17):
        e.forward(np.full((1, n), 300), np.arange(p, p + n)[None])
    times = {n: [] for n in (1, 5, 9, 17)}
    for _ in range(reps):
        for n in times:
            t = time.perf_counter()
            e.forward(np.full((1, n), 300), np.arange(p, p + n)[None])
            times[n].append(time.perf_counter() - t)
    out["ms"] = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    prefill = []
    for _ in range(0 if calls_only else 3):  # a 512-token prompt in one call, as llama-bench's pp512
        e.reset()
        t = time.perf_counter()
        e.forward(np.arange(512)[None] % 500 + 100, np.arange(512)[None])
        prefill.append(512 / (time.perf_counter() - t))
    out["prefill_tok_s"] = statistics.median(prefill) if prefill else None
elif calls_only:
    out["decode_tok_s"] = None
else:
    gen = Generator(e, drafter="none")
    gen.generate(prompts[0], max_new_tokens=4)  # first calls of each shape
    rates = []
    for prompt in prompts:
        st = gen.generate(prompt, max_new_tokens=new_tokens, min_tokens=new_tokens).stats
        rates.append((st.new_tokens - 1) / (st.elapsed_s - st.time_to_first_token_s))
    out["decode_tok_s"] = statistics.median(rates)
print(json.dumps(out))
"""


def _llama_bench(binary: Path, gguf: Path) -> dict:
    """llama-bench's tg128, pp16 and pp512 on the GGUF, 2 threads, one repetition each."""
    return {"tg128": llama_bench_rate(binary, gguf, 2, 0, 128), "pp16": llama_bench_rate(binary, gguf, 2, 16, 0),
            "pp512": llama_bench_rate(binary, gguf, 2, 512, 0)}


def _worktree(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), rev], check=True,
                   capture_output=True)
    return into


def _median(values) -> float | None:
    """The median of the figures a round measured (None: not measured, --calls-only)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _figure(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _run(src: Path, path: str, engine: Path, reps: int, new_tokens: int, position: int, calls_only: bool) -> dict:
    env = {**os.environ, "TRTSPEC_KERNEL_PATH": path, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2",
           **(AVX2_ONLY_ENV if path in AVX2_FAMILY else {})}
    out = {}
    for mode in ("calls", "decode"):
        done = subprocess.run([sys.executable, "-c", CHILD, mode, str(engine.resolve()), str(reps), str(new_tokens),
                               json.dumps(PROMPTS), str(position), "1" if calls_only else "0"], env=env,
                              capture_output=True, text=True, cwd=src)
        if done.returncode:
            raise RuntimeError(f"{engine} on {path} ({src}) failed:\n{done.stderr[-3000:]}")
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
        if "skip" in out:
            return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=Path, nargs="+", required=True)
    ap.add_argument("--baseline", help="a git revision whose kernels run the same engines too")
    ap.add_argument("--paths", nargs="*", help="ISA paths (default: every path this CPU runs but the portable one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15, help="calls of each size a round")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens a prompt in plain decode")
    ap.add_argument("--llama-bench", nargs="*", default=[], metavar="LABEL=BINARY",
                    help="llama.cpp builds to run beside (benchmarks/LLAMA_CPP.md), each round: tg128, pp16, pp512")
    ap.add_argument("--gguf", type=Path, help="the GGUF file for --llama-bench (default: the engines' source)")
    ap.add_argument("--position", type=int, default=100, help="the cache position of the timed calls")
    ap.add_argument("--calls-only", action="store_true", help="time the calls only: no plain decode, no 512-token "
                    "prompt (a long-context study with --position)")
    ap.add_argument("--out", default="cpu-paths")
    args = ap.parse_args()
    from trtspec import kernels

    cpu = _cpu()
    bandwidth = _read_bandwidth(1 << 30)
    paths = args.paths or [p for p in kernels.paths() if p != "reference"]
    llamas = dict(item.split("=", 1) for item in args.llama_bench)
    gguf = args.gguf
    if llamas and gguf is None:
        manifest = json.loads((args.engines[0] / "manifest.json").read_text())
        gguf = Path(manifest["source"]["model_dir"])
        if gguf.suffix != ".gguf":
            raise SystemExit(f"{args.engines[0]} was not built from a GGUF file; pass --gguf")
    llama_runs: dict[str, list] = {}
    print(f"{cpu['model']}: paths {paths}, read bandwidth {bandwidth:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this tree": ROOT}
        if args.baseline:
            sources[f"baseline {args.baseline}"] = _worktree(args.baseline, Path(tmp) / "baseline")
        try:
            runs: dict[tuple, list] = {}
            for r in range(args.rounds):
                for label, src in sources.items():
                    for path in paths:
                        for engine in args.engines:
                            out = _run(src, path, engine, args.reps, args.new_tokens, args.position,
                                       args.calls_only)
                            if "skip" in out:
                                continue
                            runs.setdefault((label, path, engine.name), []).append(out)
                            print(f"round {r + 1}: {label}, {path}, {engine.name}: T=1 {out['ms']['1']:.2f} ms, "
                                  f"T=17 {out['ms']['17']:.2f} ms", flush=True)
                for name, binary in llamas.items():
                    out = _llama_bench(Path(binary), gguf)
                    llama_runs.setdefault(name, []).append(out)
                    print(f"round {r + 1}: llama-bench {name}: {out}", flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "baseline")],
                               capture_output=True)
    rows = []
    for (label, path, engine), outs in runs.items():
        ms = {n: statistics.median(o["ms"][str(n)] for o in outs) for n in TOKENS}
        rows.append({"kernels": label, "path": path, "engine": engine, "ms": ms,
                     "decode_tok_s": _median(o["decode_tok_s"] for o in outs),
                     "prefill_tok_s": _median(o["prefill_tok_s"] for o in outs)})
    llama = {name: {k: statistics.median(o[k] for o in outs if o[k] is not None) if any(o[k] for o in outs) else None
                    for k in ("tg128", "pp16", "pp512")} for name, outs in llama_runs.items()}
    result = {"cpu": cpu, "read_bandwidth_gbs": bandwidth, "rounds": args.rounds, "reps": args.reps,
              "position": args.position, "calls_only": args.calls_only, "new_tokens": args.new_tokens, "rows": rows,
              "llama_bench": llama, "llama_bench_binaries": llamas,
              "compiled_for": {e.name: compiled_for(e) for e in args.engines}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    also = ("" if args.calls_only else f" and plain decode through the Generator ({len(PROMPTS)} prompts x "
            f"{args.new_tokens} tokens, time after the first token), and a 512-token prompt in one call")
    lines = [f"CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}; 2 threads; 2-thread read bandwidth "
             f"{bandwidth:.1f} GB/s (this run). Engine calls at position {args.position} (ms, and x the same run's "
             f"decode call){also}; medians over {args.rounds} alternating rounds, each process on one path "
             "(TRTSPEC_KERNEL_PATH; on avx2 and avxvnni ATen's own kernels on AVX2 too). Packages compiled for: "
             + ", ".join(f"{name} {isa}" for name, isa in result["compiled_for"].items()) + ".", "",
             "| kernels | path | engine | " + " | ".join(f"T={n}" for n in TOKENS) + " | plain decode tok/s | "
             "512-token prefill tok/s |", "|---|---|---|" + "---|" * len(TOKENS) + "---|---|"]
    for row in rows:
        ms = row["ms"]
        lines.append(f"| {row['kernels']} | {row['path']} | {row['engine']} | "
                     + " | ".join(f"{ms[n]:.2f}" + ("" if n == 1 else f" ({ms[n] / ms[1]:.2f}x)") for n in TOKENS)
                     + f" | {_figure(row['decode_tok_s'], 1)} | {_figure(row['prefill_tok_s'], 0)} |")
    def rate(v):
        return f"{v:.1f} tok/s" if v else "failed"

    for name, figures in llama.items():
        tg = figures["tg128"]
        lines += ["", f"llama-bench {name} ({llamas[name]}), medians of the same rounds: tg128 {rate(tg)}, pp16 "
                  f"{rate(figures['pp16'])}, pp512 {rate(figures['pp512'])}. Plain decode against its tg128: "
                  + "; ".join(f"{row['kernels']}, {row['path']}, {row['engine']}: {row['decode_tok_s'] / tg:.2f}x"
                              for row in rows if row["decode_tok_s"] and tg)]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
