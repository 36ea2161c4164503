"""Draft heads and token trees on the bundled pair: every way trtspec drafts, side by side, greedy.

One target export carries what every row needs (--tree, --hidden-states low,mid,high,last; fused onnxruntime
build, float32, and its INT4 (int4-rtn) build); the draft model is the bundled one; the heads are
models/stdlib-eagle3 and models/stdlib-medusa (benchmarks/train_heads.py). Rows: target alone, the draft
model's chains at k = 3..6 and trees, the EAGLE-3 head's chains and trees, Medusa trees, prompt lookup, and the
load-aware policy choosing between chains and trees. Per row: tok/s (median of alternating rounds, every row
once per round), tokens per target call, acceptance (accepted / deepest proposed path), whether the output is
the target's own, and the speed-up the row's measured calls predict (tokens per call x decode cost /
(draft time per round + verify cost)) beside the one measured. Call costs: a decode call, a 5-token chain
verify and a 16-node tree verify on the fused build, at position 300 (medians of 40 calls).

    python benchmarks/bench_tree.py [--rounds 3] [--prompts 8] [--tokens 128]   # results/tree.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import RESULTS, ROOT, WORK, made_from, save_results

MODELS = ROOT / "models"


def artifacts(work):
    from trtspec import build, export, quantize

    target_hf, draft_hf = MODELS / "stdlib-target", MODELS / "stdlib-draft"
    out = {}
    tx = made_from(work / "target-export", target_hf)
    if not tx.exists():
        export(target_hf, tx, max_seq_len=1024, max_batch=4, tree=True, hidden_states="low,mid,high,last")
    for name, src in (("target", tx),):
        out[name] = made_from(work / name, target_hf)
        if not out[name].exists():
            build(src, out[name])
    qx = made_from(work / "target-int4-export", target_hf)
    if not qx.exists():
        quantize(tx, qx, mode="int4-rtn")
    out["target-int4"] = made_from(work / "target-int4", target_hf)
    if not out["target-int4"].exists():
        build(qx, out["target-int4"])
    dx = made_from(work / "draft-export", draft_hf)
    if not dx.exists():
        export(draft_hf, dx, max_seq_len=1024, max_batch=4)
    out["draft"] = made_from(work / "draft", draft_hf)
    if not out["draft"].exists():
        build(dx, out["draft"])
    from trtspec.heads.export import export_head

    head = MODELS / "stdlib-eagle3"
    if (head / "config.json").is_file():
        for name in ("target", "target-int4"):
            out[f"eagle3-{name}"] = work / f"eagle3-{name}"
            export_head(head, out[f"eagle3-{name}"], target=out[name], target_model=target_hf)
    if (MODELS / "stdlib-medusa" / "config.json").is_file():
        out["medusa"] = MODELS / "stdlib-medusa"
    return out


def call_costs(engine, position=300, repeats=40):
    from trtspec.bench import measure_call_costs

    engine.reset()
    engine.forward(np.arange(position)[None] % 200 + 5, np.arange(position)[None])
    chain = measure_call_costs(engine, [1, 5], position=position, repeats=repeats, warmup=5)
    tree = measure_call_costs(engine, [17, 9], position=position, repeats=repeats, warmup=5, tree=True)
    return {"decode_ms": chain[1] * 1e3, "verify5_ms": chain[5] * 1e3, "tree17_ms": tree[17] * 1e3,
            "tree9_ms": tree[9] * 1e3}


def configs(paths, target_name):
    from trtspec import Generator, load_engine

    target = load_engine(paths[target_name], num_threads=2)
    draft = load_engine(paths["draft"], num_threads=2)
    rows = {"target": lambda: Generator(target)}
    for k in (3, 4, 5, 6):
        rows[f"draft chain k={k}"] = lambda k=k: Generator(target, draft, num_draft_tokens=k, k_policy="fixed")
    for k, w, nodes in ((5, 2, 8), (5, 3, 12), (6, 3, 16)):
        rows[f"draft tree {k}x{w} ({nodes} nodes)"] = lambda k=k, w=w, nodes=nodes: Generator(
            target, draft, num_draft_tokens=k, k_policy="fixed", tree_width=w, tree_nodes=nodes)
    rows["draft load-aware (chains or 3-wide trees)"] = lambda: Generator(target, draft, num_draft_tokens=6, tree_width=3)
    head = paths.get(f"eagle3-{target_name}")
    if head is not None:
        head_engine = load_engine(head, num_threads=2)
        for k in (3, 4, 5):
            rows[f"eagle3 chain k={k}"] = lambda k=k: Generator(target, head_engine, drafter="eagle3", num_draft_tokens=k,
                                                                  k_policy="fixed")
        for k, w, nodes in ((4, 2, 8), (5, 3, 12), (6, 3, 16)):
            rows[f"eagle3 tree {k}x{w} ({nodes} nodes)"] = lambda k=k, w=w, nodes=nodes: Generator(
                target, head_engine, drafter="eagle3", num_draft_tokens=k, k_policy="fixed", tree_width=w, tree_nodes=nodes)
    if "medusa" in paths:
        for nodes in (8, 16):
            rows[f"medusa tree ({nodes} nodes)"] = lambda nodes=nodes: Generator(
                target, paths["medusa"], drafter="medusa", num_draft_tokens=4, k_policy="fixed", tree_nodes=nodes)
    rows["prompt lookup k=4"] = lambda: Generator(target, drafter="prompt_lookup", num_draft_tokens=4, k_policy="fixed")
    return target, rows


def run_rows(target, rows, prompts, tokens, rounds):
    gens = {name: make() for name, make in rows.items()}
    for gen in gens.values():
        gen.generate(prompts[:2], max_new_tokens=16)  # warm-up: sessions, bindings
    rates = {name: [] for name in gens}
    stats, outputs = {}, {}
    for _ in range(rounds):
        for name, gen in gens.items():
            t0 = time.perf_counter()
            outs = [gen.generate([p], max_new_tokens=tokens) for p in prompts]
            rates[name].append(sum(o.stats.new_tokens for o in outs) / (time.perf_counter() - t0))
            if name not in stats:
                s = {key: sum(getattr(o.stats, key) for o in outs)
                     for key in ("new_tokens", "target_calls", "rounds", "proposed", "accepted", "draft_s", "verify_s")}
                stats[name] = s
                outputs[name] = [o[0].token_ids for o in outs]
    for gen in gens.values():
        gen.close()
    return rates, stats, outputs


def table_rows(rates, stats, outputs, costs):
    base = statistics.median(rates["target"])
    decode = costs["decode_ms"] / 1e3
    out = {}
    for name in rates:
        s = stats[name]
        tps = statistics.median(rates[name])
        per_call = s["new_tokens"] / s["target_calls"]
        rounds = max(s["rounds"], 1)
        predicted = per_call * decode / ((s["draft_s"] + s["verify_s"]) / rounds) if name != "target" else 1.0
        out[name] = {"tokens_per_s": tps, "tokens_per_s_runs": rates[name], "speedup": tps / base,
                     "tokens_per_target_call": per_call,
                     "acceptance": s["accepted"] / s["proposed"] if s["proposed"] else None,
                     "predicted_speedup": predicted, "measured_over_predicted": (tps / base) / predicted,
                     "draft_ms_per_round": s["draft_s"] / rounds * 1e3, "verify_ms_per_round": s["verify_s"] / rounds * 1e3,
                     "identical_to_target": outputs[name] == outputs["target"]}
    return out


def markdown(results):
    lines = []
    for target, res in results["targets"].items():
        c = res["call_costs"]
        lines += [f"### {target}", "",
                  f"Calls at position 300 (fused build, medians of 40): decode {c['decode_ms']:.2f} ms, 5-token chain verify "
                  f"{c['verify5_ms']:.2f} ms ({c['verify5_ms'] / c['decode_ms']:.2f}x), 8-node tree verify "
                  f"{c['tree9_ms']:.2f} ms ({c['tree9_ms'] / c['decode_ms']:.2f}x), 16-node tree verify {c['tree17_ms']:.2f} ms "
                  f"(**{c['tree17_ms'] / c['decode_ms']:.2f}x** a decode call).", "",
                  "| drafting | tok/s | vs target | tokens / target call | acceptance | draft ms / round | verify ms / round "
                  "| predicted speed-up | measured / predicted | = target |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in res["rows"].items():
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tokens_per_target_call']:.2f} | {acc} | "
                         f"{r['draft_ms_per_round']:.2f} | {r['verify_ms_per_round']:.2f} | {r['predicted_speedup']:.2f} | "
                         f"{r['measured_over_predicted']:.2f} | {'yes' if r['identical_to_target'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main():
    from trtspec.bench import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--targets", nargs="+", default=["target", "target-int4"])
    args = ap.parse_args()
    from trtspec import load_engine

    paths = artifacts(WORK / "tree")
    prompts = load_prompts(str(MODELS / "heldout.json"))[: args.prompts]
    results = {"settings": vars(args), "threads": 2, "targets": {}}
    for name in args.targets:
        costs = call_costs(load_engine(paths[name], num_threads=2))
        target, rows = configs(paths, name)
        rates, stats, outputs = run_rows(target, rows, prompts, args.tokens, args.rounds)
        results["targets"][name] = {"call_costs": costs, "rows": table_rows(rates, stats, outputs, costs)}
        print(markdown({"targets": {name: results["targets"][name]}}), flush=True)
    save_results(RESULTS / "tree", results, markdown(results))


if __name__ == "__main__":
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
