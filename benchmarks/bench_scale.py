"""Real sizes: a checkpoint shaped like Qwen2.5-0.5B (and 1.5B where memory allows) through every step.

    pip install onnxruntime-genai   # the comparison (optional extra `scale-bench`)
    python benchmarks/bench_scale.py                 # ~15 min on 2 cores; results/scale.{json,md}
    python benchmarks/bench_scale.py --shapes 0.5b 1.5b

The weights are random (a config's init, float32 safetensors): fine for time, memory and speed, which do not
depend on the values; the accuracy of each mode is measured on the trained bundled target instead
(bench_quant.py, bench_quant_cost.py). Every step runs in its own process, which reports its wall time and
peak RSS: export -> quantize (int4-rtn / int4-awq / int4-gptq, lm_head included: it is a tied 151,936 x H
table) -> build (onnxruntime) -> decode. onnxruntime-genai's model builder makes its float32 and int4 builds
of the same checkpoint in the same run, and decode speed is measured for all of them the same way, rounds
interleaved: a fresh process per engine and round, a 128-token prompt, then 64 greedy tokens, each token's
time = one model call + argmax (the median per token, then the median over rounds). The bandwidth bound is
the bytes of weights one decode token reads (the engine's initializers) over the read bandwidth measured in
the same run with both threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, WORK, memory_bandwidth_gbs, save_results

SHAPES = {  # Qwen2.5's published configs (tied embeddings, 151,936 tokens)
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}
QUANT_MODES = ("int4-rtn", "int4-awq", "int4-gptq")
PROMPT, NEW_TOKENS = 128, 64

STEP = """
import json, sys, time
argv = json.loads(sys.argv[1])
t = time.perf_counter()
if argv[0] == "genai-build":
    import runpy
    sys.argv = ["builder", *argv[1:]]
    try:
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code or 0
else:
    from trtspec.cli import main
    rc = main(argv)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it would report the parent's peak when larger
peak_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print("STEP " + json.dumps({"rc": rc, "seconds": time.perf_counter() - t, "peak_mb": peak_kb / 1024}))
"""

DECODE = """
import json, statistics, sys, time
import numpy as np
kind, path, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = (np.arange(prompt) * 7919 % 5000 + 10).astype(np.int64)
times = []
if kind == "trtspec":
    from trtspec import load_engine
    engine = load_engine(path, num_threads=2)
    logits = engine.forward(ids[None], np.arange(prompt)[None])
    nxt = int(logits[0, -1].argmax())
    for i in range(new):
        t = time.perf_counter()
        logits = engine.forward(np.array([[nxt]]), np.array([[prompt + i]]))
        nxt = int(logits[0, -1].argmax())
        times.append(time.perf_counter() - t)
else:
    import onnxruntime_genai as og
    model = og.Model(path)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt + new + 8, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids.tolist())
    for i in range(new):
        t = time.perf_counter()
        gen.generate_next_token()
        times.append(time.perf_counter() - t)
print("DECODE " + json.dumps({"token_ms": 1e3 * statistics.median(times[2:])}))
"""


def make_checkpoint(shape: str, out: Path) -> Path:
    """A random-init Qwen2 of the shape, float32 safetensors, with the tiny test tokenizer."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trtspec.testing import make_tokenizer

    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


def run_step(argv: list[str]) -> dict:
    """One step in its own process: {"seconds", "peak_mb"}."""
    done = subprocess.run([sys.executable, "-c", STEP, json.dumps(argv)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("STEP ")]
    if done.returncode or not lines or json.loads(lines[-1][5:])["rc"]:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][5:])
    print(f"  {' '.join(argv[:2])}: {result['seconds']:.1f} s, peak {result['peak_mb']:.0f} MB", flush=True)
    return result


