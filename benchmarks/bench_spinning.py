"""onnxruntime thread spinning, A/B: the decode call and speculation with each setting, in one run.

    python benchmarks/bench_spinning.py --target engines/stdlib-target --draft engines/stdlib-draft \
        [--int4 models/bench/decode/engines/target-512-int4-fused]

Settings: "off" (allow_spinning 0), "on" (allow_spinning 1), "on, stopped after each run" (allow_spinning 1 +
session.force_spinning_stop 1, trtspec's default). For each, in alternating rounds: the median decode call
(1 token at position 128) of the target (and of an INT4 engine), and greedy tok/s of target-only and of
speculation with the draft at k = 4 over 6 held-out prompts x 128 tokens. Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import ROOT

import trtspec.engines.onnxruntime as ort_engine

SETTINGS = {"off": {"session.intra_op.allow_spinning": "0"},
            "on": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "0"},
            "on, stopped after each run": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}}


def with_setting(entries: dict):
    original = ort_engine.session_options

    def options(num_threads, *, fuse_qdq=True):
        so = original(num_threads, fuse_qdq=fuse_qdq)
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        return so

    return options


def decode_ms(engine, calls: int = 200) -> float:
    engine.reset()
    engine.forward(np.arange(3, 131)[None], np.arange(128)[None])
    ids, pos = np.array([[5]]), np.array([[128]])
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        engine.forward(ids, pos)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    from trtspec import Generator, load_engine
    from trtspec.bench import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--int4", help="an INT4 engine to time a decode call of as well")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    texts = load_prompts(ROOT / "models" / "heldout.json")[:6]
    rows = {name: {} for name in SETTINGS}
    for _ in range(args.rounds):
        for name, entries in SETTINGS.items():
            ort_engine.session_options = with_setting(entries)
            target = load_engine(args.target, num_threads=args.threads)
            draft = load_engine(args.draft, num_threads=args.threads)
            sample = {"target decode ms": decode_ms(target)}
            if args.int4:
                sample["int4 decode ms"] = decode_ms(load_engine(args.int4, num_threads=args.threads))
            for label, gen in (("target-only tok/s", Generator(target)),
                               ("draft k=4 tok/s", Generator(target, draft, num_draft_tokens=4, k_policy="fixed"))):
                gen.generate(texts[0], max_new_tokens=8)
                t = time.perf_counter()
                out = gen.generate(texts, max_new_tokens=128)
                sample[label] = sum(len(r.token_ids) for r in out) / (time.perf_counter() - t)
                gen.close()
            for key, value in sample.items():
                rows[name].setdefault(key, []).append(value)
    columns = list(next(iter(rows.values())))
    print("| spinning | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(row[c]):.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
