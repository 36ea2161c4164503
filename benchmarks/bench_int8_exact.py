"""The exact `--int8-activations` build's decode-call time at a long context, with and without spinning threads.

    python benchmarks/bench_int8_exact.py [--engine engines/smollm2-int8x] [--position 700] [--processes 5]

The decode-call time of an engine at a position, in --processes fresh processes each with onnxruntime's
worker threads spinning (our setting) and not, and, where the engine has a decode graph, planned for one row a
call (engine.plan_rows(1): the exact build's decode graph for every call, spinning): medians of 4 blocks of 30
calls per process. At long contexts the int8 build's call time on its built graph came in phases (12 or 23 ms at
700 tokens); without spinning it stayed steady, and slower at short contexts. Writes
benchmarks/results/calls-ENGINE-POSITION.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _one_process(engine: str, position: int, spinning: bool, one_row: bool = False) -> list[float]:
    import trtspec.engines.onnxruntime as ort_engine
    from trtspec.engines import load_engine

    if not spinning:
        options = ort_engine.session_options

        def no_spinning(*args, **kwargs):
            so = options(*args, **kwargs)
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return so

        ort_engine.session_options = no_spinning
    engine = load_engine(engine, num_threads=2)
    if one_row:  # a session of one row a call: the decode graph for every call (engines/onnxruntime.py)
        engine.plan_rows(1)
    ids = np.random.default_rng(0).integers(0, 49152, size=(1, position + 120))
    pos = np.arange(ids.shape[1])[None]
    for a in range(0, position, 128):
        engine.forward(ids[:, a : min(position, a + 128)], pos[:, a : min(position, a + 128)])
    blocks = []
    for block in range(4):
        t0 = time.perf_counter()
        for i in range(30):
            p = position + 30 * block + i
            engine.forward(ids[:, p : p + 1], pos[:, p : p + 1])
        blocks.append((time.perf_counter() - t0) / 30 * 1e3)
    return blocks


def calls(args) -> dict:
    labels = {"spinning": ("1", "0"), "no spinning": ("0", "0")}  # label -> (spinning, one row)
    manifest = json.loads((args.engine / "manifest.json").read_text())
    if (manifest["build"].get("decode_graph") or {}).get("graph"):
        labels["one row (decode graph), spinning"] = ("1", "1")
    out = {"engine": str(args.engine), "position": args.position, "runs": {label: [] for label in labels}}
    for _ in range(args.processes):
        for label in out["runs"]:
            res = subprocess.run([sys.executable, __file__, "_one", str(args.engine), str(args.position),
                                  *labels[label]], capture_output=True, text=True, check=True)
            blocks = json.loads(res.stdout.strip().splitlines()[-1])
            out["runs"][label].append(blocks)
            print(f"{label:33s} ms a decode call, 4 blocks of 30: {[round(b, 1) for b in blocks]}", flush=True)
    for label, runs in out["runs"].items():
        medians = [statistics.median(r) for r in runs]
        print(f"{label}: per-process medians {[round(m, 1) for m in medians]}")
    return out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        print(json.dumps(_one_process(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5:] == ["1"])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2-int8x"))
    ap.add_argument("--position", type=int, default=700)
    ap.add_argument("--processes", type=int, default=5)
    args = ap.parse_args()
    out = calls(args)
    path = Path(__file__).resolve().parent / "results" / f"calls-{args.engine.name}-{args.position}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
