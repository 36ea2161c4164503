"""How far each build of a GGUF export predicts from its float32 build, teacher-forced on real text.

    python benchmarks/bench_gguf_quality.py --engine default=engines/smollm2 --engine int8=engines/smollm2-int8x \
        --float engines/smollm2-float [--problems 32] [--out benchmarks/results/gguf-quality]

Every engine reads the same texts (HumanEval problems with their canonical solutions, each in one prefill call)
and gives its next-token logits at every position; against the float32 build of the same file's weights
(`trtspec build --weights float`, which equals transformers' float32) each engine is scored by top-1 agreement,
mean KL(float || engine) in nats, and the largest logit difference. Greedy output compared over whole generations
(bench_real.py's "= HF fp32") says the same thing more coarsely: one early disagreement decides a prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"


def texts(n: int) -> list[str]:
    from bench_real import humaneval_problems

    return [p["prompt"] + p["canonical_solution"] for _, p in humaneval_problems(n)]


def logits(engine_dir: Path, ids: list[list[int]]) -> list[np.ndarray]:
    from trtspec.engines import load_engine

    engine = load_engine(engine_dir, num_threads=2)
    out = []
    for seq in ids:
        engine.reset()
        out.append(engine.forward(np.array([seq]), np.arange(len(seq))[None])[0].astype(np.float64).copy())
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    agree, kl, worst, n = 0, 0.0, 0.0, 0
    for r, g in zip(ref, got):
        lp, lq = _log_softmax(r), _log_softmax(g)
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        kl += float((np.exp(lp) * (lp - lq)).sum())
        worst = max(worst, float(np.abs(r - g).max()))
        n += r.shape[0]
    return {"positions": n, "top1_agreement": agree / n, "mean_kl_nats": kl / n, "max_logit_diff": worst}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--float", type=Path, required=True, help="the float32 build of the same export (--weights float)")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf-quality")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.float / "tokenizer")
    ids = [tokenizer.encode(t)[:1024] for t in texts(args.problems)]
    ref = logits(args.float, ids)
    rows = {}
    for spec in args.engine:
        label, _, path = spec.partition("=")
        rows[label] = {"engine": path, **compare(ref, logits(Path(path), ids))}
        print(f"{label}: {rows[label]}", flush=True)
    result = {"problems": args.problems, "float": str(args.float), "engines": rows}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"Teacher-forced on {args.problems} HumanEval problems with their canonical solutions "
             f"({rows[next(iter(rows))]['positions']} positions), each engine against the float32 build "
             f"`{args.float}` (`benchmarks/bench_gguf_quality.py`).", "",
             "| engine | top-1 agreement | mean KL (nats) | max logit difference |", "|---|---|---|---|"]
    lines += [f"| {label} (`{r['engine']}`) | {r['top1_agreement']:.4f} | {r['mean_kl_nats']:.5f} | {r['max_logit_diff']:.3f} |"
              for label, r in rows.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
