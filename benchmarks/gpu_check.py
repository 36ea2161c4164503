"""The torch.compile path and speculative decoding on a GPU, in one call with a time budget per stage.

    python benchmarks/gpu_check.py --device cuda --out $OUT          # a lent GPU: about 8 minutes on an H200
    python benchmarks/gpu_check.py --device cpu --smoke --out /tmp/g # here: every stage on tiny shapes

Stages, in this order (each stops at its budget, records why, and the next one starts; --deadline bounds the run):
  env              torch / transformers / GPU names and versions
  bandwidth        a device-to-device copy: bytes read plus written per second, the decode roofline's ceiling
  parity           the compiled step module (inductor) of the bundled target against HF on the same device, float32:
                   a prefill, a decode, a chain verify after a rollback, a token tree and a 17-token chain (the
                   uncaptured graph), each call's logits against HF's over the same sequences
  speculative      the bundled pair (models/stdlib-*), float32, on the same engines: target alone, draft chains and
                   trees through Generator, greedy, each checked token for token against the target alone; HF
                   generate() and HF assisted generation (assistant_model=) on the same prompts
  decode           random Qwen2.5-0.5B- and 1.5B-shaped models in bfloat16, batch 1: decode tok/s through the engine
                   (numpy in, logits out, as the runtime calls it) and with tokens kept on the device (greedy argmax
                   on the GPU, no host sync per token), against the copy-bandwidth bound on the weights and cache
                   read per token; HF generate() on the same weights
  calls            the 1.5B engine's call cost at T = 1, 5 and 17, chains and token trees (calls_pair: the bundled
                   target's float32 engine, after parity)
  parity_bf16, speculative_bf16   the first two again in bfloat16
  runtime, oracle, aot_cuda   gpu_round.py: Generator against the device loop, a drafter of known acceptance, the
                   AOTInductor build for the device against HF (a child process); with the decode stage, up to
                   about 11 minutes on an H200 (runs 5-7 in benchmarks/results/gpu: decode 2 minutes, runtime 72 s;
                   the oracle's budget is 5 minutes, the build's 4):
    python benchmarks/gpu_check.py --stages env,bandwidth,aot_cuda,decode,runtime,oracle --shapes 1.5B --no-hf ...

All stages take about 15 minutes on an H200, most of it compiling: within a lent machine's 8-minute calls, run them
as two calls (each prints its table; --cache carries the compiled kernels from the first to the second):
    python benchmarks/gpu_check.py --stages env,bandwidth,parity,calls_pair,speculative --cache $OUT/cache.tar.xz ...
    python benchmarks/gpu_check.py --stages env,bandwidth,decode,calls,parity_bf16 --cache .gpu/cache.tar.xz ...

Results go to OUT/gpu_check.json and OUT/gpu_check.md after every stage, so a run cut short keeps what it
measured. --pair DIR reads the bundled pair from DIR (a device call carries it compressed: see --unpack).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import tarfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_round  # noqa: E402  (the stages runtime, oracle, aot_cuda)

# Qwen2.5-0.5B and -1.5B shapes (their config.json files); smoke: the same layout, tiny
SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
}
SMOKE_SHAPES = {
    "0.5B": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "1.5B": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, vocab_size=512),
}
# stage -> seconds at most (full run; --smoke runs tiny shapes under the same budgets), in the order they run: the
# bundled pair first (its float32 target engine serves parity, call costs and generation alike), then the large
# shapes. Seen on an H200 (torch 2.11, 16 cores): inductor took 20-60 s a graph, the process's first about a minute,
# and an engine compiles a graph per shape class it is called with (B = 1 | B > 1) x (T = 1 | 2..16 | > 16).
BUDGETS = {"env": 30, "bandwidth": 30, "parity": 180, "calls_pair": 30, "speculative": 180, "decode": 180,
           "calls": 150, "parity_bf16": 120, "speculative_bf16": 150}
SPEC_CONFIGS = {  # name -> Generator options (None: the target alone); the chains and trees as bench_torch.py's
    "target alone": None,
    "prompt lookup, k=4": dict(drafter="prompt_lookup", num_draft_tokens=4, k_policy="fixed"),
    "draft, load-aware k (default)": dict(),
    "chain k=2": dict(num_draft_tokens=2, k_policy="fixed"),
    "chain k=4": dict(num_draft_tokens=4, k_policy="fixed"),
    "tree 5x2 (8 nodes)": dict(num_draft_tokens=5, tree_width=2, tree_nodes=8, k_policy="fixed"),
    "tree 6x3 (16 nodes)": dict(num_draft_tokens=6, tree_width=3, tree_nodes=16, k_policy="fixed"),
}


class StageTimeout(Exception):
    pass


@contextmanager
def budget(seconds: int):
    """Raise StageTimeout in the main thread once ``seconds`` have passed (checked between bytecodes), and again every
    half second until it gets out: raised inside a weakref callback or a __del__ (inductor compiles in them), Python
    prints "Exception ignored" and drops it (seen on the H200: a 150 s stage ran 252 s)."""

    def expire(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # (cancelled by the finally below once it got out)
        raise StageTimeout(f"stopped at its budget of {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Clock:
    """Seconds of device work: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn, repeats: int, warmup: int = 2) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(repeats):
            if self.cuda:
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out


