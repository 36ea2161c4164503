"""Suffix decoding over an index of the service's own past answers: what a datastore of the answers the target gave
to other requests adds, on held-out HumanEval questions and chats.

    python benchmarks/bench_answers_index.py [--data models/bench/smollm2-eagle3/data]
        [--engine engines/smollm2-torch-int8x] [--rounds 3] [--tokens 128] [--out benchmarks/results/answers-index]

The answers: what `trtspec distill` wrote for SmolLM2's head (train_smollm2_head.py: the engine's own greedy and
sampled answers to chat, docstring, completion, text and HumanEval requests), as a service would log them. The index
takes the answers' token ids only (not the requests), leaves out every HumanEval answer and every cut of the
held-out dialogues, and is built with `trtspec index` from a .jsonl of token ids. The prompts: bench_real's held-out
set (8 HumanEval problems, 8 chatterbot-corpus dialogues), each alone, greedy. Three configurations take turns each
round: plain decoding, suffix decoding, suffix decoding over the index; each output is compared with plain's.
Writes benchmarks/results/<--out>.{json,md} with the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gguf_kernels import _cpu  # noqa: E402
from bench_real import make_prompts  # noqa: E402
from common import save_results  # noqa: E402

CONFIGS = {"plain": {"drafter": "none"}, "suffix": {"drafter": "suffix"},
           "suffix + answers index": {"drafter": "suffix"}}


def answers_jsonl(data_dir: Path, held_out: list[str], out: Path) -> dict:
    """The answers' token ids, one JSON line each, but HumanEval's and the held-out dialogues' (any cut of them)."""
    from trtspec.distill.data import TargetData

    data, lines, left_out = TargetData(data_dir), [], 0
    for i, name in enumerate(data.names):
        source, _, rest = name.partition(":")
        if source == "humaneval" or any(rest == h or rest.startswith(h + "/") for h in held_out):
            left_out += 1
            continue
        start = int(data.offsets[i]) + int(data.prompt_lens[i])
        lines.append(json.dumps({"token_ids": data.tokens[start : int(data.offsets[i + 1])].tolist()}))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return {"answers": len(lines), "left_out": left_out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="models/bench/smollm2-eagle3/data")
    ap.add_argument("--engine", default="engines/smollm2-torch-int8x")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--work", default="index/answers", help="where the .jsonl and the index are written")
    ap.add_argument("--out", default="benchmarks/results/answers-index")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from trtspec import Generator, index
    from trtspec.runtime.drafters.datastore import Datastore

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.engine) / "tokenizer")
    prompts = make_prompts(tokenizer, 8)
    workloads = {"code": [p for p in prompts if p["name"].startswith("HumanEval")],
                 "chat": [p for p in prompts if not p["name"].startswith("HumanEval")]}
    work = Path(args.work)
    corpus = answers_jsonl(Path(args.data), [p["name"] for p in workloads["chat"]], work / "answers.jsonl")
    t = time.perf_counter()
    index([work / "answers.jsonl"], work / "index", tokenizer=args.engine)
    corpus.update(index_s=time.perf_counter() - t, tokens=Datastore(work / "index").tokens)
    print("index:", json.dumps(corpus), flush=True)

    cells: dict = {(w, c): [] for w in workloads for c in CONFIGS}
    order = list(CONFIGS)
    for rnd in range(args.rounds):
        shift = rnd % len(order)
        for c in order[shift:] + order[:shift]:
            options = {**CONFIGS[c], **({"datastore": str(work / "index")} if "index" in c else {})}
            gen = Generator(args.engine, max_batch=1, num_threads=2, **options)
            for w, ps in workloads.items():
                runs = []
                for p in ps:
                    r = gen.generate([p["ids"]], max_new_tokens=args.tokens)[0]
                    s = r.stats
                    runs.append({"ids": r.token_ids, "new": s.new_tokens, "calls": s.target_calls - 1,
                                 "decode_s": s.elapsed_s - s.time_to_first_token_s})
                cells[(w, c)].append(runs)
            gen.close()
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)

    def rate(runs):
        return sum(r["new"] - 1 for r in runs) / sum(r["decode_s"] for r in runs)

    results = {}
    for (w, c), rounds in cells.items():
        plain = cells[(w, "plain")]
        results.setdefault(w, {})[c] = {
            "decode_tok_s": statistics.median(rate(r) for r in rounds),
            "x_plain": statistics.median(rate(r) / rate(p) for r, p in zip(rounds, plain)),
            "x_suffix": statistics.median(rate(r) / rate(s) for r, s in zip(rounds, cells[(w, "suffix")])),
            "tokens_per_call": statistics.median(sum(x["new"] - 1 for x in r) / max(sum(x["calls"] for x in r), 1)
                                                 for r in rounds),
            "equal_to_plain": f"{sum(a['ids'] == b['ids'] for a, b in zip(rounds[0], plain[0]))}/{len(rounds[0])}"}
    cpu = _cpu()
    res = {"engine": args.engine, "cpu": cpu, "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
           "tokens": args.tokens, "corpus": corpus, "results": results}
    lines = [f"Suffix decoding over an index of the target's own past answers to other requests ({corpus['answers']:,} "
             f"answers, {corpus['tokens']:,} tokens; every HumanEval answer and every cut of the held-out dialogues "
             f"left out, {corpus['left_out']}): SmolLM2-135M-Instruct ({args.engine}), 2 threads, greedy, up to "
             f"{args.tokens} new tokens, each prompt alone; medians of {args.rounds} alternating rounds (measured "
             f"{res['date']}). CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}.", "",
             "| workload | configuration | decode tok/s | x plain | x suffix | tokens / target call | = plain |",
             "|---|---|---|---|---|---|---|"]
    for w, rows in results.items():
        for c, r in rows.items():
            lines.append(f"| {w} | {c} | {r['decode_tok_s']:.1f} | {r['x_plain']:.2f} | {r['x_suffix']:.2f} | "
                         f"{r['tokens_per_call']:.2f} | {r['equal_to_plain']} |")
    lines += ["", "x plain, x suffix: the median over rounds of each round's own ratio. tokens / target call: tokens "
              "after the first per target call after the first.", ""]
    save_results(Path(args.out), res, "\n".join(lines))


if __name__ == "__main__":
    main()
