"""Does a program that ends right after its last generate() exit cleanly? This tree against a baseline revision.

    python benchmarks/exit_check.py [--engine engines/smollm2-torch-int8x] [--baseline REV] [--runs 24]

Each run is a fresh process of a user's script: a Generator on the engine, the same prompt generated four times
(the later ones reuse its cached prefix), and the end of the script, the Generator never closed. Sources alternate
run by run (--baseline REV checked out into a temporary git worktree). Counts the runs that ended with a nonzero
status and keeps their last line of stderr (a loop thread stopped during the interpreter's exit aborted with
"terminate called without an active exception"). Writes benchmarks/results/<--out>.{json,md} with the CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench_oracle import cpu_info
from common import ROOT, save_results, sources

SCRIPT = r"""
import sys
import trtspec
gen = trtspec.Generator(sys.argv[1])
prompt = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."
for n in (8, 128, 128, 128):
    out = gen.generate(prompt, max_new_tokens=n)
print(out.finish_reason, len(out.token_ids))
"""


def _run(src: Path, engine: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(engine.resolve())], env=env, capture_output=True,
                          text=True, cwd=src)
    return done.returncode, (done.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-torch-int8x")
    ap.add_argument("--baseline", help="a git revision run alternately")
    ap.add_argument("--runs", type=int, default=24, help="runs of each source")
    ap.add_argument("--out", default="exit-check")
    args = ap.parse_args()
    if not (args.engine / "manifest.json").is_file():
        ap.error(f"{args.engine} is not a built engine (make demo builds engines/smollm2-torch-int8x)")
    counts: dict[str, dict] = {}
    with sources(args.baseline) as checkouts:
        for i in range(args.runs):
            for label, src in checkouts.items():
                rc, last = _run(src, args.engine)
                entry = counts.setdefault(label, {"runs": 0, "nonzero": 0, "statuses": {}, "messages": {}})
                entry["runs"] += 1
                if rc:
                    entry["nonzero"] += 1
                    entry["statuses"][str(rc)] = entry["statuses"].get(str(rc), 0) + 1
                    entry["messages"][last] = entry["messages"].get(last, 0) + 1
                print(f"run {i + 1}, {label}: status {rc}", flush=True)
    cpu = cpu_info(2)
    lines = [f"A script's exit right after its last generate() ({args.engine.name}; the Generator never closed), "
             f"fresh processes, sources alternating. CPU: {cpu['cpu']}; ISA: {' '.join(cpu['isa'])}.", "",
             "| source | runs | nonzero exits | statuses | last line of stderr |", "|---|---|---|---|---|"]
    for label, c in counts.items():
        statuses = ", ".join(f"{s} x{n}" for s, n in c["statuses"].items()) or "-"
        messages = "; ".join(f"{m!r} x{n}" for m, n in c["messages"].items()) or "-"
        lines.append(f"| {label} | {c['runs']} | {c['nonzero']} | {statuses} | {messages} |")
    save_results(ROOT / "benchmarks" / "results" / args.out, {"cpu": cpu, "engine": str(args.engine),
                                                             "sources": counts}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