# ---------------------------------------------------------------------------------------------------- stages


def stage_env(ctx) -> dict:
    import torch
    import transformers

    row = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": ctx.device}
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        row.update(gpu=p.name, multiprocessors=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    else:
        row.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return row


def stage_bandwidth(ctx) -> dict:
    """Device-to-device copy of a buffer far larger than the last-level cache: (bytes read + written) / time."""
    import torch

    n = (256 if ctx.smoke else 2048) * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    times = ctx.clock.time(lambda: dst.copy_(src), repeats=5 if ctx.smoke else 20, warmup=3)
    t = statistics.median(times)
    assert torch.equal(dst, src)
    return {"buffer_mib": n / 2**20, "median_ms": t * 1e3, "copy_gb_s": 2 * n / t / 1e9}


def stage_parity(ctx, dtype: str = "float32") -> dict:
    return parity(ctx, ctx.pair / "stdlib-target", dtype)


def pair_engines(ctx, dtype: str):
    """The bundled target (tree verify) and draft compiled for one row; shared by parity and generation, so
    their graphs compile once."""
    from trtspec import compile

    if dtype not in ctx.engines:
        ctx.engines[dtype] = tuple(
            compile(ctx.pair / name, max_seq_len=1024, max_batch=1, device=ctx.device, dtype=dtype, tree=tree)
            for name, tree in (("stdlib-target", True), ("stdlib-draft", False)))
    return ctx.engines[dtype]


def parity(ctx, model_dir: Path, dtype: str) -> dict:
    """Each call of the compiled engine against HF's logits over the same token sequences (same device and dtype;
    HF in float32 too, to show how far bfloat16 itself moves). Targets: float32 max|diff| <= 1e-4, bfloat16
    ||diff|| / ||ref|| <= 1e-2. One row (the engine generation runs on); the CPU suite checks ragged batches."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtspec.engines.base import tree_positions

    engine = pair_engines(ctx, dtype)[0]
    engine.reset()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(ctx.device).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(ctx.device).eval() \
        if dtype != "float32" else hf
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    seq = []  # the row's committed tokens

    def reference(model, tokens):  # logits [len(tokens), V] float32 numpy
        with torch.no_grad():
            return model(torch.tensor([tokens], device=ctx.device)).logits[0].float().cpu().numpy()

    def compare(label, got, ref, ref32):
        # got [1, T, V]; ref / ref32 [T, V]: HF in the engine's dtype and in float32
        diff = got[0] - ref
        return {"call": label, "max_abs_diff": float(np.abs(diff).max()),
                "rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
                "max_abs_logit": float(np.abs(ref).max()),
                "argmax_agree": float(np.mean(got[0].argmax(-1) == ref.argmax(-1))),
                "hf_vs_hf_float32_rel_l2": float(np.linalg.norm(ref - ref32) / np.linalg.norm(ref32))}

    def both(tokens, last):  # HF's logits of the last ``last`` positions, in the engine's dtype and in float32
        ref = reference(hf, tokens)[-last:]
        return ref, (reference(hf32, tokens)[-last:] if hf32 is not hf else ref)

    def chain_call(label, t, start):
        ids = rng.integers(3, vocab, size=(1, t))
        del seq[start:]  # a rollback: the slots past start are hidden by the mask and written over
        got = engine.forward(ids, np.arange(start, start + t)[None])
        seq.extend(ids[0].tolist())
        return compare(label, got, *both(seq, t))

    def tree_call(label, t):
        # every node has up to 3 children (as measure_call_costs' trees); the tree is not committed
        parents = [-1] + [(i - 1) // 3 for i in range(1, t)]
        mask, depth = tree_positions(np.array([parents]))
        ids = rng.integers(3, vocab, size=(1, t))
        got = engine.forward(ids, len(seq) + depth, tree_mask=mask)
        rows = []
        for i in range(t):  # node i's reference: the committed tokens, then its path from the root
            path, node = [], i
            while node >= 0:
                path.append(int(ids[0, node]))
                node = parents[node]
            rows.append([r[0] for r in both(seq + path[::-1], 1)])
        return compare(label, got, *(np.stack(x) for x in zip(*rows)))

    row = {"model": model_dir.name, "dtype": dtype, "calls": [],
           "target": "max|diff| <= 1e-4" if dtype == "float32" else "||diff||/||ref|| <= 1e-2"}
    stage = "parity" if dtype == "float32" else "parity_bf16"
    steps = [lambda: chain_call("prefill 7", 7, 0),
             lambda: chain_call("decode", 1, 7),
             lambda: chain_call("chain 5 after a rollback of 2", 5, 6),
             lambda: tree_call("tree 9", 9),
             lambda: chain_call("chain 17 (uncaptured graph)", 17, len(seq))]
    for step in steps:  # each call's result is kept as it comes: a first call compiles for a minute on a GPU
        row["calls"].append(step())
        row["worst_max_abs_diff"] = max(c["max_abs_diff"] for c in row["calls"])
        row["worst_rel_l2"] = max(c["rel_l2"] for c in row["calls"])
        row["met"] = (row["worst_max_abs_diff"] <= 1e-4 if dtype == "float32" else row["worst_rel_l2"] <= 1e-2)
        ctx.partial(stage, row)
    return row


def make_shape(ctx, name: str) -> Path:
    """A random-init Qwen2-layout model of the named shape, bfloat16, saved with the tiny test tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trtspec.testing import make_tokenizer

    out = ctx.work / f"qwen2-{name}"
    if (out / "config.json").is_file():
        return out
    shape = (SMOKE_SHAPES if ctx.smoke else SHAPES)[name]
    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(ctx.device):  # random init of 1.5B parameters is seconds on a GPU, minutes on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


def step_bytes(engine) -> int:
    """Bytes one decode step reads at least: every weight once (the embedding table only as the lm_head, if tied;
    one row otherwise) and the whole cache (attention's mask spans every slot)."""
    module = engine.module
    seen, total = set(), 0
    embed = module.step.embed.weight
    for p in module.step.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is embed and embed.data_ptr() != module.step.lm_head.weight.data_ptr():
            continue  # an untied embedding table: one row per token
        total += p.numel() * p.element_size()
    return total + sum(c.numel() * c.element_size() for c in engine.caches)


def decode_rates(ctx, engine, new_tokens: int, prompt_len: int = 16) -> dict:
    """Greedy decode at batch 1: through engine.forward (host in/out) and on the device (tokens stay there)."""
    import torch

    ids = np.arange(prompt_len)[None] % 200 + 5
    engine.reset()
    for p in range(prompt_len):  # one-token calls only: the T = 1 graph is all this needs compiled
        logits = engine.forward(ids[:, p : p + 1], np.array([[p]]))
    # engine path: what Generator pays per target call
    nxt, per_call = int(logits[0, -1].argmax()), []
    for i in range(new_tokens):
        t0 = time.perf_counter()
        logits = engine.forward(np.array([[nxt]]), np.array([[prompt_len + i]]))
        per_call.append(time.perf_counter() - t0)
        nxt = int(logits[0, -1].argmax())
    engine_tok_s = 1 / statistics.median(per_call)
    # device path: the compiled (CUDA-graphed) step called with device tensors, argmax on the device
    fn, dev = engine._graphed, engine.device
    positions = torch.arange(prompt_len, prompt_len + new_tokens, device=dev).view(-1, 1, 1)
    tree = torch.ones((1, 1, 1), dtype=torch.bool, device=dev) if engine.tree_verify else None

    def run():
        tok = torch.full((1, 1), 7, dtype=torch.long, device=dev)
        with torch.no_grad():
            for i in range(new_tokens):
                logits, _ = fn(tok, positions[i], tree)
                tok = logits[:, -1].argmax(-1, keepdim=True)
        return tok

    times = ctx.clock.time(run, repeats=3 if ctx.smoke else 5, warmup=1)
    device_tok_s = new_tokens / statistics.median(times)
    return {"engine_tok_s": engine_tok_s, "engine_call_ms": statistics.median(per_call) * 1e3,
            "device_tok_s": device_tok_s, "device_step_ms": 1e3 / device_tok_s}


def hf_generate_rate(ctx, model_dir: Path, new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(ctx.device).eval()
    ids = torch.arange(16, device=ctx.device)[None] % 200 + 5
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    times = ctx.clock.time(lambda: model.generate(ids, **kw), repeats=2, warmup=0)
    del model
    return new_tokens / statistics.median(times)


def stage_decode(ctx) -> dict:
    import torch

    from trtspec import compile

    out = {}
    new = 32 if ctx.smoke else 128
    for name in ctx.shapes:
        with ctx.substage(f"decode {name}"):
            model_dir = make_shape(ctx, name)
            tree = name == "1.5B"  # that engine serves the calls stage too
            t0 = time.perf_counter()
            engine = compile(model_dir, max_seq_len=1024, max_batch=1, device=ctx.device, dtype="bfloat16", tree=tree)
            row = {"parameters_m": sum(p.numel() for p in engine.module.step.parameters()) / 1e6,
                   "tree_engine": tree, "max_seq_len": 1024}
            row["bytes_per_step_mb"] = step_bytes(engine) / 1e6
            row.update(decode_rates(ctx, engine, new))
            row["compile_and_first_calls_s"] = time.perf_counter() - t0
            bw = ctx.results.get("bandwidth", {}).get("copy_gb_s")
            if bw:
                row["bound_tok_s"] = bw * 1e9 / (row["bytes_per_step_mb"] * 1e6)
                row["device_fraction_of_bound"] = row["device_tok_s"] / row["bound_tok_s"]
                row["engine_fraction_of_bound"] = row["engine_tok_s"] / row["bound_tok_s"]
            if tree:
                ctx.engines["1.5B"] = engine
            else:
                del engine
            out[name] = row
            ctx.partial("decode", out)
            if ctx.hf:
                row["hf_generate_tok_s"] = hf_generate_rate(ctx, model_dir, new // 2)
                ctx.partial("decode", out)
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
    return out


def stage_calls(ctx, model: str = "1.5B") -> dict:
    """Call cost at T = 1, 5, 17 (chains) and 5, 17 (trees) on the 1.5B engine (bfloat16) or the bundled target
    (float32, the engine parity and generation ran): through engine.forward, and of the compiled step alone with
    device inputs (T <= 16 replay a CUDA graph; 17 runs the general graph)."""
    import torch

    from trtspec.bench import measure_call_costs
    from trtspec.engines.base import chain_mask, tree_positions

    engine = pair_engines(ctx, "float32")[0] if model == "stdlib-target" else ctx.engines.get(model)
    if engine is None:
        raise RuntimeError(f"the decode stage did not leave its {model} engine")
    engine.reset()
    position = 300
    engine.forward(np.arange(position)[None] % 200 + 5, np.arange(position)[None])  # a cache to attend to
    repeats = 5 if ctx.smoke else 30
    rows = []
    for t, tree in ((1, False), (5, False), (17, False), (5, True), (17, True)):
        host = measure_call_costs(engine, [t], position=position, repeats=repeats, warmup=3, tree=tree)[t]
        if tree:
            mask, depth = tree_positions(np.array([[-1] + [(i - 1) // 3 for i in range(1, t)]]))
            pos = position + depth
        else:
            mask, pos = chain_mask(1, t), np.arange(position, position + t)[None]
        fn = engine._graphed if t <= 16 else engine._general
        args = [torch.ones((1, t), dtype=torch.long, device=engine.device), torch.from_numpy(pos).to(engine.device),
                torch.from_numpy(mask.copy()).to(engine.device)]

        def call():
            with torch.no_grad():
                return fn(*args)

        device = statistics.median(ctx.clock.time(call, repeats=repeats, warmup=3))
        rows.append({"tokens": t, "tree": tree, "engine_ms": host * 1e3, "device_ms": device * 1e3})
    decode = rows[0]
    for r in rows:
        r["engine_x_decode"] = r["engine_ms"] / decode["engine_ms"]
        r["device_x_decode"] = r["device_ms"] / decode["device_ms"]
    return {"model": model, "dtype": str(engine.caches[0].dtype).removeprefix("torch."), "position": position,
            "calls": rows}


def speculative(ctx, dtype: str = "float32", stage: str = "speculative") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtspec import Generator
    from trtspec.bench import load_prompts

    prompts = load_prompts(ctx.pair / "heldout.json")[: 2 if ctx.smoke else 8]
    new, runs = (16, 1) if ctx.smoke else (128, 3)
    target, draft = pair_engines(ctx, dtype)
    row = {"dtype": dtype, "prompts": len(prompts), "new_tokens": new, "runs": runs, "configs": {}}
    outputs = {}
    for name, options in SPEC_CONFIGS.items():
        if options is None:
            gen = Generator(target)
        elif options.get("drafter") == "prompt_lookup":
            gen = Generator(target, **options)
        else:
            gen = Generator(target, draft, **options)
        t0 = time.perf_counter()
        for p in prompts:  # compile / capture every shape these prompts need first
            gen.generate(p, max_new_tokens=new)
        warm = time.perf_counter() - t0
        rates = []
        for _ in range(runs):
            t0 = time.perf_counter()
            results = [gen.generate(p, max_new_tokens=new) for p in prompts]
            rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0))
        gen.close()
        calls = sum(r.stats.target_calls for r in results)
        outputs[name] = [r.token_ids for r in results]
        row["configs"][name] = {"tok_s": statistics.median(rates), "warm_up_s": warm,
                                "tokens_per_target_call": sum(map(len, outputs[name])) / max(calls, 1),
                                "equals_target_alone": outputs[name] == outputs["target alone"]}
        ctx.partial(stage, row)
    alone = row["configs"]["target alone"]["tok_s"]
    for c in row["configs"].values():
        c["speedup"] = c["tok_s"] / alone
    # HF generate() and assisted generation on the same prompts, greedy
    tok = AutoTokenizer.from_pretrained(ctx.pair / "stdlib-target")
    hf_t, hf_d = (AutoModelForCausalLM.from_pretrained(ctx.pair / name, dtype=getattr(torch, dtype))
                  .to(ctx.device).eval() for name in ("stdlib-target", "stdlib-draft"))
    hf_rows = {}
    for name, extra in (("HF generate()", {}), ("HF assisted (assistant_model=draft)", {"assistant_model": hf_d})):
        def run():
            texts = []
            for p in prompts:
                ids = torch.tensor([tok(p)["input_ids"]], device=ctx.device)
                gen = hf_t.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                    pad_token_id=tok.pad_token_id, **extra)
                texts.append(gen[0, ids.shape[1]:].tolist())
            return texts

        run()
        rates = []
        for _ in range(runs):
            t0 = time.perf_counter()
            texts = run()
            rates.append(sum(map(len, texts)) / (time.perf_counter() - t0))
        hf_rows[name] = {"tok_s": statistics.median(rates),
                         "equals_trtspec_target_alone": [t[: len(o)] for t, o in zip(texts, outputs["target alone"])]
                         == outputs["target alone"]}
    row["hf"] = hf_rows
    best = max(row["configs"].items(), key=lambda kv: kv[1]["tok_s"])
    row["best"] = {"config": best[0], "speedup_over_target_alone": best[1]["speedup"],
                   "x_hf_generate": best[1]["tok_s"] / hf_rows["HF generate()"]["tok_s"],
                   "x_hf_assisted": best[1]["tok_s"] / hf_rows["HF assisted (assistant_model=draft)"]["tok_s"]}
    return row


STAGES = {"env": stage_env, "bandwidth": stage_bandwidth, "parity": stage_parity,
          "calls_pair": lambda ctx: stage_calls(ctx, "stdlib-target"), "speculative": speculative,
          "decode": stage_decode, "calls": stage_calls,
          "parity_bf16": lambda ctx: stage_parity(ctx, "bfloat16"),
          "speculative_bf16": lambda ctx: speculative(ctx, "bfloat16", "speculative_bf16"),
          **gpu_round.STAGES}
BUDGETS.update(gpu_round.BUDGETS)


# ---------------------------------------------------------------------------------------------------- run


class Context:
    def __init__(self, args):
        self.device, self.smoke, self.pair, self.out = args.device, args.smoke, args.pair, args.out
        self.work, self.shapes, self.hf = args.work, args.shapes.split(","), not args.no_hf
        self.clock = Clock(args.device)
        self.results: dict = {}
        self.engines: dict = {}
        self.started = time.perf_counter()

    @contextmanager
    def substage(self, name):
        t0 = time.perf_counter()
        print(f"[{time.perf_counter() - self.started:6.1f} s] {name} ...", flush=True)
        yield
        print(f"[{time.perf_counter() - self.started:6.1f} s] {name} done in {time.perf_counter() - t0:.1f} s",
              flush=True)

    def partial(self, stage, value):
        self.results[stage] = value
        self.write()

    def write(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "gpu_check.md").write_text(markdown(self.results))


def _f(x, spec=".1f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(r: dict) -> str:
    lines = []
    env = r.get("env", {})
    lines.append(f"Device: {env.get('gpu') or env.get('cpu', '?')}; torch {env.get('torch')}, "
                 f"transformers {env.get('transformers')}, CUDA {env.get('cuda', '-')}.")
    if "bandwidth" in r and "copy_gb_s" in r["bandwidth"]:
        b = r["bandwidth"]
        lines.append(f"Copy bandwidth (read + written): {b['copy_gb_s']:.0f} GB/s ({b['buffer_mib']:.0f} MiB copy, "
                     f"median {b['median_ms']:.3f} ms).")
    for stage, value in r.items():
        if isinstance(value, dict) and "error" in value:
            lines.append(f"\n**{stage}: {value['error']}**")
    parities = [r[k] for k in ("parity", "parity_bf16") if isinstance(r.get(k), dict) and "calls" in r[k]]
    if parities:
        lines += ["", "### Parity: compiled step module vs HF, same device", "",
                  "| dtype | call | max abs diff | rel L2 | argmax agree | HF dtype vs HF fp32 (rel L2) |",
                  "|---|---|---|---|---|---|"]
        for v in parities:
            for c in v["calls"]:
                lines.append(f"| {v['dtype']} | {c['call']} | {c['max_abs_diff']:.2e} | {c['rel_l2']:.2e} | "
                             f"{c['argmax_agree']:.3f} | {c['hf_vs_hf_float32_rel_l2']:.2e} |")
            lines.append(f"| {v['dtype']} | **target {v['target']}** | {v['worst_max_abs_diff']:.2e} | "
                         f"{v['worst_rel_l2']:.2e} | {'met' if v['met'] else 'NOT met'} over {len(v['calls'])} of 5 "
                         "calls | |")
    d = r.get("decode", {})
    if any(isinstance(v, dict) and "device_tok_s" in v for v in d.values()):
        lines += ["", "### Decode, batch 1, bfloat16, random weights", "",
                  "| shape | params (M) | bytes/step (MB) | bound tok/s | device-loop tok/s (x bound) | "
                  "engine.forward tok/s (x bound) | HF generate() tok/s |", "|---|---|---|---|---|---|---|"]
        for name, v in d.items():
            if not isinstance(v, dict) or "device_tok_s" not in v:
                continue
            lines.append(f"| {name} | {v['parameters_m']:.0f} | {v['bytes_per_step_mb']:.0f} | "
                         f"{_f(v.get('bound_tok_s'), '.0f')} | {v['device_tok_s']:.0f} "
                         f"({_f(v.get('device_fraction_of_bound'), '.2f')}) | {v['engine_tok_s']:.0f} "
                         f"({_f(v.get('engine_fraction_of_bound'), '.2f')}) | "
                         f"{_f(v.get('hf_generate_tok_s'), '.0f')} |")
    for c in (r.get(k) for k in ("calls_pair", "calls")):
        if not isinstance(c, dict) or "calls" not in c:
            continue
        lines += ["", f"### Call costs, {c['model']} {c.get('dtype', '')}, batch 1, position {c['position']}", "",
                  "| call | engine.forward ms (x decode) | compiled step ms (x decode) |", "|---|---|---|"]
        for x in c["calls"]:
            kind = "tree" if x["tree"] else ("decode" if x["tokens"] == 1 else "chain")
            lines.append(f"| {kind} T={x['tokens']} | {x['engine_ms']:.3f} ({x['engine_x_decode']:.2f}x) | "
                         f"{x['device_ms']:.3f} ({x['device_x_decode']:.2f}x) |")
    for v in (r.get(k) for k in ("speculative", "speculative_bf16")):
        if not isinstance(v, dict) or "configs" not in v:
            continue
        lines += ["", f"### Speculative generation, bundled pair, {v['dtype']}, greedy, {v['prompts']} prompts x "
                  f"{v['new_tokens']} new tokens, median of {v['runs']} runs", "",
                  "| config | tok/s | speedup | tokens/target call | equals target alone |", "|---|---|---|---|---|"]
        for name, cfg in v["configs"].items():
            lines.append(f"| {name} | {cfg['tok_s']:.0f} | {_f(cfg.get('speedup'), '.2f')} | "
                         f"{cfg['tokens_per_target_call']:.2f} | {cfg['equals_target_alone']} |")
        for name, h in v.get("hf", {}).items():
            lines.append(f"| {name} | {h['tok_s']:.0f} | | | {h['equals_trtspec_target_alone']} |")
    lines += gpu_round.markdown(r)
    return "\n".join(lines) + "\n"


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack a carried tar.xz of models/stdlib-{target,draft} and models/heldout.json; returns their folder."""
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "models"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few tokens: checks every stage runs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    ap.add_argument("--work", type=Path, default=ROOT / "models" / "bench" / "gpu_check")
    ap.add_argument("--pair", type=Path, default=ROOT / "models", help="folder with stdlib-target, stdlib-draft, "
                    "heldout.json")
    ap.add_argument("--unpack", type=Path, help="a tar.xz of the pair to unpack into --work first (sets --pair)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--shapes", default="1.5B,0.5B", help="the decode stage's model shapes, of 1.5B, 0.5B")
    ap.add_argument("--no-hf", action="store_true", help="leave out HF generate() beside the decode stage")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage's time budget")
    ap.add_argument("--deadline", type=float, default=540, help="seconds for the whole run (scaled like the "
                    "stages): a stage gets at most what is left, and none starts with under 10 s left")
    ap.add_argument("--cache", type=Path, help="a tar.xz of torch.compile's caches: unpacked before the run where it "
                    "exists (a rerun compiles less), written after it (at most 15 MiB)")
    args = ap.parse_args(argv)
    # torch.compile's caches (inductor's FX graphs, Triton's kernels) in one folder that can travel to a rerun
    cache_dir = args.work / "inductor-cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    if args.cache and args.cache.is_file():
        with tarfile.open(args.cache) as tar:
            tar.extractall(args.work, filter="data")
    import torch

    if args.device == "cpu":
        torch.set_num_threads(2)
    elif not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA GPU here; use --device cpu --smoke")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.unpack:
        args.pair = unpack(args.unpack, args.work)
    ctx = Context(args)
    deadline = ctx.started + args.deadline * args.budget_scale
    for name in args.stages.split(","):
        left = deadline - time.perf_counter()
        if left < 10:
            ctx.partial(name, {"error": f"not started: {left:.0f} s of the run's deadline left"})
            continue
        seconds = max(1, int(min(BUDGETS[name] * args.budget_scale, left)))
        t0 = time.perf_counter()
        print(f"== {name} (budget {seconds} s)", flush=True)
        try:
            with budget(seconds):
                value = STAGES[name](ctx)
        except StageTimeout as e:
            value = {**ctx.results.get(name, {}), "error": str(e)}
        except Exception as e:
            traceback.print_exc()
            value = {**ctx.results.get(name, {}), "error": f"{type(e).__name__}: {e}"}
        value["seconds"] = time.perf_counter() - t0
        value["cudagraph_skips_so_far"] = cudagraph_skips()
        ctx.partial(name, value)
        print(json.dumps(value, default=str)[:2000], flush=True)
    if args.cache:
        save_cache(cache_dir, args.cache)
    text = markdown(ctx.results)
    print(text)
    return 0


def cudagraph_skips() -> int:
    """How often inductor ran a graph without capturing it (the reasons are in the log with TORCH_LOGS=perf_hints)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def save_cache(cache_dir: Path, archive: Path, limit: int = 15 * 2**20, raw_limit: int = 150 * 2**20):
    if not cache_dir.is_dir():
        return
    raw = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())
    if raw > raw_limit:
        print(f"torch.compile caches left out: {raw / 2**20:.0f} MiB before compression")
        return
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=1) as tar:
        tar.add(cache_dir, arcname=cache_dir.name)
    size = tmp.stat().st_size
    if size <= limit:
        tmp.replace(archive)
        print(f"torch.compile caches: {archive} ({size / 2**20:.1f} MiB)")
    else:
        tmp.unlink()
        print(f"torch.compile caches left out: {size / 2**20:.1f} MiB is over {limit / 2**20:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
