"""A sampled token's host work over a 49,152-token vocabulary: coupled sampling's pick and top-p's distribution, the
runtime's way against the full computation each replaced (the same results, checked here on every row).

    python benchmarks/bench_picks.py [--rows 16] [--calls 200] [--engine DIR] [--out picks]

Rows of float32 logits drawn N(0, 4^2) (fixed seed), or with --engine a model's own (its prefill of the first
held-out prompt, the first --rows positions), temperature 0.8, top-p 0.9, one thread:
- coupled pick: picks.coupled_pick with the compiled kernels' candidates, against the full Gumbel-max pick (G for
  every token in numpy, then the first maximum of x / T + G);
- top-p: SamplingParams.probs, which sorts only the head of the distribution, against a stable sort of the whole
  vocabulary (the definition, as the tests' reference writes it);
- a coupled pick's support (the ids it scores) under top-p 0.9 and under top-k 50: SamplingParams.support against
  np.flatnonzero(SamplingParams.probs), the way it was found before.
Medians of --calls calls per row, the two ways alternating row by row; writes benchmarks/results/<--out>.{json,md}
with the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_oracle import cpu_info  # noqa: E402
from common import RESULTS, median_time  # noqa: E402

V, TEMPERATURE, TOP_P, TOP_K = 49152, 0.8, 0.9, 50


def _full_pick(x: np.ndarray, key: int, position: int) -> int:
    from trtspec.runtime.picks import gumbel_noise_host

    return int((x.astype(np.float64) / TEMPERATURE + gumbel_noise_host(key, position, x.size)).argmax())


def _full_top_p(params, x: np.ndarray) -> np.ndarray:
    from trtspec.runtime.sampling import SamplingParams

    p = SamplingParams(temperature=params.temperature).probs(x)
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    drop = np.zeros(p.size, dtype=bool)
    drop[order] = (np.cumsum(sorted_p) - sorted_p) >= params.top_p
    p = np.where(drop, 0.0, p)
    return p / p.sum()


def _engine_logits(engine_dir: str, rows: int) -> np.ndarray:
    from common import ROOT

    from trtspec import Generator, load_engine
    from trtspec.bench import load_prompts

    engine = load_engine(engine_dir, num_threads=1)
    gen = Generator(engine, drafter="none")
    prompt = next(p for p in load_prompts(ROOT / "models" / "heldout.json")
                  if len(gen.tokenizer(p)["input_ids"]) >= rows)
    ids = gen.tokenizer(prompt)["input_ids"][:rows]
    gen.close()
    engine.reset()
    return engine.forward(np.array([ids]), np.arange(len(ids))[None])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--engine", help="logits from this engine's prefill of a held-out prompt (its vocabulary)")
    ap.add_argument("--out", default="picks")
    args = ap.parse_args()
    import torch

    from trtspec import kernels
    from trtspec.runtime.picks import coupled_pick
    from trtspec.runtime.sampling import SamplingParams

    torch.set_num_threads(1)
    if kernels.load() != "native":
        sys.exit("the compiled kernels could not be built here: the candidates need them")
    rng = np.random.default_rng(0)
    real = _engine_logits(args.engine, args.rows) if args.engine else None
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    top_k = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
    times: dict[str, list[float]] = {name: [] for name in ("pick", "full pick", "top-p", "full top-p", "top-p support",
                                                           "top-p nonzero", "top-k support", "top-k nonzero")}
    for row in range(args.rows):
        x = (rng.standard_normal(V) * 4).astype(np.float32) if real is None else real[row]
        key, position = 1000 + row, 17 * row
        if coupled_pick(x, TEMPERATURE, key, position) != _full_pick(x, key, position):
            sys.exit(f"row {row}: the picks differ")
        if not np.array_equal(params.probs(x), _full_top_p(params, x)):
            sys.exit(f"row {row}: the top-p distributions differ")
        times["pick"].append(1e6 * median_time(lambda: coupled_pick(x, TEMPERATURE, key, position), args.calls))
        times["full pick"].append(1e6 * median_time(lambda: _full_pick(x, key, position), args.calls))
        times["top-p"].append(1e6 * median_time(lambda: params.probs(x), args.calls))
        times["full top-p"].append(1e6 * median_time(lambda: _full_top_p(params, x), max(10, args.calls // 10)))
        for name, prm in (("top-p", params), ("top-k", top_k)):
            if not np.array_equal(prm.support(x), np.flatnonzero(prm.probs(x))):
                sys.exit(f"row {row}: the {name} supports differ")
            times[f"{name} support"].append(1e6 * median_time(lambda: prm.support(x), args.calls))
            times[f"{name} nonzero"].append(1e6 * median_time(lambda: np.flatnonzero(prm.probs(x)), args.calls))
    cpu = cpu_info(1)
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {"cpu": cpu, "logits": args.engine or "N(0, 4^2)", "vocab": V, "temperature": TEMPERATURE,
              "top_p": TOP_P, "top_k": TOP_K, "rows": args.rows, "calls": args.calls, "median_us": med,
              "per_row_us": times}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    text = "\n".join([
        f"A sampled token's host work, {V}-token rows of {args.engine or 'N(0, 4^2)'} float32 logits, "
        f"T = {TEMPERATURE}, top-p {TOP_P}, top-k {TOP_K}; "
        f"medians over {args.rows} rows of each row's median call, the same results checked on every row. CPU: "
        f"{cpu['cpu']}; ISA: {' '.join(cpu['isa'])}; 1 thread.", "",
        "| work | the runtime's way (us) | the full computation (us) | ratio |", "|---|---|---|---|",
        f"| coupled pick | {med['pick']:.1f} | {med['full pick']:.1f} | {med['full pick'] / med['pick']:.1f}x |",
        f"| top-p distribution | {med['top-p']:.1f} | {med['full top-p']:.1f} | "
        f"{med['full top-p'] / med['top-p']:.1f}x |",
        *(f"| a pick's support, {name} (np.flatnonzero(probs) before) | {med[name + ' support']:.1f} | "
          f"{med[name + ' nonzero']:.1f} | {med[name + ' nonzero'] / med[name + ' support']:.1f}x |"
          for name in ("top-p", "top-k")), ""])
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
