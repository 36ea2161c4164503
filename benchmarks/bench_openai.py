"""What the OpenAI surface costs, on the bundled pair (2 threads, in one process, rounds alternating):

Each prompt runs alone (batch 1), one after another, with the bundled draft in float32 and with its INT4 build
(int4-awq, block 32, lm_head included: engines/stdlib-draft-int4, built here if missing; the draft only proposes,
so either keeps the output the target's own).

1. logprobs: greedy generation with each draft, logprobs off vs on (logprobs=5: each token's and 5 alternatives).
2. structured output: JSON documents under a json_schema (runtime/grammar.py), with each draft vs without one (a
   Generator over the target alone; all with jump-forward: forced tokens are verified without drafting), greedy
   and sampled; every output is validated.
3. the grammar's share of a decode step: all the time spent in the grammar (llguidance's bitmasks and their
   application to the logits, the one-token checks of lazy masking, consuming and rolling back tokens, forced
   tokens) per token emitted, in each json_schema run, against a batch-1 target decode call measured in the same
   run.

    .venv/bin/python benchmarks/bench_openai.py [--rounds 5] [--max-tokens 128]

Writes benchmarks/results/openai.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, ROOT, save_results  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 200},
        "arguments": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                             "default": {"type": ["string", "null"], "maxLength": 24}},
            "required": ["name", "default"], "additionalProperties": False}},
        "returns": {"type": "string", "maxLength": 60},
    },
    "required": ["name", "summary", "arguments", "returns"],
    "additionalProperties": False,
}
PROMPTS = [
    'def list_python_files(top):\n    """Return the Python files under top."""\n\n# as JSON:\n',
    "class LRUCache:\n    def __init__(self, capacity):\n\n# as JSON:\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser()\n\n# as JSON:\n",
    "def read_config(path, defaults=None):\n\n# as JSON:\n",
]


def int4_draft():
    """engines/stdlib-draft-int4: the bundled draft's INT4 build (made from its export, as docs/building.md shows)."""
    from trtspec import build, export, quantize

    engine = ROOT / "engines" / "stdlib-draft-int4"
    if not (engine / "manifest.json").is_file():
        exported, quantized = ROOT / "export" / "stdlib-draft", ROOT / "export" / "stdlib-draft-int4"
        if not (exported / "manifest.json").is_file():
            export(ROOT / "models" / "stdlib-draft", exported, max_seq_len=512, max_batch=4)
        if not (quantized / "manifest.json").is_file():
            quantize(exported, quantized, mode="int4-awq", block_size=32, quantize_lm_head=True)
        build(quantized, engine)
    return engine


