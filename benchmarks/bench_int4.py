"""INT4 everywhere: engine bytes, INT4 speed against onnxruntime-genai, the target's own INT4 build as its draft.

    python benchmarks/bench_int4.py      # ~15 min on 2 cores; writes benchmarks/results/int4.{json,md}

Part 1, a random-init Llama with tied embeddings (vocab 8192, hidden 512, 8 layers: 27.8M parameters, the
layout of Qwen2.5 / Llama-3.2 / Gemma), batch 1, 2 threads, greedy, 8 prompts x 128 new tokens:
- engine bytes: float32 vs `int4-awq --block-size 32 --quantize-lm-head` (the tied table in INT4 once), and
  `int4-gptq --block-size 128 --quantize-lm-head` (trtspec's default block; onnxruntime-genai's is 32, built at
  128 too for the comparison; the MLP width 1376 is not a multiple of 128: down_proj's last block is ragged);
- tokens/s, rounds alternating between: trtspec float32, trtspec INT4, trtspec float32 drafting with its own
  INT4 build (`--draft self`, k = 4), and onnxruntime-genai's float32 and INT4 builds of the same HF model
  (its model builder `-p fp32|int4 -e cpu`, `intra_op_num_threads` 2, same onnxruntime), if installed
  (`pip install onnxruntime-genai==0.18.0`: its only dependencies are numpy and onnxruntime >= 1.31);
Part 2, the bundled pair (models/stdlib-*): float32 and INT4 targets x no drafter / the draft (float32 and
INT4) / the self-draft / prompt lookup, greedy, k = 2, 3 and 4, and the int4-gptq builds at block 128 (trtspec's
default block) with each other, 8 held-out prompts x 128 tokens, medians of --rounds rounds, and whether each output equals its target's own greedy output; "engine-only tok/s" counts only the time
inside engine calls (the scheduler's prefill, draft and verify clocks, over all rounds): what a host loop
costing nothing would reach.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT, WORK, made_from, random_llama, save_results

# INT4 builds: block 32 (onnxruntime-genai's default block) with int4-awq, and block 128 (trtspec's default
# block) with int4-gptq, the more accurate mode at that block (bundled target, lm_head in INT4 too: perplexity
# +0.44 % vs int4-awq's +1.55 %, `bench_quant.py --out quant-int4-blocks`)
INT4_BUILDS = {"": {"mode": "int4-awq", "block_size": 32}, "-gptq-b128": {"mode": "int4-gptq", "block_size": 128}}


def stored_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.name.startswith("model.onnx")) / 1e6


def og_build(hf_dir: Path, out: Path, precision: str, threads: int, block_size: int | None = None) -> Path | None:
    """onnxruntime-genai's own build of ``hf_dir`` (None if onnxruntime-genai is not installed); ``block_size``:
    its INT4 block (its default 32)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return None
    made_from(out, hf_dir)
    if not (out / "genai_config.json").is_file():
        extra = ["--extra_options", f"block_size={block_size}"] if block_size else []
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(out / "cache"), *extra], check=True)
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    return out


def og_runner(path: Path, max_new_tokens: int):
    import onnxruntime_genai as og

    model = og.Model(str(path))

    def run(ids):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        out = []
        while not gen.is_done() and len(out) < max_new_tokens:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out

    return run


def trtspec_runner(gen, max_new_tokens: int):
    def run(ids):  # the same token ids as onnxruntime-genai gets
        return gen.generate([list(ids)], max_new_tokens=max_new_tokens)[0].token_ids

    return run


