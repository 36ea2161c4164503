"""gpu_check.py's stages of the device-resident runtime: the runtime against the compiled step, the AOTInductor
build for the device, and speculation with a drafter of known acceptance (bench_oracle.py). Run after the decode
stage, whose 1.5B engine (ctx.engines["1.5B"]) they share:

    python benchmarks/gpu_check.py --stages env,bandwidth,decode,runtime,oracle,aot_cuda --shapes 1.5B --no-hf ...

  runtime    Generator (target alone) on the decode stage's engine: greedy (the engine's own loop, tokens on the
             device) and sampled (coupled, temperature 0.8: each round's pick made on the device, runtime/picks.py),
             tok/s against the compiled step's device loop measured in the same stage
  oracle     bench_oracle.oracle_rows on the same engine: a = 0.6 and 0.8, k = 2, 4, 8 against the target alone
  aot_cuda   `trtspec build --backend torch --device DEVICE` of a small random Qwen2 (float32), as the CUDA build
             is made (no live-length input), against HF on a prefill, a decode and a 5-token verify (<= 1e-4)
"""

from __future__ import annotations

import statistics
import time

import numpy as np

PROMPTS = ["def fibonacci(n):", "The three laws of motion are", "import numpy as np\n\nclass Matrix:",
           "Once upon a time"]
BUDGETS = {"runtime": 90, "oracle": 150, "aot_cuda": 240}


def _engine(ctx):
    engine = ctx.engines.get("1.5B")
    if engine is None:
        raise RuntimeError("the decode stage did not leave its 1.5B engine: run --stages ...,decode,runtime,... "
                           "with --shapes 1.5B")
    return engine


def stage_runtime(ctx) -> dict:
    import gpu_check

    from trtspec import Generator

    engine = _engine(ctx)
    new = 32 if ctx.smoke else 128
    row = {"new_tokens": new, "device_loop": gpu_check.decode_rates(ctx, engine, new)}
    device = row["device_loop"]["device_tok_s"]
    gen = Generator(engine)
    for name, options in (("greedy", {}), ("sampled (coupled, temperature 0.8)", {"temperature": 0.8, "seed": 1})):
        gen.generate(PROMPTS[0], max_new_tokens=new, **options)  # its shapes compiled and captured first
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = gen.generate(PROMPTS[0], max_new_tokens=new, **options)
            rates.append(len(out.token_ids) / (time.perf_counter() - t0))
        row[name] = {"tok_s": statistics.median(rates), "x_device_loop": statistics.median(rates) / device,
                     "tokens": len(out.token_ids)}
        ctx.partial("runtime", row)
    gen.close()
    row["met_0_9"] = row["greedy"]["x_device_loop"] >= 0.9
    return row


def stage_oracle(ctx) -> dict:
    from bench_oracle import oracle_rows

    engine = _engine(ctx)
    new = 24 if ctx.smoke else 96
    rows = oracle_rows(engine, PROMPTS[:2] if ctx.smoke else PROMPTS, new, runs=1 if ctx.smoke else 2,
                       k_values=(2, 4) if ctx.smoke else (2, 4, 8), call_repeats=5 if ctx.smoke else 20,
                       log=lambda line: print(line, flush=True))
    best = next((r for r in rows["rows"] if r["a"] == 0.8 and r["k"] == 4), None)
    if best:
        rows["target_a0.8_k4"] = {"speedup": best["speedup"], "fraction_of_ideal": best["fraction_of_ideal"],
                                  "met": best["speedup"] >= 2.5 and best["fraction_of_ideal"] >= 0.85}
    return rows


def stage_aot_cuda(ctx) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trtspec import load_engine
    from trtspec.testing import make_tokenizer
    from trtspec.torch_backend.aot import build_torch

    src, out = ctx.work / "qwen2-aot-src", ctx.work / "qwen2-aot-engine"
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096, rope_theta=1e6,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    t0 = time.perf_counter()
    # live=False: the CUDA build's form (no live-length input) on the CPU too, so the smoke run traces what a GPU does
    build_torch(src, None, out, device=ctx.device, max_seq_len=512, max_batch=2, live=False)
    row = {"build_s": time.perf_counter() - t0, "device": ctx.device}
    engine = load_engine(out)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(ctx.device).eval()
    ids = np.random.default_rng(0).integers(3, config.vocab_size, size=13)
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], device=ctx.device)).logits[0].float().cpu().numpy()
    engine.reset()
    calls = []
    for name, start, end in (("prefill 7", 0, 7), ("decode", 7, 8), ("verify 5", 8, 13)):
        got = engine.forward(ids[None, start:end], np.arange(start, end)[None])
        calls.append({"call": name, "max_abs_diff": float(np.abs(got[0] - want[start:end]).max())})
    row["calls"] = calls
    row["worst_max_abs_diff"] = max(c["max_abs_diff"] for c in calls)
    row["met_1e-4"] = row["worst_max_abs_diff"] <= 1e-4
    tokens = []
    engine.reset()
    engine.greedy_steps(0, int(ids[0]), 0, 16, lambda t: tokens.append(t) or True)
    engine.reset()
    logits = engine.forward(np.array([[int(ids[0])] + tokens[:-1]]), np.arange(16)[None])
    row["greedy_steps_equal_forward"] = logits[0].argmax(-1).tolist() == tokens
    return row


def markdown(r: dict) -> list[str]:
    lines = []
    rt = r.get("runtime")
    if isinstance(rt, dict) and "device_loop" in rt:
        lines += ["", f"### Runtime vs the compiled step's device loop (1.5B bfloat16, {rt['new_tokens']} tokens)", "",
                  "| path | tok/s | x device loop |", "|---|---|---|",
                  f"| device loop | {rt['device_loop']['device_tok_s']:.0f} | 1.00 |",
                  f"| engine.forward (host in/out) | {rt['device_loop']['engine_tok_s']:.0f} | "
                  f"{rt['device_loop']['engine_tok_s'] / rt['device_loop']['device_tok_s']:.2f} |"]
        for name in ("greedy", "sampled (coupled, temperature 0.8)"):
            if name in rt:
                lines.append(f"| Generator, {name} | {rt[name]['tok_s']:.0f} | {rt[name]['x_device_loop']:.2f} |")
    orc = r.get("oracle")
    if isinstance(orc, dict) and "rows" in orc:
        from bench_oracle import markdown as oracle_markdown

        lines += ["", oracle_markdown(orc, "Oracle drafter (1.5B bfloat16)").replace("# ", "### ", 1)]
    aot = r.get("aot_cuda")
    if isinstance(aot, dict) and "calls" in aot:
        lines += ["", f"### AOTInductor build on {aot['device']} (float32, no live input): built in "
                  f"{aot['build_s']:.0f} s; worst max|diff| vs HF {aot['worst_max_abs_diff']:.2e} "
                  f"({'met' if aot['met_1e-4'] else 'NOT met'}); greedy loop = forward: "
                  f"{aot['greedy_steps_equal_forward']}"]
    return lines


STAGES = {"runtime": stage_runtime, "oracle": stage_oracle, "aot_cuda": stage_aot_cuda}
