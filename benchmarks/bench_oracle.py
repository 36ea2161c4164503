"""Speculation with a drafter of known acceptance: what the runtime makes of it against what it could.

    python benchmarks/bench_oracle.py [--engine engines/smollm2-torch-int8x] [--prompts 4] [--new 96]

The oracle (a benchmark's drafter, not a user's) knows the target's own greedy continuation of each prompt (a
target-alone run first) and proposes each of its k tokens right with probability a, independently (a wrong one:
the right id + 1). So a chain's acceptance is geometric with rate a, E[tokens a call] = (1 - a^(k+1)) / (1 - a),
and the ideal speed-up is E x T1 / T(k+1) from the engine's measured call costs (T(k+1): a verify call of k + 1
tokens). Every configuration's output must equal the target alone. Measured: tok/s against the target alone (the
engine's own greedy loop), tokens a target call, and the fraction of the ideal reached. ``oracle_rows`` is the
measurement; gpu_check.py's oracle stage runs it on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from common import ROOT

A_VALUES, K_VALUES = (0.6, 0.8), (2, 4, 8)


def oracle_class(references, a: float, seed: int = 0):
    """A Drafter class (drafters/base.py) proposing from ``references`` (full greedy sequences: prompt ids then the
    target's continuation): at a row whose tokens are a reference's prefix, each next token right with probability
    ``a``."""
    from trtspec.runtime.drafters.base import Drafter, Proposal

    refs = [np.asarray(r, np.int64) for r in references]

    class Oracle(Drafter):
        name = "oracle"
        proposes_drafts = True

        def __init__(self, vocab: int):
            self.vocab, self.rng = vocab, np.random.default_rng(seed)

        @classmethod
        def make(cls, *, target, **_):
            return cls(target.vocab_size)

        def propose(self, tokens, n, caps, samplers, capacity):
            b, k = n.size, int(caps.max()) if caps.size else 0
            drafts, counts = np.zeros((b, k), np.int64), np.zeros(b, np.int64)
            for s in range(b):
                m = int(n[s])
                ref = next((r for r in refs if r.size > m and np.array_equal(r[:m], tokens[s, :m])), None)
                if ref is None:
                    continue
                truth = ref[m : m + int(caps[s])]
                right = self.rng.random(truth.size) < a
                drafts[s, : truth.size] = np.where(right, truth, (truth + 1) % self.vocab)
                counts[s] = truth.size
            return Proposal(drafts, counts)

    return Oracle


def first_difference(got, want) -> int | None:
    """The first index where two token lists differ (one's end counts), or None where they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def call_costs(engine, sizes, *, position: int, repeats: int) -> dict[int, float]:
    """Median seconds of a chain call of T tokens as the runtime makes it: the logits left where the engine makes
    them and the argmax ids read back (the sync a round pays), at ``position``."""
    kw = {"as_tensor": True} if getattr(engine, "tensor_logits", False) else {}
    costs = {}
    for t in sizes:
        ids, pos = np.ones((1, t), np.int64), np.arange(position, position + t)[None]
        times = []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            logits = engine.forward(ids, pos, **kw)
            logits.argmax(-1).tolist()
            if i >= 3:  # (warm-up calls: a first call of a shape may capture a CUDA graph)
                times.append(time.perf_counter() - t0)
        costs[t] = statistics.median(times)
    return costs


def oracle_rows(engine, prompts, new_tokens: int, *, a_values=A_VALUES, k_values=K_VALUES, runs: int = 3,
                call_repeats: int = 20, position: int = 128, log=print, keep_outputs: bool = False) -> dict:
    """The oracle's configurations against the target alone on one engine (greedy, batch 1, prompts one after
    another): a dict with the measured call costs and one row per (a, k); ``keep_outputs``: also the prompts' ids,
    the target alone's tokens (``references``) and each row's drafted ``outputs``."""
    from trtspec import Generator
    from trtspec.kernels import release_openmp_workers
    from trtspec.runtime import drafters as drafters_module
    from trtspec.runtime.verify import expected_tokens_per_call

    sizes = sorted({1, *(k + 1 for k in k_values)})
    costs = call_costs(engine, sizes, position=position, repeats=call_repeats)
    # this thread's OpenMP workers (its calls above) would spin beside the scheduler's and slow every round's calls
    # (about 1.8x, seen here: kernels.release_openmp_workers)
    release_openmp_workers()

    def rate(options) -> tuple[float, list, int, float]:
        """A Generator's (tok/s, outputs, target calls, ms a decoding call took inside the generations); the
        Generator is closed after (two alive keep two OpenMP pools, which slows both)."""
        gen = Generator(engine, **options)
        rates = []
        for _ in range(runs):
            t0 = time.perf_counter()
            out = [gen.generate([p], max_new_tokens=new_tokens) for p in prompts]  # (one at a time: batch 1)
            rates.append(sum(len(o[0].token_ids) for o in out) / (time.perf_counter() - t0))
        gen.close()
        decode_calls = sum(o.stats.rounds for o in out)
        return (statistics.median(rates), [o[0].token_ids for o in out], sum(o.stats.target_calls for o in out),
                1e3 * sum(o.stats.verify_s for o in out) / max(decode_calls, 1))

    alone = {"drafter": "none"}  # (an engine that carries a head drafts with it by default)
    gen = Generator(engine, **alone)
    ids = [gen.tokenizer(p)["input_ids"] for p in prompts]
    want = [gen.generate(p, max_new_tokens=new_tokens).token_ids for p in prompts]
    gen.close()
    references = [list(i) + w for i, w in zip(ids, want)]
    result = {"call_ms": {str(t): c * 1e3 for t, c in costs.items()}, "rows": []}
    if keep_outputs:
        result.update(prompt_ids=[list(i) for i in ids], references=want)
    for a in a_values:
        for k in k_values:
            base, got, _, base_call_ms = rate(alone)  # the target alone beside each configuration, in turn
            drafters_module.REGISTRY["oracle"] = oracle_class(references, a)
            try:
                tok_s, out, calls, call_ms = rate({"drafter": "oracle", "num_draft_tokens": k, "k_policy": "fixed"})
            finally:
                drafters_module.REGISTRY.pop("oracle", None)
            expected = expected_tokens_per_call(a, k)
            ideal = expected * costs[1] / costs[k + 1]
            row = {"a": a, "k": k, "tok_s": tok_s, "alone_tok_s": base, "speedup": tok_s / base,
                   "tokens_per_call": sum(map(len, out)) / calls, "expected_tokens_per_call": expected,
                   "ideal_speedup": ideal, "fraction_of_ideal": tok_s / base / ideal,
                   "equals_target_alone": out == want and got == want, "alone_call_ms": base_call_ms,
                   # per prompt, the first token where the drafted run (and the alone run again) left the reference
                   "first_difference": [first_difference(o, w) for o, w in zip(out, want)],
                   "alone_first_difference": [first_difference(o, w) for o, w in zip(got, want)],
                   "call_ms_in_rounds": call_ms,
                   # the ideal again from the calls' cost inside the generations, the alone loop's and the rounds'
                   "ideal_in_rounds": expected * base_call_ms / call_ms}
            if keep_outputs:
                row["outputs"] = out
            result["rows"].append(row)
            log(f"  a={a} k={k}: {tok_s:.1f} tok/s ({row['speedup']:.2f}x the target alone's {base:.1f}), "
                f"{row['tokens_per_call']:.2f} tokens a call (E {expected:.2f}), ideal {ideal:.2f}x -> "
                f"{row['fraction_of_ideal']:.2f} of it, equal: {row['equals_target_alone']}")
    result["target_alone_tok_s"] = statistics.median(r["alone_tok_s"] for r in result["rows"])
    return result


def cpu_info(threads: int) -> dict:
    """The CPU's model name and vector ISA (flags avx*, fma, amx*), and the threads used."""
    from pathlib import Path

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines()) if v}
    isa = sorted(f for f in field.get("flags", "").split() if f.startswith(("avx", "fma", "amx")))
    return {"cpu": field.get("model name", "?"), "isa": isa, "threads": threads}


