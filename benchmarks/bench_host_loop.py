"""The host's own work per token: the scheduler and engine wrappers in Python, with onnxruntime's run made a no-op.

    python benchmarks/bench_host_loop.py [--target engines/stdlib-target] [--draft engines/stdlib-draft]

Each engine's first calls run for real (prompt reading); then `InferenceSession.run_with_iobinding` is replaced by
a function that returns at once and the logits buffers are zeroed, so every call "predicts" token 0 (a draft's
proposals are then always accepted). What is left of a generation's time is the Python around the calls: the
scheduler's rounds, the engines' input checks and bindings, argmax, emitting. Batch 1, greedy, 4 held-out prompts x
256 tokens, median of 5 runs; target only (one lone row: the engine's own loop, engines.base.greedy_steps) and
with the draft at k = 4 (per round and per token), each round one step (schedule -> execute -> update), with
scheduler.lone_row_loops on and off (off only sends a lone greedy row without drafts out of the engine's loop).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import ROOT


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "engines" / "stdlib-target"))
    ap.add_argument("--draft", default=str(ROOT / "engines" / "stdlib-draft"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    from trtspec import Generator, load_engine
    from trtspec.bench import load_prompts

    prompts = load_prompts(ROOT / "models" / "heldout.json")[:4]
    target, draft = load_engine(args.target), load_engine(args.draft)
    gens = {"target only": Generator(target), "draft, k = 4": Generator(target, draft, num_draft_tokens=4, k_policy="fixed"),
            "draft, k = 4, batch path": Generator(target, draft, num_draft_tokens=4, k_policy="fixed")}
    gens["draft, k = 4, batch path"].scheduler.lone_row_loops = False  # (the same steps with a draft)
    for g in gens.values():
        g.generate(prompts[0], max_new_tokens=8)  # bind the inputs of every call shape for real
    ort.InferenceSession.run_with_iobinding = lambda self, binding, run_options=None: None
    for e in (target, draft):  # every bound logits buffer (engines/onnxruntime.py): token 0 wins every call
        for g in (e._decode, e._full):
            for bd in [*(g.small.values() if g else ()), *([g.other] if g and g.other.logits is not None else [])]:
                bd.logits[...] = 0

    for name, g in gens.items():
        per_token, per_round = [], []
        for _ in range(args.runs):
            tokens = rounds = 0
            t0 = time.perf_counter()
            for p in prompts:  # one request at a time: batch 1
                out = g.generate([p], max_new_tokens=args.tokens)
                tokens += len(out[0].token_ids)
                rounds += out.stats.rounds
            el = time.perf_counter() - t0
            per_token.append(el / tokens * 1e6)
            per_round.append(el / rounds * 1e6)
        print(f"{name}: {statistics.median(per_token):.1f} µs per token, {statistics.median(per_round):.1f} µs per "
              f"round ({tokens} tokens in {rounds} rounds)", flush=True)


if __name__ == "__main__":
    main()
