"""A refactor's "behaviour and speed unchanged", measured: this checkout against an earlier revision, in one run.

    python benchmarks/bench_revisions.py --base 5fff860 [--rounds 3] [--out benchmarks/results/revisions]

The base revision is checked out into a temporary git worktree; each round runs the same workload once per revision
(alternating which goes first), each in a fresh process with that revision's trtspec first on sys.path, on the same
engines (this checkout's engines/stdlib-{target,draft} and engines/smollm2: `make demo-stdlib`,
`make engines/smollm2/manifest.json`):
  the bundled pair, 8 held-out prompts x 128 tokens in one list (4 rows): draft k = 4 fixed, load-aware k, rejection
  sampling at T = 0.8, prompt lookup; SmolLM2 with the suffix drafter, 4 chat prompts in one list and one alone.
Decode tok/s, medians over the rounds, with their ratio. Then both revisions generate the same 8 prompts x 64 tokens
greedy, seeded rejection sampling, seeded coupled top-p sampling and seeded prompt lookup: whether the tokens are
identical (a refactor that keeps behaviour keeps them; a seed's rejection samples depend on every random draw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_gguf_kernels import _cpu  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

WORKLOAD = r'''
import json, sys, time
mode, root = sys.argv[1], sys.argv[2]
from trtspec import Generator, load_engine
from trtspec.bench import load_prompts
prompts = load_prompts(f"{root}/models/heldout.json")[:8]
target, draft = load_engine(f"{root}/engines/stdlib-target"), load_engine(f"{root}/engines/stdlib-draft")
out = {}
if mode == "speed":
    configs = {
        "pair, draft k=4, 8 prompts": (Generator(target, draft, num_draft_tokens=4, k_policy="fixed"), {}),
        "pair, load-aware k, 8 prompts": (Generator(target, draft), {}),
        "pair, rejection sampling T=0.8 k=4": (Generator(target, draft, num_draft_tokens=4, k_policy="fixed",
                                                         sampling="rejection"), dict(temperature=0.8, seed=1)),
        "pair, prompt lookup, 8 prompts": (Generator(target, drafter="prompt_lookup"), {}),
    }
    for name, (gen, kw) in configs.items():
        gen.generate(prompts[:4], max_new_tokens=16, **kw)
        t0 = time.perf_counter()
        res = gen.generate(prompts, max_new_tokens=128, **kw)
        out[name] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
        gen.close()
    chats = ["Write a Python function that checks whether a string is a palindrome.",
             "Explain what a hash table is in two sentences.",
             "Write a JSON object describing a book with title, author and year.",
             "List three uses of Python's itertools module."]
    gen = Generator(load_engine(f"{root}/engines/smollm2"), drafter="suffix")
    ids = [gen.chat_ids([{"role": "user", "content": c}]) for c in chats]
    gen.generate(ids[:1], max_new_tokens=16)
    t0 = time.perf_counter()
    res = gen.generate(ids, max_new_tokens=128)
    out["SmolLM2, suffix, 4 chats"] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    one = gen.generate([ids[0]], max_new_tokens=128)[0]
    out["SmolLM2, suffix, 1 chat alone"] = len(one.token_ids) / (time.perf_counter() - t0)
    gen.close()
else:
    for name, gen, kw in [
        ("greedy, draft k=4", Generator(target, draft, num_draft_tokens=4, k_policy="fixed"), {}),
        ("rejection sampling T=0.8, draft k=4, seed 3",
         Generator(target, draft, num_draft_tokens=4, k_policy="fixed", sampling="rejection"),
         dict(temperature=0.8, seed=3)),
        ("coupled sampling T=0.8 top-p 0.9, draft k=3, seed 5",
         Generator(target, draft, num_draft_tokens=3, k_policy="fixed"), dict(temperature=0.8, top_p=0.9, seed=5)),
        ("rejection sampling T=1, prompt lookup k=4, seed 9",
         Generator(target, drafter="prompt_lookup", num_draft_tokens=4, k_policy="fixed", sampling="rejection"),
         dict(temperature=1.0, seed=9)),
    ]:
        out[name] = [r.token_ids for r in gen.generate(prompts, max_new_tokens=64, **kw)]
        gen.close()
print("RESULT " + json.dumps(out))
'''


def run(code_root: Path, mode: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code_root), OMP_NUM_THREADS=str(threads))
    p = subprocess.run([sys.executable, "-c", WORKLOAD, mode, str(ROOT)], env=env, capture_output=True, text=True,
                       cwd=code_root)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the workload failed under {code_root}:\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier revision (a commit, tag or branch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "revisions")
    args = ap.parse_args(argv)
    for engine in ("stdlib-target", "stdlib-draft", "smollm2"):
        if not (ROOT / "engines" / engine / "manifest.json").is_file():
            ap.error(f"engines/{engine} is missing: build it first (make demo-stdlib, make engines/smollm2/manifest.json)")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True)
    if base.returncode:
        ap.error(f"{args.base!r} is not a revision of this repository")
    base = base.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="trtspec-base-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), base], cwd=ROOT, check=True)
        try:
            roots = {f"base {base}": tree, f"this checkout {head}": ROOT}
            speeds: dict[str, dict[str, list[float]]] = {name: {} for name in roots}
            for r in range(args.rounds):
                order = list(roots.items()) if r % 2 == 0 else list(reversed(roots.items()))
                for name, root in order:
                    for config, rate in run(root, "speed", args.threads).items():
                        speeds[name].setdefault(config, []).append(rate)
                    print(f"round {r + 1}: {name}: " + ", ".join(f"{c} {v[-1]:.1f}" for c, v in speeds[name].items()),
                          flush=True)
            tokens = {name: run(root, "tokens", args.threads) for name, root in roots.items()}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    (b_name, b), (h_name, h) = speeds.items()
    cpu = _cpu()
    lines = [f"Decode tok/s, medians of {args.rounds} alternating rounds, {args.threads} threads "
             f"(`python benchmarks/bench_revisions.py --base {args.base}`); CPU: {cpu['model']}; ISA: "
             f"{' '.join(cpu['isa'])}.", "",
             f"| workload | {b_name} | {h_name} | ratio |", "|---|---|---|---|"]
    for config in b:
        before, after = statistics.median(b[config]), statistics.median(h[config])
        lines.append(f"| {config} | {before:.1f} | {after:.1f} | {after / before:.3f} |")
    (tb, xb), (th, xh) = tokens.items()
    lines += ["", "Same tokens, 8 prompts x 64 tokens:", ""]
    lines += [f"- {config}: {sum(a == c for a, c in zip(xb[config], xh[config]))}/{len(xb[config])} identical"
              for config in xb]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "speeds": speeds, "identical": {
        c: [a == d for a, d in zip(xb[c], xh[c])] for c in xb}}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
