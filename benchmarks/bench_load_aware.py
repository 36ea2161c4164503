"""The load-aware k policy against every fixed chain length, one prompt at a time (the policy's check against fixed k).

    python benchmarks/bench_load_aware.py [--rounds 3] [--prompts 8] [--tokens 128] [--max-k 6]

The bundled pair (engines/stdlib-target, engines/stdlib-draft: `make demo-stdlib`), greedy, held-out prompts each
alone (batch 1), in one process: each round runs target-only, fixed k = 1..--max-k and load-aware k (up to --max-k)
over every prompt, the configurations taking turns prompt by prompt (the order rotated); the figure per
configuration is the median over rounds of new tokens per second (wall time of generate), and a ratio of two is the
median over rounds of the ratio within the round (this machine's speed drifts by a third within minutes). Reports
load-aware / the best fixed chain (and / each) and every output's equality with target-only.

The useless-drafts case rides in the same rounds: load-aware k (and fixed k = 2, for scale) drafting with a draft
of the bundled draft's shape and tokenizer but random weights (exported and built here, seed 0), whose drafts are
almost never accepted; reported as load-aware / target only. Each configuration's seconds a pass, split into prompt
reads, drafting, verify calls and host work, explain what remains. Writes benchmarks/results/load-aware.{json,md} with
the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_gguf_kernels import _cpu  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PARTS = ("prefill", "draft", "verify", "other", "total")


def _useless_draft(tmp: Path):
    """An engine of the bundled draft's shape and tokenizer with random weights: drafts that are almost never right."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trtspec import build, export, load_engine

    source = ROOT / "models" / "stdlib-draft"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    model.save_pretrained(tmp / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp / "hf" / name)
    export(tmp / "hf", tmp / "export", max_seq_len=512, max_batch=4)
    return load_engine(build(tmp / "export", tmp / "engine", backend="onnxruntime"), num_threads=2)


def _k_histogram(generator) -> dict:
    return {str(k): n for k, n in sorted(generator.scheduler.statistics.counters.k_histogram.items())}


