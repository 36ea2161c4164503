"""What a server's first requests pay without a warm-up: onnxruntime's first call of a new (rows, tokens) shape,
on the bundled target engine with 8 rows (engines/stdlib-target-b8-s512), in a fresh process each time.

Each run loads the engine, makes one one-token call, then (``warm``) Scheduler.warm_up's call (every row, 32
tokens) or not, then the shapes a server's first rounds make (a few rows verifying a few tokens), each three
times: the first call's time against the median of the next two. Runs alternate cold and warm.

    .venv/bin/python benchmarks/bench_first_calls.py [--runs 4]

Writes benchmarks/results/first-calls.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, ROOT, save_results  # noqa: E402

SHAPES = [(2, 1), (3, 5), (5, 3), (8, 5), (8, 1), (6, 4), (4, 9), (2, 7)]

CHILD = r"""
import json, sys, time
import numpy as np
from trtspec import Scheduler, load_engine
engine = load_engine(sys.argv[1], num_threads=2)
def call(b, t):
    ids = np.full((b, t), 5, np.int64)
    pos = np.broadcast_to(100 + np.arange(t), (b, t))
    t0 = time.perf_counter()
    engine.forward(ids, pos)
    return 1e3 * (time.perf_counter() - t0)
call(1, 1)
warm_ms = None
if sys.argv[2] == "warm":
    scheduler = Scheduler(engine)
    t0 = time.perf_counter()
    scheduler.warm_up()
    warm_ms = 1e3 * (time.perf_counter() - t0)
out = {}
for b, t in json.loads(sys.argv[3]):
    first = call(b, t)
    out[f"{b}x{t}"] = [first, sorted([call(b, t), call(b, t)])[0]]
print(json.dumps({"warm_up_ms": warm_ms, "shapes": out}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "first-calls")
    args = ap.parse_args(argv)
    from bench_batching import engines

    engines()  # builds the max-batch-8 engines if missing
    engine = ROOT / "engines" / "stdlib-target-b8-s512"
    runs = {"cold": [], "warm": []}
    for i in range(args.runs):
        for mode in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
            res = subprocess.run([sys.executable, "-c", CHILD, str(engine), mode, json.dumps(SHAPES)],
                                 capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    lines = [f"# First calls of new shapes, bundled target with 8 rows ({args.runs} fresh processes each, medians; "
             "ms)", "", "| shape (rows x tokens) | first call, cold | later calls, cold | first call, after warm_up "
             "| later calls, after warm_up |", "|---|---|---|---|---|"]
    table = {}
    for b, t in SHAPES:
        key = f"{b}x{t}"
        row = [statistics.median(r["shapes"][key][j] for r in runs[mode]) for mode in ("cold", "warm") for j in (0, 1)]
        table[key] = row
        lines.append(f"| {key} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    worst = {mode: statistics.median(max(v[0] for v in r["shapes"].values()) for r in runs[mode])
             for mode in runs}
    total = {mode: statistics.median(sum(v[0] - v[1] for v in r["shapes"].values()) for r in runs[mode])
             for mode in runs}
    warm_up = statistics.median(r["warm_up_ms"] for r in runs["warm"])
    lines += ["", f"- the slowest first call: {worst['cold']:.1f} ms cold, {worst['warm']:.1f} ms after warm_up",
              f"- first calls over later ones, summed over the shapes: {total['cold']:.1f} ms cold, "
              f"{total['warm']:.1f} ms after warm_up",
              f"- warm_up itself (once, at start): {warm_up:.1f} ms"]
    save_results(args.out, {"runs": runs, "medians_ms": table, "slowest_first_call_ms": worst,
                            "first_over_later_ms": total, "warm_up_ms": warm_up}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
