"""The CPU targets for AVX2-only machines (AMD Zen 2/3) and AVX-VNNI clients, measured and checked in one run.

    python benchmarks/cpu_targets.py --llama-bench /work/llama.cpp-avx2/bin/llama-bench [--path avx2]
        [--engines engines/smollm2-torch-int8x engines/smollm2-torch] [--out cpu-targets-zen3] [--check-only]

Runs, one after another (each writes its own results file, named from --out):
  1. bench_gguf_kernels.py --ops --quick              one layer's kernels, hot and cold, every path   (<out>-ops)
  2. bench_cpu_paths.py on --path, beside llama-bench  engine calls, plain decode, a 512-token prompt  (<out>-paths)
  3. bench_build.py --rounds 1                          `trtspec build FILE.gguf`, default and int8      (<out>-build)
then reads the three files and writes <out>.{json,md}: each target, the figure, met or not, with the CPU.
--check-only reads existing files and runs nothing. The path defaults to this CPU's fastest; on a machine with
AVX-512, --path avx2 runs the AVX2 code as a stand-in (its caches, clocks and bandwidth are still its own): the
kernels and step ops on AVX2, ATen on AVX2, the engines and the timed builds compiled for AVX2
(common.AVX2_ONLY_ENV). Two figures stay outside: onnxruntime-genai's int4 decode (bench_real.py) and `make demo`
from a fresh clone. About 25 minutes on 2 cores, most of it the kernels' table; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import AVX2_FAMILY, AVX2_ONLY_ENV, avx2_built  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
TYPES = {(1536, 576): ("Q4_1", "Q5_0"), (576, 1536): ("Q4_1", "Q5_0", "Q6_K")}  # (n, k): the types measured cold
RATIOS = {5: 1.5, 9: 2.2, 16: 3.2}  # int8 rows, cold: at most x its own one-row call
CALLS = {5: 1.4, 17: 3.5}  # engine calls: at most x its own decode call


def _run(args: list[str]) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=ROOT)


def _load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run without --check-only first")
    return json.loads(path.read_text())


def _row(target: str, figure: str, met: bool | None) -> dict:
    return {"target": target, "figure": figure, "met": met}


def kernel_rows(ops: dict, path: str) -> list[dict]:
    rows, bandwidth = [], ops["bandwidth_gbs"]
    cold = {(e["n"], e["k"], e["type"], e["int8_activations"], e["m"]): e for e in ops["ours"]
            if e["path"] == path and "cold_us" in e}
    for (n, k), types in TYPES.items():
        for t in types:
            for int8, least in ((False, 0.5), (True, 0.6)):
                e = cold.get((n, k, t, int8, 1))
                if e is None:
                    continue
                frac = e["cold_bandwidth_fraction"]
                rows.append(_row(f"{t} {n}x{k}, one row, cold, {'int8' if int8 else 'float'}: >= {least} of the "
                                 f"bandwidth", f"{frac:.2f} ({e['cold_us']:.1f} us at {bandwidth:.1f} GB/s)",
                                 frac >= least))
            one = cold.get((n, k, t, True, 1))
            for m, most in RATIOS.items():
                e = cold.get((n, k, t, True, m))
                if one is not None and e is not None:
                    x = e["cold_us"] / one["cold_us"]
                    rows.append(_row(f"{t} {n}x{k}, int8, cold: M = {m} <= {most}x M = 1", f"{x:.2f}x", x <= most))
    return rows


def engine_rows(paths: dict, path: str) -> list[dict]:
    rows = []
    llama = next(iter(paths.get("llama_bench", {}).values()), None)
    for r in paths["rows"]:
        if r["kernels"] != "this tree" or r["path"] != path:
            continue
        name, ms = r["engine"], r["ms"]
        for t, most in CALLS.items():
            x = ms[str(t)] / ms["1"]
            rows.append(_row(f"{name}: a {t}-token call <= {most}x its decode call",
                             f"{x:.2f}x ({ms[str(t)]:.2f} ms against {ms['1']:.2f})", x <= most))
        if llama is None or r.get("decode_tok_s") is None:
            continue
        int8 = "int8" in name
        least = 1.1 if int8 else 0.9
        x = r["decode_tok_s"] / llama["tg128"]
        rows.append(_row(f"{name}: plain decode >= {least}x llama-bench tg128",
                         f"{x:.2f}x ({r['decode_tok_s']:.1f} against {llama['tg128']:.1f} tok/s)", x >= least))
        if r.get("prefill_tok_s") is not None:
            rows.append(_row(f"{name}: a 512-token prompt faster per row than llama-bench pp512",
                             f"{r['prefill_tok_s']:.0f} against {llama['pp512']:.0f} tok/s",
                             r["prefill_tok_s"] > llama["pp512"]))
    return rows


def build_rows(build: dict) -> list[dict]:
    return [_row(f"`trtspec build FILE.gguf` ({r['variant']}) <= 60 s", f"{r['build_s']:.1f} s", r["build_s"] <= 60)
            for r in build["rows"] if r["source"] == "this tree"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", type=Path, help="an AVX2-only llama-bench (benchmarks/LLAMA_CPP.md)")
    ap.add_argument("--path", help="the kernels' ISA path to measure (default: this CPU's fastest)")
    ap.add_argument("--engines", type=Path, nargs="+",
                    default=[ROOT / "engines" / "smollm2-torch-int8x", ROOT / "engines" / "smollm2-torch"])
    ap.add_argument("--out", default="cpu-targets")
    ap.add_argument("--check-only", action="store_true", help="read the three results files; run nothing")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from trtspec import kernels

    path = args.path or kernels.paths()[0]
    if path not in kernels.paths():
        ap.error(f"--path {path}: this CPU runs {kernels.paths()}")
    if not args.check_only:
        if args.llama_bench is None or not args.llama_bench.is_file():
            ap.error("--llama-bench BINARY is needed (an AVX2-only build: benchmarks/LLAMA_CPP.md); "
                     "--check-only reads earlier results instead")
        missing = [str(e) for e in args.engines if not (e / "manifest.json").is_file()]
        if missing:
            ap.error(f"not built: {missing} (the build commands: docs/kernels.md, 'Quick start')")
        if path in AVX2_FAMILY and kernels.paths()[0] not in AVX2_FAMILY:
            # a stand-in on a CPU with AVX-512: everything as an AVX2-only CPU runs it, the build timed included
            wide = [str(e) for e in args.engines if not avx2_built(e)]
            if wide:
                ap.error(f"--path {path} on this AVX-512 CPU measures engines compiled for AVX2; {wide} were not: "
                         "build them with " + " ".join(f"{k}={v}" for k, v in AVX2_ONLY_ENV.items())
                         + " (docs/building.md, 'An engine for other CPUs')")
            os.environ.update(AVX2_ONLY_ENV)
        _run(["benchmarks/bench_gguf_kernels.py", "--ops", "--quick", "--out", f"{args.out}-ops"])
        _run(["benchmarks/bench_cpu_paths.py", "--engines", *map(str, args.engines), "--paths", path,
              "--llama-bench", f"avx2-only={args.llama_bench}", "--out", f"{args.out}-paths"])
        _run(["benchmarks/bench_build.py", "--rounds", "1", "--out", f"{args.out}-build"])
    ops, paths, build = (_load(f"{args.out}-{s}") for s in ("ops", "paths", "build"))
    rows = kernel_rows(ops, path) + engine_rows(paths, path) + build_rows(build)
    cpu = paths["cpu"]
    result = {"cpu": cpu, "path": path, "rows": rows,
              "not_measured_here": ["trtspec plain decode >= onnxruntime-genai's int4 decode (bench_real.py)",
                                    "`make demo` <= 4 min from a fresh clone"]}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    met = sum(r["met"] is True for r in rows)
    lines = [f"CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}; kernels' path measured: {path}; 2 threads. "
             f"From {args.out}-ops, {args.out}-paths and {args.out}-build (`python benchmarks/cpu_targets.py`). "
             f"{met} of {len(rows)} targets met.", "", "| target | figure | met |", "|---|---|---|"]
    lines += [f"| {r['target']} | {r['figure']} | {'yes' if r['met'] else 'no'} |" for r in rows]
    lines += ["", "Not measured by this script: " + "; ".join(result["not_measured_here"]) + "."]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
