"""How much a corpus index can add to suffix decoding on this model, at best: an upper bound that no drafter copying
text from these sources can pass, on bench_datastore.py's workloads and index.

    python benchmarks/bench_datastore_ceiling.py [--engine engines/smollm2-torch-int8x] [--out ...]

The target's greedy output of each prompt is decoded again offline. At each position, each source offers candidate
continuations (up to 16 tokens):
- own: the request's own text so far (prompt and output) where its longest suffix (>= 2 tokens) occurred before,
  the latest 16 occurrences: what the suffix drafter looks at;
- own, every 2-gram: every earlier occurrence of the last two tokens (any longer match is among them);
- index, 16: Datastore.find as the drafter calls it (16 occurrences of the longest match, spread over its range);
- index, every: every occurrence of the longest match in the index;
- own + index: the two drafters' sources; all: every candidate above.
A perfect chooser then takes the candidate that agrees longest with the true output, up to k tokens, and the call
adds one more token (greedy verification). Tokens per call from that are a ceiling for the source at depth k: a
real drafter must guess which candidates to send, and a tree holding all of them would cost far more to verify.
The ceiling of speed over the target alone charges each call the back-to-back cost of a call of its size (the
chooser sends exactly the drafts that will be taken, so a call is T(a+1) for a taken drafts), measured in the same
run, against T1 a token alone; drafting itself is counted as free.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_datastore import humaneval, lib_paths, repo_cuts  # noqa: E402
from bench_oracle import call_costs, cpu_info  # noqa: E402
from common import ROOT, save_results  # noqa: E402

SOURCES = ("own", "own, every 2-gram", "index, 16", "index, every", "own + index", "all")
DEPTH, LATEST = 16, 16


def own_longest(seq: list[int], p: int) -> list[tuple[int, ...]]:
    """Continuations after the latest LATEST earlier occurrences of the longest suffix of seq[:p] (2..16 tokens)."""
    for m in range(min(DEPTH, p - 1), 1, -1):
        key = seq[p - m : p]
        hits = [i for i in range(m, p) if seq[i - m : i] == key]
        if hits:
            return [tuple(seq[i : i + DEPTH]) for i in hits[-LATEST:]]
    return []


def own_every(seq: list[int], p: int) -> list[tuple[int, ...]]:
    key = seq[p - 2 : p]
    return [tuple(seq[i : i + DEPTH]) for i in range(2, p) if seq[i - 2 : i] == key]


def index_every(store, tail) -> list[tuple[int, ...]]:
    """Every occurrence of the longest match (Datastore.find with no cap on the occurrences)."""
    from trtspec.runtime.drafters import datastore

    cap = datastore.MAX_OCCURRENCES
    datastore.MAX_OCCURRENCES = store.tokens
    try:
        return store.find(tail, DEPTH)[1]
    finally:
        datastore.MAX_OCCURRENCES = cap


def agree(candidate, truth) -> int:
    n = 0
    for a, b in zip(candidate, truth):
        if a != b:
            break
        n += 1
    return n


def ceilings(seq: list[int], start: int, store, ks) -> dict:
    """{source: {k: drafts each target call sent}} to decode seq[start:] with a perfect chooser over each source's
    candidates."""
    best = []  # per position: each source's longest agreement
    for p in range(start, len(seq)):
        truth = seq[p:]
        own, own2 = own_longest(seq, p), own_every(seq, p)
        idx = store.find(seq[:p], DEPTH)[1]
        idx_all = index_every(store, seq[:p])
        b = {name: max((agree(c, truth) for c in cands), default=0)
             for name, cands in (("own", own), ("own, every 2-gram", own2), ("index, 16", idx),
                                 ("index, every", idx_all))}
        b["own + index"] = max(b["own"], b["index, 16"])
        b["all"] = max(b.values())
        best.append(b)
    calls = {}
    for name in SOURCES:
        for k in ks:
            p, drafts = start, []
            while p < len(seq):
                a = min(best[p - start][name], k)
                drafts.append(a)  # the perfect chooser sends exactly the drafts that will be taken
                p += a + 1
            calls.setdefault(name, {})[k] = drafts
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=str(ROOT / "engines" / "smollm2-torch-int8x"))
    ap.add_argument("--index", type=Path, default=ROOT / "models" / "bench" / "datastore" / "cpython-lib",
                    help="an index of CPython's Lib/ (built here if missing, as bench_datastore.py builds it)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "datastore-ceiling")
    args = ap.parse_args(argv)
    from trtspec import Generator, index, load_engine
    from trtspec.runtime.drafters.datastore import Datastore

    lib = Path(sysconfig.get_paths()["stdlib"])
    if not (args.index / "manifest.json").is_file():
        index(lib_paths(lib), args.index, tokenizer=args.engine, patterns=("*.py",))
    store = Datastore(args.index)
    engine = load_engine(args.engine, num_threads=args.threads)
    ks = (4, 8, 16)
    costs = call_costs(engine, range(1, max(ks) + 2), position=128, repeats=20)
    gen = Generator(engine, drafter="none")
    workloads = {"humaneval": [w["ids"] for w in humaneval(gen.tokenizer, args.prompts)],
                 "repo": [w["ids"] for w in repo_cuts(gen.tokenizer, lib, args.prompts)]}
    res = {"engine": args.engine, "index": str(args.index), "index_tokens": store.tokens, "tokens": args.tokens,
           "machine": cpu_info(args.threads), "call_ms": {str(t): c * 1e3 for t, c in costs.items()}, "rows": []}
    for name, prompts in workloads.items():
        new, drafts = 0, {}
        for ids in prompts:
            out = gen.generate([ids], max_new_tokens=args.tokens)[0].token_ids
            seq = list(ids) + list(out)
            new += len(out) - 1  # the tokens after the first, as bench_datastore counts them
            for src, by_k in ceilings(seq, len(ids) + 1, store, ks).items():
                for k, sent in by_k.items():
                    drafts.setdefault((src, k), []).extend(sent)
        for k in ks:
            own = new / len(drafts[("own", k)])
            for src in SOURCES:
                sent = drafts[(src, k)]
                tpc = new / len(sent)
                seconds = sum(costs[a + 1] for a in sent)  # each call as long as a back-to-back call of its size
                res["rows"].append({"workload": name, "k": k, "source": src, "tokens_per_call": tpc,
                                    "x_own": tpc / own, "speed_ceiling": new * costs[1] / seconds})
        print(f"{name}: done", flush=True)
    gen.close()
    save_results(args.out, res, markdown(res))
    return 0


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# Ceiling of corpus drafting: {Path(res['engine']).name}, greedy, up to {res['tokens']} new tokens",
             "", f"CPU: {m['cpu']}; ISA: {' '.join(m['isa'])}; {m['threads']} threads. Index: "
             f"{res['index_tokens']:,} tokens of CPython's Lib/. Call ms (back to back, median): "
             + ", ".join(f"T={t}: {c:.2f}" for t, c in res["call_ms"].items() if t in ("1", "5", "9", "17"))
             + ".", "",
             "Tokens per target call with a perfect chooser over each source's candidates (bench_datastore_ceiling.py"
             "'s docstring); x own: against the request's own text alone (what suffix decoding looks at); speed "
             "ceiling: x the target alone, each call charged T(a+1) for the a drafts it takes, drafting free.", "",
             "| workload | k | source | tokens / call (ceiling) | x own | speed ceiling |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['workload']} | {r['k']} | {r['source']} | {r['tokens_per_call']:.2f} | "
                     f"{r['x_own']:.2f} | {r['speed_ceiling']:.2f} |")
    best = {}
    for r in res["rows"]:
        if r["source"] == "own + index":
            best[r["workload"]] = max(best.get(r["workload"], 0), r["speed_ceiling"])
    lines += ["", "Best speed ceiling of the two drafters' sources (own + index), any k: "
              + ", ".join(f"{w} {x:.2f}x" for w, x in best.items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
