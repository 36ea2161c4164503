"""The torch engines on our GGUF kernels beside onnxruntime builds of the same file: call times at T = 1, 2, 5, 9 and
17 tokens against each engine's own decode call, and where a torch call's time goes.

    python benchmarks/bench_torch_gguf.py [--export export/smollm2]
        [--engines engines/smollm2-int8x engines/smollm2-torch-int8x ...]   (built engines: onnxruntime, torch)
        [--backends eager inductor] [--activations int8 float] [--position 100]

--engines are built engines of any backend (`trtspec build --backend torch` is the AOTInductor package);
--backends are torch.compile backends of trtspec.compile(export, weights="gguf"), compiled in this process.

2 threads, one row, medians of --reps rounds that alternate the engines. Writes benchmarks/results/<--out>.{json,md}
(default torch-gguf)
with the CPU model and ISA, and the torch profiler's top operators of an eager decode call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_gguf_kernels import _cpu, _read_bandwidth  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOKENS = (1, 2, 5, 9, 17)


def _profile(engine, position: int, calls: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):  # the first pass under the profiler recompiles (dynamo guards on its dispatch mode): the second
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                engine.forward(np.full((1, 1), 300), np.array([[position]]))
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    return [{"op": e.key, "ms_per_call": e.self_cpu_time_total / 1e3 / calls, "calls_per_call": e.count / calls}
            for e in rows]


def main() -> None:
    import torch

    import trtspec
    from trtspec.engines import load_engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, default=Path("export/smollm2"))
    ap.add_argument("--engines", type=Path, nargs="*",
                    default=[Path("engines/smollm2-int8x"), Path("engines/smollm2-torch-int8x")])
    ap.add_argument("--backends", nargs="*", default=["eager", "inductor"])
    ap.add_argument("--activations", nargs="*", default=["int8", "float"], choices=["int8", "float"])
    ap.add_argument("--position", type=int, default=100)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="torch-gguf", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(2)
    engines, load_s = {}, {}
    for path in args.engines:
        t = time.perf_counter()
        e = load_engine(path, num_threads=2)
        label = f"{e.manifest['backend']} {path.name}" + (" (AOTInductor)" if e.manifest["backend"] == "torch" else "")
        engines[label], load_s[label] = e, time.perf_counter() - t
    for backend in args.backends:
        for int8 in [a == "int8" for a in args.activations]:
            t = time.perf_counter()
            engines[f"torch.compile {backend}, GGUF kernels, {'int8' if int8 else 'float'} activations"] = trtspec.compile(
                args.export, backend=backend, weights="gguf", int8_activations=int8, max_batch=1)
            load_s[list(engines)[-1]] = time.perf_counter() - t
    first_call_s = {}
    p = args.position
    for label, e in engines.items():
        e.reset()
        e.forward(np.arange(p)[None] % 500 + 100, np.arange(p)[None])
        t = time.perf_counter()
        for n in TOKENS:  # every shape once (torch.compile compiles here)
            e.forward(np.full((1, n), 300), np.arange(p, p + n)[None])
        first_call_s[label] = time.perf_counter() - t
    times = {label: {n: [] for n in TOKENS} for label in engines}
    for _ in range(args.reps):
        for label, e in engines.items():
            for n in TOKENS:
                t = time.perf_counter()
                e.forward(np.full((1, n), 300), np.arange(p, p + n)[None])
                times[label][n].append(time.perf_counter() - t)
    med = {label: {n: statistics.median(v) * 1e3 for n, v in per.items()} for label, per in times.items()}
    # the decode bound: every byte of the file's tensors read once a call, at the 2-thread read bandwidth of this run
    gguf = Path(json.loads((args.export / "manifest.json").read_text())["source"]["model_dir"])
    bandwidth = _read_bandwidth(1 << 30) * 1e9  # (bytes/s; 1 GiB: past any L3 of these machines)
    bound_ms = gguf.stat().st_size / bandwidth * 1e3
    eager = next((e for label, e in engines.items() if label.startswith("torch.compile eager") and "int8" in label), None)
    result = {"cpu": _cpu(), "export": str(args.export), "position": p, "ms": med, "load_s": load_s,
              "read_bandwidth_gbs": bandwidth / 1e9, "gguf_bytes": gguf.stat().st_size, "decode_bound_ms": bound_ms,
              "first_calls_s": first_call_s, "max_seq_len": json.loads((args.export / "manifest.json").read_text())[
                  "model"]["max_seq_len"], "profile_eager_int8_decode": _profile(eager, p) if eager else None}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [f"CPU: {result['cpu']['model']}; ISA: {' '.join(result['cpu']['isa'])}; 2 threads; one row at position "
             f"{p}; S_max {result['max_seq_len']}; medians of {args.reps} alternating rounds (ms, and x the engine's "
             "own decode call).", "", "| engine | " + " | ".join(f"T={n}" for n in TOKENS) + " |",
             "|---|" + "---|" * len(TOKENS)]
    for label, per in med.items():
        lines.append(f"| {label} | " + " | ".join(f"{per[n]:.2f} ({per[n] / per[1]:.2f}x)" for n in TOKENS) + " |")
    lines += ["", f"Decode bound: the GGUF's {gguf.stat().st_size / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s (2-thread "
              f"read, this run) = {bound_ms:.2f} ms; each engine's decode call at that bound: "
              + "; ".join(f"{label} {bound_ms / per[1]:.2f}" for label, per in med.items())]
    lines += ["", "Load (built engines: the package or graph; torch.compile: transformers reads the GGUF, the kernels' "
              "layers are checked and packed) and first calls (s): "
              + "; ".join(f"{k}: {load_s.get(k, 0):.0f} + {first_call_s[k]:.1f}" for k in engines)]
    if result["profile_eager_int8_decode"]:
        lines += ["", "Where an eager decode call goes (torch profiler, self time per call):", "",
                  "| operator | ms | calls |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['ms_per_call']:.2f} | {r['calls_per_call']:.0f} |"
                  for r in result["profile_eager_int8_decode"]]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
