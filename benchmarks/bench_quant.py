"""Quantization modes on the bundled trained pair: perplexity, sizes, decode speed, draft acceptance, in one run.

    python benchmarks/bench_quant.py     # ~25 min on 2 cores; writes benchmarks/results/quant.{json,md}

Target (models/stdlib-target) exported in float32, quantized with every mode, each built twice for
onnxruntime: with onnxruntime's quantized kernels (the default engine) and with the Q/DQ nodes run as
written (`--no-qdq-fusion`: the artifact's exact numerics, what the accuracy targets are judged on).
- perplexity on benchmarks/data/eval_text.json (held-out files never used for calibration), first
  WINDOW tokens of each text, one prefill call per text; and, more sensitive on this pair whose own
  errors dwarf int4's, the mean KL divergence from the float32 graph's next-token distribution and how
  often both pick the same top-1 token;
- artifact size (model.onnx) and decode speed: the cost of a decode call at position 128 (median of 30)
  and greedy tokens/s (target only, 64 new tokens, 8 held-out prompts), each the median of 5 rounds
  that visit every engine in turn;
- the draft quantized to INT4: per-token acceptance alpha of greedy speculation (k = 4) against the
  float32 target on the 24 held-out prompts, vs the float32 draft.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT, WORK

# row name -> quantize() options
MODES = {"int8-wo": {"mode": "int8-wo"}, "int8-sq": {"mode": "int8-sq"}, "fp8": {"mode": "fp8"}}
for _b in (32, 64, 128):
    for _mode in ("int4-rtn", "int4-awq", "int4-gptq"):
        MODES[f"{_mode}-b{_b}"] = {"mode": _mode, "block_size": _b}
for _b in (32, 128):  # lm_head (8192 x 512, a third of the float32 bytes read per token) in INT4 too
    for _mode in ("int4-awq", "int4-gptq"):
        MODES[f"{_mode}-b{_b}+lm_head"] = {"mode": _mode, "block_size": _b, "quantize_lm_head": True}


def log_probs(engine, windows: list[np.ndarray]) -> list[np.ndarray]:
    """Next-token log-probabilities [T, V] of each window, one prefill call each."""
    out = []
    for ids in windows:
        engine.reset()
        logits = engine.forward(ids[None], np.arange(len(ids), dtype=np.int64)[None])[0].astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        out.append(logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True)))
    return out


def perplexity(logps: list[np.ndarray], windows: list[np.ndarray]) -> float:
    nll = sum(-lp[np.arange(len(ids) - 1), ids[1:]].sum() for lp, ids in zip(logps, windows))
    return math.exp(nll / sum(len(ids) - 1 for ids in windows))


def fidelity(reference: list[np.ndarray], logps: list[np.ndarray]) -> tuple[float, float]:
    """Mean KL(reference || quantized) per token, and how often both pick the same top-1 token."""
    kl = np.concatenate([(np.exp(r) * (r - q)).sum(axis=-1) for r, q in zip(reference, logps)])
    agree = np.concatenate([r.argmax(-1) == q.argmax(-1) for r, q in zip(reference, logps)])
    return float(kl.mean()), float(agree.mean())


def acceptance(target, draft, prompts, new_tokens: int) -> dict:
    from trtspec import Generator

    out = Generator(target, draft, num_draft_tokens=4, k_policy="fixed").generate(prompts, max_new_tokens=new_tokens)
    s = out.stats
    return {"alpha": s.token_acceptance, "accepted_per_proposed": s.acceptance_rate,
            "tokens_per_target_call": s.mean_tokens_per_target_call, "tokens": [r.token_ids for r in out]}


def main():
    from trtspec import Generator, build, export, load_engine
    from trtspec.bench import load_prompts, measure_call_costs
    from trtspec.quantization import quantize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--eval-texts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds (medians are quoted)")
    parser.add_argument("--modes", nargs="+", choices=["float32", *MODES],
                        help="rows to run (default: all; float32, the reference, always runs)")
    parser.add_argument("--out", default="quant", help="results name under benchmarks/results (default quant)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    modes = {name: MODES[name] for name in (args.modes or MODES) if name != "float32"}
    work = WORK / "quant"
    prompts = load_prompts(ROOT / "models" / "heldout.json")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "stdlib-target")
    texts = json.loads((ROOT / "benchmarks" / "data" / "eval_text.json").read_text())["texts"][: args.eval_texts]
    windows = [np.asarray(tokenizer(t)["input_ids"][: args.window], dtype=np.int64) for t in texts]

    start = time.perf_counter()
    exports = {"float32": export(ROOT / "models" / "stdlib-target", work / "export" / "float32", max_seq_len=512, max_batch=1)}
    draft_fp = export(ROOT / "models" / "stdlib-draft", work / "export" / "draft-float32", max_seq_len=512, max_batch=1)
    report = {}
    for name, options in modes.items():
        t = time.perf_counter()
        exports[name] = quantize(exports["float32"], work / "export" / name, **options)
        report[name] = {"quantize_s": time.perf_counter() - t}
        print(f"quantized {name} in {report[name]['quantize_s']:.1f} s", flush=True)
    report["float32"] = {"quantize_s": 0.0}

    rows, reference = {}, None
    for name, exp in exports.items():  # float32 first: the reference of the fidelity columns
        row = dict(report[name])
        manifest = json.loads((Path(exp) / "manifest.json").read_text())
        row["size_mb"] = (Path(exp) / "model.onnx").stat().st_size / 1e6
        fused = build(exp, work / "engines" / name)
        engine = load_engine(fused, num_threads=2)
        row["kernels"] = json.loads((Path(fused) / "manifest.json").read_text())["build"].get("kernels", {})
        row["ppl_engine"] = perplexity(log_probs(engine, windows), windows)
        if "quantization" in manifest:
            exact = build(exp, work / "engines" / f"{name}-qdq", fuse_qdq=False)
            exact_engine = load_engine(exact, num_threads=2)
            logps = log_probs(exact_engine, windows)
            del exact_engine
        else:
            logps = reference = log_probs(engine, windows)
        row["ppl_qdq"] = perplexity(logps, windows)
        row["kl_qdq"], row["top1_agreement_qdq"] = fidelity(reference, logps)
        rows[name] = row
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del engine

    # Speed, interleaved: every engine once per round, so a slow spell of this shared machine hits them all.
    engines = {name: load_engine(work / "engines" / name, num_threads=2) for name in exports}
    generators = {name: Generator(engine) for name, engine in engines.items()}
    for gen in generators.values():
        gen.generate(prompts[0], max_new_tokens=4)  # warm up
    calls, rates = {n: [] for n in engines}, {n: [] for n in engines}
    for rnd in range(args.rounds):
        for name, engine in engines.items():
            calls[name].append(measure_call_costs(engine, [1])[1] * 1e3)
            t0 = time.perf_counter()
            out = [generators[name].generate(p, max_new_tokens=args.new_tokens).token_ids for p in prompts[:8]]
            rates[name].append(sum(map(len, out)) / (time.perf_counter() - t0))
        print(f"speed round {rnd + 1}/{args.rounds}", flush=True)
    for name, row in rows.items():
        row["decode_ms"], row["decode_ms_runs"] = statistics.median(calls[name]), calls[name]
        row["greedy_tok_s"], row["greedy_tok_s_runs"] = statistics.median(rates[name]), rates[name]
    del engines, generators

    base = rows["float32"]
    for row in rows.values():
        row["ppl_qdq_change_pct"] = 100 * (row["ppl_qdq"] / base["ppl_qdq"] - 1)
        row["ppl_engine_change_pct"] = 100 * (row["ppl_engine"] / base["ppl_engine"] - 1)
        row["decode_speedup"] = base["decode_ms"] / row["decode_ms"]
        row["greedy_speedup"] = row["greedy_tok_s"] / base["greedy_tok_s"]

    # The draft in INT4 against the float32 target.
    target = load_engine(build(exports["float32"], work / "engines" / "float32"), num_threads=2)
    drafts = {"float32": draft_fp}
    for mode in ("int4-rtn", "int4-awq"):
        drafts[mode] = quantize(draft_fp, work / "export" / f"draft-{mode}", mode=mode, block_size=32)
    # the draft's lm_head is tied to its embedding: both in INT4, one copy
    drafts["int4-awq+lm_head"] = quantize(draft_fp, work / "export" / "draft-int4-awq+lm_head", mode="int4-awq",
                                          block_size=32, quantize_lm_head=True)
    draft_rows = {}
    for name, exp in drafts.items():
        engine = load_engine(build(exp, work / "engines" / f"draft-{name}"), num_threads=2)
        draft_rows[name] = acceptance(target, engine, prompts, 128)
        draft_rows[name]["draft_decode_ms"] = measure_call_costs(engine, [1])[1] * 1e3
        draft_rows[name]["size_mb"] = (Path(exp) / "model.onnx").stat().st_size / 1e6
    target_only = Generator(target).generate(prompts, max_new_tokens=128)
    for name, row in draft_rows.items():
        row["lossless"] = row.pop("tokens") == [r.token_ids for r in target_only]
        row["alpha_change_points"] = 100 * (row["alpha"] - draft_rows["float32"]["alpha"])
        print("draft", name, row, flush=True)

    result = {"target": rows, "draft": draft_rows, "eval": {"texts": len(windows), "tokens": int(sum(map(len, windows))),
              "window": args.window}, "minutes": (time.perf_counter() - start) / 60}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"Target perplexity on {len(windows)} held-out texts ({result['eval']['tokens']} tokens); decode = one call "
        f"at position 128; greedy = 8 prompts x 64 tokens; both medians of {args.rounds} interleaved rounds.",
        "",
        "| mode | size MB | ppl (Q/DQ as written) | change | KL to float32 | top-1 = float32 | ppl (onnxruntime engine) | "
        "change | engine kernels | decode ms | vs float32 | greedy tok/s | vs float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        kernels = ", ".join(f"{k} {v}" for k, v in r["kernels"].items()) or "-"
        lines.append(f"| {name} | {r['size_mb']:.1f} | {r['ppl_qdq']:.3f} | {r['ppl_qdq_change_pct']:+.3f} % | "
                     f"{r['kl_qdq']:.2e} | {r['top1_agreement_qdq']:.4f} | {r['ppl_engine']:.3f} | "
                     f"{r['ppl_engine_change_pct']:+.3f} % | {kernels} | {r['decode_ms']:.2f} | "
                     f"{r['decode_speedup']:.2f}x | {r['greedy_tok_s']:.1f} | {r['greedy_speedup']:.2f}x |")
    lines += ["", "Draft quantized (block 32), speculative greedy k=4 against the float32 target, 24 held-out prompts x 128 tokens:",
              "", "| draft | size MB | draft decode ms | alpha | change (points) | accepted/proposed | tokens/target call | lossless |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in draft_rows.items():
        lines.append(f"| {name} | {r['size_mb']:.1f} | {r['draft_decode_ms']:.2f} | {r['alpha']:.3f} | "
                     f"{r['alpha_change_points']:+.1f} | {r['accepted_per_proposed']:.3f} | {r['tokens_per_target_call']:.2f} | "
                     f"{r['lossless']} |")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