def run_alone(gen, prompts, **kw):
    """Each prompt alone (batch 1, the latency case), one after another: results and total seconds."""
    t0 = time.perf_counter()
    out = [gen.generate(p, **kw) for p in prompts]
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "openai")
    args = ap.parse_args(argv)
    import jsonschema

    from trtspec import Generator, load_engine
    from trtspec.bench import load_prompts
    from trtspec.runtime import grammar as grammar_module
    from trtspec.runtime.verify import expected_tokens_per_call

    target = load_engine(ROOT / "engines" / "stdlib-target", num_threads=2)
    draft = load_engine(ROOT / "engines" / "stdlib-draft", num_threads=2)
    draft4 = load_engine(int4_draft(), num_threads=2)
    drafting = {"draft": Generator(target, draft, num_draft_tokens=4),
                "int4 draft": Generator(target, draft4, num_draft_tokens=4)}
    plain = Generator(target)  # no draft at all: what a user without one runs
    heldout = load_prompts(ROOT / "models" / "heldout.json")[:8]
    fmt = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA}}

    # every call into the grammar, through the Constraint the runtime uses (the outermost call counts: a kept
    # mask's bitmask inside allows is not counted twice)
    grammar_s, depth = [0.0], [0]
    originals = {m: getattr(grammar_module.Constraint, m)  # (an older checkout has no allows)
                 for m in ("mask", "allows", "consume", "rollback", "forced", "allowed_prefix")
                 if hasattr(grammar_module.Constraint, m)}

    def timed(method):
        def call(self, *a, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return method(self, *a, **kw)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    grammar_s[0] += time.perf_counter() - t0
        return call

    for m, f in originals.items():
        setattr(grammar_module.Constraint, m, timed(f))
    grammar_us = {}  # run -> [us of grammar work per emitted token, per round]
    rows = {f"logprobs {on}{suffix}": [] for suffix in ("", ", int4 draft") for on in ("off", "on (5)")}
    rows.update({f"json_schema {label}, {which}": [] for label in ("greedy", "sampled")
                 for which in (*drafting, "no draft")})
    tokens, invalid, decode_ms, forced, calls, k_rounds, accepted = {}, 0, [], {}, {}, {}, {}
    verify4_ms, draft_ms, draft4_ms = [], [], []  # a target call over 4 tokens, one-token draft calls
    for gen in (*drafting.values(), plain):  # warm-up
        gen.generate(heldout[:2], max_new_tokens=16)
        gen.generate(PROMPTS[0], max_new_tokens=16, response_format=fmt)
    for rnd in range(args.rounds):
        runs = []
        for which, gen in drafting.items():
            suffix = "" if which == "draft" else f", {which}"
            runs += [(f"logprobs off{suffix}", gen, heldout, {}), (f"logprobs on (5){suffix}", gen, heldout, {"logprobs": 5})]
        for temperature, label in ((0.0, "greedy"), (0.8, "sampled")):
            for which, gen in (*drafting.items(), ("no draft", plain)):
                runs.append((f"json_schema {label}, {which}", gen, PROMPTS,
                             {"response_format": fmt, "temperature": temperature, "seed": 7}))
        if rnd % 2:
            runs = runs[::-1]  # alternate the order between rounds
        for name, gen, prompts, kw in runs:
            before = dict(gen.scheduler.stats().k_histogram)
            grammar_s[0] = 0.0
            out, seconds = run_alone(gen, prompts, max_new_tokens=args.max_tokens, **kw)
            after = gen.scheduler.stats().k_histogram
            k_rounds[name] = {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v > before.get(k, 0)}
            accepted[name] = sum(r.stats.accepted for r in out), sum(r.stats.accepted + r.stats.rejected for r in out)
            n = sum(len(r.token_ids) for r in out)
            rows[name].append(n / seconds)
            tokens[name] = n
            forced[name] = sum(r.stats.forced_tokens for r in out)
            calls[name] = sum(r.stats.target_calls for r in out)
            if "json" in name:
                grammar_us.setdefault(name, []).append(1e6 * grammar_s[0] / n)
                for r in out:
                    try:
                        jsonschema.validate(json.loads(r.text), SCHEMA)
                    except (ValueError, jsonschema.ValidationError):
                        invalid += r.finish_reason != "length"  # cut by max_tokens is not the grammar's fault
        for engine, t, record in ((target, 1, decode_ms), (target, 4, verify4_ms), (draft, 1, draft_ms),
                                  (draft4, 1, draft4_ms)):
            times = []
            engine.forward(np.array([[1]]), np.array([[0]]))
            for i in range(32):
                t0 = time.perf_counter()
                engine.forward(np.full((1, t), 5), np.arange(1, t + 1)[None] + t * i)
                times.append(time.perf_counter() - t0)
            record.append(1e3 * statistics.median(times))
    for m, f in originals.items():
        setattr(grammar_module.Constraint, m, f)
    decode = statistics.median(decode_ms)
    verify4 = statistics.median(verify4_ms)
    draft_call = {"draft": statistics.median(draft_ms), "int4 draft": statistics.median(draft4_ms)}
    # the most drafting could give JSON's free tokens with no host work: k = 3 drafts at the greedy rows' acceptance
    ideal = {}
    for which in drafting:
        acc, checked = accepted[f"json_schema greedy, {which}"]
        alpha = acc / checked if checked else 0.0
        ideal[which] = (alpha, expected_tokens_per_call(alpha, 3) / (3 * draft_call[which] + verify4) * decode)
    grammar_med = {name: statistics.median(v) for name, v in grammar_us.items()}
    worst = max(grammar_med, key=grammar_med.get)
    med = {name: statistics.median(v) for name, v in rows.items()}

    def paired(a, b):  # the median over rounds of a / b measured in the same round (the machine drifts between rounds)
        return statistics.median(x / y for x, y in zip(rows[a], rows[b]))

    ratios = {}
    for which in drafting:
        suffix = "" if which == "draft" else f", {which}"
        ratios[f"logprobs on / off{suffix}"] = paired(f"logprobs on (5){suffix}", f"logprobs off{suffix}")
        for label in ("greedy", "sampled"):
            ratios[f"json {label}: {which} / no draft"] = paired(f"json_schema {label}, {which}",
                                                                f"json_schema {label}, no draft")
    ratios["grammar / decode step (the most of the json runs)"] = grammar_med[worst] / 1e3 / decode
    res = {"rounds": args.rounds, "max_tokens": args.max_tokens, "tok_s_median": med, "tok_s_rounds": rows,
           "tokens": tokens, "forced_tokens": forced, "target_calls": calls, "invalid_documents": invalid,
           "k_rounds_last": k_rounds, "accepted_checked_last": accepted,
           "decode_step_ms": decode, "verify_4_tokens_ms": verify4, "draft_call_ms": draft_call,
           "json_greedy_alpha_and_ideal_free_token_speedup_k3": ideal,
           "grammar_us_per_token_median": grammar_med, "ratios": ratios}
    lines = [f"# The OpenAI surface's costs (bundled pair, 2 threads, {args.rounds} alternating rounds, medians; "
             "ratios: the median over rounds of each round's ratio)", "",
             "| run | tok/s | tokens | forced tokens | target calls | drafts accepted / checked | rounds by k |",
             "|---|---|---|---|---|---|---|"]
    for name, v in med.items():
        acc, checked = accepted[name]
        ks = " ".join(f"{k}:{c}" for k, c in k_rounds[name].items())
        lines.append(f"| {name} | {v:.1f} | {tokens[name]} | {forced[name]} | {calls[name]} | {acc} / {checked} | {ks} |")
    lines.append("")
    for which in drafting:
        suffix = "" if which == "draft" else f", {which}"
        lines += [f"- {which}: logprobs on / off {ratios[f'logprobs on / off{suffix}']:.3f}; json_schema with it / "
                  f"without a draft: greedy {ratios[f'json greedy: {which} / no draft']:.2f}x, sampled "
                  f"{ratios[f'json sampled: {which} / no draft']:.2f}x"]
    lines += [f"- grammar work per emitted token: "
              + ", ".join(f"{name.removeprefix('json_schema ')} {us:.1f} us" for name, us in grammar_med.items())
              + f"; the most = {100 * grammar_med[worst] / 1e3 / decode:.1f} % of a decode step ({decode:.2f} ms, "
              "batch 1)",
              f"- calls: target decode {decode:.2f} ms, target over 4 tokens {verify4:.2f} ms, draft decode "
              f"{draft_call['draft']:.2f} ms (float32), {draft_call['int4 draft']:.2f} ms (INT4); with no host work, "
              "3 drafts at the greedy JSON rows' acceptance would make the tokens the grammar leaves free "
              + " and ".join(f"{x:.2f}x faster with the {which} (alpha {a:.2f})" for which, (a, x) in ideal.items())
              + " than plain decoding",
              f"- documents that failed to validate: {invalid} (of {4 * 6 * args.rounds})"]
    save_results(args.out, res, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
