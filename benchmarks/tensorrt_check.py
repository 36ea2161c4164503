"""End-to-end check of the TensorRT backend, for a machine with TensorRT 11 and an NVIDIA GPU.

    python benchmarks/tensorrt_check.py [--work DIR] [--dtype float16] [--verify-tokens 2,3,5,9]

It makes two tiny random Llamas offline (target and draft), exports them,
runs `trtspec check`, builds onnxruntime and TensorRT engines, then:
  1. compares TensorRT logits with onnxruntime's (prefill, decode, each verify size),
  2. times a decode call and a call of each verify profile,
  3. runs speculative generation with TensorRT target and draft, and checks that
     greedy output equals the target's own greedy decoding.
Nothing here runs without TensorRT; importing this file does nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def _require_tensorrt():
    try:
        import tensorrt
    except Exception as e:
        sys.exit(f"tensorrt_check needs TensorRT 11 and an NVIDIA GPU; `import tensorrt` failed here: {e}")
    return tensorrt


def _artifacts(work: Path, dtype: str, verify_tokens: list[int]):
    from trtspec import build, export
    from trtspec.builder.tensorrt_check import check_export, format_report
    from trtspec.testing import make_tiny_model

    out = {}
    for role, seed in (("target", 0), ("draft", 1)):
        hf = make_tiny_model("llama", work / f"hf-{role}", seed=seed)
        exp = export(hf, work / f"export-{role}", max_seq_len=256, max_batch=4, dtype=dtype)
        problems = check_export(exp)
        print(format_report(exp, problems))
        if problems:
            sys.exit(1)
        out[role] = {
            "onnxruntime": build(exp, work / f"engine-{role}-ort"),
            "tensorrt": build(exp, work / f"engine-{role}-trt", backend="tensorrt", verify_tokens=verify_tokens,
                              timing_cache=work / "timing.cache"),
        }
    return out


def compare_logits(ort, trt, verify_tokens: list[int]):
    """Same calls on both engines, from an empty cache: prefill 7, decode 1, then each verify size."""
    # calls: input_ids [B, T] int64 at consecutive positions per row
    rng = np.random.default_rng(0)
    b, pos = 2, 0
    print("call            max|diff|   argmax agreement")
    for label, t in [("prefill 7", 7), ("decode", 1), *((f"verify {t}", t) for t in verify_tokens)]:
        ids = rng.integers(3, ort.vocab_size, size=(b, t))
        positions = np.tile(np.arange(pos, pos + t), (b, 1))
        a = ort.forward(ids, positions).astype(np.float32)
        c = trt.forward(ids, positions).astype(np.float32)
        agree = float(np.mean(a.argmax(-1) == c.argmax(-1)))
        print(f"{label:<14} {np.abs(a - c).max():10.4f}   {agree:.3f}")
        pos += t


def speculative(target_dir, draft_dir, k: int):
    from trtspec import Generator

    prompts = ["def add(a, b):", "The quick brown fox"]
    plain = Generator(target_dir).generate(prompts, max_new_tokens=64)
    spec = Generator(target_dir, draft_dir, num_draft_tokens=k, k_policy="fixed").generate(prompts, max_new_tokens=64)
    same = all(p.token_ids == s.token_ids for p, s in zip(plain, spec))
    s = spec.stats
    print(f"plain:       {plain.stats.tokens_per_s:8.1f} tok/s, {plain.stats.target_calls} target calls")
    print(f"speculative: {s.tokens_per_s:8.1f} tok/s, {s.target_calls} target calls, acceptance {s.acceptance_rate:.2f}, "
          f"{s.mean_tokens_per_target_call:.2f} tokens/target call, accepted per round {s.accepted_histogram}")
    print(f"greedy output identical to the target's own: {same}")
    return same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("models/bench/tensorrt_check"))
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--verify-tokens", default="2,3,5,9", help="tokens per verify call (k+1), comma-separated")
    args = parser.parse_args(argv)
    trt_module = _require_tensorrt()
    from trtspec import load_engine
    from trtspec.bench import measure_call_costs

    verify = [int(v) for v in args.verify_tokens.split(",")]
    print(f"TensorRT {trt_module.__version__}")
    built = _artifacts(args.work, args.dtype, verify)
    ort = load_engine(built["target"]["onnxruntime"])
    trt = load_engine(built["target"]["tensorrt"])
    compare_logits(ort, trt, verify)
    for batch in (1, trt.max_batch):
        times = measure_call_costs(trt, [1, *verify], position=16, repeats=50, batch=batch, warmup=3)
        decode = times[1]
        cells = ", ".join(f"T={t}: {s * 1e3:.3f} ms (x{s / decode:.2f})" for t, s in times.items())
        print(f"TensorRT, batch {batch}: {cells}")
    ok = speculative(built["target"]["tensorrt"], built["draft"]["tensorrt"], k=verify[-1] - 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