def markdown(r: dict, title: str) -> str:
    lines = [f"# {title}", "", f"- target alone (measured beside each configuration; median): "
             f"{r['target_alone_tok_s']:.1f} tok/s",
             "- call ms, back to back (median): " + ", ".join(f"T={t}: {ms:.2f}" for t, ms in r["call_ms"].items()),
             "- ideal x = E x T1 / T(k+1) from the back-to-back costs; in rounds: from the calls' own time inside the "
             "generations (the alone loop's T1, the rounds' T(k+1))", "",
             "| a | k | tok/s | alone tok/s | x alone | tokens/call | E | ideal x | of ideal | call ms alone / in rounds | "
             "ideal x in rounds | = alone |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in r["rows"]:
        lines.append(f"| {w['a']} | {w['k']} | {w['tok_s']:.1f} | {w['alone_tok_s']:.1f} | {w['speedup']:.2f} | "
                     f"{w['tokens_per_call']:.2f} | {w['expected_tokens_per_call']:.2f} | {w['ideal_speedup']:.2f} | "
                     f"{w['fraction_of_ideal']:.2f} | {w['alone_call_ms']:.2f} / {w['call_ms_in_rounds']:.2f} | "
                     f"{w['ideal_in_rounds']:.2f} | {w['equals_target_alone']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=str(ROOT / "engines" / "smollm2-torch-int8x"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "oracle"))
    args = ap.parse_args(argv)
    from trtspec import load_engine
    from trtspec.bench import load_prompts

    engine = load_engine(args.engine, num_threads=args.threads)
    prompts = load_prompts(ROOT / "models" / "heldout.json")[: args.prompts]
    print(f"oracle drafter on {args.engine}: {len(prompts)} prompts x {args.new} tokens, {args.runs} runs")
    r = oracle_rows(engine, prompts, args.new, runs=args.runs)
    r.update(engine=args.engine, prompts=len(prompts), new_tokens=args.new, machine=cpu_info(args.threads))
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    md = markdown(r, f"Oracle drafter on {args.engine} ({r['machine']['cpu']}; ISA: {' '.join(r['machine']['isa'])}; "
                     f"{args.threads} threads)")
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0 if all(w["equals_target_alone"] for w in r["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
