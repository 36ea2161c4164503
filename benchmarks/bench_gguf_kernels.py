"""The onnxruntime facts the GGUF build rests on (builder/ort_lowering.py: gguf_linears, GGUF_ACCURACY_LEVEL), and
what they cost on the real model.

    python benchmarks/bench_gguf_kernels.py [--engine engines/smollm2] [--int8-engine engines/smollm2-int8x]
                                            [--export export/smollm2]

1. One MatMulNBits node (N=1536, K=576, block 32, 2 threads), median us per one-token call: Q4_1's minimum as
   MatMulNBits' float zero point against uint8 zero points, at accuracy levels 0 and 4; the Q8_0 head's shape
   (49152 x 576, 8 bits) at levels 0 and 4.
2. Batch invariance per node: the max difference between rows computed one at a time and the same rows in one
   call of 5, per accuracy level; and the 4-bit layer's time at level 4 against the rows of the call (1..16).
3. The engines (2 threads, position 100): decode and 5-token call times, interleaved; with --export also a build
   whose minimums' term is dropped (wrong weights: it only measures what the term costs); and the largest logit
   difference between a 5-token call and the same 5 tokens one call at a time (a random-token prompt).

Writes benchmarks/results/gguf-kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"


def _session(n, k, bits, acc, zero_points=None):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (n, k // 32, 32 * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * (k // 32)) * 0.01).astype(np.float32)
    inits, names = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")], ["A", "B", "S"]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "Z"))
        names.append("Z")
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=32,
                            accuracy_level=acc)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, "T", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "T", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _us(session, k, calls, rows=1):
    x = np.random.default_rng(1).standard_normal((1, rows, k)).astype(np.float32)
    for _ in range(10):
        session.run(None, {"A": x})
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            session.run(None, {"A": x})
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def _invariance(session, k):
    x = np.random.default_rng(2).standard_normal((1, 5, k)).astype(np.float32)
    alone = np.array([session.run(None, {"A": x[:, i:i + 1]})[0][0, 0] for i in range(5)])
    return float(np.abs(alone - session.run(None, {"A": x})[0][0]).max())


ROWS = (1, 2, 3, 4, 5, 8, 16)


def nodes() -> dict:
    n, k = 1536, 576
    nz = n * ((k // 32 + 1) // 2)
    out = {"layer": {}, "head": {}, "invariance": {}}
    for acc in (0, 4):
        out["layer"][f"uint8 zero points, level {acc}"] = _us(_session(n, k, 4, acc, np.zeros(nz, np.uint8)), k, 300)
        out["layer"][f"float zero points, level {acc}"] = _us(
            _session(n, k, 4, acc, np.zeros(n * (k // 32), np.float32)), k, 20)
        out["head"][f"8-bit, level {acc}"] = _us(_session(49152, k, 8, acc), k, 3 if acc == 0 else 100)
        out["invariance"][f"4-bit layer, level {acc}"] = _invariance(_session(n, k, 4, acc, np.zeros(nz, np.uint8)), k)
        out["invariance"][f"8-bit head, level {acc}"] = _invariance(_session(49152, k, 8, acc), k)
    # what a call of T tokens costs the int8 build's layers: the same node at level 4 with M rows
    layer = _session(n, k, 4, 4, np.zeros(nz, np.uint8))
    out["rows"] = {m: _us(layer, k, 200, rows=m) for m in ROWS}
    return out


def _consistency(engine) -> float:
    ids = np.random.default_rng(0).integers(100, 40000, 60)
    engine.reset()
    engine.forward(ids[None, :50], np.arange(50)[None])
    one = np.array([engine.forward(ids[None, i:i + 1], np.array([[i]])).copy()[0, 0] for i in range(50, 55)])
    engine.reset()
    engine.forward(ids[None, :50], np.arange(50)[None])
    five = engine.forward(ids[None, 50:55], np.arange(50, 55)[None]).copy()[0]
    return float(np.abs(one - five).max())


def engines(paths: dict[str, Path], reps: int = 30, one_row: tuple[str, ...] = ()) -> dict:
    """Call times of each engine; those labelled in ``one_row`` planned for one row a call (an exact int8 build's
    decode graph for every call)."""
    from trtspec.engines import load_engine

    loaded = {label: load_engine(p, num_threads=2) for label, p in paths.items()}
    for label in one_row:
        loaded[label].plan_rows(1)
    for e in loaded.values():
        e.reset()
        e.forward(np.arange(100)[None] % 500 + 100, np.arange(100)[None])
    times = {label: {1: [], 5: []} for label in loaded}
    for _ in range(reps):
        for label, e in loaded.items():
            for t in (1, 5):
                start = time.perf_counter()
                e.forward(np.full((1, t), 300), np.arange(100, 100 + t)[None])
                times[label][t].append(time.perf_counter() - start)
    return {label: {"decode_ms": statistics.median(v[1]) * 1e3, "five_tokens_ms": statistics.median(v[5]) * 1e3,
                    "five_vs_one_at_a_time_max_logit_diff": _consistency(loaded[label])}
            for label, v in times.items()}


def without_minimums(export_dir: Path, out: Path) -> Path:
    import trtspec.builder.ort_lowering as lowering
    from trtspec import build

    original = lowering.gguf_linears

    def dropped(model, arrays, kept, accuracy_level=lowering.GGUF_ACCURACY_LEVEL):
        return original(model, arrays, {k: {**v, "minimums": False} for k, v in kept.items()}, accuracy_level)

    lowering.gguf_linears = dropped
    try:
        return build(export_dir, out)
    finally:
        lowering.gguf_linears = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2"))
    ap.add_argument("--int8-engine", type=Path, default=Path("engines/smollm2-int8x"))
    ap.add_argument("--export", type=Path, default=Path("export/smollm2"))
    args = ap.parse_args()
    result = {"nodes": nodes()}
    with tempfile.TemporaryDirectory() as tmp:
        paths, one_row = {"default": args.engine}, ()
        if args.int8_engine.exists():
            paths["--int8-activations"] = args.int8_engine
            manifest = json.loads((args.int8_engine / "manifest.json").read_text())
            if (manifest["build"].get("decode_graph") or {}).get("graph"):  # a session of one row a call
                one_row = ("--int8-activations, one row a call (its decode graph)",)
                paths[one_row[0]] = args.int8_engine
        if args.export.exists():
            paths["default, minimums' term dropped (wrong weights)"] = without_minimums(args.export, Path(tmp) / "e")
        result["engines"] = engines(paths, one_row=one_row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf-kernels.json").write_text(json.dumps(result, indent=2))
    lines = ["MatMulNBits, one node, 2 threads, one-token call (median us):", "",
             "| node | us |", "|---|---|"]
    lines += [f"| 1536x576 4-bit, {k} | {v:.1f} |" for k, v in result["nodes"]["layer"].items()]
    lines += [f"| 49152x576 head, {k} | {v:.1f} |" for k, v in result["nodes"]["head"].items()]
    lines += ["", "Rows one at a time against the same 5 rows in one call (max abs difference):", "",
              "| node | max diff |", "|---|---|"]
    lines += [f"| {k} | {v:.3g} |" for k, v in result["nodes"]["invariance"].items()]
    rows = result["nodes"]["rows"]
    lines += ["", "The 1536x576 4-bit layer at level 4 (uint8 zero points) with M rows a call (median us; a decode "
              "call of the int8 build runs 2 rows, its token and the pad; a verify of k drafts k + 1):", "",
              "| M | us | x one row |", "|---|---|---|"]
    lines += [f"| {m} | {v:.1f} | {v / rows[1]:.2f} |" for m, v in rows.items()]
    lines += ["", f"Engines ({args.engine.name}), position 100, 2 threads, medians of 30 interleaved calls:", "",
              "| build | decode ms | 5-token call ms | 5-token call vs one at a time: max logit diff |",
              "|---|---|---|---|"]
    lines += [f"| {k} | {v['decode_ms']:.2f} | {v['five_tokens_ms']:.2f} | {v['five_vs_one_at_a_time_max_logit_diff']:.3g} |"
              for k, v in result["engines"].items()]
    (RESULTS / "gguf-kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