def timed_rounds(runners: dict, prompts: list, rounds: int, log) -> tuple[dict, dict, dict]:
    """tok/s per runner, median over ``rounds`` that each visit every runner; first round's outputs; every
    round's tok/s per runner (a ratio of two runners taken round by round compares them under the same load)."""
    rates, outputs = {n: [] for n in runners}, {}
    for name, run in runners.items():
        run(prompts[0][:8])  # warm up
    for r in range(rounds):
        for name, run in runners.items():
            t0, new, outs = time.perf_counter(), 0, []
            for ids in prompts:
                out = run(ids)
                new, outs = new + len(out), outs + [list(out)]
            rates[name].append(new / (time.perf_counter() - t0))
            outputs.setdefault(name, outs)
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items()))
    return {n: statistics.median(v) for n, v in rates.items()}, outputs, rates


def paired(per_round: dict, a: str, b: str) -> dict:
    """a's tok/s over b's, round by round: median and range."""
    ratios = [x / y for x, y in zip(per_round[a], per_round[b])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main(argv=None):
    from transformers import AutoTokenizer

    from trtspec import Generator, build, export, load_engine, quantize, self_draft
    from trtspec.bench import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["tied", "pair"], help="run one part only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = lambda m: print(m, flush=True)  # noqa: E731
    work = WORK / "int4"
    texts = load_prompts(ROOT / "models" / "heldout.json")[: args.prompts]
    res = {"settings": vars(args)}
    out_json = RESULTS / "int4.json"
    if args.only and out_json.is_file():
        res = {**json.loads(out_json.read_text()), "settings": vars(args)}

    def engines_of(hf_dir, name, *, quantize_options):
        """float32 engine, then one engine per INT4_BUILDS entry."""
        exp = made_from(work / "export" / name, hf_dir)
        if not (exp / "manifest.json").is_file():
            export(hf_dir, exp, max_seq_len=512, max_batch=1)
        engines = [build(exp, work / "engines" / name)]
        for suffix, options in INT4_BUILDS.items():
            tag = f"{name}-int4{suffix}"
            q = made_from(work / "export" / tag, hf_dir)
            if not (q / "manifest.json").is_file():
                quantize(exp, q, **quantize_options, **options)
            engines.append(build(q, work / "engines" / tag))
        return engines

    int4 = {"quantize_lm_head": True}
    if args.only in (None, "tied"):
        hf = random_llama(WORK / "llama28m-tied", vocab=8192, tied=True)
        fp, q4, q4b = engines_of(hf, "tied", quantize_options=int4)
        sd = self_draft(fp)
        tok = AutoTokenizer.from_pretrained(hf)
        prompts = [tok(t)["input_ids"][:48] for t in texts]
        sizes = {"trtspec float32": stored_mb(fp), "trtspec int4": stored_mb(q4), "trtspec int4 gptq-b128": stored_mb(q4b),
                 "trtspec self-draft": stored_mb(sd)}
        runners = {
            "trtspec float32": trtspec_runner(Generator(load_engine(fp, num_threads=args.threads)), args.max_new_tokens),
            "trtspec int4": trtspec_runner(Generator(load_engine(q4, num_threads=args.threads)), args.max_new_tokens),
            "trtspec int4 gptq-b128": trtspec_runner(Generator(load_engine(q4b, num_threads=args.threads)), args.max_new_tokens),
            "trtspec float32 + self-draft k4": trtspec_runner(Generator(
                load_engine(fp, num_threads=args.threads), load_engine(sd, num_threads=args.threads),
                num_draft_tokens=4, k_policy="fixed"), args.max_new_tokens),
        }
        for precision, block, name in (("fp32", None, "fp32"), ("int4", None, "int4"), ("int4", 128, "int4 b128")):
            path = og_build(hf, work / f"og-{name.replace(' ', '-')}", precision, args.threads, block)
            if path is not None:
                sizes[f"onnxruntime-genai {name}"] = sum(
                    f.stat().st_size for f in path.iterdir() if f.suffix in (".onnx", ".data")) / 1e6
                runners[f"onnxruntime-genai {name}"] = og_runner(path, args.max_new_tokens)
        rates, outputs, per_round = timed_rounds(runners, prompts, args.rounds, log)
        base = outputs["trtspec float32"]
        res["tied"] = {
            "model": "random Llama, tied embeddings, vocab 8192, hidden 512, 8 layers, 27.8M parameters",
            "engine_mb": sizes, "int4_over_float32_bytes": sizes["trtspec int4"] / sizes["trtspec float32"],
            "tok_s": rates, "same_tokens_as_trtspec_float32": {n: o == base for n, o in outputs.items()},
            "same_tokens_as_trtspec_int4": {n: o == outputs["trtspec int4"] for n, o in outputs.items()},
            "per_round_tok_s": per_round,
        }
        if "onnxruntime-genai int4" in per_round:
            res["tied"]["int4_vs_onnxruntime_genai_int4_per_round"] = paired(per_round, "trtspec int4",
                                                                            "onnxruntime-genai int4")
            res["tied"]["int4_b128_vs_onnxruntime_genai_int4_b128_per_round"] = paired(
                per_round, "trtspec int4 gptq-b128", "onnxruntime-genai int4 b128")
            res["tied"]["defaults_per_round"] = paired(per_round, "trtspec int4 gptq-b128", "onnxruntime-genai int4")
        log(json.dumps(res["tied"], indent=1))

    if args.only in (None, "pair"):
        t_fp, t_q4, t_q4b = engines_of(ROOT / "models" / "stdlib-target", "target", quantize_options=int4)
        d_fp, d_q4, d_q4b = engines_of(ROOT / "models" / "stdlib-draft", "draft", quantize_options=int4)
        sd = self_draft(t_fp, mode="int4-awq", block_size=32)  # the self-draft's default until 2026-11-24
        sd_b128 = self_draft(t_fp)  # the default: int4-gptq, block 128 here
        load = {p: load_engine(p, num_threads=args.threads) for p in (t_fp, t_q4, t_q4b, d_fp, d_q4, d_q4b, sd, sd_b128)}
        configs = {}

        def fixed(target, draft=None, k=4, **options):  # every speculative row is labelled with its fixed k
            return Generator(load[target], draft and load[draft], num_draft_tokens=k, k_policy="fixed", **options)

        for tname, target in (("float32", t_fp), ("int4", t_q4)):
            configs[f"{tname} target"] = Generator(load[target])
            for k in (2, 3, 4):
                configs[f"{tname} target + float32 draft k{k}"] = fixed(target, d_fp, k)
                configs[f"{tname} target + int4 draft k{k}"] = fixed(target, d_q4, k)
                if tname == "float32":
                    configs[f"{tname} target + self-draft awq-b32 k{k}"] = fixed(target, sd, k)
                    if k > 2:  # the default self-draft
                        configs[f"{tname} target + self-draft gptq-b128 k{k}"] = fixed(target, sd_b128, k)
            configs[f"{tname} target + prompt lookup k4"] = fixed(target, drafter="prompt_lookup")
        # both at trtspec's default INT4 block (128)
        configs["int4-gptq-b128 target"] = Generator(load[t_q4b])
        for k in (2, 3, 4):
            configs[f"int4-gptq-b128 target + int4-gptq-b128 draft k{k}"] = fixed(t_q4b, d_q4b, k)
        configs["int4-gptq-b128 target + prompt lookup k4"] = fixed(t_q4b, drafter="prompt_lookup")
        inside = {n: [0, 0.0] for n in configs}  # tokens, seconds inside engine calls (the scheduler's own clocks)

        def runner(name, g):
            def run(text):
                before = g.scheduler.stats()
                ids = g.generate([text], max_new_tokens=args.max_new_tokens)[0].token_ids
                after = g.scheduler.stats()
                inside[name][0] += len(ids)
                inside[name][1] += sum(getattr(after, f) - getattr(before, f) for f in ("prefill_s", "draft_s", "verify_s"))
                return ids
            return run

        rates, outputs, per_round = timed_rounds({n: runner(n, g) for n, g in configs.items()}, texts, args.rounds, log)
        rows = {}
        for name, rate in rates.items():
            base = name.split(" + ")[0]  # its own target, alone
            rows[name] = {"tok_s": rate, "vs_float32_target": rate / rates["float32 target"],
                          "vs_own_target_only": rate / rates[base], "greedy_equals_own_target": outputs[name] == outputs[base],
                          "engine_only_tok_s": inside[name][0] / inside[name][1],
                          "vs_own_target_only_per_round": paired(per_round, name, base)["median"]}
        res["pair"] = {"engine_mb": {"float32 target": stored_mb(t_fp), "int4 target": stored_mb(t_q4),
                                     "int4-gptq-b128 target": stored_mb(t_q4b), "float32 draft": stored_mb(d_fp),
                                     "int4 draft": stored_mb(d_q4), "int4-gptq-b128 draft": stored_mb(d_q4b),
                                     "self-draft awq-b32": stored_mb(sd), "self-draft gptq-b128": stored_mb(sd_b128)},
                       "rows": rows,
                       "best": max(rows, key=lambda n: rows[n]["tok_s"])}
        log(json.dumps(res["pair"], indent=1))
    save_results(RESULTS / "int4", res, markdown(res))


def markdown(res) -> str:
    lines = []
    if "tied" in res:
        t = res["tied"]
        lines += [f"## {t['model']}: batch 1, greedy, {res['settings']['prompts']} prompts x "
                  f"{res['settings']['max_new_tokens']} new tokens, {res['settings']['threads']} threads, "
                  f"median of {res['settings']['rounds']} alternating rounds", "",
                  "| engine | MB | tok/s | same tokens as trtspec float32 | same tokens as trtspec int4 |", "|---|---|---|---|---|"]
        for name, rate in t["tok_s"].items():
            mb = t["engine_mb"].get(name, t["engine_mb"].get(name.split(" + ")[0]))
            lines.append(f"| {name} | {mb:.1f} | {rate:.1f} | {t['same_tokens_as_trtspec_float32'][name]} | "
                         f"{t['same_tokens_as_trtspec_int4'][name]} |")
        lines += ["", f"INT4 engine bytes / float32 engine bytes: {t['int4_over_float32_bytes']:.3f}", ""]
        for key, what in (("int4_vs_onnxruntime_genai_int4_per_round", "trtspec int4 (block 32) / onnxruntime-genai int4 (block 32)"),
                          ("int4_b128_vs_onnxruntime_genai_int4_b128_per_round", "trtspec int4 block 128 / onnxruntime-genai int4 block 128"),
                          ("defaults_per_round", "each at its default block: trtspec int4-gptq block 128 / onnxruntime-genai int4 (block 32)")):
            if key in t:
                q = t[key]
                lines += [f"{what}, round by round: median {q['median']:.3f}x (range {q['min']:.2f}-{q['max']:.2f})", ""]
    if "pair" in res:
        p = res["pair"]
        lines += ["## The bundled pair: float32 / INT4 target x drafters, greedy", "",
                  "Engines (MB): " + ", ".join(f"{k} {v:.1f}" for k, v in p["engine_mb"].items()), "",
                  "| configuration | tok/s | vs float32 target-only | vs its target-only | greedy = its target's | "
                  "engine-only tok/s | vs its target-only, median per round |", "|---|---|---|---|---|---|---|"]
        for name, r in p["rows"].items():
            lines.append(f"| {name} | {r['tok_s']:.1f} | {r['vs_float32_target']:.2f}x | {r['vs_own_target_only']:.2f}x | "
                         f"{r['greedy_equals_own_target']} | {r.get('engine_only_tok_s', float('nan')):.1f} | "
                         f"{r.get('vs_own_target_only_per_round', float('nan')):.2f}x |")
        lines += ["", f"Best: {p['best']} ({p['rows'][p['best']]['tok_s']:.1f} tok/s)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
