"""Engine speed on CPU: decode against the memory-bandwidth bound, capacity independence, verify cost, generation.

    python benchmarks/bench_decode.py      # ~8 min on 2 cores; writes benchmarks/results/decode.{json,md}

The bound: a decode call must read every weight once, so it takes at least weight bytes / read bandwidth. The
read bandwidth is measured in the same run with both cores, 2-thread `torch.sum` over 256 MB (a single-thread
reduction reads about half as fast here, and would understate the bound), median of 7 sums, before every
round: the bound uses the best of those probes (the host is shared, and a slow probe would flatter us).

Part 1, calls (a random-init Llama of ~31M parameters: vocab 8000, hidden 512, 8 layers, 8 heads, 4 KV heads;
batch 1, the cache filled to position 128): the median time of a decode call (1 token) and a verify call
(5 tokens, k = 4) for the plain build (`--no-fusion`) and the default fused build, at `--max-seq-len` 256 and
4096, float32, and `int4-awq --quantize-lm-head` (fused, 256). Rounds alternate between the engines.

Part 2, generation (the bundled target, models/stdlib-target): greedy target-only generation of 128 tokens
for 8 held-out prompts, rounds alternating between HF `generate()`, trtspec float32 (plain and fused), trtspec
INT4, and onnxruntime-genai's float32 and INT4 builds of the same HF model (if installed:
`pip install onnxruntime-genai==0.18.0`, see benchmarks/README.md); and the share of a generation's time spent
outside engine calls (the host loop), at batch 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import time

import numpy as np
from bench_int4 import og_build, og_runner, paired, stored_mb, timed_rounds, trtspec_runner
from common import RESULTS, ROOT, WORK, made_from, memory_bandwidth_gbs, random_llama, save_results

POSITION, VERIFY_TOKENS = 128, 5


def call_times(engine, calls: int) -> dict:
    """Median ms of a decode and a verify call at POSITION, the cache holding POSITION tokens."""
    rng = np.random.default_rng(0)
    engine.reset()
    engine.forward(rng.integers(3, 300, size=(1, POSITION)), np.arange(POSITION)[None])
    out = {}
    for name, t in (("decode", 1), ("verify", VERIFY_TOKENS)):
        ids = rng.integers(3, 300, size=(1, t))
        pos = np.arange(POSITION, POSITION + t)[None]
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            engine.forward(ids, pos)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main(argv=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtspec import Generator, build, export, load_engine, quantize
    from trtspec.bench import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--only", choices=["calls", "generation"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    log = lambda m: print(m, flush=True)  # noqa: E731
    work = WORK / "decode"
    res = {"settings": vars(args)}
    out_json = RESULTS / "decode.json"
    if args.only and out_json.is_file():
        res = {**json.loads(out_json.read_text()), "settings": vars(args)}
    probes = []

    def probe():  # the bound is the best read rate seen: measured again every round (the host is shared)
        probes.append(memory_bandwidth_gbs(torch_threads=args.threads))
        res["read_bandwidth_gbs"], res["read_bandwidth_probes_gbs"] = max(probes), probes
        return probes[-1]

    log(f"read bandwidth, {args.threads}-thread torch.sum over 256 MB: {probe():.1f} GB/s")

    def exported(hf_dir, name, capacity, quant=None):
        exp = made_from(work / "export" / f"{name}-{capacity}", hf_dir)
        if not (exp / "manifest.json").is_file():
            export(hf_dir, exp, max_seq_len=capacity, max_batch=1)
        if quant:
            q = made_from(work / "export" / f"{name}-{capacity}-int4", hf_dir)
            if not (q / "manifest.json").is_file():
                quantize(exp, q, **quant)
            exp = q
        return exp

    def engine(exp, tag, **options):
        out = work / "engines" / f"{exp.name}-{tag}"
        digest = hashlib.sha256((exp / "manifest.json").read_bytes()).hexdigest()
        if (out / "manifest.json").is_file() and (
                json.loads((out / "manifest.json").read_text())["source"].get("export_manifest_sha256") != digest):
            shutil.rmtree(out)  # built from an earlier export
        if not (out / "manifest.json").is_file():
            build(exp, out, **options)
        return out

    int4 = {"mode": "int4-awq", "block_size": 32, "quantize_lm_head": True}
    if args.only in (None, "calls"):
        hf = random_llama(WORK / "llama31m")
        variants = {}
        for cap in (256, 4096):
            exp = exported(hf, "llama31m", cap)
            variants[f"plain, capacity {cap}"] = engine(exp, "plain", fusion=False)
            variants[f"fused, capacity {cap}"] = engine(exp, "fused")
        variants["int4 fused, capacity 256"] = engine(exported(hf, "llama31m", 256, int4), "fused")
        variants["int4 plain, capacity 256"] = engine(exported(hf, "llama31m", 256, int4), "plain", fusion=False)
        loaded = {n: load_engine(p, num_threads=args.threads) for n, p in variants.items()}
        weight_bytes = {n: stored_mb(p) * 1e6 for n, p in variants.items()}
        samples = {n: {"decode": [], "verify": []} for n in loaded}
        for r in range(args.rounds):
            probe()
            for n, e in loaded.items():
                for k, v in call_times(e, args.calls).items():
                    samples[n][k].append(v)
            log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {s['decode'][-1]:.2f}/{s['verify'][-1]:.2f} ms"
                                                            for n, s in samples.items()))
        bw = res["read_bandwidth_gbs"]
        calls = {}
        for n, s in samples.items():
            d, v = statistics.median(s["decode"]), statistics.median(s["verify"])
            bound_ms = weight_bytes[n] / (bw * 1e9) * 1e3
            calls[n] = {"decode_ms": d, "verify_ms": v, "verify_over_decode": v / d, "engine_mb": weight_bytes[n] / 1e6,
                        "bound_ms": bound_ms, "fraction_of_bound": bound_ms / d}
        for kind in ("plain", "fused"):
            calls[f"{kind}, capacity 4096"]["decode_4096_over_256"] = (
                calls[f"{kind}, capacity 4096"]["decode_ms"] / calls[f"{kind}, capacity 256"]["decode_ms"])
        res["calls"] = {"model": "random Llama, vocab 8000, hidden 512, 8 layers, 8/4 heads, 31M parameters",
                        "position": POSITION, "verify_tokens": VERIFY_TOKENS, "engines": calls}
        log(json.dumps(res["calls"], indent=1))

    if args.only in (None, "generation"):
        hf_dir = ROOT / "models" / "stdlib-target"
        exp = exported(hf_dir, "target", 512)
        fp_plain, fp = engine(exp, "plain", fusion=False), engine(exp, "fused")
        q4 = engine(exported(hf_dir, "target", 512, int4), "fused")
        tok = AutoTokenizer.from_pretrained(hf_dir)
        texts = load_prompts(ROOT / "models" / "heldout.json")[: args.prompts]
        prompts = [tok(t)["input_ids"] for t in texts]
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

        def hf_run(ids):
            x = torch.tensor([ids])
            with torch.no_grad():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, pad_token_id=0, eos_token_id=2)
            return out[0, len(ids):].tolist()

        gens = {"trtspec float32 (plain)": Generator(load_engine(fp_plain, num_threads=args.threads)),
                "trtspec float32": Generator(load_engine(fp, num_threads=args.threads)),
                "trtspec int4": Generator(load_engine(q4, num_threads=args.threads))}
        runners = {"HF generate()": hf_run, **{n: trtspec_runner(g, args.max_new_tokens) for n, g in gens.items()}}
        for precision in ("fp32", "int4"):
            path = og_build(hf_dir, work / f"og-target-{precision}", precision, args.threads)
            if path is not None:
                runners[f"onnxruntime-genai {precision}"] = og_runner(path, args.max_new_tokens)
        probe()
        rates, outputs, per_round = timed_rounds(runners, prompts, args.rounds, log)
        probe()
        # the host loop: a generation's time outside engine calls (batch 1, target only)
        host = []
        g = gens["trtspec float32"]
        for text in texts:
            st = g.generate([text], max_new_tokens=args.max_new_tokens).stats
            host.append(st.other_s / st.elapsed_s)
        base = outputs["HF generate()"]
        res["generation"] = {
            "model": "models/stdlib-target (27.3M parameters, untied)", "tok_s": rates,
            "trtspec_over_hf": rates["trtspec float32"] / rates["HF generate()"],
            "trtspec_over_og_fp32": rates["trtspec float32"] / rates["onnxruntime-genai fp32"]
            if "onnxruntime-genai fp32" in rates else None,
            "int4_over_float32": rates["trtspec int4"] / rates["trtspec float32"],
            "int4_over_og_int4": rates["trtspec int4"] / rates["onnxruntime-genai int4"]
            if "onnxruntime-genai int4" in rates else None,
            "int4_over_og_int4_per_round": paired(per_round, "trtspec int4", "onnxruntime-genai int4")
            if "onnxruntime-genai int4" in rates else None,
            "same_tokens_as_hf": {n: o == base for n, o in outputs.items()},
            "host_loop_share": statistics.median(host),
        }
        log(json.dumps(res["generation"], indent=1))
    save_results(RESULTS / "decode", res, markdown(res))


def markdown(res) -> str:
    lines = []
    bw = res["read_bandwidth_gbs"]  # the best of the run's probes
    if "calls" in res:
        c = res["calls"]
        lines += [f"Calls: {c['model']}, batch 1, position {c['position']}, medians; read bandwidth {bw:.1f} GB/s "
                  "(2-thread torch.sum over 256 MB, best of the run's probes).", "",
                  "| engine | MB | decode ms | bound ms | fraction of bound | verify (5 tokens) ms | verify / decode |",
                  "|---|---|---|---|---|---|---|"]
        for n, e in c["engines"].items():
            lines.append(f"| {n} | {e['engine_mb']:.1f} | {e['decode_ms']:.3f} | {e['bound_ms']:.3f} | "
                         f"{e['fraction_of_bound']:.2f} | {e['verify_ms']:.3f} | {e['verify_over_decode']:.2f} |")
        lines += ["", "Decode at capacity 4096 over capacity 256: " + ", ".join(
            f"{n.split(',')[0]} {e['decode_4096_over_256']:.2f}x" for n, e in c["engines"].items()
            if "decode_4096_over_256" in e), ""]
    if "generation" in res:
        g = res["generation"]
        lines += [f"Generation: {g['model']}, greedy, target only, batch 1, read bandwidth {bw:.1f} GB/s.", "",
                  "| runtime | tok/s | same tokens as HF |", "|---|---|---|"]
        for n, r in g["tok_s"].items():
            lines.append(f"| {n} | {r:.1f} | {g['same_tokens_as_hf'][n]} |")
        og = lambda v: "n/a" if v is None else f"{v:.2f}x"  # noqa: E731
        lines += ["", f"trtspec float32 / HF: {g['trtspec_over_hf']:.2f}x; / onnxruntime-genai fp32: "
                  f"{og(g['trtspec_over_og_fp32'])}; trtspec int4 / float32: {g['int4_over_float32']:.2f}x; "
                  f"/ onnxruntime-genai int4: {og(g['int4_over_og_int4'])}"
                  + (f" (round by round: median {g['int4_over_og_int4_per_round']['median']:.2f}x)"
                     if g.get("int4_over_og_int4_per_round") else "")
                  + f"; host loop {g['host_loop_share']:.1%} of a generation's time."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
