"""Per-token cost of a JSON-schema grammar mask on this CPU: llguidance vs xgrammar (issue 31's choice).

For each schema, a valid JSON document is tokenized with the bundled tokenizer; each library then computes the
allowed-token mask before every token and consumes the token, as a decoder does. Reported: compile time per
schema and the per-token mask cost (median over tokens, then median over rounds), next to a float32 decode
step of the bundled target (engines/stdlib-target, batch 1) measured in the same run.

    .venv/bin/python benchmarks/bench_grammar.py [--rounds 5]
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

SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "tags"]},
     {"name": "os.path.join", "age": 42, "tags": ["files", "paths", "strings"]}),
    ({"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["file", "dir", "link"]},
                                         "size": {"type": "number"}}, "required": ["id", "kind", "size"]}}},
      "required": ["items"]},
     {"items": [{"id": i, "kind": ["file", "dir", "link"][i % 3], "size": 1.5 * i} for i in range(6)]}),
    ({"type": "object"}, {"result": {"ok": True, "values": [1, 2, 3], "message": "def main(): return None"}}),
]


def llguidance_setup(tokenizer, vocab):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)


def llguidance_run(lltok, vocab, schema, tokens):
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    mask = lnp.allocate_token_bitmask(1, vocab)
    per_token = []
    for t in tokens:
        t1 = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        per_token.append(time.perf_counter() - t1)
        assert matcher.consume_token(t), matcher.get_error()
    return compile_s, per_token


def xgrammar_setup(tokenizer, vocab):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1,
                               cache_enabled=False)


def xgrammar_run(compiler, vocab, schema, tokens):
    import xgrammar as xgr

    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    per_token = []
    for t in tokens:
        t1 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        per_token.append(time.perf_counter() - t1)
        assert matcher.accept_token(t)
    return compile_s, per_token


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "stdlib-target")
    ap.add_argument("--out", type=Path, default=RESULTS / "grammar")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from trtspec.engines import load_engine

    engine = load_engine(args.engine, num_threads=2)
    tokenizer = AutoTokenizer.from_pretrained(args.engine / "tokenizer")
    vocab = engine.vocab_size
    docs = [(s, tokenizer.encode(json.dumps(d), add_special_tokens=False)) for s, d in SCHEMAS]
    libs = {"llguidance": (llguidance_setup, llguidance_run), "xgrammar": (xgrammar_setup, xgrammar_run)}
    rounds = {name: {"setup_ms": [], "compile_ms": [], "mask_us": []} for name in libs}
    decode_ms = []
    for _ in range(args.rounds):
        for name, (setup, run) in libs.items():  # alternating within each round
            compiles, masks = [], []
            t0 = time.perf_counter()
            prepared = setup(tokenizer, vocab)
            rounds[name]["setup_ms"].append(1e3 * (time.perf_counter() - t0))
            for schema, tokens in docs:
                c, per = run(prepared, vocab, schema, tokens)
                compiles.append(c)
                masks.extend(per)
            rounds[name]["compile_ms"].append(1e3 * statistics.median(compiles))
            rounds[name]["mask_us"].append(1e6 * statistics.median(masks))
        engine.forward(np.array([[1]]), np.array([[0]]))
        times = []
        for i in range(32):
            t0 = time.perf_counter()
            engine.forward(np.array([[5]]), np.array([[i + 1]]))
            times.append(time.perf_counter() - t0)
        decode_ms.append(1e3 * statistics.median(times))
    decode = statistics.median(decode_ms)
    res = {"vocab": vocab, "tokens": sum(len(t) for _, t in docs), "rounds": args.rounds,
           "decode_step_ms": decode, "libraries": {}}
    for name, r in rounds.items():
        mask = statistics.median(r["mask_us"])
        res["libraries"][name] = {"tokenizer_setup_ms": statistics.median(r["setup_ms"]), "compile_ms": statistics.median(r["compile_ms"]), "mask_us": mask,
                                  "mask_per_decode_step": mask / 1e3 / decode}
    lines = [f"# Grammar mask cost (vocab {vocab}, {res['tokens']} tokens of 3 JSON documents, {args.rounds} rounds)",
             "", f"float32 decode step of the bundled target, batch 1: {decode:.2f} ms", "",
             "| library | tokenizer setup (ms, once) | compile per schema (ms) | mask per token (us) | mask / decode step |",
             "|---|---|---|---|---|"]
    for name, r in res["libraries"].items():
        lines.append(f"| {name} | {r['tokenizer_setup_ms']:.1f} | {r['compile_ms']:.1f} | {r['mask_us']:.1f} | {100 * r['mask_per_decode_step']:.1f} % |")
    save_results(args.out, res, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
