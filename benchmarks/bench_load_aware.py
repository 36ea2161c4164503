"""The load-aware k policy against every fixed chain length, one prompt at a time (issue 60's check).

    python benchmarks/bench_load_aware.py [--rounds 3] [--prompts 8] [--tokens 128] [--max-k 6]

The bundled pair (engines/stdlib-target, engines/stdlib-draft: `make demo-stdlib`), greedy, held-out prompts each
alone (batch 1), in one process: each round runs target-only, fixed k = 1..--max-k and load-aware k (up to --max-k)
over every prompt, the order rotated by round; the figure per configuration is the median over rounds of new tokens
per second (wall time of generate). Reports load-aware / the best fixed chain and every output's equality with
target-only.

The useless-drafts case rides in the same rounds: load-aware k (and fixed k = 2, for scale) drafting with a draft
of the bundled draft's shape and tokenizer but random weights (exported and built here, seed 0), whose drafts are
almost never accepted; reported as load-aware / target only. Writes benchmarks/results/load-aware.{json,md} with
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
    rates = {name: [] for name in gens}
    identical = {name: True for name in gens}
    names = list(gens)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            tokens, t = 0, time.perf_counter()
            for p, want in zip(prompts, reference):
                got = gens[name].generate(p, max_new_tokens=args.tokens).token_ids
                identical[name] &= got == want
                tokens += len(got)
            rates[name].append(tokens / (time.perf_counter() - t))
    med = {name: statistics.median(v) for name, v in rates.items()}
    fixed = {name: v for name, v in med.items() if name.startswith("fixed")}
    best = max(fixed, key=fixed.get)
    aware = next(name for name in med if name.startswith("load-aware"))
    useless = next(name for name in med if name.startswith("useless drafts: load-aware"))
    result = {"cpu": _cpu(), "rounds": args.rounds, "prompts": len(prompts), "tokens": args.tokens, "tok_s": med,
              "identical_to_target_only": identical, "best_fixed": best,
              "load_aware_over_best_fixed": med[aware] / med[best], "load_aware_over_target_only":
                  med[aware] / med["target only"],
              "useless_drafts_load_aware_over_target_only": med[useless] / med["target only"],
              "useless_drafts_k_histogram": {str(k): n for k, n in sorted(
                  gens[useless].scheduler.statistics.counters.k_histogram.items())}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load-aware.json").write_text(json.dumps(result, indent=2))
    lines = [f"CPU: {result['cpu']['model']}; ISA: {' '.join(result['cpu']['isa'])}; 2 threads; the bundled pair, "
             f"{len(prompts)} held-out prompts each alone, {args.tokens} new tokens, greedy; medians of {args.rounds} "
             "rounds in one process, the order rotated (`python benchmarks/bench_load_aware.py`).", "",
             "| configuration | tok/s | = target only |", "|---|---|---|"]
    lines += [f"| {name} | {v:.1f} | {'yes' if identical[name] else 'NO'} |" for name, v in med.items()]
    lines += ["", f"load-aware / best fixed chain ({best}): {result['load_aware_over_best_fixed']:.3f}; "
              f"load-aware / target only: {result['load_aware_over_target_only']:.3f}",
              "", f"Useless drafts (a random-weight draft): load-aware / target only "
              f"{result['useless_drafts_load_aware_over_target_only']:.3f}; its rounds by k "
              f"{result['useless_drafts_k_histogram']}"]
    text = "\n".join(lines) + "\n"
    (RESULTS / "load-aware.md").write_text(text)
    print(text)
    for g in gens.values():
        g.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
