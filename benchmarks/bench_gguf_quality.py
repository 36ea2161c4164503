"""How far each build of a GGUF export predicts from its float32 build, teacher-forced on real text.

    python benchmarks/bench_gguf_quality.py --engine default=engines/smollm2 --engine int8=engines/smollm2-int8x \
        --float engines/smollm2-float [--problems 32] [--out benchmarks/results/gguf-quality] [--llama-bin DIR]

Every engine reads the same texts (HumanEval problems with their canonical solutions, each in one prefill call)
and gives its next-token logits at every position; against the float32 build of the same file's weights
(`trtspec build --weights float`, which equals transformers' float32) each engine is scored by top-1 agreement,
mean KL(float || engine) in nats, and the largest logit difference. Greedy output compared over whole generations
(bench_real.py's "= HF fp32") says the same thing more coarsely: one early disagreement decides a prompt.

With --llama-bin (llama.cpp built as LLAMA_CPP.md says, with the llama-perplexity and llama-quantize targets), llama.cpp's
own numerics beside ours, on the same tokens and positions: llama-perplexity's KL-divergence mode runs the GGUF
against llama.cpp's F32 of the same file (`llama-quantize --allow-requantize GGUF F32`, the file's weights
dequantized by llama.cpp), over all 164 HumanEval problems with their solutions in one text, in chunks of 512
tokens whose second halves are scored; each engine then reads the very tokens llama.cpp read (from its base file)
and is scored the same way against the float32 build: mean, median, 99th-percentile and largest KL, and how often
the top token is the reference's (llama-perplexity's "Same top p").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
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


CHUNK = 512  # llama-perplexity's -c: tokens a chunk; its second half is scored


def llama_numerics(llama_bin: Path, work: Path) -> dict:
    """llama.cpp's GGUF against its F32 of the same file over the HumanEval text: its KL statistics and the tokens
    and chunking it read (the base file's header: "_logits_", n_ctx, n_vocab, n_chunk, then the tokens)."""
    from bench_real import humaneval_problems, smollm2_gguf

    gguf = smollm2_gguf()
    work.mkdir(parents=True, exist_ok=True)
    f32, text, base = work / "f32.gguf", work / "humaneval.txt", work / "base.dat"
    if not f32.is_file():
        subprocess.run([str(llama_bin / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32", "2"],
                       check=True, capture_output=True)
    text.write_text("\n\n".join(p["prompt"] + p["canonical_solution"] for _, p in humaneval_problems(164)))
    ppl = [str(llama_bin / "llama-perplexity"), "-f", str(text), "-c", str(CHUNK), "-b", str(CHUNK), "-t", "2",
           "--kl-divergence-base", str(base)]
    for model, extra, log in ((f32, [], "f32.log"), (gguf, ["--kl-divergence"], "gguf.log")):
        out = subprocess.run(ppl[:1] + ["-m", str(model)] + ppl[1:] + extra, capture_output=True, text=True)
        (work / log).write_text(out.stdout + out.stderr)
        if out.returncode:
            raise SystemExit(f"llama-perplexity failed (log: {work / log})")
    log = (work / "gguf.log").read_text()

    def stat(name):
        return float(re.search(rf"{re.escape(name)}:\s*(-?[0-9.]+)", log).group(1))

    head = np.fromfile(base, np.int32, count=3, offset=8)
    n_ctx, n_chunk = int(head[0]), int(head[2])
    tokens = np.fromfile(base, np.int32, count=n_ctx * n_chunk, offset=20).reshape(n_chunk, n_ctx)
    return {"mean_kl_nats": stat("Mean    KLD"), "median_kl_nats": stat("Median  KLD"), "p99_kl_nats": stat("99.0%   KLD"),
            "max_kl_nats": stat("Maximum KLD"), "top1_agreement": stat("Same top p") / 100,
            "positions": n_chunk * (n_ctx - 1 - n_ctx // 2), "tokens": tokens.astype(np.int64), "gguf": str(gguf)}


def ours_on_chunks(float_dir: Path, engines: dict[str, Path], tokens: np.ndarray) -> dict:
    """Each engine against the float32 build on llama-perplexity's chunks and scored positions."""
    from gguf import GGUFReader

    from bench_real import smollm2_gguf
    from trtspec.engines import load_engine

    fields = GGUFReader(str(smollm2_gguf())).fields
    if "tokenizer.ggml.add_bos_token" in fields and bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0]):
        tokens = tokens.copy()  # (llama-perplexity puts BOS in each chunk's first slot)
        tokens[:, 0] = int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0])
    n_ctx, first = tokens.shape[1], tokens.shape[1] // 2
    loaded = {label: load_engine(path, num_threads=2) for label, path in {"float": float_dir, **engines}.items()}
    kl = {label: [] for label in engines}
    same = {label: [] for label in engines}
    for row in tokens:
        lp = {}
        for label, engine in loaded.items():
            engine.reset()
            lp[label] = _log_softmax(engine.forward(row[None], np.arange(n_ctx)[None])[0][first:-1].astype(np.float64))
        for label in engines:
            kl[label].append((np.exp(lp["float"]) * (lp["float"] - lp[label])).sum(-1))
            same[label].append(lp["float"].argmax(-1) == lp[label].argmax(-1))
    out = {}
    for label in engines:
        k = np.concatenate(kl[label])
        out[label] = {"engine": str(engines[label]), "mean_kl_nats": float(k.mean()), "median_kl_nats": float(np.median(k)),
                      "p99_kl_nats": float(np.percentile(k, 99)), "max_kl_nats": float(k.max()),
                      "top1_agreement": float(np.concatenate(same[label]).mean()), "positions": int(k.size)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--float", type=Path, required=True, help="the float32 build of the same export (--weights float)")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf-quality")
    ap.add_argument("--llama-bin", type=Path,
                    help="llama.cpp's bin directory (llama-perplexity, llama-quantize): its numerics beside ours")
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
    if args.llama_bin is not None:
        from bench_real import WORKDIR

        llama = llama_numerics(args.llama_bin, WORKDIR / "llama-quality")
        ours = ours_on_chunks(args.float, {label: Path(path) for label, _, path in
                                           (spec.partition("=") for spec in args.engine)}, llama.pop("tokens"))
        result["llama_chunks"] = {"chunk": CHUNK, "llama.cpp": llama, "engines": ours}
        print(f"llama.cpp: {llama}\n{ours}", flush=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"Teacher-forced on {args.problems} HumanEval problems with their canonical solutions "
             f"({rows[next(iter(rows))]['positions']} positions), each engine against the float32 build "
             f"`{args.float}` (`benchmarks/bench_gguf_quality.py`).", "",
             "| engine | top-1 agreement | mean KL (nats) | max logit difference |", "|---|---|---|---|"]
    lines += [f"| {label} (`{r['engine']}`) | {r['top1_agreement']:.4f} | {r['mean_kl_nats']:.5f} | {r['max_logit_diff']:.3f} |"
              for label, r in rows.items()]
    if "llama_chunks" in result:
        chunks = result["llama_chunks"]
        llama = chunks["llama.cpp"]
        lines += ["", f"On llama-perplexity's chunks ({llama['positions']} positions: the 164 HumanEval problems with "
                  f"their solutions as one text, chunks of {chunks['chunk']} tokens, second halves scored), each "
                  "against its own float reference of the same weights: llama.cpp's run of the GGUF against its F32 "
                  "of the file (`llama-quantize --allow-requantize`), ours against the float32 build.", "",
                  "| system | same top token | mean KL (nats) | median KL | 99th percentile KL | largest KL |",
                  "|---|---|---|---|---|---|"]
        for label, r in [("llama.cpp (`llama-perplexity --kl-divergence`)", llama),
                         *((f"trtspec {label} (`{r['engine']}`)", r) for label, r in chunks["engines"].items())]:
            lines.append(f"| {label} | {r['top1_agreement']:.4f} | {r['mean_kl_nats']:.5f} | {r['median_kl_nats']:.5f} | "
                         f"{r['p99_kl_nats']:.4f} | {r['max_kl_nats']:.4f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
