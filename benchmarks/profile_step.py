"""Where a step call spends its time: onnxruntime's per-node profile of an engine, by op type and by node.

    python benchmarks/profile_step.py ENGINE_DIR [--tokens 1 5] [--position 128] [--batch 1] [--calls 50]

Runs `--calls` calls of each token count at the given position (the cache filled with random values up to
it) with onnxruntime's profiler on, and prints, per token count, the median call time and the summed node
time per op type (and the top nodes), so a k+1-token verify call can be compared op by op with a decode call.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def profile(engine_dir: Path, tokens: int, position: int, batch: int, calls: int, threads: int) -> dict:
    import onnxruntime as ort

    from trtspec.engine_contract import fuses_qdq
    from trtspec.ort_session import session_options

    manifest = json.loads((engine_dir / "manifest.json").read_text())
    model = manifest["model"]
    so = session_options(threads, fuse_qdq=fuses_qdq(manifest))
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = os.path.join(tmp, "profile")
        # the graph the engine runs for this call shape: a fused build's decode graph for one row or one token
        decode = (manifest.get("build", {}).get("decode_graph") or {}).get("graph")
        graph = decode if decode and (batch == 1 or tokens == 1) else manifest["graph"]
        sess = ort.InferenceSession(str(engine_dir / graph), so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        shape = (batch, model["num_kv_heads"], model["max_seq_len"], model["head_dim"])
        cache = {past: rng.standard_normal(shape).astype(np.float32) * 0.1 for past in model["kv_aliases"].values()}
        binding = sess.io_binding()
        for present, past in model["kv_aliases"].items():
            buf = cache[past]
            binding.bind_input(past, "cpu", 0, np.float32, list(shape), buf.ctypes.data)
            binding.bind_output(present, "cpu", 0, np.float32, list(shape), buf.ctypes.data)
        ids = rng.integers(3, 300, size=(batch, tokens)).astype(np.int64)
        pos = np.broadcast_to(np.arange(position, position + tokens), (batch, tokens)).astype(np.int64).copy()
        logits = np.empty((batch, tokens, model["vocab_size"]), np.float32)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("position_ids", pos)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            sess.run_with_iobinding(binding)
            times.append(time.perf_counter() - t)
        events = json.loads(Path(sess.end_profiling()).read_text())
        if os.environ.get("KEEP_PROFILE"):
            Path(os.environ["KEEP_PROFILE"]).write_text(json.dumps(events))
    by_op, by_node = collections.Counter(), collections.Counter()
    runs = list(e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            by_op[op] += e["dur"]
            by_node[f"{e['name'][: -len('_kernel_time')]} ({op})"] += e["dur"]
    return {"tokens": tokens, "graph": graph, "median_ms": statistics.median(times[calls // 5 :]) * 1e3,
            "run_ms": statistics.median(runs[calls // 5 :]) / 1e3,
            "op_ms": {k: v / calls / 1e3 for k, v in by_op.most_common()},
            "node_ms": {k: v / calls / 1e3 for k, v in by_node.most_common(15)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--position", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the profiles here")
    args = parser.parse_args()
    results = [profile(args.engine, t, args.position, args.batch, args.calls, args.threads) for t in args.tokens]
    ops = sorted({op for r in results for op in r["op_ms"]}, key=lambda op: -max(r["op_ms"].get(op, 0) for r in results))
    print(f"{args.engine}: position {args.position}, batch {args.batch}, {args.calls} calls each")
    print("| op | " + " | ".join(f"T={r['tokens']} ms ({r['graph']})" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    print("| call (median, wall) | " + " | ".join(f"{r['median_ms']:.3f}" for r in results) + " |")
    print("| call inside onnxruntime (median) | " + " | ".join(f"{r['run_ms']:.3f}" for r in results) + " |")
    print("| sum of node times | " + " | ".join(f"{sum(r['op_ms'].values()):.3f}" for r in results) + " |")
    for op in ops:
        print(f"| {op} | " + " | ".join(f"{r['op_ms'].get(op, 0):.3f}" for r in results) + " |")
    for r in results:
        print(f"\ntop nodes, T={r['tokens']}:")
        for name, ms in r["node_ms"].items():
            print(f"  {ms:7.3f} ms  {name}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
