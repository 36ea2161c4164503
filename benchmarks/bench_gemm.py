"""What a float32 MatMul over M tokens costs on this CPU, in onnxruntime (MLAS, 2 threads): the floor under a
verify or tree call of M tokens.

    python benchmarks/bench_gemm.py [--repeats 30]     # writes benchmarks/results/gemm.{json,md}

A graph of 12 MatMuls of 512 x 3072 float32 weights (75 MB: more than the 32 MiB L3, as the bundled target's 109 MB
are) run over M rows; for each M the median time, GFLOP/s and the weight bytes read per second. At M = 1 the calls
are bound by reading the weights; as M grows they become compute-bound, and the rate approaches MLAS's float32
peak on these cores. The bundled target's 17-token (16-node tree) call computes 17 x 23.1M multiply-adds in its
MatMuls: at the M = 17 rate that alone sets how close to a decode call it can come.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from common import RESULTS

K, N, LAYERS = 512, 3072, 12
SIZES = (1, 5, 9, 17, 33, 64, 128)


def graph():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(LAYERS):  # each MatMul's output sliced back to K columns feeds the next
        inits.append(numpy_helper.from_array((rng.standard_normal((K, N)) * 0.01).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"]))
        nodes.append(helper.make_node("Slice", [f"y{i}", "start", "end", "axis"], [f"z{i}"]))
        x = f"z{i}"
    inits += [numpy_helper.from_array(np.array([v]), name) for name, v in (("start", 0), ("end", K), ("axis", -1))]
    g = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", K])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main(argv=None):
    import onnxruntime as ort

    from trtspec.ort_session import session_options

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    session = ort.InferenceSession(graph().SerializeToString(), session_options(2), providers=["CPUExecutionProvider"])
    rows = {}
    for m in SIZES:
        x = np.random.default_rng(m).random((m, K), dtype=np.float32)
        for _ in range(5):
            session.run(None, {"x": x})
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            session.run(None, {"x": x})
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        rows[m] = {"ms": t * 1e3, "gflop_s": 2 * m * K * N * LAYERS / t / 1e9, "weight_gb_s": K * N * LAYERS * 4 / t / 1e9}
        print(m, rows[m], flush=True)
    (RESULTS / "gemm.json").write_text(json.dumps(rows, indent=2))
    lines = [f"{LAYERS} float32 MatMuls of {K} x {N} ({K * N * LAYERS * 4 / 1e6:.0f} MB), onnxruntime CPU, 2 threads, "
             f"median of {args.repeats}", "", "| M | ms | GFLOP/s | weights read GB/s | ms / ms at M = 1 |", "|---|---|---|---|---|"]
    for m, r in rows.items():
        lines.append(f"| {m} | {r['ms']:.2f} | {r['gflop_s']:.0f} | {r['weight_gb_s']:.1f} | {r['ms'] / rows[1]['ms']:.2f}x |")
    (RESULTS / "gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