def decode_ms(kind: str, path: Path) -> float:
    done = subprocess.run([sys.executable, "-c", DECODE, kind, str(path), str(PROMPT), str(NEW_TOKENS)],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("DECODE ")]
    if done.returncode or not lines:
        raise RuntimeError(f"decode {kind} {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][7:])["token_ms"]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def weight_bytes(path: Path) -> int:
    """Bytes of the graph's initializers (what a decode token reads: the tied table is read whole by the head)."""
    import onnx

    files = [f for f in Path(path).glob("*.onnx") if f.name != "decode.onnx"]
    proto = onnx.load(str(files[0]), load_external_data=False)
    total = 0
    for init in proto.graph.initializer:
        stored = {e.key: e.value for e in init.external_data}
        total += int(stored["length"]) if "length" in stored else len(init.raw_data)
    return total


def has_genai() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def bench_shape(shape: str, work: Path, rounds: int, max_seq_len: int) -> dict:
    hf = make_checkpoint(shape, work / "hf")
    params = sum(v for v in _param_count(hf).values())
    f32_bytes = 4 * params
    steps, engines = {}, {}
    export_dir = work / "export"
    if not (export_dir / "manifest.json").is_file():
        steps["export"] = run_step(["export", str(hf), "-o", str(export_dir), "--max-seq-len", str(max_seq_len),
                                    "--max-batch", "1"])
    arts = {"float32": export_dir}
    for mode in QUANT_MODES:
        out = work / f"export-{mode}"
        if not (out / "manifest.json").is_file():
            steps[f"quantize {mode}"] = run_step(["quantize", str(export_dir), "-o", str(out), "--mode", mode,
                                                  "--quantize-lm-head"])
        arts[mode] = out
    for name, art in arts.items():
        out = work / f"engine-{name}"
        if not (out / "manifest.json").is_file():
            steps[f"build {name}"] = run_step(["build", str(art), "-o", str(out)])
        engines[f"trtspec {name}"] = ("trtspec", out)
    if has_genai():
        for precision in ("fp32", "int4"):
            out = work / f"genai-{precision}"
            if not (out / "genai_config.json").is_file():
                steps[f"genai build {precision}"] = run_step(["genai-build", "-i", str(hf), "-o", str(out), "-p",
                                                              precision, "-e", "cpu", "-c", str(work / "genai-cache")])
                config = json.loads((out / "genai_config.json").read_text())
                config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 2
                (out / "genai_config.json").write_text(json.dumps(config, indent=4))
            engines[f"onnxruntime-genai {precision}"] = ("genai", out)
    for row in steps.values():
        row["peak_vs_float32_weights"] = row["peak_mb"] * 2**20 / f32_bytes
    bandwidth = memory_bandwidth_gbs(torch_threads=2)
    times = {name: [] for name in engines}
    for r in range(rounds):  # interleaved: a slow spell of this shared machine hits every engine
        for name, (kind, path) in engines.items():
            times[name].append(decode_ms(kind, path))
        print(f"  decode round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.1f} ms" for n, t in times.items()),
              flush=True)
    decode = {}
    for name, (kind, path) in engines.items():
        ms = statistics.median(times[name])
        nbytes = weight_bytes(path)
        bound = bandwidth * 1e9 / nbytes
        decode[name] = {"token_ms": ms, "token_ms_runs": times[name], "tok_s": 1e3 / ms, "weight_bytes": nbytes,
                        "artifact_bytes": dir_bytes(path), "bound_tok_s": bound, "of_bound": 1e3 / ms / bound}
    return {"parameters": params, "float32_weight_bytes": f32_bytes, "steps": steps, "decode": decode,
            "bandwidth_gbs": bandwidth, "max_seq_len": max_seq_len}


def _param_count(hf: Path) -> dict:
    from safetensors import safe_open

    counts = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                counts[key] = int(math.prod(shape))
    return counts


def table(results: dict) -> str:
    lines = []
    for shape, r in results.items():
        gb = r["float32_weight_bytes"] / 1e9
        lines += [f"### {shape} shape: {r['parameters'] / 1e6:.0f}M parameters, {gb:.2f} GB in float32 "
                  f"(random weights), max_seq_len {r['max_seq_len']}, batch 1, 2 threads", "",
                  "| step | time | peak RSS | peak / float32 weights |", "|---|---|---|---|"]
        for name, s in r["steps"].items():
            lines.append(f"| {name} | {s['seconds']:.1f} s | {s['peak_mb'] / 1024:.2f} GiB | "
                         f"{s['peak_vs_float32_weights']:.2f}x |")
        lines += ["", f"Decode after a {PROMPT}-token prompt, {NEW_TOKENS} greedy tokens, median per token, median of "
                  f"{len(next(iter(r['decode'].values()))['token_ms_runs'])} interleaved rounds; read bandwidth "
                  f"{r['bandwidth_gbs']:.1f} GB/s (2 threads, same run).", "",
                  "| engine | weights read per token | artifact | ms / token | tok/s | bandwidth bound tok/s | of bound |",
                  "|---|---|---|---|---|---|---|"]
        for name, d in r["decode"].items():
            lines.append(f"| {name} | {d['weight_bytes'] / 1e6:.0f} MB | {d['artifact_bytes'] / 1e6:.0f} MB | "
                         f"{d['token_ms']:.1f} | {d['tok_s']:.1f} | {d['bound_tok_s']:.1f} | {d['of_bound']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["0.5b"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--fresh", action="store_true", help="redo every step (default: reuse finished artifacts)")
    parser.add_argument("--out", default="scale")
    args = parser.parse_args()
    if not has_genai():
        print("onnxruntime-genai is not installed: its rows are left out (pip install onnxruntime-genai)")
    results = {}
    t0 = time.perf_counter()
    for shape in args.shapes:
        work = WORK / "scale" / shape
        if args.fresh and work.exists():
            import shutil

            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        print(f"{shape}:", flush=True)
        results[shape] = bench_shape(shape, work, args.rounds, args.max_seq_len)
    results["minutes"] = (time.perf_counter() - t0) / 60
    save_results(RESULTS / args.out, results, table({k: v for k, v in results.items() if k != "minutes"}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
