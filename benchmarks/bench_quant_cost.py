"""What quantization's speed-ups cost in accuracy: the same modes quantized the way trtspec did before (a
checkout given with --baseline) and with each choice of today's code, on the bundled trained target.

    python benchmarks/bench_quant_cost.py --baseline /tmp/old   # ~6 min on 2 cores; results/quant-cost.{json,md}

Variants of today's code (module settings, set for the run): the AWQ search's matmuls in float32 or in
bfloat16 (what ``numerics.search_dtype()`` picks where the CPU multiplies bfloat16 fast), and the AWQ
scale search on 2048 or 512 calibration rows per MatMul input. GPTQ has one variant (torch, float32; the
checkout before: numpy, float64). Each artifact is judged as written (Q/DQ run by onnxruntime without its
quantized kernels), as bench_quant.py does: perplexity on held-out texts, KL divergence from the float32
graph and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_quant import fidelity, log_probs, perplexity
from common import RESULTS, ROOT, WORK, save_results

MODES = {
    "int4-awq-b128": {"mode": "int4-awq", "block_size": 128},
    "int4-awq-b32+lm_head": {"mode": "int4-awq", "block_size": 32, "quantize_lm_head": True},
    "int4-gptq-b128": {"mode": "int4-gptq", "block_size": 128},
    "int4-gptq-b32+lm_head": {"mode": "int4-gptq", "block_size": 32, "quantize_lm_head": True},
}
VARIANTS = {  # name -> (search dtype, AWQ rows); GPTQ ignores both
    "float32 search, 2048 rows": ("float32", 2048),
    "bfloat16 search, 2048 rows": ("bfloat16", 2048),
    "bfloat16 search, 512 rows": ("bfloat16", 512),
}


def quantize_before(baseline: Path, src: Path, out: Path, options: dict) -> float:
    """Quantize with the baseline checkout's code, in its own process; returns its wall time."""
    code = (f"import sys, time; sys.path.insert(0, {str(baseline)!r}); from trtspec.quantization import quantize; "
            f"t = time.perf_counter(); quantize({str(src)!r}, {str(out)!r}, **{options!r}); "
            "print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=baseline)
    return float(done.stdout.strip().splitlines()[-1])


def main():
    import torch

    from trtspec import build, export, load_engine
    import importlib

    from trtspec.quantization import numerics, quantize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of trtspec before (git worktree add /tmp/old REV)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--eval-texts", type=int, default=64)
    parser.add_argument("--out", default="quant-cost")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    qmod = importlib.import_module("trtspec.quantization.quantize")  # its settings (the package exports the function)
    work = WORK / "quant-cost"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "stdlib-target")
    texts = json.loads((ROOT / "benchmarks" / "data" / "eval_text.json").read_text())["texts"][: args.eval_texts]
    windows = [np.asarray(tokenizer(t)["input_ids"][: args.window], dtype=np.int64) for t in texts]
    src = export(ROOT / "models" / "stdlib-target", work / "export" / "float32", max_seq_len=512, max_batch=1)

    def judge(exp: Path, name: str):
        exact = {"fuse_qdq": False} if name != "float32" else {}
        engine = load_engine(build(exp, work / "engines" / name, **exact), num_threads=2)
        return log_probs(engine, windows)

    reference = judge(src, "float32")
    base_ppl = perplexity(reference, windows)
    rows = []
    for mode, options in MODES.items():
        variants = {}
        if args.baseline:
            variants["before"] = None
        for name, setting in VARIANTS.items():
            if mode.startswith("int4-gptq") and name != "float32 search, 2048 rows":
                continue
            variants["torch, float32" if mode.startswith("int4-gptq") else name] = setting
        for variant, setting in variants.items():
            out = work / "export" / f"{mode}-{variant.replace(' ', '_').replace(',', '')}"
            if out.exists():
                shutil.rmtree(out)
            if setting is None:
                seconds = quantize_before(args.baseline.resolve(), src, out, options)
            else:
                dtype, rows_ = setting
                numerics._SEARCH_DTYPE = getattr(torch, dtype)
                qmod.AWQ_ROWS = rows_
                t = time.perf_counter()
                quantize(src, out, **options)
                seconds = time.perf_counter() - t
            logps = judge(out, out.name)
            ppl = perplexity(logps, windows)
            kl, top1 = fidelity(reference, logps)
            rows.append({"mode": mode, "variant": variant, "quantize_s": seconds, "ppl": ppl,
                         "ppl_change_pct": 100 * (ppl / base_ppl - 1), "kl": kl, "top1": top1})
            print(rows[-1], flush=True)
    lines = [f"Bundled target, perplexity on {len(windows)} held-out texts ({int(sum(map(len, windows)))} tokens), "
             f"float32 {base_ppl:.3f}; artifacts judged as written (Q/DQ, no fused kernels). Quantize time is this "
             "27M-parameter model's (the 0.5B shape's is in scale.md).", "",
             "| mode | variant | quantize s | ppl | change | KL to float32 | top-1 = float32 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['variant']} | {r['quantize_s']:.1f} | {r['ppl']:.3f} | "
                     f"{r['ppl_change_pct']:+.3f} % | {r['kl']:.2e} | {r['top1']:.4f} |")
    save_results(RESULTS / args.out, {"float32_ppl": base_ppl, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