def main() -> None:
    from trtspec import Generator, load_engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-k", type=int, default=6)
    args = ap.parse_args()
    prompts = json.loads((ROOT / "models" / "heldout.json").read_text())["prompts"][: args.prompts]
    prompts = [p["prompt"] if isinstance(p, dict) else p for p in prompts]
    target = load_engine(ROOT / "engines" / "stdlib-target", num_threads=2)
    draft = load_engine(ROOT / "engines" / "stdlib-draft", num_threads=2)
    configs = {"target only": dict(),
               **{f"fixed k={k}": dict(draft=draft, num_draft_tokens=k, k_policy="fixed")
                  for k in range(1, args.max_k + 1)},
               f"load-aware k<={args.max_k}": dict(draft=draft, num_draft_tokens=args.max_k, k_policy="load-aware")}
    tmp = Path(tempfile.mkdtemp(prefix="trtspec-useless-draft-"))
    useless = _useless_draft(tmp)
    configs["useless drafts: fixed k=2"] = dict(draft=useless, num_draft_tokens=2, k_policy="fixed")
    configs[f"useless drafts: load-aware k<={args.max_k}"] = dict(draft=useless, num_draft_tokens=args.max_k,
                                                                  k_policy="load-aware")
    gens = {name: Generator(target, **options) for name, options in configs.items()}
    reference = [r.token_ids for r in gens["target only"].generate(prompts[:1], max_new_tokens=8)]  # warm-up
    reference = [gens["target only"].generate(p, max_new_tokens=args.tokens).token_ids for p in prompts]
    names = list(gens)
    # per round and configuration: tokens, and seconds by where they went. The configurations take turns prompt by
    # prompt (the order rotated), so a round's figures of every configuration come from the same minutes of a
    # machine whose speed drifts, and a ratio is taken within each round, then the median over rounds
    tokens = {name: [0] * args.rounds for name in gens}
    parts = {name: {part: [0.0] * args.rounds for part in PARTS} for name in gens}
    identical = {name: True for name in gens}
    for r in range(args.rounds):
        for i, (p, want) in enumerate(zip(prompts, reference)):
            turn = (r + i) % len(names)
            for name in names[turn:] + names[:turn]:
                before, t = gens[name].scheduler.stats(), time.perf_counter()
                got = gens[name].generate(p, max_new_tokens=args.tokens).token_ids
                elapsed = time.perf_counter() - t
                after = gens[name].scheduler.stats()
                identical[name] &= got == want
                tokens[name][r] += len(got)
                spent = {part: getattr(after, f"{part}_s") - getattr(before, f"{part}_s") for part in PARTS[:3]}
                for part, seconds in {**spent, "other": elapsed - sum(spent.values()), "total": elapsed}.items():
                    parts[name][part][r] += seconds
    rates = {name: [n / s for n, s in zip(tokens[name], parts[name]["total"])] for name in gens}
    med = {name: statistics.median(v) for name, v in rates.items()}
    fixed = {name: v for name, v in med.items() if name.startswith("fixed")}
    best = max(fixed, key=fixed.get)
    aware = next(name for name in med if name.startswith("load-aware"))
    useless = next(name for name in med if name.startswith("useless drafts: load-aware"))

    def ratio(a, b):  # the median over rounds of a's rate / b's, both measured in the round
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    result = {"cpu": _cpu(), "rounds": args.rounds, "prompts": len(prompts), "tokens": args.tokens, "tok_s": med,
              "identical_to_target_only": identical, "best_fixed": best,
              "load_aware_over_best_fixed": ratio(aware, best),
              "load_aware_over_each_fixed_chain": {name: ratio(aware, name) for name in fixed},
              "load_aware_over_target_only": ratio(aware, "target only"),
              "useless_drafts_load_aware_over_target_only": ratio(useless, "target only"),
              "seconds_a_pass": {name: {part: statistics.median(v) for part, v in by.items()}
                                 for name, by in parts.items()},
              "load_aware_k_histogram": _k_histogram(gens[aware]),
              "useless_drafts_k_histogram": _k_histogram(gens[useless])}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load-aware.json").write_text(json.dumps(result, indent=2))
    lines = [f"CPU: {result['cpu']['model']}; ISA: {' '.join(result['cpu']['isa'])}; 2 threads; the bundled pair, "
             f"{len(prompts)} held-out prompts each alone, {args.tokens} new tokens, greedy; medians of {args.rounds} "
             "rounds in one process, the order rotated (`python benchmarks/bench_load_aware.py`).", "",
             "| configuration | tok/s | = target only |", "|---|---|---|"]
    lines += [f"| {name} | {v:.1f} | {'yes' if identical[name] else 'NO'} |" for name, v in med.items()]
    lines += ["", "Ratios: the median over rounds of the two rates measured in the round.", "",
              f"load-aware / best fixed chain ({best}): {result['load_aware_over_best_fixed']:.3f}; "
              f"load-aware / target only: {result['load_aware_over_target_only']:.3f}",
              "load-aware / each fixed chain: " + ", ".join(
                  f"{name} {v:.3f}" for name, v in result["load_aware_over_each_fixed_chain"].items()),
              f"Load-aware's rounds by k: {result['load_aware_k_histogram']}",
              "", f"Useless drafts (a random-weight draft): load-aware / target only "
              f"{result['useless_drafts_load_aware_over_target_only']:.3f}; its rounds by k "
              f"{result['useless_drafts_k_histogram']}", "",
              f"Where a pass of the {len(prompts)} prompts went (seconds, medians over rounds; prefill: target calls "
              "reading prompts, and the draft's reads of them; draft: the draft model's drafting calls (a catch-up "
              "included); verify: the other target calls; other: the host's work between calls):", "",
              "| configuration | " + " | ".join(PARTS) + " |", "|---|" + "---|" * len(PARTS)]
    lines += [f"| {name} | " + " | ".join(f"{result['seconds_a_pass'][name][part]:.3f}" for part in PARTS) + " |"
              for name in med]
    text = "\n".join(lines) + "\n"
    (RESULTS / "load-aware.md").write_text(text)
    print(text)
    for g in gens.values():
        g.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
